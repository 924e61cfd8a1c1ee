"""Translation engines: the torch table in-process, hipify-perl / hipify-clang as subprocesses."""

import os
import re
import stat
from pathlib import Path

import pytest

from tiletune.errors import UserError
import torch
from torch.utils.hipify import hipify_python

from tiletune.port.engines import TORCH_TABLE_CORRECTIONS, select_engine, torch_table_undeclared
from tiletune.port.hipify import cuda_names, defined_names

from port_corpus import CLEAN_SAMPLE


def _tool(directory: Path, name: str, script: str) -> Path:
    path = directory / name
    path.write_text("#!/bin/sh\n" + script)
    path.chmod(path.stat().st_mode | stat.S_IEXEC)
    return path


@pytest.fixture
def bare_path(tmp_path, monkeypatch):
    """A PATH holding only sh and sed, plus a bin/ directory the test can put fake tools in."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for tool in ("sh", "sed", "cat"):
        os.symlink(f"/bin/{tool}", bin_dir / tool)
    monkeypatch.setenv("PATH", str(bin_dir))
    monkeypatch.delenv("CUDA_HOME", raising=False)
    monkeypatch.delenv("CUDA_PATH", raising=False)
    return bin_dir


def test_torch_engine_translates_runtime_api_and_headers():
    engine = select_engine("torch")
    hip = engine.translate(CLEAN_SAMPLE)
    assert engine.name == "torch" and "torch" in engine.description
    assert "hipMalloc(" in hip and "hipStream_t" in hip and "hip/hip_fp16.h" in hip
    assert "cudaMalloc" not in hip and "cudaStream_t" not in hip


def test_torch_engine_translates_cub_enumerators_and_macros(tmp_path):
    source = tmp_path / "scan.cu"
    source.write_text(
        "#include <cub/cub.cuh>\n"
        "using Load = cub::BlockLoad<int, 128, 4, cub::BLOCK_LOAD_WARP_TRANSPOSE>;\n"
        "using Scan = ::cub::BlockScan<int, 128, cub::BLOCK_SCAN_WARP_SCANS>;\n"
        "__device__ int f(int v) { return Scan(t).Sum(v, cub::Sum()) + CUB_WARP_THREADS(0) + CUB_PTX_ARCH; }\n")
    hip = select_engine("torch").translate(source)
    assert "hipcub::BlockLoad<int, 128, 4, hipcub::BLOCK_LOAD_WARP_TRANSPOSE>" in hip
    assert "::hipcub::BlockScan<int, 128, hipcub::BLOCK_SCAN_WARP_SCANS>" in hip and "hipcub::Sum()" in hip
    assert "HIPCUB_WARP_THREADS + HIPCUB_ARCH" in hip and "<hipcub/hipcub.hpp>" in hip
    assert not re.search(r"(?<!\w)cub::|\bCUB_", hip)


def test_torch_engine_maps_pytorch_headers_rccl_graph_params_the_kernel_cast_and_spmm_defaults(tmp_path):
    source = tmp_path / "ext.cu"
    source.write_text(
        "#include <ATen/cuda/CUDAContext.h>\n#include <ATen/cuda/Exceptions.h>\n"
        "#include <c10/cuda/CUDAGuard.h>\n#include \"c10/cuda/CUDAStream.h\"\n#include <vector_functions.h>\n"
        "#include \"nccl.h\"\n"
        "void f() { cudaKernelNodeParams params; cudaLaunchParams launches[2];\n"
        "  cudaFuncSetAttribute(k<64>, cudaFuncAttributeMaxDynamicSharedMemorySize, n);\n"
        "  cudaFuncSetAttribute((const void*)k<64>, cudaFuncAttributeMaxDynamicSharedMemorySize, n);\n"
        "  cudaFuncSetSharedMemConfig(k<32>, cudaSharedMemBankSizeFourByte); cudaFuncSetCacheConfig(k<16>, cudaFuncCachePreferShared); }\n"
        "void g() { cusparseSpMM(h, op, op, &a, A, B, &b, C, CUDA_R_32F, CUSPARSE_SPMM_ALG_DEFAULT, buf); }\n")
    hip = select_engine("torch").translate(source)
    assert "<ATen/hip/HIPContext.h>" in hip and "<ATen/hip/Exceptions.h>" in hip
    assert "<c10/hip/HIPGuard.h>" in hip and '"c10/hip/HIPStream.h"' in hip and "<hip/hip_vector_types.h>" in hip
    assert "hipKernelNodeParams params;" in hip and "hipLaunchParams launches[2];" in hip and "#include <rccl/rccl.h>" in hip
    assert hip.count("hipFuncSetAttribute((const void*)k<64>, hipFuncAttributeMaxDynamicSharedMemorySize") == 2
    assert "hipFuncSetSharedMemConfig((const void*)k<32>, hipSharedMemBankSizeFourByte)" in hip
    assert "hipFuncSetCacheConfig((const void*)k<16>, hipFuncCachePreferShared)" in hip
    assert "hipsparseSpMM(h, op, op, &a, A, B, &b, C, HIP_R_32F, HIPSPARSE_SPMM_ALG_DEFAULT, buf)" in hip


@pytest.mark.parametrize(("name", "cuda", "expected"), [
    # the fp8, device-runtime and launch-parameter headers
    ("rasterize.cu", '#include "device_launch_parameters.h"\n#include <cuda_device_runtime_api.h>\n#include <cuda_fp8.h>\n'
                     "__global__ void k(float* x) { x[threadIdx.x] = 0.f; }\n",
     ['"hip/hip_runtime.h"', "<hip/hip_runtime_api.h>", "<hip/hip_fp8.h>"]),
    # torch's table writes `hipPointerAttributeMemoryType`, `hipStreamCreate__`, `hipDeviceP2PAttribute...`; HIP declares
    # `HIP_POINTER_ATTRIBUTE_MEMORY_TYPE`, `hipStreamCreateWithFlags`, `hipDevP2PAttr...`
    ("driver.cpp", "void f(CUdeviceptr p, CUdevice d, CUdevice peer) {\n"
                   "  CUstream s; cuStreamCreate(&s, CU_STREAM_NON_BLOCKING);\n"
                   "  CUmemorytype type; cuPointerGetAttribute(&type, CU_POINTER_ATTRIBUTE_MEMORY_TYPE, p);\n"
                   "  int rank; cuDeviceGetP2PAttribute(&rank, CU_DEVICE_P2P_ATTRIBUTE_PERFORMANCE_RANK, d, peer);\n"
                   "  size_t total; cuDeviceTotalMem(&total, d); cuCtxPopCurrent(nullptr); }\n"
                   "size_t bytes = sizeof(__nv_fp8x2_storage_t);\n",
     ["hipStreamCreateWithFlags(&s, hipStreamNonBlocking)",
      "hipPointerGetAttribute(&type, HIP_POINTER_ATTRIBUTE_MEMORY_TYPE, p)",
      "hipDeviceGetP2PAttribute(&rank, hipDevP2PAttrPerformanceRank, d, peer)",
      "hipDeviceTotalMem(&total, d); hipCtxPopCurrent(nullptr);", "sizeof(__hip_fp8x2_storage_t)"]),
    # cuBLAS's math modes, whose enum torch's table leaves
    ("gemm_setup.cpp", "#include <cublas_v2.h>\n"
                       "cublasMath_t pick(bool strict, bool tf32) {\n"
                       "  return strict ? CUBLAS_PEDANTIC_MATH : tf32 ? CUBLAS_TF32_TENSOR_OP_MATH : CUBLAS_DEFAULT_MATH;\n"
                       "}\n"
                       "void setup(cublasHandle_t h) { cublasSetMathMode(h, pick(true, false)); }\n",
     ["hipblasMath_t pick(bool strict, bool tf32)",
      "HIPBLAS_PEDANTIC_MATH : tf32 ? HIPBLAS_TF32_TENSOR_OP_MATH : HIPBLAS_DEFAULT_MATH",
      "hipblasSetMathMode(h, pick(true, false))"]),
])
def test_torch_engine_writes_names_hip_declares_and_leaves_no_cuda_name(tmp_path, name, cuda, expected):
    source = tmp_path / name
    source.write_text(cuda)
    hip = select_engine("torch").translate(source)
    assert all(text in hip for text in expected), hip
    assert not cuda_names(hip)


def test_the_driver_header_without_a_space_is_translated_and_the_runtime_include_not_added_twice(tmp_path):
    """torch's table maps `include <cuda.h` with one space, and its header magic looks for the runtime include spelt
    so: `#include<cuda.h>` stayed (Cholla) and `#include<cuda_runtime.h>` got a second runtime include above it."""
    source = tmp_path / "kernel.cu"
    source.write_text("#include<cuda.h>\n#include<cuda_runtime.h>\n__global__ void k(float* x) { x[0] = 0; }\n")
    hip = select_engine("torch").translate(source)
    assert hip == ("#include<hip/hip_runtime.h>\n#include<hip/hip_runtime.h>\n"
                   "__global__ void k(float* x) { x[0] = 0; }\n")


def test_nvrtcs_macro_becomes_hiprtcs(tmp_path):
    """A header shared by offline and run-time compilation tests NVRTC's macro to keep standard headers out of the
    run-time compile; under hiprtc that test must name hiprtc's macro, or the branch for offline builds is taken."""
    source = tmp_path / "compat.h"
    source.write_text("#ifdef __CUDACC_RTC__\ntypedef unsigned int uint32_t;\n#else\n#  include <stdint.h>\n#endif\n"
                      "#if !defined(__CUDACC_RTC__) && defined(__CUDACC__)\n#include <cmath>\n#endif\n")
    hip = select_engine("torch").translate(source)
    assert hip.count("__HIPCC_RTC__") == 2 and "__CUDACC_RTC__" not in hip


def test_a_name_torchs_table_maps_to_nothing_hip_declares_is_left_and_counted(tmp_path):
    """`cudaErrorInvalidHostPointer` -> torch's `hipErrorInvalidHostPointer`, which HIP does not declare: the name
    stays as written, so the report counts it left untranslated instead of a compile error on an AMD machine."""
    source = tmp_path / "errors.cu"
    source.write_text("bool f(cudaError_t e) { return e == cudaErrorInvalidHostPointer || e == cudaErrorInvalidValue; }\n")
    hip = select_engine("torch").translate(source)
    assert "e == cudaErrorInvalidHostPointer || e == hipErrorInvalidValue" in hip
    assert cuda_names(hip) == {"cudaErrorInvalidHostPointer": 1}


def test_the_undeclared_list_is_torchs_table_of_its_version_and_no_correction_is_on_it():
    """Regenerate with benchmarks/hipify_eval/torch_table_audit.py when torch's table changes."""
    header = (Path(__file__).parents[2] / "src/tiletune/port/torch_table_undeclared.txt").read_text()
    listed_for = re.search(r"torch (\S+)'s hipify table", header).group(1)
    if listed_for != torch.__version__:
        pytest.skip(f"the list was written from torch {listed_for}'s table, this is torch {torch.__version__}: "
                    "run benchmarks/hipify_eval/torch_table_audit.py with HIP's headers to check it against this one")
    undeclared = torch_table_undeclared()
    assert len(undeclared) > 400
    assert all(hipify_python.PYTORCH_MAP.get(name) == target for name, target in undeclared.items())
    assert not set(undeclared) & set(TORCH_TABLE_CORRECTIONS)


def test_bf16_conversions_hip_lacks_become_their_exact_hip_equivalents(tmp_path):
    source = tmp_path / "gate.cu"
    source.write_text(
        "#include <cuda_bf16.h>\n"
        "#define TO_BF16(v) (__float2bfloat16_rn(v))\n"
        "__device__ void store_gate(__nv_bfloat162* out, float g, float u) {\n"
        "  *out = __floats2bfloat162_rn(g * (1.f / (1.f + __expf(-g))), fmaxf(u, 0.f));\n"
        "}\n"
        "__device__ __nv_bfloat162 splat(float s) { return __float2bfloat162_rn(s * 0.5f); }\n")
    hip = select_engine("torch").translate(source)
    assert "(__float2bfloat16(v))" in hip
    assert "__float22bfloat162_rn(make_float2(g * (1.f / (1.f + __expf(-g))), fmaxf(u, 0.f)))" in hip
    assert "__bfloat162bfloat162(__float2bfloat16(s * 0.5f))" in hip
    assert not re.search(r"__float2bfloat16_rn|__floats2bfloat162_rn|__float2bfloat162_rn", hip)


def test_a_files_own_bf16_conversion_stays_as_written(tmp_path):
    source = tmp_path / "compat.cuh"
    polyfill = ("__device__ inline __nv_bfloat162 __floats2bfloat162_rn(float a, float b) {\n"
                "  return __halves2bfloat162(__float2bfloat16(a), __float2bfloat16(b));\n}\n")
    source.write_text(f"#ifdef USE_ROCM\n{polyfill}#endif\n"
                      "__device__ __nv_bfloat162 pack(float a, float b) { return __floats2bfloat162_rn(a, b); }\n")
    hip = select_engine("torch").translate(source)
    assert "__floats2bfloat162_rn(float a, float b) {" in hip and "return __floats2bfloat162_rn(a, b);" in hip


def test_trap_becomes_the_builtin_hip_aborts_with_unless_the_file_defines_it(tmp_path):
    source = tmp_path / "act.cu"
    source.write_text("__device__ float act(float x, int kind) {\n"
                      "  switch (kind) {\n    case 0: return fmaxf(x, 0.f);\n    default: __trap ();\n  }\n"
                      "  return x;\n}\n")
    hip = select_engine("torch").translate(source)
    assert "default: __builtin_trap();" in hip and "__trap" not in hip
    own = tmp_path / "own_trap.cuh"
    own.write_text("#ifdef USE_ROCM\n#define __trap() abort()\n#endif\n__device__ void fail() { __trap(); }\n")
    assert "__device__ void fail() { __trap(); }" in select_engine("torch").translate(own)


def test_a_projects_own_cu_named_variables_are_not_cuda_names():
    """`cuDevice`, `cuModule`: a project's handles named after the driver API (Blender Cycles'); its calls are."""
    text = "CUdevice cuDevice; result = hipDeviceGet(&cuDevice, cuDevId);\ncuCtxCreate(&cuContext, 0, cuDevice);"
    assert set(cuda_names(text)) == {"CUdevice", "cuCtxCreate"}


def test_cucomplex_types_left_are_cuda_names():
    """cuComplex.h's types and constructors, which no translator call-syntax check sees (no parenthesis after a type)."""
    text = "cuFloatComplex z = make_cuFloatComplex(1.f, 0.f);\ncuDoubleComplex w;\nhipFloatComplex ok;"
    assert set(cuda_names(text)) == {"cuFloatComplex", "make_cuFloatComplex", "cuDoubleComplex"}


def test_cuda_names_are_the_apis_and_headers_not_a_projects_own_snake_case_names():
    text = ("cudaError_t cuda_status = cudaMemcpyAsync(d, h, n, cudaMemcpyHostToDevice, s);\n#include <cuda_fp16.h>\n"
            "curand_init(seed, id, 0, &state); int cuda_device_count = 0; bool use_cudnn_v8 = false;")
    assert set(cuda_names(text)) == {"cudaError_t", "cudaMemcpyAsync", "cudaMemcpyHostToDevice", "cuda_fp16.h", "curand_init"}


def test_names_the_project_defines_are_its_own_not_cuda_names_left():
    """A function or macro the sources define under a CUDA-looking name (KataGo's `cublasGetErrorString`, gputt's
    `cudaCheck`) is the project's: a translation that keeps it leaves nothing of CUDA's."""
    text = ("#define cudaCheck(x) check((x), __FILE__)\n"
            "static const char* cublasGetErrorString(const hipblasStatus_t status) { return \"\"; }\n"
            "void f() { cudaCheck(hipFree(p)); puts(cublasGetErrorString(s)); }")
    own = frozenset(defined_names(text))
    assert {"cudaCheck", "cublasGetErrorString", "f"} <= own
    assert not cuda_names(text, own) and set(cuda_names(text)) == {"cudaCheck", "cublasGetErrorString"}


def test_variables_and_members_the_source_declares_are_its_own():
    """RELION's `cufftHandle cufftPlanForward, cufftPlanBackward;`, vecmem's `cudaEvent_t cudaEvent = nullptr;`: the
    members and locals are the file's, not CUDA's; a statement that only uses a name (`return cudaErrorX;`,
    `delete cudaPtr;`) declares nothing."""
    text = ("class Plan {\n\tcufftHandle cufftPlanForward, cufftPlanBackward;\n\tstatic const cudaStream_t *cudaStreamMine;\n"
            "\tstd::vector<int> cudaSizes;\n\tcudaEvent_t cudaEvent = nullptr, cudaDone = 0;\n\tint cudaCount = f(a, b);\n};\nint f() { return cudaErrorX; }\nvoid g() {\n  delete cudaPtr;\n  x = cudaFoo;\n}\n"
            "void h() {\n  hipfftExecR2C(cufftPlanForward, a, b);\n  return cudaErrorX;\n}\n")
    own = frozenset(defined_names(text))
    assert {"cufftPlanForward", "cufftPlanBackward", "cudaStreamMine", "cudaSizes", "cudaEvent", "cudaDone"} <= own
    assert not {"cudaErrorX", "cudaPtr", "cudaFoo", "cufftHandle", "cudaCount"} & own  # an initializer with a call: left
    assert set(cuda_names(text, own)) == {"cufftHandle", "cudaStream_t", "cudaEvent_t", "cudaErrorX", "cudaPtr", "cudaFoo",
                                          "cudaCount"}


def test_auto_uses_torch_without_hipify_tools(bare_path):
    assert select_engine("auto").name == "torch"


def test_auto_prefers_hipify_perl_on_path(bare_path, tmp_path):
    _tool(bare_path, "hipify-perl", 'for f; do :; done; sed "s/cudaMalloc/hipMalloc/g" "$f"\n')
    engine = select_engine("auto")
    assert engine.name == "perl" and "hipify-perl" in engine.description
    assert "hipMalloc(&ptr" in engine.translate(CLEAN_SAMPLE)


def test_a_failing_tool_is_a_user_error_naming_the_file(bare_path):
    _tool(bare_path, "hipify-perl", 'echo "parse error near line 3" >&2; exit 1\n')
    with pytest.raises(UserError, match=r"hipify-perl failed on .*clean_silu_mul.cu.*parse error"):
        select_engine("perl").translate(CLEAN_SAMPLE)


def test_clang_engine_passes_cuda_path_and_reads_its_output(bare_path, tmp_path, monkeypatch):
    toolkit = tmp_path / "cuda"
    (toolkit / "include").mkdir(parents=True)
    (toolkit / "include" / "cuda_runtime.h").write_text("")
    monkeypatch.setenv("CUDA_HOME", str(toolkit))
    log = tmp_path / "args"
    _tool(bare_path, "hipify-clang",
          f'echo "$@" > {log}\nwhile [ "$1" != "-o" ]; do shift; done\necho "// translated" > "$2"\n')
    engine = select_engine("auto")
    assert engine.name == "clang"
    assert engine.translate(CLEAN_SAMPLE) == "// translated\n"
    assert f"--cuda-path={toolkit}" in log.read_text()


@pytest.mark.parametrize(("engine", "message"), [
    ("perl", "hipify-perl is not on PATH"),
    ("clang", "hipify-clang is not on PATH"),
    ("cuda2hip", "unknown --engine"),
])
def test_unavailable_or_unknown_engine_is_a_user_error(bare_path, engine, message):
    with pytest.raises(UserError, match=message):
        select_engine(engine)


def test_torch_engine_gives_a_host_only_file_the_runtime_include(tmp_path):
    """nvcc includes cuda_runtime.h by itself, hipcc nothing, and torch's hipify only where kernels are."""
    host = tmp_path / "utils.cu"
    host.write_text("int device() {\n  int d;\n  cudaGetDevice(&d);\n  return d;\n}\n")
    included = tmp_path / "ext.cu"
    included.write_text("#include <torch/extension.h>\nint device() { int d; cudaGetDevice(&d); return d; }\n")
    engine = select_engine("torch")
    assert engine.translate(host).startswith("#include <hip/hip_runtime.h>\nint device() {")
    assert "hip_runtime.h" not in engine.translate(included)  # torch's headers bring the runtime


@pytest.mark.parametrize(("name", "cuda", "expected"), [
    # CUDA's C++ overload (event and flags) and default argument (flags 0), which HIP's namesakes lack
    ("events.cu", "void order(cudaStream_t a, cudaStream_t b, cudaEvent_t e) {\n"
                  "  cudaEventCreate(&e, cudaEventDisableTiming);\n  cudaEventCreate(&e);\n"
                  "  cudaStreamWaitEvent(b, e);\n  cudaStreamWaitEvent(a, e, flags);\n}\n",
     ["hipEventCreateWithFlags(&e, hipEventDisableTiming);\n  hipEventCreate(&e);",
      "hipStreamWaitEvent(b, e, 0);\n  hipStreamWaitEvent(a, e, flags);"]),
    # HIP_VERSION counts major * 10^7: `CUDART_VERSION >= 11020` renamed to it would be true on every ROCm
    ("consts.cu", "#include <math_constants.h>\n#if CUDART_VERSION >= 11020\n#define ASYNC_ALLOC 1\n#endif\n"
                  "__device__ float f(float x) { return x > 0 ? CUDART_PI_F * x : -CUDART_INF_F; }\n",
     ["#if CUDART_VERSION >= 11020", "HIP_PI_F * x : -HIP_INF_F"]),
    # a header of device functions: hipcc includes the runtime only in -x hip mode; the include goes where a port puts
    # it, beside the file's first include every build compiles (inside the include guard, below the licence)
    ("debug.h", "#pragma once\n#include <cstdio>\n__device__ void print(float v) { printf(\"%f\\n\", v); }\n",
     ["#pragma once\n#include <hip/hip_runtime.h>\n#include <cstdio>"]),
    ("guarded.cuh", "// Copyright (c) someone\n#ifndef GUARDED_CUH\n#define GUARDED_CUH\n#ifdef USE_FAST\n#include <fast.h>\n"
                    "#endif\n#include \"common.h\"\n__device__ int one() { return 1; }\n#endif\n",
     ["#ifdef USE_FAST\n#include <fast.h>\n#endif\n#include <hip/hip_runtime.h>\n#include \"common.h\""]),
    ("bare.cu", "// no include at all\n__global__ void k(int* x) { *x = 1; }\n",
     ['#include "hip/hip_runtime.h"\n// no include at all']),
    # cuComplex.h's names beyond the two torch's table maps
    ("rotary.cu", "#include <cuComplex.h>\n__global__ void k(cuFloatComplex* x, float c, float s) {\n"
                  "  x[0] = cuCmulf(x[0], make_cuFloatComplex(c, s));\n  x[1].x = cuCabsf(x[1]);\n}\n",
     ["<hip/hip_complex.h>", "hipFloatComplex* x", "hipCmulf(x[0], make_hipFloatComplex(c, s))", "hipCabsf(x[1])"]),
])
def test_torch_engine_fills_what_cuda_gives_implicitly(tmp_path, name, cuda, expected):
    source = tmp_path / name
    source.write_text(cuda)
    hip = select_engine("torch").translate(source)
    assert all(text in hip for text in expected), hip
