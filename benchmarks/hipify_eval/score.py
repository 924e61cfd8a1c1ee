"""Score `tiletune hipify` on human CUDA -> HIP ports held out from its tests.

Each `ports/*.json` names a public file (repo, path, the CUDA commit and the commit of the human AMD
port) and lists the human changes as line ranges of the CUDA original, each with a class (a change made
once for many places, such as a polyfill or a `#define` at the top of the file, lists those places as
`sites`: a fitting finding on any of them covers it). Classes `not-needed` and `plumbing` (no AMD reason)
and `obsolete` (only a ROCm older than 6.0 needed it) are counted apart. This script
reads the CUDA originals from `cache/` (it fetches nothing while scoring), runs the migration lint and
the torch engine on them, and reports:

- recall: human changes the tool translated or flagged with a rule that fits the change's class;
- precision: findings that sit on a human change, or that `findings` in the port file labels a
  genuine pitfall (unlabelled findings count against precision).

    python benchmarks/hipify_eval/score.py --fetch               # online: fill cache/ from raw GitHub
    python benchmarks/hipify_eval/score.py --from-git owner/name=DIR  # or from a local clone
    (both fill it for the ports --ports / --round select, all of them by default)
    python benchmarks/hipify_eval/score.py [--verbose] [--ports GLOB] [--round N]  # offline: score
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import urllib.request
from collections import Counter, defaultdict
from dataclasses import dataclass
from pathlib import Path

from tiletune.port.compile_check import line_map
from tiletune.port.engines import select_engine
from tiletune.port.hipify import cuda_names, defined_names
from tiletune.port.lint import lint_text, strip_comments
from tiletune.port.preprocessor import Build, cxx_standard, directives, on_amd
from tiletune.port.twins import HIP_SPELLINGS, SCANNED_SUFFIXES, ProjectTwins, cuda_spelled

HERE = Path(__file__).resolve().parent
PORTS = HERE / "ports"
CACHE = HERE / "cache"
TWINS_INDEX = ".project-twins.json"  # beside a cached original: its project's HIP twins at that commit
RAW = "https://raw.githubusercontent.com/{repo}/{commit}/{path}"


@dataclass(frozen=True)
class ChangeClass:
    """A kind of human change: the rules that fit it, whether a translator's rewrite covers it, whether a
    translation that leaves the lines as written does (the humans' edit only undid another tool's rewrite), and
    whether one that changes what hipcc makes of a conditional directive in the lines does."""

    rules: tuple[str, ...]
    translation_covers: bool
    what: str
    kept_covers: bool = False
    # a preprocessor test the translation renames (`__CUDACC__` -> `__HIPCC__`) so that hipcc answers it otherwise
    translation_decides_guard: bool = False
    # a line the humans inserted (the lines name no `#include`) that the translation inserts too, wherever it puts it:
    # torch's hipify adds `#include "hip/hip_runtime.h"` at the top of a file with kernel syntax and no CUDA runtime
    # include, where nvcc had included cuda_runtime.h implicitly
    translation_inserts: re.Pattern | None = None
    # a rename of the project's own names: covered by a translation only where no CUDA-spelled identifier of the lines
    # is left in them (the rest of the line may be rewritten for other reasons)
    renames_project_names: bool = False


HIP_RUNTIME_INCLUDE = re.compile(r'^[ \t]*#[ \t]*include[ \t]*[<"]hip/hip_runtime\.h[>"]', re.MULTILINE)
CUDA_RUNTIME_INCLUDE = re.compile(r'^[ \t]*#[ \t]*include[ \t]*[<"](?:cuda|cuda_runtime|cuda_runtime_api)\.h[>"]',
                                  re.MULTILINE)
WARP_RULES = ("warp-size-define", "warp-size-literal", "warp-lane-loop", "lane-indexed-warp-array",
              "block-32-threads", "warp-tile-32", "mask-32bit", "ballot-32bit-result", "popc-32bit", "host-warp-size",
              "warp-size-assert", "warp-buffer-passed-on")
CLASSES: dict[str, ChangeClass] = {
    "cub-to-hipcub": ChangeClass((), True, "CUB headers / names replaced by hipCUB"),
    "bf16-header": ChangeClass(("bf16-type",), True, "cuda_bf16.h -> hip/hip_bf16.h"),
    "dependent-typename": ChangeClass(("dependent-template-name",), False,
                                      "`typename` added before a dependent type (hipcc rejects its absence)"),
    "constexpr-minmax": ChangeClass(("constexpr-std-minmax",), False,
                                    "std::max({...}) / std::min in constexpr initialisers replaced"),
    "func-attribute-cast": ChangeClass(("lds-limit",), True, "cudaFuncSetAttribute needs a (const void*) kernel"),
    "warp-size": ChangeClass(WARP_RULES, True, "warp size 32 written as a macro, CUB_WARP_THREADS or a launch table"),
    "lane-mask": ChangeClass(("mask-32bit",), False, "32-bit lane mask in a *_sync warp function"),
    "libcudacxx": ChangeClass(("libcudacxx",), False, "libcu++ <cuda/std/...> replaced"),
    "arch-guard": ChangeClass(("cuda-arch-guard",), False, "a `__CUDA_ARCH__` test that compiles code out on AMD"),
    "cg-header": ChangeClass((), True, "<cooperative_groups.h> -> <hip/hip_cooperative_groups.h>"),
    "large-block": ChangeClass(("launch-bounds",), False, "a block above 256 threads (no launch bounds) shrunk for ROCm"),
    "sync-shuffle": ChangeClass(("mask-32bit",), False, "a `*_sync` shuffle (absent before ROCm 6.2) routed to a shim"),
    "hipcub-api": ChangeClass((), False, "a hipCUB call differs from CUB (extra argument)"),
    "blas-backend": ChangeClass(("rocblas-branch",), True, "cuBLAS call sent to hipBLAS (torch 2.13's hipify maps it there too; 2023's, to rocBLAS)"),
    "missing-return": ChangeClass(("missing-return",), False, "non-void function fell off its end"),
    "device-only-math": ChangeClass(("device-only-math",), False, "a device-only math function called from a host function (rsqrtf)"),
    "launch-bounds-added": ChangeClass(("launch-bounds",), False,
                                       "__launch_bounds__(max block size) added to kernels for ROCm"),
    "host-warp-size": ChangeClass(WARP_RULES, False,
                                  "C10_WARP_SIZE or 32 as the warp size in host code -> at::cuda::warp_size()"),
    "syncwarp": ChangeClass(("syncwarp",), False, "__syncwarp removed or made a no-op (HIP has none)"),
    "builtin-redefinition": ChangeClass(("hip-builtin-redefinition",), False, "the file's own atomicMax/atomicMin(float) clash with HIP's"),
    "math-constants-header": ChangeClass((), True, "<math_constants.h> -> <hip/hip_math_constants.h>"),
    "wmma-header": ChangeClass(("wmma",), True, "<mma.h> removed"),
    "missing-include": ChangeClass((), False, "a standard header CUDA's headers include transitively, added"),
    "missing-intrinsic": ChangeClass(("missing-intrinsic",), False, "a polyfill for a CUDA intrinsic HIP lacks (__dp4a, __vsubss4)"),
    "runtime-header": ChangeClass((), True, "CUDA runtime / cuBLAS / fp16 headers -> HIP's",
                                  translation_inserts=HIP_RUNTIME_INCLUDE),
    "blas-workaround": ChangeClass((), False, "a call added to work around a rocBLAS bug"),
    "missing-overload": ChangeClass(("ldg-torch-half",), False, "an at::Half overload HIP lacks (__ldg, __shfl_*) added"),
    "blas-signature": ChangeClass((), True, "a cuBLAS call rewritten for rocBLAS's other arguments (hipBLAS keeps cuBLAS's)"),
    "half-raw-init": ChangeClass(("half-raw-bits",), False, "a __half_raw / __half2_raw braced from bit patterns (HIP reads values)"),
    "half2-brace-assign": ChangeClass(("half-brace-assign",), False, "`h2 = {}` on a __half2 (ambiguous between HIP's assignment operators)"),
    "compiler-guard": ChangeClass(("compiler-guard",), False, "an `#ifdef __NVCC__` that takes the host-only branch under hipcc",
                                  translation_decides_guard=True),
    # round 6's classes, defined by its labeller (before the round was scored)
    "version-guard": ChangeClass(("cuda-arch-guard", "compiler-guard", "cuda-version-expression"), False,
                                 "a compiler / toolkit version test true under hipcc (`__GNUC__ < 6`) that compiles code out"),
    "runtime-api": ChangeClass((), True, "a CUDA runtime name the hipify of its day left untranslated, written as its HIP name"),
    "api-signature": ChangeClass(("capture-info-v2", "runtime-overload"), False,
                                 "a CUDA runtime call whose HIP namesake takes other arguments"),
    "device-attribute": ChangeClass(("smem-optin-zero",), False, "a device attribute HIP lacks or reads wrong (shared memory opt-in)"),
    "nvcc-pragma": ChangeClass((), False, "an nvcc-only `#pragma` that hipcc reaches"),
    "amd-tuning": ChangeClass((), False, "a launch or tuning parameter set differently for AMD, for speed only"),
    "inline-ptx": ChangeClass(("inline-asm", "ptx-mma"), False, "PTX `asm volatile` rewritten as AMD GPU assembly or C++"),
    "bf16-operator": ChangeClass(("bf16-type", "bf16-arithmetic"), False, "an operator on bf16 values HIP's bf16 type lacked (`a + b` before ROCm 6.1)"),
    "void-pointer-arith": ChangeClass(("void-pointer-arith",), False, "arithmetic on a `void*` (g++ accepts it, clang rejects it)"),
    # round 7's classes, defined by its labellers (before the round was scored)
    "operator-ambiguity": ChangeClass((), False,
                                      "a host comparison on a SIMD wrapper that clang finds ambiguous (its built-in vector operators)"),
    "unused-header": ChangeClass(("unused-thrust-header", "unused-nvtx-header"), False, "an unused CUDA-toolkit library header (Thrust, NVTX) kept out of the HIP build"),
    "build-flag-guard": ChangeClass(("cuda-build-flag",), False, "a project build macro selecting the GPU code (`#if BUILD_CUDA`) widened to the HIP build's"),
    # round 8's classes, defined by its labellers (before the round was scored)
    "ambiguous-call": ChangeClass(("ffs-ballot",), False,
                                  "an unqualified call (`fma`, `__ffs` of a 64-bit ballot) that a ROCm header's overloads make ambiguous, qualified"),
    "scoped-atomic": ChangeClass(("scoped-atomic",), False, "clang's `__scoped_atomic_*` builtins (absent from ROCm 6.1's clang) -> `__atomic_*`"),
    # round 9's classes, defined by its labellers (before the round was scored)
    "register-keyword": ChangeClass(("register-storage",), False, "the `register` storage class, which clang rejects in C++17 (nvcc accepts it)"),
    "warpsize-constexpr": ChangeClass(("warpsize-constexpr",), False, "`warpSize` in a constant expression (an array bound): not constexpr from ROCm 7.0"),
    "unroll-warning": ChangeClass(("unroll-unknown-trip",), False, "`#pragma unroll` on a loop hip-clang cannot unroll (a -Wpass-failed warning nvcc does not give)"),
    "fp8-format": ChangeClass(("fp8-type",), False, "CUDA's OCP fp8 (e4m3fn) replaced by the fnuz encoding MI300 computes in"),
    "libstdcxx-device-assert": ChangeClass(("device-std-clamp",), False, "a standard-library call in device code that gcc 14's libstdc++ asserts through a host function"),
    # round 10's classes, defined by its labellers (before the round was scored)
    "hipcub-traits": ChangeClass((), False, "a CUB type-trait specialisation (FpLimits / NumericTraits) hipCUB lacks for a HIP type, written by hand"),
    "optional-library-guard": ChangeClass((), False, "code needing a ROCm library the HIP build may lack (hipBLASLt before ROCm 6.1) compiled out under a project flag"),
    "unsupported-enum": ChangeClass((), False, "a CUDA library enum value with no HIP counterpart, replaced by the nearest one the HIP library has"),
    # round 11's classes, defined by its labellers (before the round was scored)
    "two-phase-lookup": ChangeClass((), False, "an unqualified call in a template to a name declared only later (clang's two-phase lookup rejects it)"),
    "nodiscard-result": ChangeClass(("discarded-status",), False, "a discarded runtime status cast to `(void)`: HIP declares hipError_t [[nodiscard]] in C++17"),
    "runtime-workaround": ChangeClass((), False, "a valid runtime call pattern restructured around a ROCm runtime defect (one hipMemUnmap over several maps)"),
    "hipify-name-clash": ChangeClass((), False, "a file renamed because torch's hipify would write its HIP copy over a hand-written HIP file"),
    "op-schema-guard": ChangeClass((), False, "a torch operator schema registered only off ROCm, whose CUDA kernel the HIP build does not compile"),
    # round 12's classes, defined by its labellers (before the round was scored)
    "bf16-conversion": ChangeClass(("bf16-type", "bf16-arithmetic"), False,
                                   "a float converted implicitly to bf16 (a `const bf16 scale` argument, `{ 0.0f }`): HIP's bf16 types had no implicit constructor (before ROCm 6.2)"),
    "half2-member-type": ChangeClass((), False, "code reading `__half2`'s x / y as `unsigned short`, which ROCm 6.0 made `__half` members"),
    # round 13's classes, defined by its labellers (before the round was scored)
    "half-host-operator": ChangeClass(("device-only-math",), False, "a `__half` operator (device-only in HIP) used in host code"),
    "constexpr-device-call": ChangeClass(("device-only-math", "constexpr-std-minmax", "constexpr-device-only"), False,
                                         "a `constexpr __device__` function called from host code (nvcc's relaxed constexpr; hip-clang rejects it)"),
    "stdlib-host-call": ChangeClass(("device-std-clamp", "device-std-throw", "device-std-printf"), False, "a host-only standard-library member (`std::optional::value()`) called in device code"),
    "hcc-platform-macro": ChangeClass(("compiler-guard",), False,
                                      "a test of `__HIP_PLATFORM_HCC__`, which ROCm 6.0 and torch >= 2.3 no longer define: the AMD branch compiles out"),
    "hipify-kernel-launch": ChangeClass((), False, "a `<<<>>>` launch torch's hipify rewrote into broken code, rewritten by hand",
                                        kept_covers=True),
    "driver-api-gap": ChangeClass(("cuda-library-dlopen",), False, "a CUDA driver call with no HIP counterpart (cuFuncSetCacheConfig, cuStreamGetCtx)"),
    "ptx-module": ChangeClass(("code-object-text",), False, "a module built from PTX by the driver, loaded from an AMD code object instead"),
    "warp-lds-sync": ChangeClass(("warp-sync-skipped",), False,
                                 "a `__syncwarp` added to a warp-synchronous shared-memory loop, or its skipped barrier kept"),
    "pragma-placement": ChangeClass((), False, "a `#pragma unroll` with no loop after it (clang rejects it)"),
    "missing-runtime-feature": ChangeClass(("launch-attribute-missing",), False,
                                           "a CUDA runtime feature HIP lacks (`cudaStreamLegacy`), emulated"),
    # round 14's classes, defined by its labellers (before the round was scored)
    "cg-missing-api": ChangeClass(("cg-missing-api",), False,
                                  "a cooperative-groups API HIP lacks (`cg::reduce`, `cg::labeled_partition`), rebuilt from shuffles"),
    "device-ctad": ChangeClass(("device-ctad",), False, "class template argument deduction (`std::array{...}`) in device code: hip-clang rejects the host-only guide"),
    "hipify-math-rewrite": ChangeClass((), False, "a `std::min` / `std::max` that torch's hipify rewrites to `::min` / `::max`, absent from a host pass",
                                       kept_covers=True),
    "device-link": ChangeClass(("device-link",), False, "a `__device__` function linked from another file (nvcc -rdc) moved into the header: no -fgpu-rdc in the HIP build"),
    "narrowing-init": ChangeClass(("builtin-index-narrowing",), False, "a braced initialiser narrowing a non-constant (`{threadIdx.x, ...}` into an int): clang rejects it, nvcc warns"),
    "auto-builtin-index": ChangeClass(("auto-builtin-index",), False,
                                      "`auto i = blockIdx.y`: before ROCm 6.1 a proxy type whose `+=` does not update `i`, written as `int`"),
    # round 16's classes, defined by its labellers (before the round was scored)
    "uninit-shuffle": ChangeClass(("uninit-shuffle",), False, "a value broadcast by a shuffle from lane 0 initialised first (ROCm's compiler miscompiled the uninitialised one)"),
    "spaced-kernel-launch": ChangeClass(("spaced-kernel-launch",), False, "a launch written `k << <grid, block >> > (...)` (nvcc takes it; hipcc rejects it, torch's hipify looks for `<<<`)"),
    "vector-partial-init": ChangeClass(("vector-partial-init",), False, "a vector type braced from fewer values than members (`float3 v = {a, b}`): HIP's has no such constructor"),
    "grid-constant": ChangeClass(("grid-constant",), False, "the `__grid_constant__` kernel-parameter qualifier, which HIP lacks, removed"),
    # round 17's classes, defined by its labellers (before the round was scored)
    "device-global-used": ChangeClass((), False, "a device global the host looks up by name marked `__attribute__((used))` (hip-clang drops unreferenced ones)"),
    "opaque-handle-type": ChangeClass((), False, "a CUDA handle the file declares as an integer (`CUtexObject`) where HIP's is a pointer"),
    "runtime-compile-command": ChangeClass(("nvrtc-option",), False, "a kernel compiled at run time by nvcc, rewritten to invoke hipcc (`--genco`)"),
    "its-spinlock": ChangeClass((), False, "a per-lane spin lock relying on independent thread scheduling, run one lane at a time (AMD has none)"),
    "hipblas-v1-types": ChangeClass((), True, "cuBLAS's CUDA types written as hipBLAS's own (hipblasComplex, hipblasDatatype_t) for hipBLAS < 3.0"),
    "bf16-pair-missing": ChangeClass((), False, "the bf16 pair or complex bf16 types (`__nv_bfloat162`, CUDA_C_16BF) dropped: the HIP build had no counterpart"),
    "opaque-library-handle": ChangeClass((), True, "a cuBLAS / cuSPARSE handle named through its struct (`cublasContext`), re-expressed: HIP's handles are `void*`"),
    "cuda-only-library": ChangeClass(("cutlass-cute", "cudnn-api"), False,
                                     "code built on a CUDA-only library (FlashInfer, CUTLASS, cuDNN) replaced for AMD by a "
                                     "HIP copy or another library (ck_tile, MIOpen)"),
    "hip-fallback-path": ChangeClass(WARP_RULES, False, "a 32-lane warp algorithm kept for CUDA only, HIP given a shared-memory algorithm"),
    "ballot-width": ChangeClass(("ballot-32bit-result", "ballot-bit-test", "popc-32bit", "mask-32bit"), False, "a ballot result or lane mask kept in 32 bits on a 64-lane wavefront, widened"),
    "lds-budget": ChangeClass(("lds-limit",), False, "a dynamic shared-memory request above the 64 KiB an AMD workgroup gets, made per-architecture"),
    "hip-no-half-operators": ChangeClass((), False, "a `__half` operator torch's HIP build removes (-D__HIP_NO_HALF_OPERATORS__), replaced by a conversion"),
    # round 18's classes, defined by its labellers (before the round was scored)
    "rtc-arch-option": ChangeClass(("nvrtc-option",), False, "NVRTC's `-arch=compute_XY` option rewritten as hiprtc's `--gpu-architecture=gfx...` from the device's gcnArchName"),
    "cub-internal-api": ChangeClass(("cub-internal",), False, "a CUB / Thrust internal (`cub::WarpReduceShfl`, `thrust::cuda_cub::core`) replaced by the public API: hipCUB and rocThrust expose only that"),
    "fp-atomic-workaround": ChangeClass((), False, "a float `atomicAdd` replaced on AMD by an `atomicCAS` loop on its bits (a HIP defect of 2019)"),
    "device-clock": ChangeClass(("device-clock",), False, "a `clock64()` timeout rewritten with `wall_clock64()`: AMD's clock64 counts a shader clock of varying rate"),
    "nvshmem-to-rocshmem": ChangeClass(("nvshmem",), False, "NVSHMEM (headers, calls, teams, unique ids) replaced by rocSHMEM"),
    # round 19's classes, defined by its labellers (before the round was scored)
    "volatile-flag-atomic": ChangeClass((), False, "a volatile load / store of a flag shared with a peer GPU rewritten as an `__atomic_load_n` / `__atomic_store_n`"),
    "inline-control": ChangeClass((), False, "`__forceinline__` dropped or `noinline` added on big device functions to bound AMD's code size, registers and compile time"),
    "named-barrier": ChangeClass(("inline-asm",), False, "a PTX named barrier over part of the block (`bar.sync 1, n`) gone on AMD, the thread roles restructured"),
    "p2p-direct-off": ChangeClass((), False, "NCCL's direct mode (a peer writing into the user's buffer) switched off on AMD"),
    "grid-dim-limit": ChangeClass((), False, "a 1-D launch above 2^32 work-items per dimension (HIP's limit) folded into a 2-D / 3-D grid"),
    "cub-arch-argument": ChangeClass((), False, "CUB's PTX_ARCH template argument from a CUDA compute-capability macro (empty in the HIP build) dropped"),
    "dynamic-parallelism": ChangeClass((), False, "a launch made `__host__ __device__` for CUDA dynamic parallelism made host-only: HIP launches no kernel from the device"),
    "device-pass-instantiation": ChangeClass((), False, "a run-time `if` around a host-only launch in a `__host__ __device__` function made an `#if` (hip-clang's device pass rejects the host call)"),
    "shadow-warning": ChangeClass((), False, "a kernel-local variable shadowing an outer one renamed: clang sees the kernel body under the project's -Wshadow (nvcc's host compiler never does)"),
    # round 20's classes, defined by its labellers (before the round was scored)
    "math-library-workaround": ChangeClass((), False, "a HIP math / complex-library function with a numerical defect (an unscaled `hipCabs`) replaced by the project's own"),
    "vector-type-abi": ChangeClass((), False, "a HIP vector-backed type (`hipDoubleComplex`) passed by value between hipcc- and host-compiled code, whose ABIs differ: passed by `const&`"),
    "fft-backend": ChangeClass((), True, "cuFFT plans and executions rewritten for rocFFT's API (hipFFT, a translator's target, keeps cuFFT's calls)"),
    "thrust-hip-policy": ChangeClass(("thrust-cuda-par",), True, "Thrust's `thrust::cuda::par` written as rocThrust's `thrust::hip::par`"),
    "openmp-device-pass": ChangeClass((), False, "OpenMP (`omp.h`, `thrust::omp::par`) kept out of the code hip-clang compiles for the GPU, whose pass finds no OpenMP headers"),
    "global-init-overload": ChangeClass((), False, "a math call in a namespace-scope initialiser that hip-clang resolved to HIP's device-only overload (before LLVM D158247)"),
    "device-werror-warning": ChangeClass((), False, "a warning in device code (unused parameter, signed/unsigned comparison) fixed: hip-clang checks device bodies under the project's -Werror, nvcc passes it to the host compiler only"),
    "typedef-linkage-name": ChangeClass(("typedef-anonymous-struct",), False, "`typedef struct : Base {...} T;` given a tag name: clang's -Wnon-c-typedef-for-linkage, fatal under -Werror"),
    "texture-reference": ChangeClass(("texture-reference",), False, "a CUDA texture reference replaced on AMD by a `__device__` pointer found with hipModuleGetGlobal"),
    "launch-extra-args": ChangeClass((), False, "a driver-API launch's `kernelParams` packed into one buffer passed through `extra` (HIP_LAUNCH_PARAM_BUFFER_POINTER)"),
    "macro-redefinition": ChangeClass((), False, "a project macro named as one HIP's headers define (`#define __local`), #undef'd first"),
    # round 21's classes, defined by its labellers (before the round was scored)
    "solver-backend": ChangeClass((), True, "cuSOLVER calls rewritten for rocSOLVER's API (hipSOLVER, a translator's target today, keeps cuSOLVER's)"),
    "std-complex-device": ChangeClass((), False, "thrust::complex dropped from the HIP build: complex maths on std::complex with hand-written `__device__` operators"),
    "shift-width": ChangeClass((), False, "a shift by the operand's full width (64 on a 64-bit word) guarded: undefined in "
                               "C++; NVIDIA's shl / shr clamp the count (1 << 64 == 0), AMD's take it modulo the width"),
    "device-oob-read": ChangeClass((), False, "an out-of-bounds device load that NVIDIA tolerated, moved under its bounds "
                                   "check: it faults on AMD (HSA_STATUS_ERROR_MEMORY_FAULT)"),
    "uninit-device-memory": ChangeClass((), False, "a device allocation read before it is written, zeroed with a memset: "
                                        "fresh allocations happened to read as zero on NVIDIA"),
    "loop-carried-uninit": ChangeClass((), False, "a variable declared in a loop body but read as the previous iteration's value, hoisted and initialised: undefined behaviour hip-clang's optimiser breaks"),
    "device-assert": ChangeClass((), False, "a device-code `assert` routed through a project macro that is empty in the HIP build"),
    "complex-scalar-brace-init": ChangeClass(("vector-partial-init", "vector-designated-init"), False, "CUDA complex / vector values braced from scalars (`cuDoubleComplex r[4] = {0}`): HIP's double2 is no aggregate, its scalar constructor explicit"),
    "amd-compile-resource": ChangeClass((), False, "a kernel hip-clang cannot build for lack of registers restructured, or its compile-time array bounds lowered for HIP"),
    # round 22's classes, defined by its labellers (before the round was scored)
    "hipcub-sum-init": ChangeClass((), False, "a type summed by `cub::DeviceReduce::Sum` made constructible from the int 0: hipCUB's rocPRIM backend starts the sum at `T(0)`, CUB at a value-initialised `T()`"),
    "amd-memory-fence": ChangeClass((), False, "a `__threadfence*()` added on AMD after a cross-block atomic (a reduction's semaphore reset for the next launch)"),
    "specialization-target-mismatch": ChangeClass((), False, "a `__device__` explicit specialisation of a `__host__ __device__` function template made `__host__ __device__`: hip-clang matches a specialisation only to a template of the same target (nvcc ignores it)"),
    "partial-warp-shuffle": ChangeClass(("mask-32bit",), False, "a masked `*_sync` shuffle run by a subset of lanes restructured so every lane of the wavefront runs HIP's maskless shuffle, only the loads and stores predicated"),
    # round 23's classes, defined by its labeller (before the round was scored)
    "rtc-execution-space": ChangeClass((), False, "functions or data a runtime-compiled source left device-only by NVRTC's `--device-as-default-execution-space` (which hiprtc lacks) given `__host__ __device__` or made `constexpr`"),
    "mpi-stream-sync": ChangeClass((), False, "a device synchronise added after a kernel writes a buffer GPU-aware MPI then reads: on AMD the send read it before the kernel finished"),
    # round 25's, defined after its labelling (the labeller named it; first labelled runtime-api / runtime-header)
    "project-backend-api": ChangeClass((), True, "a project's own CUDA-backend API switched to its HIP namesake (PETSc's `VecCUDAGetArrayRead`, `VECCUDA`, `WaitForCUDA`, `petscdevice_cuda.h`)",
                                       renames_project_names=True),
    # round 45's, defined by its labeller (before the round was scored)
    "extern-c-include": ChangeClass(("extern-c-include",), False, "a HIP header reached from inside an `extern \"C\"` block moved out of it (HIP's C++ templates need C++ linkage; nvcc pre-includes cuda_runtime.h, so the CUDA file never saw it)"),
    # round 46's, defined by its labeller (before the round was scored)
    "device-recursion": ChangeClass((), False, "a device function's run-time recursion unrolled into templates for the HIP port (hip-clang's stack for a recursive device call)"),
    # round 49's, defined by its labeller (before the round was scored)
    "device-function-pointer": ChangeClass((), False, "device function pointers fetched with `cudaMemcpyFromSymbol` replaced by a switch (HIP had no device function pointers in 2021)"),
    "device-noinline": ChangeClass((), False, "big device functions marked `__noinline__` because hipcc otherwise never finished compiling them"),
    # round 53's, defined by its labeller (before the round was scored)
    "hip-branch-fix": ChangeClass((), False, "an error fixed in the file's own HIP-only branch, code hipcc compiles and nvcc never sees (an undeclared name under `#else` of a CUDA test)"),
    # round 55's classes, defined by its labellers (before the round was scored)
    "clang-werror-pragma": ChangeClass((), False, "a warning hip-clang raises in host code of a .hip file under the project's -pedantic -Werror (GoogleTest's [[maybe_unused]] as a C++17 extension in a C++14 HIP target) silenced with `#pragma clang diagnostic ignored`; nvcc's host compiler gives none"),
    # round 56's classes, defined by its labellers (before the round was scored)
    "complex-alignment-pun": ChangeClass((), False, "host `std::complex` data (8-byte aligned, inside a struct or on the stack) reinterpreted as HIP's 16-byte-aligned `hipDoubleComplex` and read: hip-clang's aligned loads fault; the elements copied out one by one instead"),
    # round 59's classes, defined by its labeller (before the round was scored)
    "builtin-index-struct": ChangeClass((), False, "`blockIdx` / `threadIdx` passed whole where a `uint3` is expected: HIP's are builtin proxy structs that convert to dim3 only, so rebuilt into a `uint3` by hand"),
    "host-device-call": ChangeClass((), False, "a `__device__` function that `__host__ __device__` code calls made `__host__ __device__`: hip-clang rejects the call where the caller is emitted for the host (nvcc lets it pass in templates)"),
    "fp16-dropped": ChangeClass((), False, "half-precision (`__half` / `__half2`) specialisations and code paths compiled out of the HIP build, the project's mixed precision left CUDA-only"),
}
# Kept in the files, left out of the score: edits with no AMD reason, and the plumbing of a fix that is
# counted where it matters (a warp-size parameter threaded through callers, a helper's definition).
EXCLUDED = ("not-needed", "plumbing")
# Also left out of the score, and counted apart: changes only the ROCm of their day needed (each note names
# the ROCm version whose headers made the CUDA original compile and behave; tiletune targets ROCm >= 6.0).
OBSOLETE = "obsolete"


def cached(repo: str, commit: str, path: str) -> Path:
    """Where the cache keeps `path` of `repo` at `commit`."""
    return CACHE / repo.replace("/", "+") / commit / path


def load_ports(pattern: str = "*") -> list[dict]:
    """The ground-truth files under ports/ whose names match `pattern` (a glob), sorted by name."""
    return [json.loads(path.read_text()) for path in sorted(PORTS.glob(f"{pattern}.json"))]


def fill_cache(get, ports: list[dict]) -> None:
    """Store each port's CUDA original and its repository's license file (at `license_commit` where the license was
    added after the original); `get(repo, commit, path)` -> text."""
    for port in ports:
        repo, commit = port["repo"], port["cuda"]["commit"]
        for path, at in ((port["cuda"]["path"], commit), (port["license_file"], port.get("license_commit", commit))):
            target = cached(repo, at, path)
            if not target.exists():
                target.parent.mkdir(parents=True, exist_ok=True)
                target.write_text(get(repo, at, path), encoding="utf-8")
                print(f"cached {repo}@{at[:10]}:{path}")


def twins_index(port: dict) -> Path:
    """Where the cache keeps the project's HIP twins (`tiletune hipify --project`) at the port's CUDA commit."""
    return cached(port["repo"], port["cuda"]["commit"], TWINS_INDEX)


def project_twins(port: dict) -> ProjectTwins:
    """The project's HIP twins as `tiletune hipify --project` reads them at the port's CUDA commit, from the cache
    (empty where the cache was filled without a clone: `--fetch` reads single files)."""
    index = twins_index(port)
    if not index.exists():
        return ProjectTwins()
    data = json.loads(index.read_text())
    return ProjectTwins(frozenset(data["names"]), tuple(data["paths"]))


def index_project(git_dir: str, port: dict, excluded: list[str]) -> None:
    """Write the project's HIP twins at the port's CUDA commit to the cache: what `ProjectTwins.scan` reads in a
    checkout, its sources read with git, the CUDA file and every HIP file of the repository's ports (the human
    answers) left out."""
    commit = port["cuda"]["commit"]
    git = ["git", f"--git-dir={git_dir}"]
    paths = subprocess.run([*git, "ls-tree", "-r", "--name-only", commit], capture_output=True, text=True,
                           check=True).stdout.splitlines()
    listed = subprocess.run([*git, "grep", "-l", "-I", "-E", HIP_SPELLINGS,
                             commit, "--", *(f"*{suffix}" for suffix in SCANNED_SUFFIXES)],
                            capture_output=True, text=True).stdout.splitlines()
    spelled = [path for path in (line.split(":", 1)[1] for line in listed) if path not in excluded]
    batch = subprocess.run([*git, "cat-file", "--batch"], input="".join(f"{commit}:{p}\n" for p in spelled).encode(),
                           capture_output=True, check=True).stdout
    twins = ProjectTwins.from_texts([batch.decode("utf-8", errors="replace")], paths)
    target = twins_index(port)
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text(json.dumps({"excluded": excluded, "names": sorted(twins.names), "paths": list(twins.paths)}))
    print(f"indexed {port['repo']}@{commit[:10]}: {len(twins.names)} HIP-spelled names, {len(twins.paths)} headers")


def fetch_raw(repo: str, commit: str, path: str) -> str:
    with urllib.request.urlopen(RAW.format(repo=repo, commit=commit, path=path), timeout=60) as response:
        return response.read().decode("utf-8")


def from_git(clones: dict[str, str]):
    def get(repo: str, commit: str, path: str) -> str:
        if repo not in clones:
            raise SystemExit(f"no clone given for {repo}: add --from-git {repo}=DIR")
        raw = subprocess.run(["git", f"--git-dir={clones[repo]}", "show", f"{commit}:{path}"],
                             capture_output=True, check=True).stdout
        return raw.decode("utf-8", errors="replace")  # a Latin-1 byte in a comment (a few old sources) read as U+FFFD
    return get


@dataclass
class PortScore:
    name: str
    changes: int = 0
    covered: int = 0
    by_translation: int = 0  # covered by the translator alone (what plain hipify gives)
    findings: int = 0
    on_change: int = 0
    pitfalls: int = 0
    unlabelled: int = 0
    excluded: int = 0
    obsolete: int = 0


def score_port(port: dict, engine, missed: Counter, notes: list[str]) -> PortScore:
    """Recall and precision counts of one port; misses by class go to `missed`, details to `notes`."""
    source = cached(port["repo"], port["cuda"]["commit"], port["cuda"]["path"])
    if not source.exists():
        raise SystemExit(f"{source} is missing: run `score.py --fetch` online (or --from-git) first")
    text = source.read_text(encoding="utf-8")
    build = port.get("hip_build", {})  # the project's HIP build macros and C++ standard, as its build files set them
    hip_build = Build(frozenset(build.get("defined", ())), frozenset(build.get("undefined", ())),
                      cxx_standard(build.get("std", "c++17")))
    # the project's own names: those this file defines and the macros the project defines in its other files (gputt's
    # `cudaCheck`): `tiletune hipify` run on the project reads them there and does not count them as CUDA names left
    own_names = frozenset(port.get("project_macros", ())) | defined_names(text)
    findings = lint_text(text, port["cuda"]["path"], build=hip_build)
    translated, _ = project_twins(port).rename(engine.translate(source))
    original_lines, translated_lines = text.splitlines(), translated.splitlines()
    back = line_map(text, translated)
    translated_of = defaultdict(list)
    for index, line in enumerate(back):
        translated_of[line].append(translated_lines[index])

    result = PortScore(port["name"])
    ranges, all_sites = [], set()
    counted = []  # (change, flagged, rewritten) of the changes the score counts
    for change in port["changes"]:
        first, last = change["lines"]
        ranges.append((first, last))
        all_sites.update(change.get("sites", ()))
        if change["class"] in (*EXCLUDED, OBSOLETE):
            result.obsolete += change["class"] == OBSOLETE
            result.excluded += change["class"] != OBSOLETE
            continue
        kind = CLASSES[change["class"]]
        sites = set(change.get("sites", ()))
        flagged = any(f.rule in kind.rules and (first <= f.line <= last or f.line in sites) for f in findings)
        lines = sorted({*range(first, last + 1), *sites})  # a change made once covers its sites too
        before = "\n".join(original_lines[n - 1] for n in lines)
        after = "\n".join(line for n in lines for line in translated_of[n])
        rewritten = ((kind.translation_covers and after.strip() != before.strip() and not cuda_names(after, own_names)
                      and not (kind.renames_project_names and cuda_spelled(after) & cuda_spelled(before)))
                     or (kind.kept_covers and after.strip() == before.strip())
                     or (kind.translation_decides_guard and _guard_decided(before, after, hip_build))
                     or _inserted_elsewhere(kind, change, before, text, translated))  # fmt: skip
        counted.append((change, flagged, rewritten))
    covered_lines = {n for change, flagged, rewritten in counted if flagged or rewritten
                     for n in range(change["lines"][0], change["lines"][1] + 1)}
    openers = _conditional_openers(text, hip_build)
    for change, flagged, rewritten in counted:
        first, last = change["lines"]
        # the #else / #endif of a conditional whose #if line another change holds: one edit, covered with its #if
        flagged = flagged or (first in openers and openers[first] in covered_lines)
        result.changes += 1
        result.covered += bool(flagged or rewritten)
        result.by_translation += bool(rewritten)
        if not (flagged or rewritten):
            missed[change["class"]] += 1
            notes.append(f"missed {port['name']}:{first}-{last} [{change['class']}] {change.get('note', '')}")
    labels = port.get("findings", {})
    for finding in findings:
        result.findings += 1
        if finding.line in all_sites or any(first - 1 <= finding.line <= last + 1 for first, last in ranges):
            result.on_change += 1
            continue
        label = labels.get(f"{finding.line} {finding.rule}")
        if label is None:
            result.unlabelled += 1
            notes.append(f"unlabelled finding {port['name']}:{finding.line} [{finding.rule}] {finding.code}")
        elif label.startswith("pitfall"):
            result.pitfalls += 1
        else:
            notes.append(f"false finding {port['name']}:{finding.line} [{finding.rule}] {label}")
    return result


def _conditional_openers(text: str, build: Build) -> dict[int, int]:
    """{line of an #elif / #else / #endif: line of the #if / #ifdef / #ifndef it continues} (1-based)."""
    found = directives(text, build)
    opener = {d.group: d.first + 1 for d in found if d.kind in ("if", "ifdef", "ifndef")}
    return {d.first + 1: opener[d.group] for d in found if d.kind in ("elif", "else", "endif") and d.group in opener}


def _inserted_elsewhere(kind: ChangeClass, change: dict, before: str, text: str, translated: str) -> bool:
    """Whether the humans inserted a line that the translation inserts too, elsewhere: their lines hold no include,
    or only the line their insertion is anchored at (a note that starts "anchor:"), `kind.translation_inserts` is
    in the translation and not in the CUDA file, which includes no CUDA runtime header."""
    pattern = kind.translation_inserts
    inserted = "#include" not in before or change.get("note", "").startswith("anchor:")
    return (pattern is not None and inserted and bool(pattern.search(translated))
            and not pattern.search(text) and not CUDA_RUNTIME_INCLUDE.search(text))


def _guard_decided(before: str, after: str, build: Build) -> bool:
    """Whether the translation changes what hipcc makes of a conditional directive in the lines (a known value to
    the other known value): `#ifdef __CUDACC__`, false under hipcc (which leaves nvcc's macro undefined; the lint
    leaves it to the translation), becomes `#ifdef __HIPCC__`, true."""
    tests = ("if", "ifdef", "ifndef", "elif")
    before, after = strip_comments(before), strip_comments(after)  # `#ifdef __CUDACC__ // CUDA or C++`
    as_written = Build(build.defined, build.undefined | {"__CUDACC__"}, build.std)
    old = [on_amd(d.condition, as_written) for d in directives(before, as_written) if d.kind in tests]
    new = [on_amd(d.condition, build) for d in directives(after, build) if d.kind in tests]
    return len(old) == len(new) and any(a is not None and b is not None and a != b for a, b in zip(old, new))


def percent(part: int, whole: int) -> str:
    return f"{100 * part / whole:.0f}%" if whole else "n/a"


def table(scores: list[PortScore], missed: Counter) -> str:
    """The results as a Markdown table plus the misses by class."""
    header = ("| port | human changes | covered | recall | translator alone | findings | on a change | "
              "genuine pitfall | precision |")
    rows = [header, "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    total = PortScore("**all**")
    for score in [*scores, total]:
        if score is not total:
            for name in ("changes", "covered", "by_translation", "findings", "on_change", "pitfalls", "unlabelled",
                         "excluded", "obsolete"):
                setattr(total, name, getattr(total, name) + getattr(score, name))
        good = score.on_change + score.pitfalls
        rows.append(f"| {score.name} | {score.changes} | {score.covered} | {percent(score.covered, score.changes)} | "
                    f"{percent(score.by_translation, score.changes)} | {score.findings} | {score.on_change} | "
                    f"{score.pitfalls} | {percent(good, score.findings)} |")
    left_out = (f"Human edits left out (no AMD reason, or plumbing of a counted fix): {total.excluded}. "
                f"Changes only a ROCm older than 6.0 needed: {total.obsolete}. Unlabelled findings: {total.unlabelled}.")
    misses = ", ".join(f"{name} {count} ({CLASSES[name].what})" for name, count in missed.most_common()) or "none"
    rows += ["", left_out, "", f"Missed, by class: {misses}"]
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--fetch", action="store_true", help="download the CUDA originals into cache/ (online)")
    parser.add_argument("--from-git", action="append", default=[], metavar="OWNER/NAME=GIT_DIR",
                        help="fill cache/ from a local clone instead of the network")
    parser.add_argument("--verbose", action="store_true", help="list every miss and every finding off a change")
    parser.add_argument("--ports", default="*", metavar="GLOB", help="score only the ports whose names match")
    parser.add_argument("--round", type=int, help="score only a held-out round's ports (their `port` says `(round N)`)")
    args = parser.parse_args(argv)
    ports = [port for port in load_ports(args.ports) if args.round is None or f"(round {args.round})" in port["port"]]
    if args.fetch:
        fill_cache(fetch_raw, ports)
    if args.from_git:
        clones = dict(item.split("=", 1) for item in args.from_git)
        fill_cache(from_git(clones), ports)
        answers = defaultdict(list)  # the HIP files of every port of a repository, left out of its index
        for port in load_ports():
            answers[port["repo"]].append(port["hip"]["path"])
        for port in ports:
            excluded = sorted({port["cuda"]["path"], *answers[port["repo"]]})
            index = twins_index(port)
            if port["repo"] in clones and (not index.exists() or json.loads(index.read_text())["excluded"] != excluded):
                index_project(clones[port["repo"]], port, excluded)
    engine = select_engine("torch")
    missed, notes = Counter(), []
    scores = [score_port(port, engine, missed, notes) for port in ports]
    print(table(scores, missed))
    if args.verbose:
        print("\n" + "\n".join(notes))
    return 0


if __name__ == "__main__":
    sys.exit(main())
