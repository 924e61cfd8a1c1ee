"""The preprocessor as hipcc sees it: which `#if` branches AMD compiles, without running a preprocessor.

hipcc defines USE_ROCM (torch extensions) and the __HIP_PLATFORM_* macros, leaves __CUDA_ARCH__ and
CUDA's version macros undefined (0 in a comparison), and says __GNUC__ 4 (clang's GCC compatibility). Code under `#ifndef USE_ROCM` is the CUDA side of a port already made;
code under `#ifdef __CUDA_ARCH__`, `#if __CUDA_ARCH__ >= 800` or `#ifdef __NVCC__` is compiled out on AMD (the
`cuda-arch-guard` and `compiler-guard` rules say so at the `#if`, and the port decides whether to enable it there). The lint skips both. A
project's own build macros are known only as its HIP build sets them (`Build`: hipcc's `-D` / `-U`, e.g. an fp8
feature flag the HIP build leaves off); conditions on anything else are unknown, and their branches count as compiled.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Iterable
from dataclasses import dataclass

# hip-clang is clang: `#if defined __clang__` is taken, a test for another host compiler (Intel's icx / icc, NVIDIA's
# nvc++) is not
DEFINED_ON_AMD = {"USE_ROCM", "__HIP_PLATFORM_AMD__", "__HIPCC__", "__HIP__", "__clang__"}
# Never defined by hipcc, nor renamed by any translator (torch's hipify renames __CUDACC__, not these); the
# hcc-era platform macro, which hip_common.h still defined up to ROCm 5.7 and ROCm 6.0 dropped (as torch 2.3 dropped
# it from its extension flags); and the CUDA headers' feature-test macros.
UNDEFINED_ON_AMD = {"__CUDA_ARCH__", "__NVCC__", "__HIP_PLATFORM_HCC__",
                    # nvcc's own version macros (a comparison is _VERSION_TEST's: 0 there)
                    "__CUDACC_VER_MAJOR__", "__CUDACC_VER_MINOR__", "__CUDACC_VER_BUILD__",
                    # feature-test macros only CUDA's cuda_bf16.h / cuda_fp8.h define (not HIP's headers, through 6.2)
                    "__CUDA_BF16_TYPES_EXIST__", "__CUDA_FP8_TYPES_EXIST__",
                    "__INTEL_COMPILER", "__INTEL_LLVM_COMPILER", "__NVCOMPILER",
                    # what IDEs' code models define for their indexing, never a compiler
                    "__CLION_IDE__", "__JETBRAINS_IDE__", "__INTELLISENSE__", "__RESHARPER__"}
_DIRECTIVE = re.compile(r"^\s*#\s*(if|ifdef|ifndef|elif|else|endif)\b(.*)$")
# CUDA's version macros are undefined under hipcc (0 in a comparison); torch's hipify renames CUDA_VERSION to
# TORCH_HIP_VERSION (major * 100 + minor, ~600), which compares the same against CUDA's versions (>= 9000).
# __CUDA_ARCH__, or a project's own name for it (Eigen's `#define EIGEN_CUDA_ARCH __CUDA_ARCH__`, in another header):
# undefined under hipcc as the macro it stands for
# nvcc's `__CUDA_ARCH_LIST__` (CUDA 11.5: every arch of the build) likewise
CUDA_ARCH_NAME = r"(?:__CUDA_ARCH__|__CUDA_ARCH_LIST__|\w+_CUDA_ARCH)"
_VERSION_TEST = re.compile(rf"^({CUDA_ARCH_NAME}|CUDA_VERSION|CUDART_VERSION|__CUDACC_VER_MAJOR__|__GNUC__)\s*(>=|<=|==|!=|>|<)\s*(\d+)[uUlL]*$")
# hipcc's clang says it is GCC 4.2 (__GNUC__ 4, checked with hipcc 5.2: `#if __GNUC__ < 6` is taken); the others are 0.
_VERSION_ON_AMD = {"__GNUC__": 4}
# `(NAME - 0)`: the idiom that reads a macro as 0 when it is undefined (sppark's `(__CUDACC_VER_MAJOR__-0) >= 11`)
_PLUS_ZERO = re.compile(r"\(\s*(\w+)\s*[-+]\s*0\s*\)")
# `#ifdef __CUDA_ARCH__` and its spellings, with no version: the device / host pass test (`Build.pass_split`)
_PASS_TEST = re.compile(r"!?\s*\(?\s*(?:defined\s*\(?\s*__CUDA_ARCH__\s*\)?|__CUDA_ARCH__)\s*\)?")
_COMPARISON = re.compile(r"^(\w+)\s*(>=|<=|==|!=|>|<)\s*(\d+)[uUlL]*$")  # `SIZEOF_CUFLOATCOMPLEX == 8`
# C++'s alternative tokens, which a directive may spell its operators with (`#if defined __NVCC__ or defined X`)
_ALTERNATIVE_TOKENS = ((re.compile(r"\bor\b"), "||"), (re.compile(r"\band\b"), "&&"), (re.compile(r"\bnot\b"), "!"))
_COMPARE = {">=": int.__ge__, "<=": int.__le__, "==": int.__eq__, "!=": int.__ne__, ">": int.__gt__, "<": int.__lt__}


@dataclass(frozen=True)
class Build:
    """The HIP build's own macros beyond hipcc's: names it defines (`-DNAME`, true in `#if NAME`) and names it leaves
    undefined (`-UNAME`: false in `#ifdef NAME` and `#if NAME`); and the C++ standard it compiles (`-std=c++11`: 11),
    hipcc's clang defaulting to gnu++17."""

    defined: frozenset[str] = frozenset()
    undefined: frozenset[str] = frozenset()
    std: int = 17
    # whether `#ifdef __CUDA_ARCH__` (defined or not, no version) is the device / host pass split a port keeps (as
    # `__HIP_DEVICE_COMPILE__`): both branches compile, each in its pass; hipcc alone compiles the defined one out
    pass_split: bool = False


HIPCC = Build()  # hipcc alone: no project macro known


def cxx_standard(flag: str) -> int:
    """The year of a C++ standard as `-std` names it: 'c++11' -> 11 (what `Build.std` holds)."""
    return int(flag.removeprefix("c++"))


def on_amd(condition: str, build: Build = HIPCC) -> bool | None:
    """The value of a preprocessor condition under hipcc (with `build`'s macros), or None when it depends on
    anything else."""
    condition = _PLUS_ZERO.sub(r"\1", condition.strip())
    for token, operator in _ALTERNATIVE_TOKENS:
        condition = token.sub(operator, condition)
    if build.pass_split and "__CUDA_ARCH__" not in build.defined and _PASS_TEST.fullmatch(condition):
        return None  # either pass: the port keeps the split
    for operator, decisive in (("||", True), ("&&", False)):
        parts = _split_outside_parentheses(condition, operator)
        if len(parts) > 1:  # a part alone is no pass split: `!defined(__CUDA_ARCH__) || __CUDA_ARCH__ >= 800`
            values = [on_amd(part, dataclasses.replace(build, pass_split=False)) for part in parts]
            if decisive in values:
                return decisive
            return None if None in values else not decisive
    if condition.startswith("!"):
        value = on_amd(condition[1:], build)
        return None if value is None else not value
    if condition.startswith("(") and condition.endswith(")"):
        return on_amd(condition[1:-1], build)
    if match := re.fullmatch(r"defined\s*\(?\s*(\w+)\s*\)?", condition):
        name = match.group(1)
        if name in DEFINED_ON_AMD | build.defined:
            return True
        return False if name in UNDEFINED_ON_AMD | build.undefined or re.fullmatch(CUDA_ARCH_NAME, name) else None
    if match := _VERSION_TEST.match(condition):
        return _COMPARE[match.group(2)](_VERSION_ON_AMD.get(match.group(1), 0), int(match.group(3)))
    if (match := _COMPARISON.match(condition)) and match.group(1) in build.undefined:  # an undefined name reads 0
        return _COMPARE[match.group(2)](0, int(match.group(3)))
    if match := re.fullmatch(r"(\d+)[uUlL]*", condition):  # `#if 0`: code kept out of every build
        return int(match.group(1)) != 0
    return True if condition in DEFINED_ON_AMD | build.defined else False if condition in build.undefined else None


def _split_outside_parentheses(text: str, operator: str) -> list[str]:
    parts, depth, start, index = [], 0, 0, 0
    while index < len(text):
        depth += {"(": 1, ")": -1}.get(text[index], 0)
        if depth == 0 and text.startswith(operator, index):
            parts.append(text[start:index])
            start = index = index + len(operator)
            continue
        index += 1
    return [*parts, text[start:]]


@dataclass
class Directive:
    """One conditional directive: its first and last line (0-based; continued lines included), kind and
    condition, whether it sits in code hipcc compiles out, and whether the lines after it are (the branch it
    opens, or after an #endif the enclosing code)."""

    first: int
    last: int
    kind: str
    condition: str
    enclosed_dead: bool
    opens_dead: bool
    group: int  # the index of its #if among the directives


def directives(code: str, build: Build = HIPCC) -> list[Directive]:
    """The conditional directives of `code` (comments stripped) with what hipcc (with `build`'s macros) makes of them."""
    lines = code.split("\n")
    found: list[Directive] = []
    stack = []  # per open #if: [its index, dead around it, a branch so far known taken]
    index = 0
    while index < len(lines):
        first = index
        while lines[index].endswith("\\") and index + 1 < len(lines):  # continued on the next line
            index += 1
        match = _DIRECTIVE.match(" ".join(line.rstrip("\\") for line in lines[first : index + 1]))
        if match and (match.group(1) in ("if", "ifdef", "ifndef") or stack):
            kind, condition = match.group(1), match.group(2).strip()
            if kind in ("if", "ifdef", "ifndef"):
                condition = {"ifdef": f"defined({condition})", "ifndef": f"!defined({condition})"}.get(kind, condition)
                around = bool(found) and found[-1].opens_dead  # the state of the code this #if sits in
                stack.append([len(found), around, False])
            group, around, taken = stack[-1]
            value = on_amd(condition, build) if kind != "else" else True
            opens_dead = around if kind == "endif" else around or taken or value is False
            stack[-1][2] = taken or value is True
            found.append(Directive(first, index, kind, condition, around, opens_dead, group))
            if kind == "endif":
                stack.pop()
        index += 1
    return found


def dead_lines(code: str, build: Build = HIPCC) -> Iterable[int]:
    """0-based lines hipcc compiles out: the body of each dead branch and every directive inside dead code."""
    found = directives(code, build)
    for directive, following in zip(found, found[1:] + [None]):
        if directive.enclosed_dead:
            yield from range(directive.first, directive.last + 1)
        if directive.opens_dead and following is not None:
            yield from range(directive.last + 1, following.first)


def blank_branches_dead_on_amd(code: str, build: Build = HIPCC) -> str:
    """`code` with every line hipcc (with `build`'s macros) compiles out replaced by blanks (line numbers kept)."""
    lines = code.split("\n")
    for number in dead_lines(code, build):
        lines[number] = " " * len(lines[number])
    return "\n".join(lines)
