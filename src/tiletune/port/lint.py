"""The migration lint: run the rules in `rules.py` over CUDA sources and return findings.

Comments are blanked before matching (string literals are kept: inline PTX lives in them), so a
comment that mentions "32 lanes" never fires a rule and line numbers stay those of the file; so are the
preprocessor branches hipcc never compiles (`#ifndef USE_ROCM`, `#if __CUDA_ARCH__ >= 800`), except those that only a
CUDA build flag of the project compiles out around the whole file (`#ifdef WITH_CUDA` with `-U WITH_CUDA`):
`cuda-build-flag` asks to widen that test to the HIP build, so the code under it is linted as the port will compile it.
Code under `#ifdef __CUDACC__` is linted too: every translator renames the test to `__HIPCC__`, true on AMD.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass
from pathlib import Path

from tiletune.port.preprocessor import HIPCC, Build, blank_branches_dead_on_amd
from tiletune.port.rules import RULES, Rule, build_flags_compiling_out, pattern_hits

COMMENT_OR_LITERAL = re.compile(
    r"//[^\n]*|/\*.*?\*/|\"(?:\\.|[^\"\\\n])*\"|'(?:\\.|[^'\\\n])*'", re.DOTALL
)


@dataclass(frozen=True)
class Finding:
    """One rule firing at one place of a CUDA source file."""

    path: str
    line: int
    column: int
    rule: str
    severity: str
    title: str
    detail: str
    code: str  # the source line, stripped

    @property
    def message(self) -> str:
        """The one-line message: the rule's title plus what this place adds."""
        return f"{self.title}: {self.detail}" if self.detail else self.title


def strip_comments(text: str) -> str:
    """`text` with every comment replaced by spaces (newlines kept), string literals untouched."""

    def blank(match: re.Match) -> str:
        token = match.group(0)
        if token.startswith(("//", "/*")):
            return re.sub(r"[^\n]", " ", token)
        return token

    return COMMENT_OR_LITERAL.sub(blank, text)


def lint_text(text: str, path: str, rules: list[Rule] = RULES, build: Build = HIPCC) -> list[Finding]:
    """Findings of `rules` on CUDA source `text`, lines the HIP build (hipcc with `build`'s macros) compiles out
    left alone; `path` is only used to label them."""
    whole = strip_comments(text)
    code = blank_branches_dead_on_amd(whole, _as_ported(whole, _translated(build)))
    code_lines = code.splitlines()  # split once for every pattern rule
    source_lines = text.splitlines()
    findings, seen = [], set()
    for rule in rules:
        source = whole if rule.reads_dead_code else code
        if not rule.check:
            hits = pattern_hits(rule.pattern, code_lines)
        elif rule.reads_build:
            hits = rule.check(source, build)
        else:
            hits = rule.check(source)
        for hit in hits:
            if (rule.id, hit.line, hit.column) in seen:  # one place reached twice (two arrays of one name)
                continue
            seen.add((rule.id, hit.line, hit.column))
            findings.append(
                Finding(
                    path=path,
                    line=hit.line,
                    column=hit.column,
                    rule=rule.id,
                    severity=hit.severity or rule.severity,
                    title=rule.title,
                    detail=hit.detail,
                    code=source_lines[hit.line - 1].strip() if hit.line <= len(source_lines) else "",
                )
            )
    return sorted(findings, key=lambda f: (f.path, f.line, f.column, f.rule))


# nvcc's macros every translator renames to one hipcc defines (torch's table and hipify-perl: `__CUDACC__` ->
# `__HIPCC__`): whatever the HIP build leaves undefined of the CUDA name, the translated test is true on AMD
RENAMED_TO_DEFINED = frozenset({"__CUDACC__"})


def _translated(build: Build) -> Build:
    """`build` as the translated source meets it: `RENAMED_TO_DEFINED` defined."""
    return dataclasses.replace(build, defined=build.defined | RENAMED_TO_DEFINED,
                               undefined=build.undefined - RENAMED_TO_DEFINED)


def _as_ported(text: str, build: Build) -> Build:
    """`build` as the port will compile: the CUDA build flags that compile a whole file out (`build_flags_compiling_out`,
    a branch holding WHOLE_FILE of its lines: a header of RAJA's CUDA policy under `#if defined(RAJA_ENABLE_CUDA)`)
    taken as defined, as the test `cuda-build-flag` asks to widen will be (a smaller CUDA-only branch may stay CUDA's:
    SuperLU_DIST keeps its `#ifdef HAVE_CUDA` helpers out of the HIP build, so it is left compiled out); and
    `#ifdef __CUDA_ARCH__` read as the device / host pass split (`Build.pass_split`), which `cuda-arch-guard` asks to
    keep as `__HIP_DEVICE_COMPILE__`: the device code under it is linted."""
    flags = {flag for branch in build_flags_compiling_out(text, build) if branch.whole_file for flag in branch.flags}
    return dataclasses.replace(build, defined=build.defined | flags, undefined=build.undefined - flags, pass_split=True)


def lint_file(path: Path, label: str | None = None) -> list[Finding]:
    """Findings on one CUDA source file, labelled `label` (default: the path as given)."""
    return lint_text(path.read_text(encoding="utf-8", errors="replace"), label or str(path))
