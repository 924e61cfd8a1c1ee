"""The project's HIP twins of its CUDA-back-end names and headers: found in the project, renamed in the translation."""

import pytest
from click.testing import CliRunner

from tiletune.cli import main
from tiletune.port.hipify import run_hipify
from tiletune.port.twins import ProjectTwins, cuda_spelled, twins_of

# a project keeping a HIP back end beside its CUDA one: macros, a policy type and a variant id per back end
PROJECT = {
    "base/macros/cuda.h": "#define cudaCheckOnDebug() cudaErrcheck(cudaDeviceSynchronize())\n",
    "base/macros/rocm.h": "#define hipCheckOnDebug() hipErrcheck(hipDeviceSynchronize())\n",
    "include/policy/cuda.hpp": "template <int B> struct cuda_exec {};\n",
    "include/policy/hip.hpp": "template <int B> struct hip_exec {};\nenum Variant { Base_CUDA, Base_HIP };\n",
    "src/private/cuda_util.cuh": "#define SAFE_FREE_HOST_CUDA(p) cudaFreeHost(p)\n",
    "src/private/hip_util.hpp": "#define SAFE_FREE_HOST_HIP(p) hipHostFree(p)\n",
}

KERNEL = """\
#include <base/macros/cuda.h>
#include "../private/cuda_util.cuh"
#include "cuda_only_helpers.h"
// cuda_exec is the CUDA policy
#ifdef RAJA_ENABLE_CUDA
__global__ void scale(float* x) { x[threadIdx.x] *= 2.0f; }
void run(float* x, float* host, int vid) {
  if (vid == Base_CUDA) {
    scale<<<1, 64>>>(x);
    cudaCheckOnDebug();
    RAJA::forall<cuda_exec<256>>(0, 64, [=] __device__ (int i) { x[i] = 0; });
    printf("ran cuda_exec\\n");
    cuda_only_function(x);
  }
  SAFE_FREE_HOST_CUDA(host);
}
#endif
"""


@pytest.fixture
def project(tmp_path):
    root = tmp_path / "project"
    for path, text in PROJECT.items():
        (root / path).parent.mkdir(parents=True, exist_ok=True)
        (root / path).write_text(text)
    kernel = root / "src" / "kernels" / "scale-Cuda.cu"
    kernel.parent.mkdir(parents=True)
    kernel.write_text(KERNEL)
    return root, kernel


@pytest.mark.parametrize(("name", "twins"), [
    ("cudaCheckOnDebug", ["hipCheckOnDebug", "rocmCheckOnDebug"]),
    ("runCudaVariant", ["runHipVariant", "runRocmVariant", "runROCmVariant"]),
    ("Base_CUDA", ["Base_HIP", "Base_ROCM", "Base_ROCm"]),
    ("util_nvgpu", ["util_amdgpu"]),
    ("ERRCUFFTDIM", ["ERRHIPFFTDIM", "ERRROCFFTDIM"]),  # a CUDA library's prefix: RELION's error codes
    ("cublasWrapper", ["hipblasWrapper", "rocblasWrapper"]),
    ("blockDim", []),
])
def test_twin_candidates_swap_each_cuda_spelling(name, twins):
    assert twins_of(name) == twins


def test_names_and_headers_with_a_twin_in_the_project_are_renamed(project):
    root, kernel = project
    twins = ProjectTwins.scan(root, exclude=[kernel])
    renamed, renames = twins.rename(KERNEL)
    assert "#include <base/macros/rocm.h>" in renamed and '#include "../private/hip_util.hpp"' in renamed
    assert "hipCheckOnDebug();" in renamed and "hip_exec<256>" in renamed and "vid == Base_HIP" in renamed
    assert "SAFE_FREE_HOST_HIP(host)" in renamed
    assert renames["cudaCheckOnDebug -> hipCheckOnDebug"] == 1 and renames["cuda_exec -> hip_exec"] == 1
    # no twin in the project: left as written, no guess
    assert '#include "cuda_only_helpers.h"' in renamed and "cuda_only_function(x);" in renamed
    # comments, strings and the build flag's conditional are not code that calls the back end
    assert "// cuda_exec is the CUDA policy" in renamed and '"ran cuda_exec\\n"' in renamed
    assert "#ifdef RAJA_ENABLE_CUDA" in renamed
    assert not cuda_spelled(renamed) - {"RAJA_ENABLE_CUDA", "cuda_only_function"}


def test_the_files_being_translated_are_no_twins_of_themselves(tmp_path):
    kernel = tmp_path / "k_hip.cu"
    kernel.write_text("void hipOnlyHere();\ncudaOnlyHere();\n")
    assert ProjectTwins.scan(tmp_path, exclude=[kernel]).rename("cudaOnlyHere();")[1] == {}
    assert ProjectTwins.scan(tmp_path).twin_name("cudaOnlyHere") == "hipOnlyHere"


def test_hipify_with_the_project_writes_and_reports_the_renames(project, tmp_path):
    root, kernel = project
    out = tmp_path / "hip"
    result = CliRunner().invoke(main, ["hipify", str(kernel), "--out", str(out), "--engine", "torch",
                                       "--project", str(root)])
    assert result.exit_code == 0, result.output
    assert "hipCheckOnDebug();" in (out / "scale-Cuda.hip").read_text()
    assert "renamed to the project's HIP twins: " in result.stdout and "cuda_exec -> hip_exec x1" in result.stdout
    without = run_hipify([str(kernel)], str(tmp_path / "plain"), engine="torch")
    assert without.files[0].renamed == {} and "cudaCheckOnDebug" in (tmp_path / "plain" / "scale-Cuda.hip").read_text()


def test_a_missing_project_directory_is_a_user_error(project, tmp_path):
    _, kernel = project
    result = CliRunner().invoke(main, ["hipify", str(kernel), "--out", str(tmp_path / "hip"),
                                       "--project", str(tmp_path / "nowhere")])
    assert result.exit_code == 2 and "--project" in result.output and "Traceback" not in result.output
