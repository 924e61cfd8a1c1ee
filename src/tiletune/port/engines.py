"""Translation engines: one CUDA source file in, its HIP text out.

- `clang`: AMD's hipify-clang (a real C++ parse; needs a CUDA toolkit for the headers),
- `perl`: AMD's hipify-perl (regex-based, the same mapping tables as hipify-clang),
- `torch`: PyTorch's `torch.utils.hipify` mapping table, the one `torch.utils.cpp_extension`
  applies when it builds an extension for ROCm; always available where torch is installed.

`auto` takes the first that can run here, in that order. Engines never write files: the caller
decides where the text goes, so the input tree stays untouched.

The torch engine applies torch's table the way `torch.utils.hipify` does, plus `TORCH_TABLE_GAPS`:
what that table misses and hipify-perl / hipify-clang translate (CUB, PyTorch's own CUDA headers,
the kernel cast `hipFuncSetAttribute` and its two siblings need), and the HIP runtime include a host-only file
needs. Before the table it writes HIP's own name where the table misspells one (`TORCH_TABLE_CORRECTIONS`), and it
leaves a CUDA name whose table entry names nothing HIP declares as it is (`torch_table_undeclared.txt`), so the
report lists it as left.
"""

from __future__ import annotations

import importlib.util
import os
import re
import shutil
import subprocess
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from tiletune.errors import UserError
from tiletune.port.rules import split_arguments

ENGINE_NAMES = ("auto", "torch", "perl", "clang")


@dataclass(frozen=True)
class Engine:
    """A translator: `translate(path)` returns the HIP text of the CUDA file at `path`."""

    name: str
    description: str
    translate: Callable[[Path], str]


def cuda_toolkit() -> Path | None:
    """The CUDA toolkit root (the directory holding include/cuda_runtime.h), if one is installed."""
    candidates = [os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda"]
    nvcc = shutil.which("nvcc")
    if nvcc:
        candidates.insert(2, str(Path(nvcc).resolve().parent.parent))
    for candidate in filter(None, candidates):
        if (Path(candidate) / "include" / "cuda_runtime.h").is_file():
            return Path(candidate)
    return None


def _run_tool(command: list[str], path: Path, engine: str) -> subprocess.CompletedProcess:
    result = subprocess.run(command, capture_output=True, text=True, check=False)
    if result.returncode != 0:
        tail = (result.stderr or result.stdout).strip().splitlines()[-5:]
        raise UserError(
            f"{engine} failed on {path} (exit {result.returncode}): {' | '.join(tail) or 'no output'}; "
            "fix the source or pick another translator with --engine torch|perl|clang"
        )
    return result


def _tool_version(executable: str) -> str:
    result = subprocess.run([executable, "--version"], capture_output=True, text=True, check=False)
    lines = (result.stdout or result.stderr).strip().splitlines()
    return lines[0].strip() if lines else "version unknown"


@dataclass(frozen=True)
class Rewrite:
    """One translation torch's table lacks: `pattern` replaced by `replacement` (a template or a function)."""

    pattern: re.Pattern
    replacement: str | Callable[[re.Match], str]
    why: str


def _torch_header(match: re.Match) -> str:
    from torch.utils.hipify import hipify_python

    return match.group(1) + hipify_python.get_hip_file_path(match.group(2), is_pytorch_extension=True)


_CALL_ARGUMENTS = r"\(((?:[^()]|\((?:[^()]|\((?:[^()]|\([^()]*\))*\))*\))*)\)"  # balanced, three levels deep


def _unless_defined(name: str, template: str) -> Callable[[re.Match], str]:
    """A replacement writing `template` (its `{0}` the call's arguments) for a call of `name`, unless the file
    defines `name` itself (a function or a macro: a polyfill, whose definition and calls stay as written)."""
    definition = re.compile(rf"\b{name}\s*\([^;{{}}()]*\)\s*(?:const\s*)?\{{|^[ \t]*#[ \t]*define[ \t]+{name}\b",
                            re.MULTILINE)

    def replace(match: re.Match) -> str:
        return match.group(0) if definition.search(match.string) else template.format(match.group(1))

    return replace


def _with_arity(arity: int, template: str) -> Callable[[re.Match], str]:
    """A replacement writing `template` (its `{0}` the call's arguments) for a call with `arity` arguments; a call
    with any other number stays as written."""
    def replace(match: re.Match) -> str:
        return template.format(match.group(1)) if len(split_arguments(match.group(1))) == arity else match.group(0)

    return replace


# the constants of CUDA's math_constants.h, which hip/hip_math_constants.h defines under HIP_ names (`CUDART_VERSION`,
# `CUDART_CB` and cuda_fp16.h's `CUDART_INF_FP16` are not among them)
_MATH_CONSTANT = re.compile(
    r"\bCUDART_((?:INF|NAN|MIN_DENORM|MAX_NORMAL|NEG_ZERO|ZERO|ONE|SQRT_HALF(?:_HI|_LO)?|SQRT_TWO|THIRD|TWOTHIRD"
    r"|PIO4(?:_HI|_LO)?|PIO2(?:_HI|_LO)?|3PIO4|2_OVER_PI|SQRT_2_OVER_PI|PI(?:_HI|_LO)?|SQRT_PI(?:_HI|_LO)?"
    r"|SQRT_2PI(?:_HI|_LO)?|SQRT_PIO2(?:_HI|_LO)?|SQRT_2OPI|L2E(?:_HI|_LO)?|L2T|LG2(?:_HI|_LO)?|LGE(?:_HI|_LO)?"
    r"|LN2(?:_HI|_LO)?|LNT(?:_HI|_LO)?|LNPI|LN2_X_10(?:24|25|75)|LG2_X_10(?:24|75)|TWO_TO_(?:M?\d+)|NORM_HUGE"
    r"|REMQUO_(?:BITS|MASK)|TRIG_PLOSS|DBL2INT_CVT)(?:_F)?)\b")

TORCH_TABLE_GAPS: list[Rewrite] = [
    Rewrite(re.compile(r"(?<!\w)cub::"), "hipcub::",
            "torch's table lists some `cub::` names, and `cub::` alone only before a non-word character, so "
            "enumerators such as `cub::BLOCK_LOAD_WARP_TRANSPOSE` stay; hipCUB mirrors CUB's names in namespace hipcub"),
    Rewrite(re.compile(r"\bCUB_PTX_ARCH\b"), "HIPCUB_ARCH", "hipify-clang's CUB table"),
    Rewrite(re.compile(r"\bCUB_PTX_WARP_THREADS\b|\bCUB_WARP_THREADS\s*\(\s*\w*\s*\)"), "HIPCUB_WARP_THREADS",
            "hipCUB's warp size is the wavefront size of the target (64 on CDNA), taking no arch argument"),
    Rewrite(re.compile(r"\bCUB_RUNTIME_FUNCTION\b"), "HIPCUB_RUNTIME_FUNCTION", "hipify-clang's CUB table"),
    Rewrite(re.compile(r"\bCUB_STDERR\b"), "HIPCUB_STDERR", "hipify-clang's CUB table"),
    Rewrite(re.compile(r"\bCubDebug\b"), "HipcubDebug", "hipify-clang's CUB table"),
    Rewrite(re.compile(r"\bCUB_NAMESPACE_BEGIN\b"), "BEGIN_HIPCUB_NAMESPACE", "hipify-clang's CUB table"),
    Rewrite(re.compile(r"\bCUB_NAMESPACE_END\b"), "END_HIPCUB_NAMESPACE", "hipify-clang's CUB table"),
    Rewrite(re.compile(r"(#\s*include\s*)([<\"])cuda\.h([>\"])"), r"\1\2hip/hip_runtime.h\3",
            "torch's table maps the driver header only as `include <cuda.h` / `include \"cuda.h` with one space, so "
            "`#include<cuda.h>` stayed (Cholla's gravity solver); ROCm has no cuda.h"),
    Rewrite(re.compile(r"\bcudaKernelNodeParams\b"), "hipKernelNodeParams", "HIP graph API, missing from torch's table"),
    Rewrite(re.compile(r"\bcudaLaunchParams\b"), "hipLaunchParams",
            "the launch-parameter struct of cooperative multi-device launches, missing from torch's table"),
    Rewrite(re.compile(r"\b__CUDACC_RTC__\b"), "__HIPCC_RTC__",
            "NVRTC's macro for a source compiled at run time; hiprtc defines __HIPCC_RTC__ instead (clang D100652), so "
            "a test of __CUDACC_RTC__ takes its offline branch under hiprtc (standard headers it cannot find)"),
    Rewrite(re.compile(r"\bnv_bfloat16(2?)\b"), r"__hip_bfloat16\1",
            "cuda_bf16.h's typedef names `nv_bfloat16` / `nv_bfloat162`, which HIP does not declare; torch's table "
            "maps only `__nv_bfloat16` / `__nv_bfloat162`"),
    # cuda_bf16.h's conversions that name their rounding, which HIP's amd_hip_bf16.h lacks (through ROCm 7): HIP's
    # `__float2bfloat16` rounds to nearest even, so each has an exact equivalent
    Rewrite(re.compile(rf"\b__float2bfloat16_rn\s*{_CALL_ARGUMENTS}"),
            _unless_defined("__float2bfloat16_rn", "__float2bfloat16({0})"),
            "HIP has no `__float2bfloat16_rn`; its `__float2bfloat16` is the same round-to-nearest-even conversion"),
    Rewrite(re.compile(rf"\b__floats2bfloat162_rn\s*{_CALL_ARGUMENTS}"),
            _unless_defined("__floats2bfloat162_rn", "__float22bfloat162_rn(make_float2({0}))"),
            "HIP has no `__floats2bfloat162_rn(a, b)`; it has `__float22bfloat162_rn` of a float2"),
    Rewrite(re.compile(rf"\b__float2bfloat162_rn\s*{_CALL_ARGUMENTS}"),
            _unless_defined("__float2bfloat162_rn", "__bfloat162bfloat162(__float2bfloat16({0}))"),
            "HIP has no `__float2bfloat162_rn(x)` (x in both halves); it has `__bfloat162bfloat162` of a bf16"),
    # nvcc's device trap: no HIP header declares `__trap` (clr's amd_detail headers, hipify's table marks it
    # unsupported); clang's `__builtin_trap` aborts the kernel on AMD as `__trap` does on NVIDIA
    Rewrite(re.compile(rf"\b__trap\s*{_CALL_ARGUMENTS}"), _unless_defined("__trap", "__builtin_trap()"),
            "HIP has no `__trap()`; `__builtin_trap()` (what HIP's own `abort()` calls) aborts the kernel the same way"),
    # cuBLAS's math modes: torch's table maps cublasSetMathMode / cublasGetMathMode to hipBLAS's but not their
    # enum, which hipBLAS has under the same names since ROCm 6.1 (hipblasMath_t). On the rocBLAS backend
    # hipblasSetMathMode takes HIPBLAS_DEFAULT_MATH (rocBLAS's full-precision default) and HIPBLAS_XF32_XDL_MATH
    # only: the others return HIPBLAS_STATUS_NOT_SUPPORTED
    Rewrite(re.compile(r"\bcublasMath_t\b"), "hipblasMath_t", "hipBLAS's math-mode enum (ROCm >= 6.1)"),
    Rewrite(re.compile(r"\bCUBLAS_(DEFAULT_MATH|PEDANTIC_MATH|TENSOR_OP_MATH|TF32_TENSOR_OP_MATH"
                       r"|MATH_DISALLOW_REDUCED_PRECISION_REDUCTION)\b"), r"HIPBLAS_\1",
            "hipBLAS names cuBLAS's math modes alike (ROCm >= 6.1); on AMD only HIPBLAS_DEFAULT_MATH is accepted of them"),
    Rewrite(re.compile(r"\bhip(FuncSetAttribute|FuncSetCacheConfig|FuncSetSharedMemConfig)\s*\("
                       r"\s*(?!\(\s*const\s+void\s*\*\s*\))"),
            r"hip\1((const void*)",
            "HIP declares `hipFuncSetAttribute`, `hipFuncSetCacheConfig` and `hipFuncSetSharedMemConfig` for a "
            "`const void*` only (no template overload for a kernel as CUDA's runtime has): a kernel name does not "
            "convert implicitly"),
    # CUDA's runtime header gives these calls a C++ overload or a default argument that HIP's namesakes lack
    Rewrite(re.compile(rf"\bhipEventCreate\s*{_CALL_ARGUMENTS}"), _with_arity(2, "hipEventCreateWithFlags({0})"),
            "cuda_runtime.h overloads `cudaEventCreate(&event, flags)` in C++; HIP's `hipEventCreate` takes the event "
            "alone and its flags go to `hipEventCreateWithFlags`"),
    Rewrite(re.compile(rf"\bhipStreamWaitEvent\s*{_CALL_ARGUMENTS}"), _with_arity(2, "hipStreamWaitEvent({0}, 0)"),
            "cuda_runtime_api.h defaults `cudaStreamWaitEvent`'s flags to 0; hip_runtime_api.h gave "
            "`hipStreamWaitEvent`'s no default before ROCm 6.1"),
    # cuComplex.h's names: torch maps the header, cuComplex and cuDoubleComplex only (cuFloatComplex, the make_
    # constructors and the arithmetic are left as they were)
    Rewrite(re.compile(r"\bcu(FloatComplex|C(?:add|sub|mul|div|abs|real|imag|fma)f?|Conjf?|Complex(?:FloatToDouble|"
                       r"DoubleToFloat))\b"), r"hip\1",
            "hip/hip_complex.h's names for cuComplex.h's (hipFloatComplex, hipCaddf, hipCabs, hipConjf ...)"),
    Rewrite(re.compile(r"\bmake_cu(Float|Double)?Complex\b"), r"make_hip\1Complex", "hip/hip_complex.h's constructors"),
    Rewrite(re.compile(r"""(#\s*include\s*[<"])vector_functions\.hp?p?([>"])"""), r"\1hip/hip_vector_types.h\2",
            "CUDA's make_float2 / make_int4 ... header; HIP defines them with its vector types (torch maps "
            "vector_types.h only)"),
    Rewrite(re.compile(r'(#\s*include\s*)"nccl\.h"'), r"\1<rccl/rccl.h>",
            "ROCm's NCCL is RCCL; torch maps the angle-bracket include only (a quoted one is taken for the project's own)"),
    Rewrite(re.compile(r"""(#\s*include\s*[<"])cuda_fp8\.h([>"])"""), r"\1hip/hip_fp8.h\2",
            "HIP's fp8 header (ROCm >= 6.2; its types are the fnuz formats MI300 computes in: `fp8-type` says where "
            "CUDA's OCP types are used)"),
    Rewrite(re.compile(r"""(#\s*include\s*[<"])cuda_device_runtime_api\.h([>"])"""), r"\1hip/hip_runtime_api.h\2",
            "CUDA's device-runtime declarations; HIP declares its runtime in one header"),
    Rewrite(re.compile(r"""(#\s*include\s*[<"])device_launch_parameters\.h([>"])"""), r"\1hip/hip_runtime.h\2",
            "the CUDA toolkit's threadIdx / blockIdx declarations (for editors), which ROCm does not ship; "
            "hip_runtime.h declares them"),
    Rewrite(re.compile(r"""(#\s*include\s*[<"])math_constants\.h([>"])"""), r"\1hip/hip_math_constants.h\2",
            "CUDA's CUDART_* constants; HIP has them as HIP_* in hip/hip_math_constants.h (hipify-clang's header table)"),
    Rewrite(_MATH_CONSTANT, r"HIP_\1",
            "hip/hip_math_constants.h names CUDA's constants with a HIP_ prefix (CUDART_PI_F -> HIP_PI_F); "
            "`CUDART_VERSION` stays: HIP_VERSION counts otherwise (major * 10^7 + ...), so "
            "`#if CUDART_VERSION >= 11020` would be taken on AMD whatever it guards"),
    Rewrite(re.compile(r"\bCUSPARSE_(SPMM|SPMV)_ALG_DEFAULT\b"), r"HIPSPARSE_\1_ALG_DEFAULT",
            "the generic SpMM / SpMV API's default algorithms (CUDA 11 names); torch maps their older aliases "
            "(CUSPARSE_MM_ALG_DEFAULT) only, hipSPARSE has both"),
    Rewrite(re.compile(r"""(#\s*include\s*[<"])((?:ATen/(?:native/(?:\w+/)?)?|c10/)cuda/[^>"]+)"""), _torch_header,
            "torch.utils.hipify renames PyTorch's CUDA headers by path when it builds an extension "
            "(ATen/cuda/CUDAContext.h -> ATen/hip/HIPContext.h), not through its table"),
]


def _same_suffix(cuda_prefix: str, hip_prefix: str, suffixes: str) -> dict[str, str]:
    return {cuda_prefix + suffix: hip_prefix + suffix for suffix in suffixes.split()}


# CUDA runtime / driver names torch's table maps to a HIP name HIP does not declare, where HIP has the same thing
# under another name with the same signature (checked against HIP's headers by
# benchmarks/hipify_eval/torch_table_audit.py). Applied before torch's table.
TORCH_TABLE_CORRECTIONS: dict[str, str] = {
    **_same_suffix("CU_POINTER_ATTRIBUTE_", "HIP_POINTER_ATTRIBUTE_",
                   "CONTEXT MEMORY_TYPE DEVICE_POINTER HOST_POINTER P2P_TOKENS SYNC_MEMOPS BUFFER_ID IS_MANAGED "
                   "DEVICE_ORDINAL RANGE_START_ADDR RANGE_SIZE MAPPED ALLOWED_HANDLE_TYPES IS_GPU_DIRECT_RDMA_CAPABLE "
                   "ACCESS_FLAGS MEMPOOL_HANDLE"),
    **_same_suffix("CU_FUNC_ATTRIBUTE_", "HIP_FUNC_ATTRIBUTE_",
                   "MAX_THREADS_PER_BLOCK SHARED_SIZE_BYTES CONST_SIZE_BYTES LOCAL_SIZE_BYTES NUM_REGS PTX_VERSION "
                   "BINARY_VERSION CACHE_MODE_CA MAX_DYNAMIC_SHARED_SIZE_BYTES PREFERRED_SHARED_MEMORY_CARVEOUT MAX"),
    "CU_DEVICE_P2P_ATTRIBUTE_PERFORMANCE_RANK": "hipDevP2PAttrPerformanceRank",
    "CU_DEVICE_P2P_ATTRIBUTE_ACCESS_SUPPORTED": "hipDevP2PAttrAccessSupported",
    "CU_DEVICE_P2P_ATTRIBUTE_NATIVE_ATOMIC_SUPPORTED": "hipDevP2PAttrNativeAtomicSupported",
    "CU_DEVICE_P2P_ATTRIBUTE_CUDA_ARRAY_ACCESS_SUPPORTED": "hipDevP2PAttrHipArrayAccessSupported",
    **_same_suffix("cudaDevP2PAttr", "hipDevP2PAttr", "PerformanceRank AccessSupported NativeAtomicSupported"),
    "cudaDevP2PAttrCudaArrayAccessSupported": "hipDevP2PAttrHipArrayAccessSupported",
    "CUdevice_P2PAttribute": "hipDeviceP2PAttr",
    "cudaDeviceP2PAttr": "hipDeviceP2PAttr",
    "CU_DEVICE_ATTRIBUTE_PCI_DOMAIN_ID": "hipDeviceAttributePciDomainID",
    "cudaDevAttrPciDomainId": "hipDeviceAttributePciDomainID",
    "CU_DEVICE_ATTRIBUTE_MULTI_GPU_BOARD_GROUP_ID": "hipDeviceAttributeMultiGpuBoardGroupID",
    "CU_DEVICE_ATTRIBUTE_MAX_BLOCKS_PER_MULTIPROCESSOR": "hipDeviceAttributeMaxBlocksPerMultiProcessor",
    "cudaDevAttrMaxBlocksPerMultiprocessor": "hipDeviceAttributeMaxBlocksPerMultiProcessor",
    "CU_CTX_SCHED_AUTO": "hipDeviceScheduleAuto",  # hipCtxCreate takes the hipDevice* flags
    "CU_CTX_SCHED_SPIN": "hipDeviceScheduleSpin",
    "CU_CTX_SCHED_YIELD": "hipDeviceScheduleYield",
    "CU_CTX_SCHED_BLOCKING_SYNC": "hipDeviceScheduleBlockingSync",
    "CU_CTX_SCHED_MASK": "hipDeviceScheduleMask",
    "CU_CTX_MAP_HOST": "hipDeviceMapHost",
    "CU_CTX_LMEM_RESIZE_TO_MAX": "hipDeviceLmemResizeToMax",
    "CU_MEMHOSTALLOC_DEVICEMAP": "hipHostMallocMapped",
    "CU_MEMHOSTALLOC_PORTABLE": "hipHostMallocPortable",
    "CU_MEMHOSTALLOC_WRITECOMBINED": "hipHostMallocWriteCombined",
    "CU_MEMHOSTREGISTER_DEVICEMAP": "hipHostRegisterMapped",
    "CU_MEMHOSTREGISTER_IOMEMORY": "hipHostRegisterIoMemory",
    "CU_MEMHOSTREGISTER_PORTABLE": "hipHostRegisterPortable",
    "CU_STREAM_LEGACY": "hipStreamLegacy",
    "CU_STREAM_PER_THREAD": "hipStreamPerThread",
    "CU_GL_DEVICE_LIST_ALL": "hipGLDeviceListAll",
    "CU_GL_DEVICE_LIST_CURRENT_FRAME": "hipGLDeviceListCurrentFrame",
    "CU_GL_DEVICE_LIST_NEXT_FRAME": "hipGLDeviceListNextFrame",
    **_same_suffix("cudaGLDeviceList", "hipGLDeviceList", "All CurrentFrame NextFrame"),
    "cuStreamCreate": "hipStreamCreateWithFlags",  # cuStreamCreate(&stream, flags)
    "cuMemcpy2D": "hipMemcpyParam2D",
    "cuMemcpy2DAsync": "hipMemcpyParam2DAsync",
    "cuMemcpy2DUnaligned": "hipDrvMemcpy2DUnaligned",
    "cuMemcpy3D": "hipDrvMemcpy3D",
    "cuMemcpy3DAsync": "hipDrvMemcpy3DAsync",
    "cuMemAllocPitch": "hipMemAllocPitch",
    "cuMemPrefetchAsync": "hipMemPrefetchAsync",
    "cuCtxPushCurrent": "hipCtxPushCurrent",
    "cuCtxPopCurrent": "hipCtxPopCurrent",
    "cuDeviceTotalMem": "hipDeviceTotalMem",
    "cuTexRefGetMipmappedArray": "hipTexRefGetMipMappedArray",
    "CUaddress_mode": "HIPaddress_mode",
    "CUarray_format": "hipArray_Format",
    "CUarray_format_enum": "hipArray_Format",
    "CUcomputemode": "hipComputeMode",
    "CUmemorytype": "hipMemoryType",
    "CUDA_TEXTURE_DESC": "HIP_TEXTURE_DESC",
    "__nv_fp8_storage_t": "__hip_fp8_storage_t",
    "__nv_fp8x2_storage_t": "__hip_fp8x2_storage_t",
    "__nv_fp8x4_storage_t": "__hip_fp8x4_storage_t",
}
_CORRECTED = re.compile(r"\b(?:" + "|".join(sorted(TORCH_TABLE_CORRECTIONS, key=len, reverse=True)) + r")\b")


def torch_table_undeclared() -> dict[str, str]:
    """CUDA name -> torch's target, for targets HIP does not declare (`torch_table_undeclared.txt`, written by
    benchmarks/hipify_eval/torch_table_audit.py from HIP's headers)."""
    text = (Path(__file__).parent / "torch_table_undeclared.txt").read_text(encoding="utf-8")
    return dict(line.split(" ", 1) for line in text.splitlines() if line and not line.startswith("#"))


_HIP_RUNTIME_INCLUDE = re.compile(r"#\s*include\s*[<\"]hip/hip_runtime(?:_api)?\.h[>\"]")


_TORCH_INCLUDE = re.compile(r"^\s*#\s*include\s*[<\"](?:torch|ATen|c10)/", re.MULTILINE)
_DEVICE_QUALIFIER = re.compile(r"\b__(?:device|host|global|shared|constant)__\b")


_CONDITIONAL = re.compile(r"^\s*#\s*(if|ifdef|ifndef|endif)\b\s*(\w*)")
_INCLUDE = re.compile(r"^\s*#\s*include\b")


def _with_include(text: str, include: str) -> str:
    """`text` with the line `include` before its first `#include` that every build compiles (in no `#if` but the
    file's include guard), where a port puts it: below the licence comment and beside the file's other includes; on
    top when there is no such `#include`."""
    lines = text.splitlines(keepends=True)
    depth, guard_seen = 0, False
    for index, line in enumerate(lines):
        if match := _CONDITIONAL.match(line):
            kind, name = match.groups()
            if kind == "ifndef" and depth == 0 and not guard_seen and index + 1 < len(lines) and re.match(
                    rf"\s*#\s*define\s+{re.escape(name)}\b", lines[index + 1]):  # fmt: skip
                guard_seen = True  # the include guard: its inside is the whole file
            elif kind == "endif":
                depth -= 1
            else:
                depth += 1
        elif depth <= 0 and _INCLUDE.match(line):
            return "".join(lines[:index]) + include + "\n" + "".join(lines[index:])
    return include + "\n" + text


def _runtime_include(text: str) -> str:
    """`text` with `#include <hip/hip_runtime.h>` (`_with_include`) when it calls the HIP runtime or declares device
    code and includes no runtime header (and none of torch's, which bring it): nvcc includes cuda_runtime.h
    implicitly, hipcc only in `-x hip` mode (a host-only file built by the C++ compiler calling `hipGetDevice` stops
    compiling), and torch's hipify adds the include only to files with kernel syntax; ports add it to every such
    file."""
    if ((re.search(r"\bhip[A-Z]\w*\s*\(", text) or _DEVICE_QUALIFIER.search(text))
            and not _HIP_RUNTIME_INCLUDE.search(text) and not _TORCH_INCLUDE.search(text)):
        return _with_include(text, "#include <hip/hip_runtime.h>")
    return text


def _torch_engine() -> Engine:
    import torch
    from torch.utils.hipify import hipify_python

    undeclared = torch_table_undeclared()

    def table_name(match: re.Match) -> str:  # a name whose target HIP does not declare stays: the report counts it
        name, target = match.group(0), hipify_python.PYTORCH_MAP[match.group(0)]
        return name if undeclared.get(name) == target else target

    def translate(path: Path) -> str:
        text = _CORRECTED.sub(lambda match: TORCH_TABLE_CORRECTIONS[match.group(0)],
                              path.read_text(encoding="utf-8", errors="replace"))
        text = hipify_python.RE_PYTORCH_PREPROCESSOR.sub(table_name, text)
        for rewrite in TORCH_TABLE_GAPS:
            text = rewrite.pattern.sub(rewrite.replacement, text)
        # torch's hip_header_magic looks for the runtime include spelt with one space: `#include<hip/hip_runtime.h>`
        # would get a second one above it; where it adds one (on top), it goes where a port puts it instead
        if not _HIP_RUNTIME_INCLUDE.search(text) and hipify_python.hip_header_magic(text) != text:
            text = _with_include(text, '#include "hip/hip_runtime.h"')
        return _runtime_include(text)

    return Engine("torch", f"torch.utils.hipify's mapping table from torch {torch.__version__}", translate)


def _perl_engine(executable: str) -> Engine:
    def translate(path: Path) -> str:
        return _run_tool([executable, "-quiet-warnings", str(path)], path, "hipify-perl").stdout

    return Engine("perl", f"hipify-perl at {executable} ({_tool_version(executable)})", translate)


def _clang_engine(executable: str, toolkit: Path) -> Engine:
    def translate(path: Path) -> str:
        with tempfile.TemporaryDirectory(prefix="tiletune-hipify-") as scratch:
            output = Path(scratch) / (path.name + ".hip")
            command = [executable, str(path), "-o", str(output), f"--cuda-path={toolkit}",
                       f"-I{path.parent}", "--", "-std=c++17"]
            _run_tool(command, path, "hipify-clang")
            return output.read_text(encoding="utf-8", errors="replace")

    return Engine("clang", f"hipify-clang at {executable} ({_tool_version(executable)}; CUDA headers from {toolkit})", translate)


def select_engine(name: str = "auto") -> Engine:
    """The engine for `--engine NAME`; `auto` prefers hipify-clang, then hipify-perl, then torch."""
    if name not in ENGINE_NAMES:
        raise UserError(f"unknown --engine {name!r}; choose one of {', '.join(ENGINE_NAMES)}")
    clang, perl = shutil.which("hipify-clang"), shutil.which("hipify-perl")
    toolkit = cuda_toolkit()
    has_torch = importlib.util.find_spec("torch") is not None
    if name == "clang" or (name == "auto" and clang and toolkit):
        if not clang:
            raise UserError("--engine clang: hipify-clang is not on PATH; install HIPIFY (ROCm's hipify-clang) "
                            "or use --engine perl|torch")
        if not toolkit:
            raise UserError("--engine clang: hipify-clang needs the CUDA headers but no CUDA toolkit was found; "
                            "set CUDA_HOME or use --engine perl|torch")
        return _clang_engine(clang, toolkit)
    if name == "perl" or (name == "auto" and perl):
        if not perl:
            raise UserError("--engine perl: hipify-perl is not on PATH; install HIPIFY (ROCm ships it in "
                            "/opt/rocm/bin) or use --engine torch")
        return _perl_engine(perl)
    if not has_torch:
        raise UserError("no translator available: install torch (for --engine torch) or put hipify-perl / "
                        "hipify-clang on PATH")
    return _torch_engine()
