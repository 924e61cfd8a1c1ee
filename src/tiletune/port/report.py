"""The hipify report and its three renderings: text for people, JSON for scripts, SARIF for CI.

SARIF 2.1.0 is what GitHub code scanning and most CI systems read to annotate pull requests; lint
findings and hipcc diagnostics become results placed on the CUDA source lines.
"""

from __future__ import annotations

import json
import textwrap
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path

import tiletune
from tiletune.errors import UserError
from tiletune.port.compile_check import CompileCheck
from tiletune.port.lint import Finding
from tiletune.port.rules import RULES, RULES_BY_ID

SARIF_SCHEMA = "https://json.schemastore.org/sarif-2.1.0.json"
COMPILE_RULE_ID = "hipcc"


@dataclass
class FileResult:
    """What translation did to one file: CUDA references translated, those left as they were, and the project's
    CUDA-back-end names renamed to its HIP twins (`"old -> new"`: count; `--project`)."""

    source: str
    output: str | None
    translated: int = 0
    left: dict[str, int] = field(default_factory=dict)
    renamed: dict[str, int] = field(default_factory=dict)


@dataclass
class HipifyReport:
    """Everything `tiletune hipify` found: translation stats, lint findings, compile results."""

    engine: str
    destination: str
    files: list[FileResult]
    findings: list[Finding]
    compile: CompileCheck | None = None
    notes: list[str] = field(default_factory=list)

    def severity_counts(self) -> Counter:
        """Findings per severity."""
        return Counter(finding.severity for finding in self.findings)

    def rule_counts(self) -> Counter:
        """Findings per rule id."""
        return Counter(finding.rule for finding in self.findings)

    def translated_count(self) -> int:
        """CUDA references the engine translated, summed over files."""
        return sum(file.translated for file in self.files)

    def left_counts(self) -> Counter:
        """CUDA names left untranslated, summed over files."""
        total: Counter = Counter()
        for file in self.files:
            total.update(file.left)
        return total

    def strict_failures(self) -> list[str]:
        """Why `--strict` fails this run (empty when it passes)."""
        reasons = []
        if errors := self.severity_counts()["error"]:
            reasons.append(f"{errors} finding(s) of severity error")
        if left := sum(self.left_counts().values()):
            reasons.append(f"{left} CUDA-only name(s) left untranslated")
        if self.compile and self.compile.skipped:
            reasons.append("the compile check could not run")
        if self.compile and self.compile.error_count:
            reasons.append(f"{self.compile.error_count} unit(s) failed to compile")
        if self.compile and self.compile.not_compiled_count:
            reasons.append(f"{self.compile.not_compiled_count} unit(s) not compiled (a ROCm library is missing)")
        return reasons


# ---- text ----------------------------------------------------------------------------------------


def _wrapped(label: str, text: str, indent: int) -> str:
    prefix = " " * indent + label
    return textwrap.fill(text, width=100, initial_indent=prefix, subsequent_indent=" " * len(prefix))


def _counts_line(counts: Counter, names: tuple[str, ...]) -> str:
    return ", ".join(f"{counts[name]} {name}{'s' if counts[name] != 1 else ''}" for name in names)


def _text_findings(report: HipifyReport) -> list[str]:
    lines = [(f"Findings on the CUDA input: {len(report.findings)} "
              f"({_counts_line(report.severity_counts(), ('error', 'warning', 'note'))})")]
    for finding in report.findings:
        lines.append(f"{finding.path}:{finding.line}:{finding.column}: {finding.severity}: "
                     f"{finding.message} [{finding.rule}]")
        lines.append(f"    {finding.code}")
    rule_counts = report.rule_counts()
    if rule_counts:
        lines += ["", "Findings by rule:"]
        lines += [f"  {rule.id:<24}{rule.severity:<9}{rule_counts[rule.id]:>4}" for rule in RULES if rule_counts[rule.id]]
        lines += ["", "What breaks on AMD, and the fix:"]
        for rule in RULES:
            if rule_counts[rule.id]:
                lines += [f"  [{rule.id}] {rule.title}", _wrapped("breaks: ", rule.breaks, 4), _wrapped("fix:    ", rule.fix, 4)]
    return lines


def _text_translation(report: HipifyReport) -> list[str]:
    left = report.left_counts()
    lines = [(f"Translation with {report.engine}: {report.translated_count()} CUDA references translated, "
              f"{sum(left.values())} left as they were")]
    for file in report.files:
        lines.append(f"  {file.source} -> {file.output}: {file.translated} translated, {sum(file.left.values())} left")
        if file.renamed:
            renames = ", ".join(f"{rename} x{count}" for rename, count in file.renamed.items())
            lines.append(_wrapped("renamed to the project's HIP twins: ", renames, 4))
    if left:
        names = ", ".join(f"{name} x{count}" for name, count in left.most_common())
        lines.append(_wrapped("left as they were: ", names, 2))
    return lines


def _text_compile(check: CompileCheck) -> list[str]:
    if check.skipped:
        return [f"Compile check (--offload-arch {check.offload_arch}): skipped: {check.skipped}"]
    passed = sum(result.ok for result in check.results)
    left_out = f", {check.not_compiled_count} not compiled" if check.not_compiled_count else ""
    lines = [(f"Compile check with {check.compiler}, --offload-arch {check.offload_arch}: "
              f"{passed} of {len(check.results)} units compiled, {check.error_count} failed{left_out}")]
    lines += [f"  note: {note}" for note in check.notes]
    for result in check.results:
        status = "SKIP  " if result.not_compiled else "ok    " if result.ok else "FAILED"
        how = " (header, through a generated unit)" if result.generated else ""
        why = f": {result.not_compiled}" if result.not_compiled else ""
        lines.append(f"  {status} {result.source}{how}{why}")
        for diagnostic in result.diagnostics:
            lines.append(f"    {diagnostic.path}:{diagnostic.line}:{diagnostic.column}: {diagnostic.severity}: "
                         f"{diagnostic.message}  (hipcc: {diagnostic.compiled_at})")
        if result.unparsed:
            lines += [f"    {line}" for line in result.unparsed.splitlines()]
    return lines


def explain(rule_id: str) -> str:
    """One rule spelled out: the pitfall, what AMD hardware does differently, CUDA before and HIP after, the fix."""
    if rule_id not in RULES_BY_ID:
        raise UserError(f"no rule {rule_id!r}; the rules are: {', '.join(RULES_BY_ID)}")
    rule = RULES_BY_ID[rule_id]
    return "\n".join([
        f"[{rule.id}] {rule.title} ({rule.severity})", "",
        _wrapped("on AMD: ", rule.breaks, 0), "",
        "before (CUDA):", *(f"    {line}" for line in rule.before.splitlines()),
        "after (HIP):", *(f"    {line}" for line in rule.after.splitlines()), "",
        _wrapped("fix:    ", rule.fix, 0),
    ]) + "\n"


def to_text(report: HipifyReport) -> str:
    """The report as plain text, sections in the order a person reads them."""
    lines = [f"tiletune hipify: {len(report.files)} file(s) -> {report.destination}", ""]
    lines += _text_findings(report)
    if report.files:
        lines += [""] + _text_translation(report)
    if report.compile:
        lines += [""] + _text_compile(report.compile)
    lines += [""] + [f"note: {note}" for note in report.notes]
    failures = report.strict_failures()
    lines.append(f"Result: {'; '.join(failures) if failures else 'nothing that needs a human was found'}"
                 f"{' (fails with --strict)' if failures else ''}.")
    return "\n".join(line for i, line in enumerate(lines) if line or (i and lines[i - 1])) + "\n"


# ---- JSON ----------------------------------------------------------------------------------------


def to_json(report: HipifyReport) -> str:
    """The report as JSON: every finding with rule, severity, message, what breaks and the fix."""
    findings = [
        {**asdict(finding), "message": finding.message,
         "breaks": RULES_BY_ID[finding.rule].breaks, "fix": RULES_BY_ID[finding.rule].fix}
        for finding in report.findings
    ]
    left = report.left_counts()
    data = {
        "tool": "tiletune hipify",
        "engine": report.engine,
        "destination": report.destination,
        "files": [asdict(file) for file in report.files],
        "findings": findings,
        "stats": {
            "files": len(report.files),
            "translated": report.translated_count(),
            "left": sum(left.values()),
            "left_by_name": dict(left.most_common()),
            "findings_by_rule": dict(report.rule_counts().most_common()),
            "findings_by_severity": dict(report.severity_counts()),
        },
        "compile": asdict(report.compile) if report.compile else None,
        "notes": report.notes,
        "strict_failures": report.strict_failures(),
    }
    return json.dumps(data, indent=2) + "\n"


# ---- SARIF ---------------------------------------------------------------------------------------


def _location(path: str, line: int, column: int) -> dict:
    artifact = {"uri": Path(path).as_uri()} if Path(path).is_absolute() else {"uri": Path(path).as_posix(), "uriBaseId": "%SRCROOT%"}
    return {"physicalLocation": {"artifactLocation": artifact, "region": {"startLine": line, "startColumn": column}}}


def _sarif_rules() -> list[dict]:
    rules = [
        {"id": rule.id, "name": rule.id, "shortDescription": {"text": rule.title},
         "fullDescription": {"text": rule.breaks}, "help": {"text": rule.fix},
         "defaultConfiguration": {"level": rule.severity}}
        for rule in RULES
    ]
    rules.append({"id": COMPILE_RULE_ID, "name": COMPILE_RULE_ID,
                  "shortDescription": {"text": "hipcc diagnostic on the translated source"},
                  "fullDescription": {"text": "An error or warning from compiling the HIP translation, placed "
                                              "on the CUDA line it came from."},
                  "help": {"text": "Fix the CUDA source (or the translation) so hipcc accepts it."},
                  "defaultConfiguration": {"level": "error"}})
    return rules


def to_sarif(report: HipifyReport) -> str:
    """The report as a SARIF 2.1.0 log: lint findings and hipcc diagnostics as results."""
    rule_index = {rule.id: index for index, rule in enumerate(RULES)}
    results = [
        {"ruleId": finding.rule, "ruleIndex": rule_index[finding.rule], "level": finding.severity,
         "message": {"text": f"{finding.message}. {RULES_BY_ID[finding.rule].breaks} "
                             f"Fix: {RULES_BY_ID[finding.rule].fix}"},
         "locations": [_location(finding.path, finding.line, finding.column)]}
        for finding in report.findings
    ]
    for result in report.compile.results if report.compile else []:
        results += [
            {"ruleId": COMPILE_RULE_ID, "ruleIndex": len(RULES), "level": diagnostic.severity,
             "message": {"text": f"hipcc ({report.compile.offload_arch}): {diagnostic.message}"},
             "locations": [_location(diagnostic.path, diagnostic.line, diagnostic.column)]}
            for diagnostic in result.diagnostics
        ]
    log = {
        "$schema": SARIF_SCHEMA,
        "version": "2.1.0",
        "runs": [{
            "tool": {"driver": {"name": "tiletune-hipify", "version": tiletune.__version__,
                                "rules": _sarif_rules()}},
            "originalUriBaseIds": {"%SRCROOT%": {"uri": Path.cwd().as_uri() + "/"}},
            "results": results,
        }],
    }
    return json.dumps(log, indent=2) + "\n"


RENDERERS = {"text": to_text, "json": to_json, "sarif": to_sarif}
REPORT_FILES = {"text": "hipify-report.txt", "json": "hipify-report.json", "sarif": "hipify-report.sarif"}


def write_reports(report: HipifyReport, directory: Path) -> list[Path]:
    """Write the report in all three formats into `directory`; return the paths written."""
    directory.mkdir(parents=True, exist_ok=True)
    written = []
    for fmt, name in REPORT_FILES.items():
        path = directory / name
        path.write_text(RENDERERS[fmt](report), encoding="utf-8")
        written.append(path)
    return written
