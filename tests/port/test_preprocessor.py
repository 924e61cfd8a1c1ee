"""Which preprocessor branches hipcc compiles, and what the lint skips."""

import pytest

from tiletune.port.lint import lint_text
from tiletune.port.preprocessor import Build, blank_branches_dead_on_amd, on_amd


@pytest.mark.parametrize(("condition", "value"), [
    ("defined(USE_ROCM)", True),
    ("!defined(__HIP_PLATFORM_AMD__)", False),
    ("__CUDA_ARCH__ >= 800", False),
    ("__CUDA_ARCH__ < 700", True),
    ("defined(__CUDA_ARCH__)", False),
    ("defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800 || defined(USE_ROCM)", True),
    ("!defined(__STOCHASTIC_MODE__) || __CUDA_ARCH__ < 700", True),
    ("!defined(__STOCHASTIC_MODE__) && __CUDA_ARCH__ < 700", None),  # depends on a macro of the project
    ("(FOO) && (__CUDA_ARCH__ >= 750)", False),
    ("FOO > 2", None),
    ("CUDA_VERSION >= 9000", False),  # the old-CUDA branch (unmasked shuffles) is the one hipcc compiles
    ("defined(__NVCC__)", False),  # nvcc's own macro
    ("__GNUC__ < 6", True),  # hipcc's clang says GCC 4 (checked with hipcc 5.2)
    ("defined(EIGEN_CUDA_ARCH) && EIGEN_CUDA_ARCH >= 530", False),  # a project's name for __CUDA_ARCH__
    ("defined(CUDA_ARCHITECTURES)", None),  # not one: a build setting of the project
    ("(__CUDACC_VER_MAJOR__-0) >= 11", False),  # `(NAME-0)`: an undefined macro read as 0
    ("__CUDA_ARCH_LIST__ >= 890", False),  # nvcc 11.5's list of the build's archs
    ("defined __clang__", True),  # hip-clang is clang
    ("defined __NVCC__ or defined __INTEL_LLVM_COMPILER", False),  # C++'s alternative tokens; not Intel's icx
    ("defined USE_ROCM and not defined __CUDA_ARCH__", True),
])
def test_conditions_as_hipcc_sees_them(condition, value):
    assert on_amd(condition) is value


def test_dead_branches_are_blanked_with_their_nested_directives():
    code = """\
live0
#if __CUDA_ARCH__ >= 800
dead1
#ifdef FOO
dead2
#endif
dead3
#elif __CUDA_ARCH__ < 700
live1
#else
dead4
#endif
#if !defined(USE_ROCM) && \\
    FOO
dead5
#endif
#ifdef FOO
live2
#else
live3
#endif"""
    kept = [line for line in blank_branches_dead_on_amd(code).split("\n") if line.strip()]
    assert [line for line in kept if not line.startswith("#") and not line.startswith(" ")] == [
        "live0", "live1", "live2", "live3"]
    assert len(blank_branches_dead_on_amd(code).split("\n")) == len(code.split("\n"))  # line numbers kept


def test_the_guard_is_flagged_and_what_it_compiles_out_is_not_linted():
    code = "#if __CUDA_ARCH__ >= 800\n__nv_bfloat162 v;\n#else\nfloat2 v;\n#endif\n"
    assert [(f.line, f.rule) for f in lint_text(code, "k.cu")] == [(1, "cuda-arch-guard")]
    assert "compiled out on AMD" in lint_text(code, "k.cu")[0].detail


def test_a_true_guard_is_flagged_only_when_it_compiles_an_else_out():
    kept = "#if __CUDA_ARCH__ < 700\n__syncthreads();\n#endif\n"
    dropped = "#if __CUDA_ARCH__ < 700\nslow();\n#else\nfast();\n#endif\n"
    assert [f.rule for f in lint_text(kept, "k.cu")] == []
    finding, = lint_text(dropped, "k.cu")
    assert (finding.rule, finding.line) == ("cuda-arch-guard", 1) and "line 3" in finding.detail


FP8_FLAGGED = """#include <cuda_fp16.h>
#ifdef KERNEL_USE_FP8
#include <cuda_fp8.h>
__device__ __nv_fp8_e4m3 to_fp8(float x) { return __nv_fp8_e4m3(x); }
#endif
#if KERNEL_USE_FP8 && defined(USE_ROCM)
__device__ float from_fp8(__nv_fp8_e4m3 x) { return float(x); }
#endif
"""


def test_the_hip_builds_own_macros_decide_their_branches():
    """A project flag is unknown to hipcc (its code linted as compiled) until the HIP build's macros say: `-U` (left
    off) compiles its branches out, `-D` keeps them; hipcc's own macros still hold."""
    off, on = Build(undefined=frozenset({"KERNEL_USE_FP8"})), Build(defined=frozenset({"KERNEL_USE_FP8"}))
    assert on_amd("defined(KERNEL_USE_FP8)") is None and on_amd("KERNEL_USE_FP8") is None
    assert on_amd("defined(KERNEL_USE_FP8)", off) is False and on_amd("KERNEL_USE_FP8 && defined(USE_ROCM)", off) is False
    assert on_amd("!defined(KERNEL_USE_FP8)", off) is True and on_amd("KERNEL_USE_FP8 && defined(USE_ROCM)", on) is True
    assert on_amd("defined(__CUDA_ARCH__)", on) is False and on_amd("defined(USE_ROCM)", off) is True
    # a name the HIP build leaves undefined reads 0 in a comparison (autoconf's SIZEOF_CUFLOATCOMPLEX, only the CUDA
    # configure sets it); an unknown one still depends on the build
    sizes = Build(undefined=frozenset({"SIZEOF_CUFLOATCOMPLEX"}))
    assert on_amd("SIZEOF_CUFLOATCOMPLEX == 8", sizes) is False and on_amd("SIZEOF_CUFLOATCOMPLEX != 8", sizes) is True
    assert on_amd("SIZEOF_CUFLOATCOMPLEX == 8") is None
    fp8_lines = {finding.line for finding in lint_text(FP8_FLAGGED, "k.cu") if finding.rule == "fp8-type"}
    assert fp8_lines == {3, 4, 7}
    assert not [f for f in lint_text(FP8_FLAGGED, "k.cu", build=off) if f.rule == "fp8-type"]
    assert {f.line for f in lint_text(FP8_FLAGGED, "k.cu", build=on) if f.rule == "fp8-type"} == fp8_lines


def test_the_device_pass_test_is_either_pass_when_the_port_keeps_the_split():
    """`#ifdef __CUDA_ARCH__` alone (any spelling, negated too) is the device / host pass split: with `pass_split` (the
    lint's build as ported) both branches compile; a version test, or the test inside a compound condition, is still
    hipcc's (false: the port does not rename those)."""
    split = Build(pass_split=True)
    for condition in ("defined(__CUDA_ARCH__)", "!defined(__CUDA_ARCH__)", "(defined __CUDA_ARCH__)"):
        assert on_amd(condition, split) is None and on_amd(condition) is not None
    assert on_amd("__CUDA_ARCH__", split) is None
    assert on_amd("__CUDA_ARCH__ >= 800", split) is False
    assert on_amd("defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800", split) is False
    assert on_amd("defined(__CUDA_ARCH__)", Build(defined=frozenset({"__CUDA_ARCH__"}), pass_split=True)) is True
