"""The project's HIP twins of its own CUDA back end: renames no translator's table holds.

A project that keeps a HIP back end beside its CUDA one (hand-kept `*_hip` files next to `*_cuda` ones, a
`rocm.h` beside `cuda.h`) calls its own API by back-end names: `cudaCheckOnDebug` and `hipCheckOnDebug`,
`RAJA::cuda_exec` and `RAJA::hip_exec`, `DataSpace::CudaDevice` and `DataSpace::HipDevice`,
`#include "cuda_util.cuh"` and `#include "hip_util.hpp"`. torch's table, hipify-perl and hipify-clang know
CUDA's names, not these, so the port keeps calling the CUDA back end, which the HIP build does not compile. In
the human ports the evaluation holds (benchmarks/hipify_eval) they were the largest class left untranslated.

`ProjectTwins` reads the project (`tiletune hipify --project DIR`): every identifier spelled with a HIP word
(hip, Hip, HIP, rocm, ROCm, amdgpu...) in its sources, and every file path. `rename` then replaces, in a
translation's code (not its comments, strings or conditional directives), each identifier spelled with a CUDA
word whose twin (the same name with the CUDA word swapped for a HIP one: cuda -> hip or rocm, Cuda -> Hip,
CUDA -> HIP, nvgpu -> amdgpu, a CUDA library's prefix -> its HIP library's: cufft -> hipfft) the project holds,
and each included header whose twin file it holds. A name without a twin in the project is left as it is: no
guess is written.
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

from tiletune.port.lint import COMMENT_OR_LITERAL

# CUDA's spelling in a name -> HIP's spellings to try, in order of preference
TWIN_SPELLINGS = {
    "cuda": ("hip", "rocm"),
    "Cuda": ("Hip", "Rocm", "ROCm"),
    "CUDA": ("HIP", "ROCM", "ROCm"),
    "nvgpu": ("amdgpu",),
    "NVGPU": ("AMDGPU",),
    "Nvgpu": ("Amdgpu",),
    # the CUDA libraries' prefixes in a project's own names (RELION's `ERRCUFFTDIM` / `ERRHIPFFTDIM`)
    "cufft": ("hipfft", "rocfft"),
    "CUFFT": ("HIPFFT", "ROCFFT"),
    "Cufft": ("Hipfft", "Rocfft"),
    "cublas": ("hipblas", "rocblas"),
    "CUBLAS": ("HIPBLAS", "ROCBLAS"),
    "Cublas": ("Hipblas", "Rocblas"),
    "curand": ("hiprand", "rocrand"),
    "CURAND": ("HIPRAND", "ROCRAND"),
    "Curand": ("Hiprand", "Rocrand"),
    "cusparse": ("hipsparse", "rocsparse"),
    "CUSPARSE": ("HIPSPARSE", "ROCSPARSE"),
    "cusolver": ("hipsolver", "rocsolver"),
    "CUSOLVER": ("HIPSOLVER", "ROCSOLVER"),
}
_CUDA_SPELLING = re.compile("|".join(TWIN_SPELLINGS))
# every HIP spelling as one alternation (`hip|Hip|HIP|...`): also what the eval's `git grep` looks for
HIP_SPELLINGS = "|".join(sorted({s for spellings in TWIN_SPELLINGS.values() for s in spellings}))
_HIP_WORD = re.compile(rf"\b\w*(?:{HIP_SPELLINGS})\w*\b")
_IDENTIFIER = re.compile(r"\b[A-Za-z_]\w*\b")
# what a rename never touches: comments, string and character literals, and conditional directives (whose macros
# the lint's build decides: `#ifdef RAJA_ENABLE_CUDA` is the project's build flag, not an API)
_UNTOUCHED = re.compile(COMMENT_OR_LITERAL.pattern + r"|^[ \t]*#[ \t]*(?:if|ifdef|ifndef|elif|include)\b[^\n]*",
                        re.DOTALL | re.MULTILINE)
_INCLUDE = re.compile(r"^([ \t]*#[ \t]*include[ \t]*)([\"<])([^\">\n]+)([\">])", re.MULTILINE)
HEADER_SUFFIXES = (".h", ".hpp", ".hh", ".cuh", ".inl", ".hxx")
SCANNED_SUFFIXES = frozenset({*HEADER_SUFFIXES, ".hip", ".cu", ".cpp", ".cc", ".cxx", ".c"})


def twins_of(name: str) -> list[str]:
    """The HIP twins a CUDA-spelled `name` may have, most likely first (every CUDA spelling in it swapped alike)."""
    found = sorted(set(_CUDA_SPELLING.findall(name)))
    if not found:
        return []
    candidates = [name]
    for spelling in found:
        candidates = [c.replace(spelling, twin) for c in candidates for twin in TWIN_SPELLINGS[spelling]]
    return candidates


def cuda_spelled(text: str) -> set[str]:
    """The identifiers of `text`'s code spelled with a CUDA word (`cudaCheckOnDebug`, `cuda_exec`, `Base_CUDA`),
    comments and string literals left out."""
    code = COMMENT_OR_LITERAL.sub(" ", text)
    return {name for name in _IDENTIFIER.findall(code) if _CUDA_SPELLING.search(name)}


def hip_words(text: str) -> set[str]:
    """The identifiers of `text` spelled with a HIP word (`hipCheckOnDebug`, `hip_exec`, `Base_HIP`)."""
    return set(_HIP_WORD.findall(text))


@dataclass(frozen=True)
class ProjectTwins:
    """What a project holds in HIP form: its HIP-spelled identifiers and its header paths (posix, relative)."""

    names: frozenset[str] = frozenset()
    paths: tuple[str, ...] = ()

    @classmethod
    def from_texts(cls, texts: Iterable[str], paths: Iterable[str]) -> ProjectTwins:
        """The twins in these source texts and file paths (the headers among them kept)."""
        names: set[str] = set()
        for text in texts:
            names |= hip_words(text)
        return cls(frozenset(names), tuple(sorted(p for p in paths if PurePosixPath(p).suffix in HEADER_SUFFIXES)))

    @classmethod
    def scan(cls, root: Path, exclude: Iterable[Path] = ()) -> ProjectTwins:
        """The twins of the project under `root`: its C/C++/CUDA/HIP sources read, `exclude` (the files being
        translated) left out."""
        skipped = {path.resolve() for path in exclude}
        files = [p for p in root.rglob("*") if p.is_file() and not any(part.startswith(".") for part in p.relative_to(root).parts)]
        sources = [p for p in files if p.suffix in SCANNED_SUFFIXES and p.resolve() not in skipped]
        return cls.from_texts((p.read_text(encoding="utf-8", errors="replace") for p in sources),
                              (p.relative_to(root).as_posix() for p in files))

    def twin_name(self, name: str) -> str | None:
        """The project's HIP twin of a CUDA-spelled identifier, or None."""
        return next((twin for twin in twins_of(name) if twin in self.names), None)

    def twin_header(self, include: str) -> str | None:
        """The include path of the project's HIP twin of header `include` (`../private/cuda_util.cuh` ->
        `../private/hip_util.hpp`), or None: a project file whose path ends with the twin's, any header suffix."""
        path = PurePosixPath(include)
        stem_twins = twins_of(path.with_suffix("").as_posix()) if path.suffix in HEADER_SUFFIXES else []
        for stem in stem_twins:
            for suffix in dict.fromkeys((path.suffix, *HEADER_SUFFIXES)):
                candidate = stem + suffix
                tail = "/" + PurePosixPath(*[p for p in PurePosixPath(candidate).parts if p not in ("..", ".")]).as_posix()
                if any(("/" + known).endswith(tail) for known in self.paths):
                    return candidate
        return None

    def rename(self, text: str) -> tuple[str, Counter]:
        """`text` with the project's CUDA-spelled names and headers renamed to their HIP twins; the renames
        (`"old -> new"`: count)."""
        if not self.names and not self.paths:
            return text, Counter()
        renames: Counter = Counter()

        def include(match: re.Match) -> str:
            twin = self.twin_header(match.group(3))
            if twin is None:
                return match.group(0)
            renames[f"{match.group(3)} -> {twin}"] += 1
            return f"{match.group(1)}{match.group(2)}{twin}{match.group(4)}"

        def identifier(match: re.Match) -> str:
            name = match.group(0)
            twin = None if name.startswith("__") else self.twin_name(name)
            if twin is None:
                return name
            renames[f"{name} -> {twin}"] += 1
            return twin

        pieces, start = [], 0
        for untouched in _UNTOUCHED.finditer(text):
            pieces.append(_IDENTIFIER.sub(identifier, text[start : untouched.start()]))
            kept = untouched.group(0)
            pieces.append(_INCLUDE.sub(include, kept) if kept.lstrip().startswith("#") else kept)
            start = untouched.end()
        pieces.append(_IDENTIFIER.sub(identifier, text[start:]))
        return "".join(pieces), renames
