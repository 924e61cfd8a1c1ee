"""Compile translated sources with hipcc for an AMD target and map its diagnostics to CUDA lines.

hipcc (found and run by tiletune.hipcc, with `HIP_PLATFORM=amd`) compiles device code for a gfx
target without a GPU. Each diagnostic that points into a translated file is mapped back to the line
of the CUDA source it came from, using a line alignment of the two texts, so it works whatever engine
produced them. Around that:

- torch's HIP headers: where the installed torch has none (a CPU or CUDA wheel), `torch_stubs/` stands
  in for `ATen/hip/...`, `c10/...` and `torch/extension.h` so extension code compiles to the syntax level;
- ROCm libraries (`LIBRARIES`): each one a unit includes is probed once; a missing one is one line in the
  report and its units are listed as not compiled, instead of one "file not found" per unit;
- header-only kernels: a header no unit includes is compiled through a generated one-line unit.
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
    re.MULTILINE,
)
_ERROR_COUNT = re.compile(r"\d+ errors? generated")
_PROBE_KERNEL = "#include <hip/hip_runtime.h>\n__global__ void tiletune_probe(float* x) { x[threadIdx.x] = 0.f; }\n"
_INCLUDE = re.compile(r"^[ \t]*#[ \t]*include[ \t]*[<\"]([^>\"]+)[>\"]", re.MULTILINE)
TORCH_STUBS = Path(__file__).parent / "torch_stubs"


@dataclass(frozen=True)
class Library:
    """A ROCm library translated code may include: the include prefixes that need it and its probe header."""

    name: str
    prefixes: tuple[str, ...]
    header: str
    install: str


LIBRARIES = [
    Library("hipCUB", ("hipcub/",), "hipcub/hipcub.hpp",
            "install hipcub-dev from ROCm's apt repository (Debian 12 does not package it) or pass "
            "--hipcc-flag=-I<dir holding hipcub/>"),
    Library("rocPRIM", ("rocprim/",), "rocprim/rocprim.hpp",
            "apt-get install librocprim-dev (Debian/Ubuntu) or rocprim-dev from ROCm's repository"),
    Library("rocThrust", ("thrust/",), "thrust/version.h",
            "install rocthrust-dev from ROCm's apt repository or pass --hipcc-flag=-I<dir holding thrust/>"),
    Library("rocWMMA", ("rocwmma/",), "rocwmma/rocwmma.hpp",
            "install rocwmma-dev from ROCm's apt repository or pass --hipcc-flag=-I<dir holding rocwmma/>"),
]
_TORCH_PREFIXES = ("ATen/", "c10/", "torch/")


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
    not_compiled: str = ""  # why the unit was not compiled (a library hipcc cannot find)
    generated: bool = False  # a header compiled through a generated unit


@dataclass
class CompileCheck:
    """All compile results, or why the check could not run."""

    offload_arch: str
    compiler: str = ""
    skipped: str = ""
    results: list[CompileResult] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)  # one line per missing library, the torch headers used

    @property
    def error_count(self) -> int:
        """Translation units that failed to compile."""
        return sum(not result.ok and not result.not_compiled for result in self.results)

    @property
    def not_compiled_count(self) -> int:
        """Translation units left out because a library they include is missing."""
        return sum(bool(result.not_compiled) for result in self.results)


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


def included(path: Path, include_dirs: list[Path]) -> tuple[set[str], set[Path]]:
    """Every include name reachable from `path`, and the files found for them (quoted or angled,
    resolved against the including file's folder, then `include_dirs`)."""
    names, files, pending = set(), {path.resolve()}, [path.resolve()]
    while pending:
        current = pending.pop()
        try:
            text = current.read_text(encoding="utf-8", errors="replace")
        except OSError:
            continue
        for name in _INCLUDE.findall(text):
            names.add(name)
            for folder in (current.parent, *include_dirs):
                candidate = (folder / name).resolve()
                if candidate.is_file():
                    if candidate not in files:
                        files.add(candidate)
                        pending.append(candidate)
                    break
    return names, files


def torch_include_flags() -> tuple[list[str], str]:
    """Include flags for torch's headers and a note saying which: the real HIP headers of a ROCm torch
    when installed, else tiletune's syntax-level stubs."""
    try:
        from torch.utils.cpp_extension import include_paths
        paths = [Path(p) for p in include_paths()]
    except (ImportError, OSError, RuntimeError):  # torch missing or unusable: the stubs still serve
        paths = []
    if any((path / "ATen" / "hip" / "HIPContext.h").is_file() for path in paths):
        return [f"-I{path}" for path in paths], f"torch's HIP headers from {paths[0]}"
    if not TORCH_STUBS.is_dir():
        return [], ("torch's HIP headers are not installed, and tiletune's stubs are missing from this install "
                    "(install tiletune from its source tree, or pass --hipcc-flag=-I<torch HIP headers>)")
    return [f"-I{TORCH_STUBS}"], (f"torch's HIP headers are not installed (CPU or CUDA torch): compiled against "
                                  f"tiletune's syntax-level stubs in {TORCH_STUBS} (device code is checked, "
                                  "host calls into torch only declared)")


def missing_libraries(hipcc: str, offload_arch: str, wanted: set[str], flags: list[str], scratch: Path) -> dict[str, str]:
    """For each library in `wanted` that hipcc cannot include, the one line that says so."""
    missing = {}
    for library in LIBRARIES:
        if library.name not in wanted:
            continue
        probe = scratch / f"probe_{library.name}.hip"
        probe.write_text(f"#include <{library.header}>\n")
        result = run_hipcc([hipcc, "-x", "hip", f"--offload-arch={offload_arch}", "-std=c++17", *flags,
                            "-fsyntax-only", str(probe)])
        if result.returncode != 0:
            missing[library.name] = f"{library.name} not found by hipcc (<{library.header}>): {library.install}"
    return missing


def compile_units(units: list[tuple[Path, str]], source_maps: dict[Path, SourceMap], offload_arch: str,
                  flags: list[str] | None = None, hipcc: str | None = None,
                  headers: list[tuple[Path, str]] | None = None) -> CompileCheck:
    """Compile each (translated file, label) with hipcc for `offload_arch`, in parallel.

    `source_maps` maps every translated file (units and the headers they include), by resolved
    path, to its CUDA label and line map. `headers` are translated kernel headers: those no unit
    includes are compiled through a generated unit. Returns a CompileCheck whose `skipped` says why
    nothing was compiled when hipcc is missing or cannot target `offload_arch`.
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

        torch_flags, torch_note = torch_include_flags()
        flags = [*(flags or []), *torch_flags]
        include_dirs = [Path(flag[2:]) for flag in flags if flag.startswith("-I")]
        jobs = [(path, label, False) for path, label in units]
        reached = {file for path, _ in units for file in included(path, include_dirs)[1]}
        for index, (header, label) in enumerate(headers or []):
            if header.resolve() not in reached:
                wrapper = scratch / f"header{index}.hip"
                wrapper.write_text(f'#include <hip/hip_runtime.h>\n#include "{header.resolve()}"\n')
                jobs.append((wrapper, label, True))
        needs = {}
        for path, _, _ in jobs:
            names = included(path, include_dirs)[0]
            needs[path] = {library.name for library in LIBRARIES if any(n.startswith(library.prefixes) for n in names)}
            if any(name.startswith(_TORCH_PREFIXES) for name in names) and torch_note not in check.notes:
                check.notes.append(torch_note)
        missing = missing_libraries(hipcc, offload_arch, set().union(*needs.values()), flags, scratch)
        check.notes += missing.values()

        def compile_one(index: int, job: tuple[Path, str, bool]) -> CompileResult:
            path, label, generated = job
            if absent := sorted(needs[path] & set(missing)):
                return CompileResult(label, False, not_compiled=f"needs {', '.join(absent)}", generated=generated)
            result = run_hipcc(_hipcc_command(hipcc, offload_arch, path, scratch / f"unit{index}.o", flags))
            diagnostics, unparsed = _parse(result.stdout + result.stderr, source_maps)
            return CompileResult(label, result.returncode == 0, diagnostics, unparsed, generated=generated)

        with ThreadPoolExecutor(max_workers=os.cpu_count() or 2) as pool:
            check.results = list(pool.map(compile_one, range(len(jobs)), jobs))
    return check
