"""`tiletune hipify`: lint CUDA sources, translate them to HIP, optionally compile the result.

The input tree is never written to unless `inplace` is set, and then every changed file keeps a
`<name>.prehip` backup (the suffix hipify-perl uses). Every file is translated before anything
is written, so a translator failure leaves no half-converted tree behind.
"""

from __future__ import annotations

import os
import re
import shutil
from collections import Counter
from dataclasses import replace
from pathlib import Path

from tiletune.errors import UserError
from tiletune.port.compile_check import SourceMap, compile_units, line_map
from tiletune.port.engines import select_engine
from tiletune.port.lint import Finding, lint_text, strip_comments
from tiletune.port.preprocessor import HIPCC, Build
from tiletune.port.report import FileResult, HipifyReport
from tiletune.port.twins import ProjectTwins

SOURCE_SUFFIXES = frozenset({".cu", ".cuh", ".cpp", ".cc", ".cxx", ".c", ".h", ".hpp", ".hh", ".hxx", ".inl"})
HOST_UNIT_SUFFIXES = frozenset({".cpp", ".cc", ".cxx", ".c"})
BACKUP_SUFFIX = ".prehip"
_OFFLOAD_ARCH = re.compile(r"^gfx[0-9a-f]{3,4}(?::[a-z]+[+-])*$")
# Names that only exist in CUDA: runtime/driver API, CUDA libraries, CUB, nv types, CUDA-only
# namespaces (camelCase after a library prefix, or a header's name: a project's own `cuda_status` is not one;
# cuRAND's device API is snake_case; a driver-API function `cuCtxCreate` is called, so a project's own variable
# `cuDevice` or `cuModule` is not one). The final scan of every translation: whatever still matches was left as it was.
_CUDA_NAME = re.compile(
    r"\b(?:cuda|cublas|cusparse|cufft|cusolver|cudnn|nvrtc|nccl)(?:[A-Z]\w*|_\w+\.h\b)|\bcurand(?:[A-Z_])\w*"
    r"|\bCU(?:DA|BLAS|SPARSE|RAND|FFT|SOLVER|DNN|B)?_[A-Z]\w*|\bcu[A-Z]\w*(?=\s*\()|\bCU[a-z]\w*|\bCub[A-Z]\w*|\b__nv_\w+"
    r"|\b(?:nvcuda|wmma|cutlass|cute|cub|thrust::cuda)::\w+"
    r"|\b(?:make_)?cu(?:Float|Double)?Complex\b"  # cuComplex.h's types and constructors
)

_MACRO_DEFINITION = re.compile(r"^[ \t]*#[ \t]*define[ \t]+(\w+)", re.MULTILINE)
# a function the source defines: a name, its parameters and a body (KataGo's own `cublasGetErrorString`)
_FUNCTION_DEFINITION = re.compile(r"\b(\w+)\s*\([^;{}()]*(?:\([^;{}()]*\)[^;{}()]*)*\)\s*(?:const\s*)?\{")
# a statement declaring variables or members of one type (RELION's `cufftHandle cufftPlanForward, cufftPlanBackward;`):
# the names after the type are the source's own, however CUDA-like they look
# (vecmem's `cudaEvent_t cudaEvent = nullptr;`: an initializer without a call or a comma in it)
_VARIABLE_DECLARATION = re.compile(r"^[ \t]*(?:(?:const|static|extern|mutable|volatile)[ \t]+)*(\w+(?:::\w+)*)(?:<[^;<>\n]*>)?"
                                   r"[ \t*&]+((?:\w+(?:[ \t]*=[^;,()\n]*)?[ \t]*,[ \t*&]*)*\w+(?:[ \t]*=[^;,()\n]*)?)[ \t]*;",
                                   re.MULTILINE)
_NOT_A_TYPE = frozenset({"return", "delete", "throw", "goto", "else", "case", "using", "co_return", "co_yield",
                         "typedef", "sizeof", "new", "namespace", "template", "typename"})


def defined_names(text: str) -> set[str]:
    """The macros, functions and variables `text` defines: the project's own names, never CUDA's left behind,
    whatever they look like (`cudaCheck`, `cublasGetErrorString`, a `cufftPlanForward` member)."""
    code = strip_comments(text)
    variables = {name.split("=")[0].strip(" \t*&") for kind, names in _VARIABLE_DECLARATION.findall(code)
                 if kind not in _NOT_A_TYPE for name in names.split(",")}
    return set(_MACRO_DEFINITION.findall(code)) | set(_FUNCTION_DEFINITION.findall(code)) | variables


def display_path(path: Path) -> str:
    """`path` relative to the working directory when it lies below it, else absolute."""
    try:
        return str(path.relative_to(Path.cwd()))
    except ValueError:
        return str(path)


def collect_sources(paths: list[str]) -> tuple[Path, list[Path]]:
    """The root the output mirrors, and every CUDA/C++ source file given or found under `paths`."""
    if not paths:
        raise UserError("no input: pass CUDA source files or directories, e.g. `tiletune hipify csrc/ --out csrc-hip`")
    inputs = []
    for given in paths:
        path = Path(given)
        if not path.exists():
            raise UserError(f"{given}: no such file or directory; pass CUDA source files or directories")
        if path.is_file() and path.suffix not in SOURCE_SUFFIXES:
            raise UserError(f"{given}: not a CUDA/C++ source ({', '.join(sorted(SOURCE_SUFFIXES))})")
        inputs.append(path.resolve())
    sources = []
    for path in inputs:
        found = sorted(p for p in path.rglob("*") if p.is_file() and p.suffix in SOURCE_SUFFIXES) if path.is_dir() else [path]
        sources += found
    if not sources:
        raise UserError(f"no CUDA/C++ sources ({', '.join(sorted(SOURCE_SUFFIXES))}) under {', '.join(paths)}")
    if len(inputs) == 1 and inputs[0].is_dir():
        root = inputs[0]
    else:
        root = Path(os.path.commonpath([p if p.is_dir() else p.parent for p in inputs]))
    return root, list(dict.fromkeys(sources))


def output_path(source: Path, root: Path, out: Path) -> Path:
    """Where the HIP translation of `source` goes: same relative path under `out`, `.cu` -> `.hip`."""
    relative = source.relative_to(root)
    return out / (relative.with_suffix(".hip") if source.suffix == ".cu" else relative)


def _check_destination(out: Path, paths: list[str], destinations: dict[Path, Path]) -> None:
    if out.exists() and not out.is_dir():
        raise UserError(f"--out {out} is a file; give a directory for the HIP sources")
    for given in paths:
        path = Path(given).resolve()
        if path.is_dir() and (out == path or path in out.parents):
            raise UserError(f"--out {out} is inside the input directory {path}: outputs would overwrite or mix "
                            f"with the CUDA sources; choose a directory outside it, e.g. {path.parent / (path.name + '-hip')}, "
                            "or use --inplace")
    if clashes := set(destinations) & set(destinations.values()):
        raise UserError(f"--out {out} would overwrite the input file(s) {', '.join(map(display_path, sorted(clashes)))}; "
                        "choose another directory or use --inplace")


def cuda_names(text: str, own_names: frozenset[str] = frozenset()) -> Counter:
    """CUDA-only names (APIs, types, namespaces) referenced in `text`, comments and the project's `own_names`
    (`defined_names`) excluded."""
    names = Counter(_CUDA_NAME.findall(strip_comments(text)))
    return Counter({name: count for name, count in names.items() if name not in own_names})


def _is_compile_unit(source: Path, text: str) -> bool:
    return source.suffix == ".cu" or (source.suffix in HOST_UNIT_SUFFIXES and ("__global__" in text or "<<<" in text))


def _is_kernel_header(source: Path, text: str) -> bool:
    return source.suffix not in HOST_UNIT_SUFFIXES | {".cu"} and ("__global__" in text or "__device__" in text)


def _write(destination: Path, text: str, inplace: bool, notes: list[str]) -> None:
    if inplace:
        backup = destination.with_name(destination.name + BACKUP_SUFFIX)
        if backup.exists():
            notes.append(f"kept the existing backup {display_path(backup)} (it holds the older original)")
        else:
            shutil.copy2(destination, backup)
    else:
        destination.parent.mkdir(parents=True, exist_ok=True)
    destination.write_text(text, encoding="utf-8")


def _moved(finding: Finding, lines: list[int]) -> Finding:
    """`finding` placed on the last translated line that came from its CUDA line (lines a translator
    inserts map to the line after them)."""
    if finding.line not in lines:
        return finding
    return replace(finding, line=len(lines) - lines[::-1].index(finding.line))


def run_hipify(paths: list[str], out: str | None = None, *, engine: str = "auto", inplace: bool = False,
               lint_only: bool = False, compile_check: bool = False, offload_arch: str = "gfx90a",
               hipcc_flags: tuple[str, ...] = (), build: Build = HIPCC, project: str | None = None) -> HipifyReport:
    """Lint `paths` (code the HIP build compiles out with `build`'s macros left alone), translate them into `out` (or
    in place), with `project`'s HIP twins of its CUDA-back-end names and headers (`twins.ProjectTwins`) renamed in,
    optionally compile with the same macros; return the report."""
    if sum([out is not None, inplace, lint_only]) != 1:
        raise UserError("say where the HIP sources go: exactly one of --out DIR, --inplace (keeps .prehip "
                        "backups) or --lint-only (no translation)")
    if compile_check and lint_only:
        raise UserError("--compile-check compiles the translation, which --lint-only does not produce; drop one")
    if not _OFFLOAD_ARCH.match(offload_arch):
        raise UserError(f"--offload-arch {offload_arch!r} is not an AMD GPU target; use e.g. gfx90a (MI200), "
                        "gfx942 (MI300), gfx1100 (RX 7900)")
    root, sources = collect_sources(paths)
    if project is not None and not Path(project).is_dir():
        raise UserError(f"--project {project}: no such directory; give the root of the project the sources belong to")
    texts = {source: source.read_text(encoding="utf-8", errors="replace") for source in sources}
    findings = [f for source in sources for f in lint_text(texts[source], display_path(source), build=build)]
    if lint_only:
        return HipifyReport(engine="none", destination="none (--lint-only)", files=[], findings=findings)

    out_dir = None if inplace else Path(out).resolve()
    destinations = {source: source if inplace else output_path(source, root, out_dir) for source in sources}
    if out_dir is not None:
        _check_destination(out_dir, paths, destinations)
    translator = select_engine(engine)
    twins = ProjectTwins.scan(Path(project), exclude=sources) if project is not None else ProjectTwins()
    translations, renames = {}, {}
    for source in sources:
        translations[source], renames[source] = twins.rename(translator.translate(source))

    line_maps = {source: line_map(texts[source], hip_text) for source, hip_text in translations.items()}
    if inplace:  # the CUDA text now lives in the .prehip backups: point findings at the rewritten files
        findings = [_moved(finding, line_maps[Path(finding.path).resolve()]) for finding in findings]
    report = HipifyReport(engine=translator.description,
                          destination="in place" if inplace else display_path(out_dir), files=[], findings=findings)
    source_maps, units, headers = {}, [], []
    own_names = frozenset(name for text in texts.values() for name in defined_names(text))
    for source, hip_text in translations.items():
        destination = destinations[source]
        if not inplace or hip_text != texts[source]:
            _write(destination, hip_text, inplace, report.notes)
        names_before, names_after = cuda_names(texts[source], own_names), cuda_names(hip_text, own_names)
        left = names_after & names_before
        report.files.append(FileResult(
            source=display_path(source), output=display_path(destination),
            translated=sum(names_before.values()) - sum(left.values()), left=dict(left.most_common()),
            renamed=dict(renames[source].most_common()),
        ))
        source_maps[destination.resolve()] = SourceMap(display_path(source), [] if inplace else line_maps[source])
        if _is_compile_unit(source, texts[source]):
            units.append((destination, display_path(source)))
        elif _is_kernel_header(source, texts[source]):
            headers.append((destination, display_path(source)))
    if inplace:
        report.notes.append(f"originals of changed files are kept as <name>{BACKUP_SUFFIX}")
    if compile_check:
        flags = [f"-I{root if inplace else out_dir}", *(f"-D{name}" for name in sorted(build.defined)),
                 *(f"-U{name}" for name in sorted(build.undefined)), *hipcc_flags]
        report.compile = compile_units(units, source_maps, offload_arch, flags, headers=headers)
    return report
