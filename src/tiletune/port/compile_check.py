"""Compile translated sources with hipcc for an AMD target and map its diagnostics to CUDA lines.

hipcc (found and run by tiletune.hipcc, with `HIP_PLATFORM=amd`) compiles device code for a gfx
target without a GPU. Each diagnostic that points into a translated file is mapped back to the line
of the CUDA source it came from, using a line alignment of the two texts, so it works whatever engine
produced them.
"""

from __future__ import annotations

import difflib
import os
import re
import tempfile
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from tiletune.hipcc import find_hipcc, hipcc_version, run_hipcc

_DIAGNOSTIC = re.compile(
    r"^(?P<file>[^\s:][^:\n]*):(?P<line>\d+):(?P<column>\d+): (?P<severity>fatal error|error|warning): (?P<message>.*)$",
    re.M,
)
_ERROR_COUNT = re.compile(r"\d+ errors? generated")
_PROBE_KERNEL = "#include <hip/hip_runtime.h>\n__global__ void tiletune_probe(float* x) { x[threadIdx.x] = 0.f; }\n"


@dataclass(frozen=True)
class SourceMap:
    """How one translated file relates to its CUDA source: label and output line -> source line."""

    label: str
    lines: list[int]

    def source_line(self, output_line: int) -> int:
        """The CUDA line (1-based) that translated line `output_line` (1-based) came from."""
        if not self.lines:
            return output_line
        return self.lines[min(output_line, len(self.lines)) - 1]


@dataclass(frozen=True)
class Diagnostic:
    """One compiler error or warning, placed on the CUDA source when it points into translated code."""

    path: str
    line: int
    column: int
    severity: str
    message: str
    compiled_at: str  # file:line as hipcc reported it


@dataclass
class CompileResult:
    """The outcome of compiling one translation unit."""

    source: str
    ok: bool
    diagnostics: list[Diagnostic] = field(default_factory=list)
    unparsed: str = ""  # compiler output with no file:line (driver errors), kept for the report


@dataclass
class CompileCheck:
    """All compile results, or why the check could not run."""

    offload_arch: str
    compiler: str = ""
    skipped: str = ""
    results: list[CompileResult] = field(default_factory=list)

    @property
    def error_count(self) -> int:
        """Translation units that failed to compile."""
        return sum(not result.ok for result in self.results)


def line_map(source_text: str, translated_text: str) -> list[int]:
    """For each line of `translated_text`, the 1-based line of `source_text` it corresponds to."""
    source_lines, translated_lines = source_text.splitlines(), translated_text.splitlines()
    mapping = [1] * len(translated_lines)
    matcher = difflib.SequenceMatcher(None, source_lines, translated_lines, autojunk=False)
    for tag, i1, i2, j1, j2 in matcher.get_opcodes():
        for j in range(j1, j2):
            if tag in ("equal", "replace"):
                mapping[j] = i1 + min(j - j1, max(i2 - i1 - 1, 0)) + 1
            else:  # lines the translator inserted belong to the source line that follows them
                mapping[j] = min(i1 + 1, max(len(source_lines), 1))
    return mapping


def _hipcc_command(hipcc: str, offload_arch: str, source: Path, obj: Path, flags: list[str]) -> list[str]:
    return [hipcc, "-x", "hip", f"--offload-arch={offload_arch}", "-std=c++17", "-Wno-unused-command-line-argument",
            f"-I{source.parent}", *flags, "-c", str(source), "-o", str(obj)]


def _parse(output: str, source_maps: dict[Path, SourceMap]) -> tuple[list[Diagnostic], str]:
    diagnostics = []
    for match in _DIAGNOSTIC.finditer(output):
        compiled_at = f"{match['file']}:{match['line']}"
        source_map = source_maps.get(Path(match["file"]).resolve())
        line = int(match["line"])
        diagnostics.append(Diagnostic(
            path=source_map.label if source_map else match["file"],
            line=source_map.source_line(line) if source_map else line,
            column=int(match["column"]),
            severity="error" if "error" in match["severity"] else "warning",
            message=match["message"].strip(),
            compiled_at=compiled_at,
        ))
    unparsed = "\n".join(
        line for line in output.splitlines()
        if "error" in line and not _DIAGNOSTIC.match(line) and not _ERROR_COUNT.search(line)
    )
    return list(dict.fromkeys(diagnostics)), unparsed  # host and device passes repeat diagnostics


def probe_arch(hipcc: str, offload_arch: str, scratch: Path) -> str:
    """Empty string when hipcc compiles a trivial kernel for `offload_arch`, else the reason it cannot."""
    probe = scratch / "probe.hip"
    probe.write_text(_PROBE_KERNEL)
    result = run_hipcc(_hipcc_command(hipcc, offload_arch, probe, scratch / "probe.o", []))
    if result.returncode == 0:
        return ""
    first_error = next((line for line in result.stderr.splitlines() if "error" in line), result.stderr.strip())
    return f"hipcc cannot compile for {offload_arch} here: {first_error.strip()}"


def compile_units(units: list[tuple[Path, str]], source_maps: dict[Path, SourceMap], offload_arch: str,
                  flags: list[str] | None = None, hipcc: str | None = None) -> CompileCheck:
    """Compile each (translated file, label) with hipcc for `offload_arch`, in parallel.

    `source_maps` maps every translated file (units and the headers they include), by resolved
    path, to its CUDA label and line map. Returns a CompileCheck whose `skipped` says why nothing
    was compiled when hipcc is missing or cannot target `offload_arch`.
    """
    check = CompileCheck(offload_arch=offload_arch)
    hipcc = hipcc or find_hipcc()
    if hipcc is None:
        check.skipped = ("hipcc not found (looked at $HIPCC, $ROCM_PATH/bin, PATH): install ROCm, or on "
                         "Debian/Ubuntu `apt-get install hipcc`, which compiles for gfx90a")
        return check
    check.compiler = f"hipcc {hipcc_version(hipcc) or '(version unknown)'} at {hipcc}"
    with tempfile.TemporaryDirectory(prefix="tiletune-hipcc-") as scratch_dir:
        scratch = Path(scratch_dir)
        check.skipped = probe_arch(hipcc, offload_arch, scratch)
        if check.skipped:
            return check

        def compile_one(index: int, unit: tuple[Path, str]) -> CompileResult:
            path, label = unit
            result = run_hipcc(_hipcc_command(hipcc, offload_arch, path, scratch / f"unit{index}.o", flags or []))
            diagnostics, unparsed = _parse(result.stdout + result.stderr, source_maps)
            return CompileResult(label, result.returncode == 0, diagnostics, unparsed)

        with ThreadPoolExecutor(max_workers=os.cpu_count() or 2) as pool:
            check.results = list(pool.map(compile_one, range(len(units)), units))
    return check
