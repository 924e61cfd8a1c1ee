"""hipcc compile check: translated units compile for gfx90a and errors land on the CUDA lines.

Needs a hipcc that targets gfx90a (Debian's `hipcc` package does, without a GPU); skipped otherwise.
"""

import shutil
import tempfile
from pathlib import Path

import pytest
from port_corpus import CORPUS

from tiletune.hipcc import find_hipcc, hipcc_version
from tiletune.port import compile_check
from tiletune.port.compile_check import compile_units, line_map, probe_arch
from tiletune.port.hipify import run_hipify
from tiletune.port.report import to_text


def _hipcc_problem() -> str:
    hipcc = find_hipcc()
    if hipcc is None:
        return "hipcc not installed: sh .ci/install-hipcc.sh"
    with tempfile.TemporaryDirectory() as scratch:
        return probe_arch(hipcc, "gfx90a", Path(scratch))


HIPCC_PROBLEM = _hipcc_problem()
needs_hipcc = pytest.mark.skipif(bool(HIPCC_PROBLEM), reason=HIPCC_PROBLEM or "hipcc works")


def test_line_map_follows_inserted_and_rewritten_lines():
    source = "a\nb cuda\nc\n"
    translated = "#include <hip/hip_runtime.h>\na\nb hip\nc\n"
    assert line_map(source, translated) == [1, 1, 2, 3]


@needs_hipcc
def test_clean_sample_compiles_with_its_header(tmp_path):
    tree = tmp_path / "src"
    tree.mkdir()
    for name in ("clean_silu_mul.cu", "common.cuh"):
        shutil.copy(CORPUS / name, tree)
    report = run_hipify([str(tree)], str(tmp_path / "hip"), engine="torch", compile_check=True)
    assert report.compile.compiler.startswith("hipcc")
    assert [(r.source.endswith("clean_silu_mul.cu"), r.ok) for r in report.compile.results] == [(True, True)]
    assert report.strict_failures() == []


@needs_hipcc
def test_errors_map_back_to_cuda_lines(tmp_path):
    source = tmp_path / "broken.cu"
    # No include: the torch engine prepends hip_runtime.h, shifting every line of the translation by one.
    source.write_text("__global__ void scale(float* x) {\n  x[threadIdx.x] *= not_declared;\n}\n")
    report = run_hipify([str(source)], str(tmp_path / "hip"), engine="torch", compile_check=True)
    result, = report.compile.results
    assert not result.ok
    diagnostic, = (d for d in result.diagnostics if d.severity == "error")
    assert (Path(diagnostic.path).name, diagnostic.line) == ("broken.cu", 2)
    assert "not_declared" in diagnostic.message and diagnostic.compiled_at.endswith("broken.hip:3")
    assert report.strict_failures() == ["1 unit(s) failed to compile"]


@needs_hipcc
def test_warp_sync_code_fails_on_the_flagged_line(tmp_path):
    report = run_hipify([str(CORPUS / "softmax_ballot.cu"), str(CORPUS / "common.cuh")], str(tmp_path / "hip"),
                        engine="torch", compile_check=True)
    result, = report.compile.results
    error_lines = {d.line for d in result.diagnostics if d.severity == "error"}
    flagged = {f.line for f in report.findings if f.rule == "mask-32bit"}
    assert 21 in error_lines & flagged  # __ballot_sync(0xffffffff, ...): missing before ROCm 6.2, rejected after


@needs_hipcc
def test_func_set_attribute_gets_the_kernel_cast_hipcc_needs(tmp_path):
    report = run_hipify([str(CORPUS / "large_smem.cu"), str(CORPUS / "common.cuh")], str(tmp_path / "hip"),
                        engine="torch", compile_check=True)
    assert [result.ok for result in report.compile.results] == [True]


@needs_hipcc
def test_dependent_names_fail_on_the_flagged_lines(tmp_path):
    source = tmp_path / "tile.cu"
    source.write_text(
        "struct Traits { using index_type = int; };\n"
        "template <typename T> struct Tile { template <int N> __device__ T get() const { return T(N); } };\n"
        "template <typename T, typename Tr> __global__ void k(T* out) {\n"
        "  Tile<T> tile;\n"
        "  Tr::index_type i = 1;\n"
        "  out[i] = tile.get<2>();\n"
        "}\n"
        "template __global__ void k<float, Traits>(float*);\n")
    report = run_hipify([str(source)], str(tmp_path / "hip"), engine="torch", compile_check=True)
    error_lines = {d.line for d in report.compile.results[0].diagnostics if d.severity == "error"}
    assert error_lines == {f.line for f in report.findings if f.rule == "dependent-template-name"} == {5, 6}


@needs_hipcc
def test_inplace_diagnostics_point_at_the_rewritten_file(tmp_path):
    source = tmp_path / "broken.cu"
    source.write_text("__global__ void scale(float* x) {\n  x[threadIdx.x] *= not_declared;\n}\n")
    report = run_hipify([str(source)], inplace=True, engine="torch", compile_check=True)
    diagnostic, = (d for d in report.compile.results[0].diagnostics if d.severity == "error")
    assert "not_declared" in source.read_text().splitlines()[diagnostic.line - 1]


@needs_hipcc
def test_target_the_compiler_cannot_build_is_reported_not_crashed(tmp_path):
    version = hipcc_version(find_hipcc()) or "0"
    if int(version.split(".")[0]) >= 6:
        pytest.skip(f"hipcc {version} supports gfx942; this test needs a pre-ROCm-6 one: apt-get install hipcc "
                    "(Debian's, ROCm 5.2)")
    check = compile_units([], {}, "gfx942")
    assert "gfx942" in check.skipped and check.results == []


def test_missing_hipcc_skips_with_the_install_hint(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.setenv("ROCM_PATH", str(tmp_path))
    monkeypatch.delenv("HIPCC", raising=False)
    check = compile_units([], {}, "gfx90a")
    assert "hipcc not found" in check.skipped and "apt-get install hipcc" in check.skipped


_TORCH_EXTENSION_KERNEL = """\
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>
#include <c10/util/Half.h>
#include <torch/extension.h>

__global__ void scale_kernel(at::Half* x, float alpha, int n) {
  int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) x[i] = at::Half(float(x[i]) * alpha);
}

void scale(at::Tensor x, float alpha) {
  TORCH_CHECK(x.is_contiguous(), "x must be contiguous");
  int n = x.numel();
  scale_kernel<<<(n + 255) / 256, 256, 0, at::cuda::getCurrentCUDAStream()>>>(x.data_ptr<at::Half>(), alpha, n);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}
"""


@needs_hipcc
def test_torch_extension_compiles_against_the_stubs_where_torch_has_no_hip_headers(tmp_path):
    source = tmp_path / "scale.cu"
    source.write_text(_TORCH_EXTENSION_KERNEL)
    report = run_hipify([str(source)], str(tmp_path / "hip"), engine="torch", compile_check=True)
    result, = report.compile.results
    assert result.ok, [d.message for d in result.diagnostics] or result.unparsed
    assert any("stubs" in note or "torch's HIP headers from" in note for note in report.compile.notes)


@needs_hipcc
def test_missing_library_is_one_line_and_its_units_are_not_compiled(tmp_path, monkeypatch):
    monkeypatch.setattr(compile_check, "LIBRARIES", [
        compile_check.Library("nolib", ("nolib/",), "nolib/nolib.hpp", "install nolib")])
    tree = tmp_path / "src"
    tree.mkdir()
    (tree / "common.cuh").write_text("#pragma once\n#include <nolib/nolib.hpp>\n")
    for name in ("a.cu", "b.cu"):
        (tree / name).write_text('#include "common.cuh"\n__global__ void k(float* x) { x[0] = 1.f; }\n')
    (tree / "plain.cu").write_text("__global__ void k(float* x) { x[0] = 1.f; }\n")
    report = run_hipify([str(tree)], str(tmp_path / "hip"), engine="torch", compile_check=True)
    check = report.compile
    assert [note for note in check.notes if "nolib" in note] == ["nolib not found by hipcc (<nolib/nolib.hpp>): install nolib"]
    assert {(Path(r.source).name, r.ok, r.not_compiled) for r in check.results} == {
        ("a.cu", False, "needs nolib"), ("b.cu", False, "needs nolib"), ("plain.cu", True, "")}
    assert (check.error_count, check.not_compiled_count) == (0, 2)
    assert "2 unit(s) not compiled (a ROCm library is missing)" in report.strict_failures()


@needs_hipcc
def test_header_only_kernel_compiles_through_a_generated_unit_with_errors_on_cuda_lines(tmp_path):
    tree = tmp_path / "src"
    tree.mkdir()
    (tree / "used.cuh").write_text("#pragma once\n__device__ inline float twice(float v) { return 2.f * v; }\n")
    (tree / "unit.cu").write_text('#include "used.cuh"\n__global__ void k(float* x) { x[0] = twice(x[0]); }\n')
    (tree / "lonely.cuh").write_text(
        "#pragma once\n"
        "template <typename T>\n"
        "__global__ void fill(T* x) {\n"
        "  x[threadIdx.x] = undeclared_value;\n"
        "}\n")
    report = run_hipify([str(tree)], str(tmp_path / "hip"), engine="torch", compile_check=True)
    results = {Path(r.source).name: r for r in report.compile.results}
    assert set(results) == {"unit.cu", "lonely.cuh"}  # used.cuh is compiled through unit.cu
    lonely = results["lonely.cuh"]
    assert lonely.generated and not lonely.ok
    diagnostic, = (d for d in lonely.diagnostics if d.severity == "error")
    assert (Path(diagnostic.path).name, diagnostic.line) == ("lonely.cuh", 4)
    assert "(header, through a generated unit)" in to_text(report)
