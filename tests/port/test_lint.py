"""The migration lint: every rule fires where the corpus says it should, and nowhere else."""

from pathlib import Path

import pytest
from port_corpus import CLEAN_SAMPLE, CORPUS, SAMPLES, build_of, expected_findings

from tiletune.port.lint import lint_file, lint_text, strip_comments
from tiletune.port.preprocessor import Build
from tiletune.port.rules import RULES, RULES_BY_ID, evaluate_int, source_constants


@pytest.mark.parametrize("sample", SAMPLES, ids=lambda p: p.name)
def test_findings_match_the_expect_markers(sample: Path):
    text = sample.read_text()
    found = {(finding.line, finding.rule) for finding in lint_text(text, sample.name, build=build_of(text))}
    assert found == expected_findings(sample)


@pytest.mark.parametrize("rule", RULES, ids=lambda r: r.id)
def test_each_rule_fires_on_its_sample_and_is_silent_on_the_clean_one(rule):
    samples = [sample for sample in SAMPLES if any(r == rule.id for _, r in expected_findings(sample))]
    assert samples, f"no corpus sample exercises {rule.id}"
    for sample in samples:
        text = sample.read_text()
        fired = {f.line for f in lint_text(text, sample.name, rules=[rule], build=build_of(text))}
        assert fired == {line for line, r in expected_findings(sample) if r == rule.id}
    assert lint_text(CLEAN_SAMPLE.read_text(), CLEAN_SAMPLE.name, rules=[rule]) == []


@pytest.mark.parametrize(("code", "rule"), [
    ("#define WARP_SIZE (32)", "warp-size-define"),
    ("static constexpr int kWarpSize = 32;", "warp-size-define"),
    ("#define WARP_THREADS 32", "warp-size-define"),
    ("constexpr int kThreadsPerWarp = 32;", "warp-size-define"),
    ("#ifdef __HIP_PLATFORM_AMD__\nconstexpr int hw_warp_size = 64;\n#else\nconstexpr int hw_warp_size = 32;\n#endif",
     "warp-size-define"),  # 64 is CDNA's; RDNA runs 32
    ("template <int WarpSize = 32> __device__ void f();", "warp-size-define"),
    ("#define ROW_THREADS 32\nv += __shfl_xor_sync(m, v, offset, ROW_THREADS);", "warp-size-define"),
    ("constexpr int kRowLanes = 32;\nconst int lane = threadIdx.x % kRowLanes;", "warp-size-define"),
    ("if (tid < 32) { s[tid] += s[tid + 32]; }", "warp-size-literal"),
    ("int lane = threadIdx.x & 0x1f;", "warp-size-literal"),
    ("for (int mask = 1; mask < 32; mask <<= 1) v += __shfl_xor_sync(m, v, mask);", "warp-lane-loop"),
    ("auto active = cg::coalesced_threads();\nfor (int o = 16; o > 0; o /= 2) v += active.shfl_down(v, o);",
     "warp-lane-loop"),  # a coalesced group holds every active lane: 64 on CDNA
    ("unsigned full = 0xFFFFFFFFu;  __any_sync(full, p);", "mask-32bit"),
    ("#define FULL_MASK 0xffffffff", "mask-32bit"),
    ("v = __shfl_down_sync(~0u, v, 1);", "mask-32bit"),
    ("v += __shfl_down_sync(-1u, v, 1);", "mask-32bit"),  # an unsigned -1: 32 bits
    ("constexpr unsigned MASK = 0xffffffff;\nT n = tl::shfl_down_sync(MASK, val, off);", "mask-32bit"),  # a wrapper
    ("q |= __shfl_down_sync(0x0f0f0f0f, q, 4) << 8;  // a partial mask: still an int", "mask-32bit"),
    ("uint32_t votes = __ballot_sync(m, p);", "ballot-32bit-result"),
    ("int leader = __ffs(__ballot_sync(m, p)) - 1;", "popc-32bit"),
    ("__asm__ __volatile__(\"bar.sync 0;\");", "inline-asm"),
    ("asm(\"wgmma.fence.sync.aligned;\");", "ptx-mma"),
    ("__shared__ float big[128][160];", "lds-limit"),
    (("__global__ void k(float* x) {}\nvoid launch(float* x, bool big) {\n  int extra = 0;\n  if (big) extra = 4096;\n"
      "  cudaFuncSetAttribute(k, cudaFuncAttributeMaxDynamicSharedMemorySize, (6112 + extra) * sizeof(double));\n}"),
     "lds-limit"),  # at most 10,208 doubles: 81,664 bytes
    ("__launch_bounds__(MAX_THREADS, MIN_BLOCKS(2))", "launch-bounds-2nd-arg"),
    ("__launch_bounds__(64, 4) __global__ void k();", "launch-bounds-2nd-arg"),  # 1024 threads per CU, not 256
    ("#if __GNUC__ < 6\n#define BUILD_OP 0\n#endif", "compiler-guard"),  # hipcc's clang says GCC 4
    ("#if (__CUDACC_VER_MAJOR__-0) >= 11\n#define HAS_ASYNC_COPY 1\n#endif", "compiler-guard"),
    ("#if __CUDA_ARCH_LIST__ >= 890\n#include \"cuda_fp8.h\"\n#endif", "cuda-arch-guard"),
    (("template <class T> struct vec {\n  T* p;\n  __host__ __device__ vec(T* q) : p(q) {}\n#ifndef __CUDA_ARCH__\n"
      "  vec(const vec& o) : p(o.p) {}\n  ~vec() {}\n#endif\n};"), "cuda-arch-guard"),  # hidden from nvcc's device pass only
    (("__host__ __device__ Reduce(const Reduce& o) : parent(o.parent) {\n#if !defined(__CUDA_ARCH__)\n"
      "  if (parent) setup_for_device();\n#endif\n}"), "cuda-arch-guard"),
    ("__device__ float hmax(float x, float y) { return cutlass::fast_max(x, y); }", "cutlass-cute"),  # via a header
    (("template <typename T>\ntypename std::enable_if<std::is_floating_point<T>::value, int>::type\nbits(T x) {\n"
      "  x += 1;\n}"), "missing-return"),  # SFINAE's type is int here
    ("void pool(Layer* l) {\n  CUDNN_CHECK(cudnnPoolingForward(l->handle, l->desc, &one, l->x_desc, l->x, &zero,\n"
     "                                  l->y_desc, l->y));\n}", "cudnn-api"),
    ("__device__ int f(int s, int t) {\n  int groupMask = 15 << ((t & 31) & ~3);\n  return __shfl_xor_sync(groupMask, s, 1);\n}",
     "mask-32bit"),  # a mask computed into an int
    ("uint warp_done = thread_warp.ballot(done);", "ballot-32bit-result"),  # a cooperative group's ballot
    (("template <typename T, typename V = T>\n__global__ void k(V* x) { x[0] = __shfl_xor_sync(m, x[0], 1); }\n"
      "void f(float* x) {\n  const dim3 threads(32, 4, 1);\n  k<float><<<1, threads>>>(x);\n}"), "block-32-threads"),
    (("__global__ void k(float* x) { x[0] = WARP_SHFL(x[0], 1); }\n"  # rows of 32 threads, warps of 32 rows
      "void f(float* x, int n) {\n  int rows = min(n, int(MAX_BLOCK_SIZE / 32));\n  k<<<1, dim3(32, rows)>>>(x);\n}"),
     "warp-size-literal"),
    (("__global__ void k(float* x) { x[0] = __shfl_xor_sync(m, x[0], 16); }\n"
      "void f(float* x) { k<<<4, 32>>>(x); }"), "block-32-threads"),
    (("__global__ void fill(float* x) { x[threadIdx.x] = 0; }\n"  # the named block also feeds a warp-level kernel
      "__global__ void k(float* x) { x[0] = __shfl_xor_sync(m, x[0], 16); }\n"
      "void f(float* x) {\n  dim3 threads(32);\n  fill<<<4, threads>>>(x);\n  k<<<4, threads>>>(x);\n}"),
     "block-32-threads"),
    ("void f(float* x) {\n  dim3 threads(32);\n  other_file_kernel<<<4, threads>>>(x);\n}", "block-32-threads"),
    (("template <int B, int WARP_SIZE = 32> __global__ void k(float* x);\n"
      "void f(float* x) { k<2, 32><<<1, 64>>>(x); k<4><<<1, 64>>>(x); }"), "warp-size-define"),
    ("#include \"cuda_fp8.h\"", "fp8-type"),
    (("__host__ __device__ int cell_count(float box, float cutoff) {\n  int n = int(box / cutoff);\n#ifndef __CUDA_ARCH__\n"
      "  if (n > 1024) throw std::runtime_error(\"too many cells\");\n#endif\n  return n;\n}"),
     "cuda-arch-guard"),  # hip-clang's device pass compiles the host branch too: a throw there does not compile
    (("__device__ void write_stats(Stats s, Stats* out) {\n  for (int i = 16; i >= 1; i /= 2) {\n    // the requests,\n"
      "    // then the cache lines,\n    // one counter at a time\n    s.lines += __shfl_xor(s.lines, i);\n  }\n"
      "  if (threadIdx.x % warpSize == 0) atomicAdd(&out->lines, s.lines);\n}"),
     "warp-lane-loop"),  # the shuffle sits in the loop's body, more than 3 lines below its header
    ("#if FOO\n#elif __CUDA_ARCH__ == 900\nfast_path();\n#endif", "cuda-arch-guard"),
    ("#ifdef __CUDA_ARCH__\n__syncthreads();\n#endif", "cuda-arch-guard"),
    ("#if EIGEN_CUDA_ARCH >= 530\nreturn __hadd2(a, b);\n#endif", "cuda-arch-guard"),  # defined as __CUDA_ARCH__ elsewhere
    ("#if (__CUDA_ARCH__ < 110)\n#define atomicAdd(x, y) *(x) += 0\n#endif", "cuda-arch-guard"),  # sm_1x's no-op, taken
    ("bool pick(int n, int& warp_size) { warp_size = (n < 32) ? n : 32; return true; }", "host-warp-size"),
    # a warp-size macro of another header sizing a launch: the host pass cannot know the device's wavefront
    ("void launch(float* x, cudaStream_t s) {\n  dim3 block(WARP_SIZE, 4);\n  k<<<1, block, 0, s>>>(x);\n}",
     "host-warp-size"),
    ("constexpr __half2_raw neg_inf = {0xFC00, 0xFC00};", "half-raw-bits"),
    ("half2 sum = __halves2half2(lo, hi);\natomicAdd(out + i, sum);", "missing-intrinsic"),
    ("frag = __ldlu(reinterpret_cast<const float4 *>(row + i));", "missing-intrinsic"),
    ("__stcs(out + i, v);", "missing-intrinsic"),
    ("float4 v = __ldcs(reinterpret_cast<const float4*>(src) + i);", "missing-intrinsic"),
    ("__half2 acc;\nfor (int i = 0; i < n; ++i) {\n  acc = {};\n}", "half-brace-assign"),
    ("auto tile = cg::tiled_partition<32>(cg::this_thread_block());\nif (tile.any(v > 0.f)) hit[tile.meta_group_rank()] = 1;",
     "warp-tile-32"),  # the tile's vote taken as the warp's
    ("template <typename T> __device__ T f(const Frag<T, 4>& frag) { return frag.get<0>(); }", "dependent-template-name"),
    ("template <class Tile> __device__ void f(Tile* tile) { tile->load<8>(0); }", "dependent-template-name"),
    ("template <typename Traits> __device__ void f() { Traits::index_type i = 0; }", "dependent-template-name"),
    ("__shared__ float sums[kNumWarps];\nv = sums[threadIdx.x & 31];", "lane-indexed-warp-array"),
    ("__shared__ float sums[BLOCK / WARP_SIZE];\nif (wid == 0) v = sums[lane_id];", "lane-indexed-warp-array"),
    ("k<<<g, dim3(32), 0, s>>>(x);", "block-32-threads"),
    ("dim3 block(32);", "block-32-threads"),
    ("    selective_scan_fwd_launch<32, 4, input_t, weight_t>(params, stream);", "block-32-threads"),
    ("  if (blockSize > 32) {", "warp-size-literal"),
    ("  int block_x = max(32, min(MAX_BLOCK_SIZE, h_last_pow2(space_size) / 4));", "block-32-threads"),
    ("static constexpr int kN = kBytes == 4 ? 4 : std::min(8, kNItems);", "constexpr-std-minmax"),
    ("static constexpr int kSmem = kEven\n    ? 0\n    : std::max({sizeof(A), sizeof(B)});", "constexpr-std-minmax"),
    ("#include <cuda/std/type_traits>", "libcudacxx"),
    ("__global__ void k(float* x);\nvoid f(float* x) { k<<<4, 512>>>(x); }", "launch-bounds"),
    (("__global__ void k(float* x);\nvoid f(float* x, int n) {\n  dim3 block(std::min(n, kMaxThreads));\n"
      "  k<<<1, block>>>(x);\n}\nconstexpr int kMaxThreads = 512;"), "launch-bounds"),
    ("template <typename Ktraits> __device__ void f(float* x) {\n  Ktraits::BlockLoadT(smem).Load(x, v);\n}",
     "dependent-template-name"),
    ("v = __scoped_atomic_fetch_add(&counter, 1, __ATOMIC_RELAXED, __MEMORY_SCOPE_WRKGRP);", "scoped-atomic"),
    ("#if defined(USE_ROCM)\n  rocblas_sgemm(h, op, op, m, n, k, &a, A, m, B, k, &b, C, m);\n#else\n"
     "  cublasSgemm(h, op, op, m, n, k, &a, A, m, B, k, &b, C, m);\n#endif", "rocblas-branch"),
    ("__host__ __device__ float4 operator/(float4 a, float4 b) { return a; }", "hip-builtin-redefinition"),
    ("IHD float3 operator*(const float3& a, const float3& b) { return a; }", "hip-builtin-redefinition"),  # IHD: another header's
    ("__device__ float atomicMax(float* address, float val) { return val; }", "hip-builtin-redefinition"),
    ("__device__ void f(nv_bfloat16 x, nv_bfloat16 y, nv_bfloat16* o) {\n  nv_bfloat16 p = x;\n  p *= y;\n  o[0] = p;\n}",
     "bf16-arithmetic"),
    ("static_assert(kBlock % warpSize == 0, \"whole warps\");", "warpsize-constexpr"),
    (("#define WARP_SIZE 32\n__device__ bool any_of(float v) {\n"  # width-32 shuffles, but a ballot spans the wavefront
      "  v += __shfl_xor_sync(0xffffffffffffffffull, v, 1, WARP_SIZE);\n  return __ballot_sync(~0ull, v > 0) != 0;\n}"),
     "warp-size-define"),
    ("using Reduce = hipcub::WarpReduce<float, warpSize>;", "warpsize-constexpr"),
    ("static constexpr int kWarps = kBlock / warpSize;", "warpsize-constexpr"),
    ("for (int i = 0; i < n; ++i) { register float acc = x[i]; y[i] = acc; }", "register-storage"),
    ("template <typename T> __host__ __device__ T sat(T v) { return std::clamp(v, T(0), T(1)); }", "device-std-clamp"),
    ("__device__ void sort1(float* k) {\n  static_assert(kWarpSize == 32, \"unexpected warp size\");\n}", "warp-size-assert"),
    ("static_assert(32 == WARP_SIZE);", "warp-size-assert"),
    ("int includeFlags = BALLOT(include);", "ballot-32bit-result"),
    ("__global__ void k(float* out, const float* in, int n) {\n  int indexInWarp = threadIdx.x % warpSize;\n"
     "  for (int j = indexInWarp; j < n; j += 32)\n    out[j] = __shfl_sync(0xffffffffffffffffull, in[j], 0);\n}",
     "warp-size-literal"),
    ("using lane_mask_type = uint32;", "mask-32bit"),
    ("typedef unsigned int warp_mask_t;", "mask-32bit"),
    ("const int warpMask = (1<<indexInWarp)-1;", "ballot-32bit-result"),
    ("unsigned below = (1u << lane_id) - 1;", "ballot-32bit-result"),
    ("inline __device__ unsigned long long int atomicSub(unsigned long long int* address,\n"
     "                                                   const unsigned long long int value) {\n"
     "  return atomicAdd(address, ~value + 1);\n}", "hip-builtin-redefinition"),
    ("ccl_device_inline int __float_as_int(float f) {\n  union { int i; float f; } u;\n  u.f = f;\n  return u.i;\n}",
     "hip-builtin-redefinition"),
    ("__global__ void k(const int* v, int* out) {\n  auto warp = cg::tiled_partition<32>(cg::this_thread_block());\n"
     "  if (!warp.any(v[threadIdx.x] > 0)) return;\n  out[threadIdx.x] = 1;\n}", "cg-missing-api"),
    ("__device__ int first(cg::thread_block_tile<32> tile, bool hit) {\n  return __ffsll(tile.ballot(hit)) - 1;\n}",
     "cg-missing-api"),
    ("namespace cg = cooperative_groups;\nauto part = cg::binary_partition(tile, pred);", "cg-missing-api"),
    ("__device__ unsigned short int cas16(unsigned short int *address, unsigned short int compare,\n"
     "                                    unsigned short int val) {\n  return atomicCAS(address, compare, val);\n}",
     "missing-intrinsic"),
    ("old = atomicCAS(reinterpret_cast<uint16_t*>(addr), assumed, desired);", "missing-intrinsic"),
    ("if (warp_size != 1 && warp_size != 2 && warp_size != 4 && warp_size != 8 && warp_size != 16 &&\n"
     "    warp_size != 32) {\n  printf(\"Error: Invalid value for warp_size.\\n\");\n  return;\n}", "warp-size-assert"),
    ("#define CC_AMPERE 800\n#define HAS_BF16_MATH (__CUDA_ARCH__ >= CC_AMPERE)", "cuda-arch-guard"),  # false on AMD
    ("#if CUDA_VERSION < 8000\n#error \"CUDA >= 8.0 is required\"\n#endif", "compiler-guard"),  # taken under hipcc
    ('#ifdef __NVCC__\n  out << "nvcc ";\n  use_tensor_cores = true;\n#endif', "compiler-guard"),  # not a banner only
    ("if (cudaMallocHost(&p, n) != cudaSuccess) {\n  cudaGetLastError();  // clear it\n  p = nullptr;\n}", "discarded-status"),
    (("template <typename T> constexpr __device__ T log2(T n) { return n <= 1 ? 0 : 1 + log2(n / 2); }\n"
      "template <int N> struct Bits { static constexpr int value = log2(N); };"), "constexpr-device-only"),
    (("template <typename T> constexpr inline __device__ T round_up(T n) { return (n + 255) / 256 * 256; }\n"
      "template <typename T> size_t smem_bytes(int n) { return round_up(n * sizeof(T)); }"), "constexpr-device-only"),
    (("template <int N, typename T> struct sorter { template <int M> __device__ void merge(T* v); };\n"
      "template <int N, typename T> struct filtered : public sorter<N, T> {\n"
      "  __device__ void add(T* v) { this->merge<N>(v); }\n};"), "dependent-template-name"),
    (("__device__ unsigned poll(const unsigned* flag) {\n  unsigned v;\n#ifdef __HIP_PLATFORM_HCC__\n"  # gone in ROCm 6.0
      "  v = __builtin_nontemporal_load(flag);\n#else\n"
      "  asm volatile(\"ld.volatile.global.u32 %0, [%1];\" : \"=r\"(v) : \"l\"(flag));\n#endif\n  return v;\n}"),
     "compiler-guard"),
    (("#if CUDART_VERSION >= 12000\nat::Tensor quantize_fp8(at::Tensor x) { return fp8_kernel(x); }\n#else\n"
      "at::Tensor quantize_fp8(at::Tensor x) { throw std::runtime_error(\"CUDA >= 12 only\"); }\n#endif"),
     "compiler-guard"),  # AMD builds the stub
    (("constexpr int kLanes = kWarpSize;  // kWarpSize: another header's\n"  # the file's alias of it, on the host
      "void launch(int rows, cudaStream_t s) { dim3 block(kLanes, 8); rows_kernel<<<rows, block, 0, s>>>(); }"),
     "host-warp-size"),
    ("#ifndef __HIP_PLATFORM_HCC__\n  threads.y = 1;  // CUDA only\n#endif", "compiler-guard"),  # taken from ROCm 6.0
    ("__global__ void k(std::optional<const Acc<float, 3>> sz, float* o) { o[0] = sz.value()[0][0][0]; }",
     "device-std-throw"),  # an optional kernel parameter
    ("__device__ std::pair<int, float> best(int k, float v) { return std::pair(k, v); }", "device-ctad"),
    ("namespace cooperative = ::cooperative_groups;\n__device__ void f() { cooperative::memcpy_async(g, d, s, n); }",
     "cg-missing-api"),  # an alias of another name
    ("__device__ void f(float v) { Pair p{blockIdx.x, v}; }", "builtin-index-narrowing"),
    ("__device__ Pair f(float v) { return {threadIdx.x, v}; }", "builtin-index-narrowing"),  # the return type's
    ("__device__ void f(float v) { Pair p = {threadIdx.y, v}; }", "builtin-index-narrowing"),
    ("__global__ void k(float* x, int n) { auto i = threadIdx.x; while (i < n) { x[i] = 0; i += blockDim.x; } }",
     "auto-builtin-index"),
    ("__device__ float lerp(float a, float b, float t);\n__global__ void k(float* x) { x[0] = lerp(x[1], x[2], .5f); }",
     "device-link"),
    ("int limit = dh::MaxSharedMemoryOptin(device);", "smem-optin-zero"),  # a project's helper for the opt-in limit
    ("__global__ void k(int* counts) { atomicMax_block(&counts[0], threadIdx.x); }", "missing-intrinsic"),
    ("__device__ __half f(double v) { return __double2half(v); }", "missing-intrinsic"),
    ("__device__ __nv_bfloat16 f(int v) { return __int2bfloat16_rn(v); }", "missing-intrinsic"),
    # cuda_bf16.h's conversions that name their rounding: HIP has none (`__float2bfloat16` rounds to nearest even)
    ("#define TO_BF16(v) (__float2bfloat16_rn(v))", "missing-intrinsic"),
    ("__device__ void store2(__nv_bfloat162* o, float a, float b) { *o = __floats2bfloat162_rn(a, b); }",
     "missing-intrinsic"),
    ("__device__ __nv_bfloat162 splat(float s) { return __float2bfloat162_rn(s); }", "missing-intrinsic"),
    # CUDA 12's vector atomicAdd (sm_90): through a cast, or on a float4 parameter
    ("__device__ void acc_pair(float* g, float dx, float dy) {\n"
     "  atomicAdd(reinterpret_cast<float2*>(g), make_float2(dx, dy));\n}", "missing-intrinsic"),
    ("__global__ void scatter(float4* __restrict__ grad, const float4* src, const int* idx) {\n"
     "  atomicAdd(grad + idx[threadIdx.x], src[threadIdx.x]);\n}", "missing-intrinsic"),
    (("__global__ void k(float* s, float* o) {\n  int group = threadIdx.x / 32;\n  o[group] = s[threadIdx.x];\n"
      "  blockReduceSum(o[group]);\n}"), "warp-size-literal"),  # another header's helper, by its name
    ("#ifdef __CUDA_BF16_TYPES_EXIST__\ntemplate <> struct IsFloat<__nv_bfloat16> { static constexpr bool value = true; };\n#endif",
     "compiler-guard"),  # only cuda_bf16.h defines it: the bf16 code is compiled out on AMD
    ("#ifdef __CUDACC_VER_MAJOR__\n  __host__ __device__ Complex(float2 v) : x(v.x), y(v.y) {}\n#endif",
     "compiler-guard"),  # nvcc's version macro: hipcc never defines it, the vector conversions are lost on AMD
    ("__device__ uint32_t smem(const void* p) { return static_cast<uint32_t>(__cvta_generic_to_shared(p)); }",
     "missing-intrinsic"),
    ("struct Pool {\n  CUdeviceptr base = 0;\n  size_t used = 0;\n  void* next() { return (void*) (base + used); }\n};",
     "void-pointer-arith"),  # a member: void* once CUdeviceptr is hipDeviceptr_t
    ("void check(void* p, int align) {\n  CUdeviceptr addr = reinterpret_cast<CUdeviceptr>(p);\n"
     "  if (addr % align != 0) throw 1;\n}", "void-pointer-arith"),
    ("__global__ void k(float* x) {\n  __shared__ float sums[32];\n  x[0] = WarpReduceSum(x[0], sums);\n}",
     "warp-buffer-passed-on"),
    ("const int blocksize = 32;  // one warp of elements per block", "block-32-threads"),
    ("__global__ void k(int* c, int n) {\n  int v = 0;\n  for (int i = get_lane_id(); i < n; i += 32) v += c[i];\n  c[0] = v;\n}",
     "warp-size-literal"),  # from the hardware lane (PTX %laneid) stepping by a 32-lane warp
    ("__global__ void k(unsigned long long* t) { t[0] = clock64(); }", "device-clock"),
    ("#include <nvshmem/nvshmem.h>", "nvshmem"),
    ("typedef cub::BlockReduceRaking<float, 128> Raking;", "cub-internal"),
    ("__host__ __device__ constexpr int warp_size() { return 32; }", "warp-size-define"),  # a function for a constant
    ("constexpr unsigned threads_per_warp() { return 32u; }", "warp-size-define"),  # unsigned
    ("if (tid < 32) { cub::WARP_SYNC(0xffffffff); s[tid] += s[tid + 16]; }", "syncwarp"),  # CUB's macro for it
    ("k << <grid, block, 0,\n      stream >> > (a, b);", "spaced-kernel-launch"),  # over two lines
    ("constexpr const Index_type WARP_SIZE = 32u;", "warp-size-define"),
    ("typedef struct : grid_task {\n  double zetp;\n} smem_task;", "typedef-anonymous-struct"),
    ("struct Amp {\n  __device__ cu_qcomp operator()(qcomp a) const {\n    return {.x = a.real(), .y=a.imag()};\n  }\n};",
     "vector-designated-init"),  # a functor's complex amplitude, spaced as written
    ("typedef cuDoubleComplex amp_t;\n__host__ __device__ inline void operator += (amp_t& a, const amp_t& b) {\n"
     "  a = cuCadd(a, b);\n}", "hip-builtin-redefinition"),  # an alias of a cuComplex type: hip_complex.h has `+=`
])
def test_rule_variants_fire(code, rule):
    assert rule in {f.rule for f in lint_text(code, "snippet.cu")}


@pytest.mark.parametrize(("code", "rule"), [
    ("__host__ __device__ int id() {\n#ifndef __CUDA_ARCH__\n#endif\n  return 0;\n}", "cuda-arch-guard"),  # empty
    ("struct host_only {\n#ifndef __CUDA_ARCH__\n  ~host_only() {}\n#endif\n};", "cuda-arch-guard"),  # no device code
    ("cudaEventCreate(&e);\ncudaEventCreateWithFlags(&e, flags);\ncudaStreamWaitEvent(s, e, 0);", "runtime-overload"),
    ('printf("built with CUDART_VERSION %d\\n", version);', "cuda-version-expression"),  # a string's words
    (("cg::thread_block_tile<32> g = cg::tiled_partition<32>(cta);\n"  # the tile is flagged, not the loop
      "for (int i = 1; i < 32; i *= 2) v += g.shfl_down(v, i);"), "warp-lane-loop"),
    ("#define TILE 32\n__shared__ float t[TILE][TILE + 1];\nint col = blockIdx.x * TILE + threadIdx.x;",
     "warp-size-define"),  # a tile width that never reaches a shuffle or a lane id
    ("constexpr int kCols = 32;\nint chunks = n / kCols;", "warp-size-define"),
    ("int chunks = std::max(1, seqlen / 64);", "constexpr-std-minmax"),  # not a constexpr initialiser
    ("static constexpr int kNWarps = kNThreads / 32;", "warp-size-literal"),  # as often a tile decomposition
    ('#ifdef __NVCC__\n#if defined __CUDACC_VER_MAJOR__\n  out << "nvcc " << __CUDACC_VER_MAJOR__ << ".";\n#else\n'
     '  out << "nvcc UNKNOWN";\n#endif\n  out << " (";\n#endif', "compiler-guard"),  # AMD loses a banner only
    ("#ifdef __NVCC__\n#if __CUDACC_VER_MAJOR__ < 11\n#error Unsupported CUDA version\n#endif\n#endif",
     "compiler-guard"),  # a check of nvcc's release, rightly skipped by hipcc
    ("#if defined __clang__\n#define FAST 1\n#elif defined __GNUC__\n#if __GNUC__ < 9\n#error old gcc\n#endif\n#endif",
     "compiler-guard"),  # hip-clang takes the clang branch: the GCC check is never reached
    ("if (num_threads > 320) return;", "warp-size-literal"),
    ("int cols = std::max(32, n / 4);", "block-32-threads"),  # not a block dimension
    ("constexpr int kA = 4;\nint n = std::min(a, b);", "constexpr-std-minmax"),  # the constexpr ended at its `;`
    ("template <typename Ktraits> __device__ void f() { v = Ktraits::helper(x).y; }", "dependent-template-name"),
    ("template <typename K> __device__ void f() { typename K::BlockLoadT(smem).Load(x, v); }", "dependent-template-name"),
    (("template <typename T> __global__ void k(T* output) {\n  output[0] = T(1);\n}\n"
      "void launch(at::Tensor* output) {\n  k<<<1, 64>>>(output->data_ptr<float>());\n}"), "dependent-template-name"),
    ("__global__ __launch_bounds__(1024) void k(float* x);\nvoid f(float* x) { k<<<4, 1024>>>(x); }", "launch-bounds"),
    ("__global__ void k(float* x);\nvoid f(float* x, int n) { k<<<4, 256>>>(x); k<<<4, n>>>(x); }", "launch-bounds"),
    # hip-clang's default bound is 1024: a 1024-thread launch without bounds is what it compiled for
    ("__global__ void k(float* x);\nvoid f(float* x) { k<<<4, 1024>>>(x); }", "launch-bounds"),
    (("__global__ void k(float* x);\n__global__ void __launch_bounds__(512) k(float* x) {}\n"  # bounded where defined
      "void f(float* x) { k<<<4, 512>>>(x); }"), "launch-bounds"),
    ("__global__ void k(float* x);\nconstexpr int kCols = 1024;\nvoid f(float* x) { k<<<4, kCols / 8>>>(x); }",
     "launch-bounds"),
    ("__global__ void fill(float* x) { x[threadIdx.x] = 0; }\nvoid f(float* x) { fill<<<4, 32>>>(x); }", "block-32-threads"),
    ("__global__ void fill(float* x) { x[threadIdx.x] = 0; }\nvoid f(float* x) { fill<<<4, dim3(32, 4)>>>(x); }",
     "block-32-threads"),
    (("__global__ void fill(float* x) { x[blockIdx.x * blockDim.x + threadIdx.x] = 0; }\n"  # a named block of one
      "void f(float* x, int n) {\n  dim3 grid_t(32);\n  dim3 grid_b(n / 32);\n  fill<<<grid_b, grid_t, 0, s>>>(x);\n}"),
     "block-32-threads"),
    (("template <int B, int WARP_SIZE = 32> __global__ void k(float* x);\n"  # a default every use overrides
      "void f(float* x) { k<2, 32><<<1, 64>>>(x); k<4, 16><<<1, 64>>>(x); }"), "warp-size-define"),
    ("__launch_bounds__(256, 2) __global__ void k(); __launch_bounds__(TH, 1) __global__ void j();", "launch-bounds-2nd-arg"),
    # AMD loses only the old-GPU trap and compiles the real conversion
    ("__device__ float2 f(bf162 v) {\n#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 800\n  assert(false);\n#else\n"
     "  return __bfloat1622float2(v);\n#endif\n}", "cuda-arch-guard"),
    # an old-GPU branch that only adds a barrier (the safe choice); a branch for new GPUs and the host pass, taken
    ("#if !defined(__STOCHASTIC_MODE__) || __CUDA_ARCH__ < 700\n  b.sync();\n#endif", "cuda-arch-guard"),
    ("#if (__CUDA_ARCH__ >= 800 || !defined(__CUDA_ARCH__))\n  st_release(p, v);\n#endif", "cuda-arch-guard"),
    ("#if defined(__NVCC__) || defined(__HIPCC__)\n#define HD __host__ __device__\n#endif", "compiler-guard"),
    ("(void)cudaGetLastError();\ncudaError_t e = cudaGetLastError();\nCHECK(cudaGetLastError());", "discarded-status"),
    (("template <typename T> struct Reduce {\n  void operator()(T* x, int n) {\n    if constexpr (sizeof(T) == 2)\n"
      "    {\n      run(x, n);\n    }\n  }\n};"), "missing-return"),  # `if constexpr (...) {` opens no function
    (("template <typename T> constexpr __host__ __device__ T log2(T n) { return n <= 1 ? 0 : 1 + log2(n / 2); }\n"
      "template <int N> struct Bits { static constexpr int value = log2(N); };"), "constexpr-device-only"),
    (("template <typename T> constexpr __device__ T log2(T n) { return n <= 1 ? 0 : 1 + log2(n / 2); }\n"
      "template <int N> __global__ void k(float* x) { x[log2(N)] = 1; }"), "constexpr-device-only"),  # device code
    (("template <int N, typename T> struct filtered : public sorter<N, T> {\n"  # its own member template
      "  template <int M> __device__ void merge(T* v);\n  __device__ void add(T* v) { this->merge<N>(v); }\n};"),
     "dependent-template-name"),
    (("template <int N, typename T> struct plain {\n"  # no dependent base: found in the class itself
      "  template <int M> __device__ void merge(T* v);\n  __device__ void add(T* v) { this->merge<N>(v); }\n};"),
     "dependent-template-name"),
    ("#if defined(__HIP_PLATFORM_HCC__) || defined(__HIP_PLATFORM_AMD__)\n#include <hip/hip_fp16.h>\n#endif",
     "compiler-guard"),  # the hcc-era macro beside the current one
    ("__device__ float ld(const float* p) {\n#if defined(__CUDA_ARCH__) || defined(__HIP_DEVICE_COMPILE__)\n"
     "  return __ldg(p);\n#else\n  return *p;\n#endif\n}", "cuda-arch-guard"),  # hipcc's device pass named: ported
    ("void f(void* p, char* q) { char* r = (char*)p + 4; q = r + 1; }", "void-pointer-arith"),  # cast first
    ("template <typename T> __global__ void k(const float* x, float* y) { y[0] = __ldg(&x[0]); }", "ldg-torch-half"),
    ("while (!__hip_atomic_load(&f, __ATOMIC_ACQUIRE, __HIP_MEMORY_SCOPE_AGENT));", "scoped-atomic"),
    (("#if defined(__HIP_PLATFORM_AMD__) && TORCH_VERSION_MAJOR == 2 && TORCH_VERSION_MINOR == 0\n"  # kept for old torch
      "  rocblas_gemm_ex(h);\n#else\n  cublasGemmEx(h);\n#endif"), "rocblas-branch"),
    ("#ifdef USE_ROCM\n  rocblas_gemm_ex(h);\n#endif", "rocblas-branch"),  # no cuBLAS: a project on rocBLAS itself
    ("cublasCreate(&h);\n#ifdef USE_ROCM\n  rocblas_gemm_ex(h);", "rocblas-branch"),  # an #if never closed (a cut file)
    ("#ifndef USE_ROCM\n  cublasGemmEx(h);\n#else\n  hipblasGemmEx(h);\n#endif", "rocblas-branch"),
    ("#include <thrust/sort.h>\nvoid f(int* p, int n) { thrust::sort(p, p + n); }", "unused-thrust-header"),
    # a scalar factor: HIP's vector-scalar operators are templates, which this non-template outranks
    ("__host__ __device__ float2 operator*(const float a, const float2& b) { return b; }", "hip-builtin-redefinition"),
    # device-only: clang's same-side preference picks it over HIP's __host__ __device__ operator (no ambiguity)
    ("__device__ inline float2 operator*(const float2& a, const float2& b) { return a; }", "hip-builtin-redefinition"),
    ("__device__ float f(__nv_bfloat16 a, float s) { return __bfloat162float(a) * s; }", "bf16-arithmetic"),
    ("__device__ __nv_bfloat16 f(__nv_bfloat16 a, __nv_bfloat16 b) { return __hadd(a, b); }", "bf16-arithmetic"),
    ("return x[warpSize - 1];", "warpsize-constexpr"),  # run-time uses of warpSize
    ("if (lane < warpSize && ok) v = x[lane % warpSize];", "warpsize-constexpr"),
    ("static constexpr int numWarps = TravConfig::numThreads / GpuConfig::warpSize;", "warpsize-constexpr"),  # a member
    ("struct GpuConfig {\n  static constexpr int warpSize = 64;\n  static_assert(warpSize == 32 || warpSize == 64, \"\");\n"
     "  static constexpr int log2 = (warpSize == 32) ? 5 : 6;\n};", "warpsize-constexpr"),  # the file's own constant
    ("int register_count = 4;", "register-storage"),
    ('asm volatile("" ::: "memory");', "inline-asm"),  # a compiler barrier, which clang takes
    # a logical warp: every shuffle keeps to 32-lane groups, which a 64-lane wavefront holds two of
    (("#define WARP_SIZE 32\n__device__ float sum(float v) {\n  for (int o = WARP_SIZE / 2; o > 0; o >>= 1)\n"
      "    v += __shfl_xor_sync(0xffffffffffffffffull, v, o, WARP_SIZE);\n  return v;\n}"), "warp-size-define"),
    ('asm("v_add3_u32 %0, %1, %2, %0" : "+v"(c) : "v"(a), "v"(b));', "inline-asm"),  # AMD GPU assembly: a port's own
    (("__global__ void k(float* x) { cg::this_grid().sync(); }\nvoid f(void** args, int sms, cudaStream_t s) {\n"
      "  int b = 0;\n  cudaOccupancyMaxActiveBlocksPerMultiprocessor(&b, k, 256, 0);\n"
      "  cudaLaunchCooperativeKernel((void*)k, b * sms, 256, args, 0, s);\n}"), "grid-sync"),  # a grid the device sized
    ("template <typename T> T clamp_host(T v) { return std::clamp(v, T(0), T(1)); }", "device-std-clamp"),
    ("using T = cuda::std::remove_cv_t<U>;\nusing V = cuda::std::decay_t<U>;\n#include <cuda/std/utility>", None),
    ('#include "cuda/helpers.h"  // the project\'s own header, not libcu++', "libcudacxx"),
    ('static_assert(kWarpSize == 32 || kWarpSize == 64, "unexpected warp size");', "warp-size-assert"),
    ("if ((warp_size & (warp_size - 1)) != 0 || warp_size > SLAB_SIZE) return;", "warp-size-assert"),
    ("if (warp_size != 16 && warp_size != 32 && warp_size != 64) return;", "warp-size-assert"),
    ("unsigned long long below = (1ull << lane) - 1;", "ballot-32bit-result"),
    ("using lane_mask_type = uint64;", "mask-32bit"),
    ("__global__ void k(float* out, int n) {\n  for (int j = threadIdx.x; j < n; j += 32) out[j] = 0.f;\n}",
     "warp-size-literal"),
    ("__global__ void k(float* out, const float* in, int n) {\n  unsigned lane = threadIdx.x & 31;\n"
     "  for (unsigned l = lane; l < n; l += 32) out[l] = __shfl_sync(0xffffffff, in[l], 0, 32);\n}",
     "warp-size-literal"),  # a 32-lane group of its own: consistent on a 64-lane wavefront
    ("int ballots = ballot_count(x);", "ballot-32bit-result"),
    ("__device__ int bits(float f) { return __float_as_int(f) & 0x7fffffff; }", "hip-builtin-redefinition"),
    ("__global__ void k(const int* v, int* out) {\n  auto warp = cg::tiled_partition<32>(cg::this_thread_block());\n"
     "  out[threadIdx.x] = warp.shfl(v[threadIdx.x], 0) + __any(v[0]);\n}", "cg-missing-api"),
    ("__device__ unsigned int cas32(unsigned int* address, unsigned int c, unsigned int v) {\n"
     "  unsigned short* unused = nullptr;\n  return atomicCAS(address, c, v);\n}", "missing-intrinsic"),
    ("#define ARCH_OF_BUILD __CUDA_ARCH__", "cuda-arch-guard"),  # no test of it: not a constant on AMD
    # 32-lane tiles throughout: tile shuffles, per-tile slots by meta_group_rank, lane and tile ids by 32, no vote
    (("auto g = cg::tiled_partition<32>(block);\nint lane = threadIdx.x & 0x1f, gid = threadIdx.x >> 5;\n"
      "for (int i = 1; i < 32; i *= 2) v += g.shfl_xor(v, i);\nif (lane == 0) partial[gid] = v;"), "warp-tile-32"),
    (("auto g = cg::tiled_partition<32>(block);\nint lane = threadIdx.x & 0x1f, gid = threadIdx.x >> 5;\n"
      "for (int i = 1; i < 32; i *= 2) v += g.shfl_xor(v, i);\nif (lane == 0) partial[gid] = v;"), "warp-size-literal"),
    # a CUDA >= 9 branch of *_sync warp functions and its #else of the legacy ones: hipcc takes what HIP has
    ("#if CUDA_VERSION >= 9000\n  v += __shfl_xor_sync(0xffffffff, v, 1);\n#else\n  v += __shfl_xor(v, 1);\n#endif",
     "compiler-guard"),
    ("constexpr int kLanes = 32;\nvoid launch(int rows) { dim3 block(kLanes, 8); rows_kernel<<<rows, block>>>(); }",
     "host-warp-size"),  # the file's own number, not another header's warp size
    ("struct P { std::array<float, 4> c; };\nfloat host_sum(const P& p) { return p.c.at(0) + p.c.at(3); }",
     "device-std-throw"),  # host code may throw
    ("__device__ float f(const View& v) { return v.at(1); }", "device-std-throw"),  # the project's own at()
    ("__device__ int f() { constexpr std::array<int, 2> a{1, 2}; return a[0]; }", "device-ctad"),  # arguments given
    ("auto sizes = std::array{2, 3};\nvoid build() { auto s = std::array{1, 2}; }", "device-ctad"),  # host code
    ("auto g = cg::tiled_partition<32>(block);\nv += g.shfl_xor(v, 1);\nauto m = __match_any(label);", "cg-missing-api"),
    ("__global__ void k() { dim3 at{threadIdx.x, blockIdx.x, 0}; uint32_t u{threadIdx.y}; }", "builtin-index-narrowing"),
    ("__global__ void k(float* x) { if (threadIdx.x == 0) { x[threadIdx.x] = 0; } }", "builtin-index-narrowing"),
    # HIP's vector types construct from it (constructor templates; checked with hipcc 5.2)
    ("__device__ int2 f() { return {threadIdx.x, 0}; }\n__device__ void g() { int4 v = {threadIdx.x, 0, 0, 0}; }",
     "builtin-index-narrowing"),
    ("__global__ void k(float* x) { auto i = blockIdx.x * blockDim.x + threadIdx.x; x[i] = 0; }", "auto-builtin-index"),
    ("__global__ void k(float* x) { auto row = blockIdx.y; x[row] = 1; }", "auto-builtin-index"),  # never changed
    ("__device__ float lerp(float a, float b, float t);\n__device__ float lerp(float a, float b, float t) { return a; }",
     "device-link"),  # declared, then defined here
    ("template __device__ float quantile<float>(const float* v, int n);", "device-link"),  # an explicit instantiation
    # internal linkage: the file including the header defines it in the same translation unit
    ("__device__ static void to_grid(const double dx, double* grid);", "device-link"),
    (("template <typename T> struct Smem {\n  __device__ T* get() {\n    extern __device__ void error(void);\n"
      "    error();\n    return nullptr;\n  }\n};"), "device-link"),  # undefined on purpose: no instantiation links
    ("__global__ void k(float* x) { x[cg::this_grid().thread_rank()] = 0; }", "grid-sync"),  # an index, no sync
    ("static_assert(kTile == 32, \"tiles of 32 columns\");", "warp-size-assert"),  # says nothing of warps
    ("CUdeviceptr base = 0;\nvoid* at(size_t off) { return (void*)((char*)(base) + off); }", "void-pointer-arith"),
    # the lanes of an mma fragment layout: the PTX itself is ptx-mma's (an AMD port rewrites the multiply whole)
    (("__device__ void mma(const unsigned* a, float* c) {\n"
      "  asm volatile(\"mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0}, {%1}, {%2}, {%3};\" : \"+f\"(c[0]) : \"r\"(a[0]));\n}\n"
      "__global__ void k(const unsigned* a, float* c) {\n  int row = threadIdx.x % 32 / 4;\n  mma(a + row, c);\n}"),
     "warp-size-literal"),
    # a block reduction the file writes itself (a lambda), through shared memory: not another header's warp helper
    (("__global__ void k(float* s, float* o) {\n  auto block_reduce = [&]() { for (int i = 1; i < 4; ++i) s[0] += s[i]; };\n"
      "  int group = threadIdx.x / 32;\n  o[group] = s[threadIdx.x];\n  block_reduce();\n}"), "warp-size-literal"),
    (("template <typename T> __device__ T block_scan(T v, T* partial) { return v + partial[0]; }\n"
      "__global__ void k(float* x) { __shared__ float partial[32]; x[0] = block_scan(x[0], partial); }"),
     "warp-buffer-passed-on"),  # the helper is the file's own: the lane-indexed read is judged where it is written
    # an overload in the project's namespace (calls there find it first), not a redefinition of HIP's global one
    ("namespace solver { namespace impl {\n__device__ double atomicAdd(double* a, double v) {\n  return ::atomicAdd(a, v);\n}\n}}",
     "hip-builtin-redefinition"),
    # an IDE's indexing block: no compiler defines __CLION_IDE__
    ("#ifdef __CLION_IDE__\n__host__ __device__ void ide_printf(const char*, ...) { asm volatile(\"trap;\"); }\n#endif",
     "inline-asm"),
    ("cub::WarpReduce<float> reduce(storage);  // the public API", "cub-internal"),
    ("typedef struct { int x; } plain_c;\ntypedef struct tagged : base { int y; } named;", "typedef-anonymous-struct"),
    # an optional NVSHMEM path the project builds without already (as its HIP build must)
    ("#ifdef HAVE_NVSHMEM\n#include <nvshmem.h>\nvoid fence() { nvshmem_quiet(); }\n#else\nvoid fence() {}\n#endif", "nvshmem"),
    # a macro whose body is a braced block is no function: nothing falls off its end
    ("#define ErrorCheck(code) { ErrorAssert((code), __FILE__, __LINE__); }\ninline void ErrorAssert(int c, const char* f, int l) {}",
     "missing-return"),
    # a fix for old nvcc releases: hipcc compiles it out and takes the general code
    (("#if defined(__CUDACC_VER_MAJOR__) && \\\n    ((__CUDACC_VER_MAJOR__ < 12) || (__CUDACC_VER_MAJOR__ == 12 && "
      "__CUDACC_VER_MINOR__ <= 8))\n  return q * __frsqrt_rn(dot(q, q));\n#else\n  return normalize(q);\n#endif"),
     "compiler-guard"),
    # the project's macro returns (bifrost's `BF_TRY_RETURN(...)` expands to `return ...`)
    ("BFstatus bfInit(BFplan plan) {\n  BF_ASSERT(plan, BF_STATUS_INVALID_HANDLE);\n  BF_TRY_RETURN(plan->init());\n}",
     "missing-return"),
    ("int cells(int n) {\n#ifndef __CUDA_ARCH__\n  if (n > 1024) throw std::runtime_error(\"too many\");\n#endif\n  return n;\n}",
     "cuda-arch-guard"),  # a host function: only the host pass compiles it
    ("PetscErrorCode MatSetUp_SeqSELLHIP(Mat A) {\n  PetscFunctionBegin;\n  PetscFunctionReturn(PETSC_SUCCESS);\n}",
     "missing-return"),  # PETSc's macro returns too
    # SFINAE's void: enable_if's type defaults to void, or is void given (its condition with commas and comparisons)
    (("template <typename K, typename V>\ninline typename std::enable_if<!(std::is_same<K, half>::value ||\n"
      "    std::is_same<V, half>::value), void>::type\nSortByKey(K* keys, V* values) {\n  sort(keys, values);\n}"),
     "missing-return"),
    ("template <int N>\nstd::enable_if_t<(N > 4)> fill(float* x) {\n  x[0] = N;\n}", "missing-return"),
    (("__global__ void k(float* x) {}\nvoid launch(float* x, bool big) {\n  int extra = 0;\n  if (big) extra = 256;\n"
      "  cudaFuncSetAttribute(k, cudaFuncAttributeMaxDynamicSharedMemorySize, (6112 + extra) * sizeof(double));\n}"),
     "lds-limit"),  # at most 6368 doubles: 50,944 bytes
    ("int* positions = new int[(rows + cols) * warpSize];", "warpsize-constexpr"),  # `new`: a run-time size
    # LLVM counts these: a geometric step between constants, a run-time start with a compile-time bound and step
    # (at most that many trips), a `break` that leaves only an inner loop, a bound a member call returns
    ("__device__ float f(float v) {\n#pragma unroll\n  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor(v, o);\n  return v;\n}",
     "unroll-unknown-trip"),
    ("template <int N> __global__ void k(float* x) {\n#pragma unroll\n  for (int i = threadIdx.x * 4; i < N * 64; i += 256) {\n"
     "    if (x[i] < 0) break;\n  }\n}", "unroll-unknown-trip"),
    ("__global__ void k(float* x, int n) {\n#pragma unroll\n  for (int i = 0; i < 8; ++i) {\n"
     "    for (int j = 0; j < n; ++j) { if (x[j] < 0) break; }\n  }\n}", "unroll-unknown-trip"),
    ("__global__ void k(const Strides s, float* x) {\n#pragma unroll\n  for (int d = 0; d < s.Capacity(); d++) {\n"
     "    if (d >= s.rank) break;\n  }\n}", "unroll-unknown-trip"),
    # a block-level combine only a block of several warps needs, not a barrier skipped within a warp
    ("if (block_size > WARP_SIZE) {\n  __syncthreads();\n  if (lane == 0) buf[warp] = v;\n  __syncthreads();\n}",
     "warp-sync-skipped"),
    # NVTX that the file uses (llm.c's NvtxRange): the include stays
    ("#include <nvtx3/nvToolsExt.h>\nstruct NvtxRange {\n  NvtxRange(const char* s) { nvtxRangePush(s); }\n"
     "  ~NvtxRange() { nvtxRangePop(); }\n};", "unused-nvtx-header"),
    # a checking macro's body: flagged where a cuDNN call uses it, not where it is defined
    ("#define CUDNN_CHECK(ans) {                             \\\n  cudnnStatus_t status = (ans);               \\\n"
     "  if (status) fail(cudnnGetErrorString(status));  \\\n}", "cudnn-api"),
])
def test_rule_variants_stay_silent(code, rule):
    found = [f for f in lint_text(code, "snippet.cu") if f.rule in ({rule} if rule else {"libcudacxx"})]
    if rule is None:  # libcu++: one finding, on the include, for the whole file
        assert [f.line for f in found] == [3]
    else:
        assert found == []


def test_code_under_cudacc_is_linted_as_the_translation_compiles_it():
    """Every translator renames `__CUDACC__` to `__HIPCC__`: its branch is AMD's, whatever the build says of nvcc's name."""
    code = "#ifdef __CUDACC__\n__device__ void add(__half2* p, __half2 v) { atomicAdd(p, v); }\n#endif\n"
    build = Build(undefined=frozenset({"__CUDACC__"}))
    assert [f.rule for f in lint_text(code, "vec.h", build=build)] == ["missing-intrinsic"]


def test_cutlass_is_named_at_its_include_or_else_on_each_line_that_uses_it():
    included = "#include <cutlass/numeric_types.h>\nusing T = cutlass::half_t;\nT one() { return cutlass::half_t(1); }"
    reached = "__device__ float f(float x) { return cutlass::fast_max(x, cutlass::fast_min(x, 1.f)); }\nusing T = cute::Int<4>;"
    assert [f.line for f in lint_text(included, "a.cu") if f.rule == "cutlass-cute"] == [1]
    assert [f.line for f in lint_text(reached, "a.h") if f.rule == "cutlass-cute"] == [1, 2]


@pytest.mark.parametrize("code", [
    "float y = x / 32.0f;",  # arithmetic on data, not lanes
    "const int blocks = 32 * num_sms;",
    "__launch_bounds__(256) __global__ void k();",
    "unsigned long long votes = __ballot_sync(0xffffffffffffffffull, p);",
    "v = __shfl_xor_sync(0xffffffffffffffffull, v, 1);",
    "q |= __shfl_down_sync(0x0f0f0f0full, q, 4) << 8;",
    "// #define WARP_SIZE 32 and lane = threadIdx.x & 31 in a comment",
    "/* asm volatile(\"mov.u32 %0, %%laneid;\") */",
    "for (int i = 0; i < 32; ++i) acc += x[i];",
    "cg::thread_block_tile<32> warp = cg::tiled_partition<32>(block);  // warp-tile-32 only",
    "__shared__ float tile[64][65];",
    "CUDA_CHECK(cudaFuncSetAttribute(k, cudaFuncAttributeMaxDynamicSharedMemorySize, 48 * 1024));",
    "printf(\"// not a comment %d\", lane & 1);",
    "template <typename T> __device__ T f(const Frag<T, 4>& frag) { return frag.template get<0>() + std::get<0>(t); }",
    "template <typename T> __device__ void f() { typename T::index_type i = 0; Holder h; h.get<4>(); }",
    "__shared__ float sums[32];\nv = lane < blockDim.x / warpSize ? sums[lane] : 0.f; sums[warp] = v;",
    "dim3 block(32, 8); k<<<32, 256>>>(x); k<<<g, dim3(32, 4)>>>(x);",
    # a butterfly over a named width of 32 lanes reduces each 32-lane group of a 64-lane wavefront
    "for (int o = 16; o > 0; o /= 2) v += __shfl_xor(v, o, 32);",
    "#ifndef USE_ROCM\nint lane = threadIdx.x % 32;\n#endif",  # the CUDA side of a port already made
    "#if defined(USE_ROCM)\nint lane = threadIdx.x % warpSize;\n#else\nint lane = threadIdx.x & 31;\n#endif",
    "#if __CUDA_ARCH__ < 700\n__syncthreads();\n#endif",  # true on AMD, nothing compiled out
    "__device__ int lanes() { return C10_WARP_SIZE; }",  # the device pass knows its wavefront
    "__device__ int lanes() { return WARP_SIZE; }",  # so does a macro of another header, in device code
    "__device__ int pick(int n) { int warp_size = n < 32 ? n : 32; return warp_size; }",  # device code: warp-size rules
    "__half_raw zero = {0x0000};",  # zero is zero as a value and as bits
    "float2 v = make_float2(0.f, 1.f);\natomicAdd(&acc, v.x);",  # atomicAdd on a float: HIP has it
    # a float `value` beside another function's half one: each function's own declarations
    "__device__ void add(half* p, half value) { half2 v = {value, value}; }\n"
    "__device__ void add(float* address, float value) { atomicAdd(address, value); }",
    "__half2 v = __ldcs(reinterpret_cast<const __half2*>(src) + i);",  # HIP declares the half forms
    "__half2 acc = {};\nfloat f;\nf = {};",  # value-initialised where declared; a float takes `= {}`
    # constructors return nothing, whatever stands before their name
    "template <typename T>\nclass Runner {\npublic:\n    Runner(int n) : n_(n) { setup(); }\n    int n_;\n};",
    "#define HD_INLINE __forceinline__ __device__ __host__\nstruct Vec {\n  HD_INLINE Vec() {}\n  HD_INLINE Vec(int n) : n(n) {}\n  int n;\n};",
    "IHD GradInfo::GradInfo() {\n  pos = make_float3(0.f, 0.f, 0.f);\n}",  # defined outside its class, declared in a header
    "__global__ void k(float* m, float v) { atomicMax(m, v); }",  # a call of HIP's own, not a definition
    # a float2's components added one by one: HIP's float atomicAdd
    "__device__ void acc(float2* g, float2 d) { atomicAdd(&g->x, d.x); atomicAdd(&g->y, d.y); }",
    # the file's own float2 overload (for every target) is what the call reaches
    ("__device__ inline float2 atomicAdd(float2* a, float2 v) {\n"
     "  return make_float2(atomicAdd(&a->x, v.x), atomicAdd(&a->y, v.y));\n}\n"
     "__device__ void acc(float2* g, float dx, float dy) { atomicAdd(g, make_float2(dx, dy)); }"),
    # the file's own bf16 conversion under USE_ROCM, as a function or a macro
    ("#ifdef USE_ROCM\n#define __float2bfloat16_rn __float2bfloat16\n#endif\n"
     "__device__ float bf16_round(float v) { return __bfloat162float(__float2bfloat16_rn(v)); }"),
    ("#ifdef USE_ROCM\n__device__ inline __hip_bfloat16 __float2bfloat16_rn(float v) { return __float2bfloat16(v); }\n"
     "#endif\n__device__ float round_trip(float v) { return __bfloat162float(__float2bfloat16_rn(v)); }"),
    # a mask parameter only the CUDA branch uses
    ("template <typename T>\n__device__ T xor_shfl(T v, int m, unsigned int mask = 0xffffffff) {\n#if CUDA_VERSION >= 9000\n"
     "  return __shfl_xor_sync(mask, v, m);\n#else\n  return __shfl_xor(v, m);\n#endif\n}"),
    "#ifndef USE_ROCM\n__device__ int dot(int a, int b) { return __dp4a(a, b, 0); }\n#endif",
    "__device__ float inv(float v) { return rsqrtf(v); }\nfloat host_inv(float v) { return 1.f / std::sqrt(v); }",
    "template <typename T> __device__ T first(const T* v) { return v[0]; }\n__global__ void k(float* x) { x[0] = 1; }",
    "Options opts{.block = 256, .stream = s};\ndouble2 v = make_double2(re, im);",  # other members; a constructor
    "typedef cuDoubleComplex amp_t;\n__host__ __device__ amp_t operator*(const amp_t& a, double s) {\n"
    "  return make_cuDoubleComplex(a.x * s, a.y * s);\n}",  # a complex times a scalar: hip_complex.h has none
])
def test_portable_code_stays_quiet(code):
    rules = {f.rule for f in lint_text(code, "snippet.cu")}
    assert rules <= {"warp-tile-32"}


@pytest.mark.parametrize(("code", "fires"), [
    ("if (threadIdx.x % 32 == 0) atomicAdd(&rows_done, 1);", False),  # one thread per 32, nothing warp-wide
    ("const int col_tile = col / 32, lane = threadIdx.x % warpSize;", False),  # `/ 32` tiles columns
    ("if (threadIdx.x % 32 == 0) warp_sums[threadIdx.x / 32] = v;", True),
    ("if ((tid & 31) == 0) {\n  v = __shfl_down_sync(m, v, 1);\n}", True),
    ("if (lane % 32 == 0) votes[warp] = __popcll(__ballot(p));", True),
    ("const int lane = threadIdx.x % 32;", True),
    ("const auto lane_id = thread_id % 32;", True),  # a thread index by another name
    ("const int lane = tid % 32;\nfor (int i = lane; i < n; i += 32) v += __shfl_xor_sync(m, x[i], 1);", True),
    ("const int warp = static_cast<int>(threadIdx.x) / 32;", True),
    ("if (tid < 32) {\n  s[tid] += s[tid + 32];\n}\n__syncthreads();", False),  # a tree step, then a barrier
    ("if ((blockSize >= 64) && (tid < 32)) s[tid] += s[tid + 32];\n\ncg::sync(cta);", False),
    ("if (tid < 32) {\n  v = s[tid] + s[tid + 32];\n  v += __shfl_down_sync(m, v, 16);\n}\n__syncthreads();", True),
    # in a function that does nothing warp-wide, 32 only lays out data: a 64-lane wavefront computes alike
    ("__global__ void fill(float* t) {\n  const int row = threadIdx.x / 32, col = threadIdx.x % 32;\n  t[row * 33 + col] = 0;\n}",
     False),
    ("__global__ void k(float* t) {\n  const int lane = threadIdx.x % 32;\n  t[lane] = __shfl_xor_sync(m, t[lane], 1);\n}", True),
    ("__global__ void k(float* t) {\n  const int lane = threadIdx.x % 32;\n  t[lane] = __shfl_xor_sync(m, t[lane], 1, 32);\n}",
     False),  # a shuffle of a named width of 32 keeps to its 32 lanes
    (("#define REDUCE(v) (v + __shfl_xor_sync(m, v, 1))\n__device__ float sum(float v) { return REDUCE(v); }\n"
      "__global__ void k(float* t) {\n  const int lane = threadIdx.x % 32;\n  t[lane] = sum(t[lane]);\n}"), True),  # via helpers
    ("__global__ void k(int* t) {\n  Exchange(s).BlockedToWarpStriped(v, v);\n  const int row = threadIdx.x / 32;\n}", True),
    # 32 and 31 in hex, however written
    ("const int lane = threadIdx.x & 0x1f;\nv = __shfl_xor_sync(m, v, 1);", True),
    ("const int lane = threadIdx.x & 0x01F;\nv = __shfl_xor_sync(m, v, 1);", True),
    ("const int lane = threadIdx.x % 0x20, warp = threadIdx.x / 0x20;\nv = __shfl_xor_sync(m, v, 1);", True),
    # warps per block on the host, in the grid of a kernel that works across a warp (one row per warp)
    (("#define BLOCK_SIZE 256\n__global__ void row_max(const float* x, float* y, int rows, int cols) {\n"
      "  const int row = blockIdx.x * (blockDim.x / warpSize) + threadIdx.x / warpSize;\n"
      "  float m = -INFINITY;\n"
      "  for (int c = threadIdx.x % warpSize; c < cols; c += warpSize) m = fmaxf(m, x[row * cols + c]);\n"
      "  for (int o = warpSize / 2; o > 0; o /= 2) m = fmaxf(m, __shfl_xor(m, o));\n"
      "  if (row < rows) y[row] = m;\n}\n"
      "void launch_row_max(const float* x, float* y, int rows, int cols) {\n"
      "  dim3 grid((rows + BLOCK_SIZE / 32 - 1) / (BLOCK_SIZE / 32));\n"
      "  row_max<<<grid, BLOCK_SIZE>>>(x, y, rows, cols);\n}"), True),
])
def test_warp_size_literal_follows_the_value(code, fires):
    assert any(f.rule == "warp-size-literal" for f in lint_text(code, "snippet.cu")) == fires


def test_an_intrinsic_the_file_polyfills_for_hip_is_not_missing():
    polyfill = "static __device__ __forceinline__ int __vsubss4(const int a, const int b) {\n  return a - b;\n}\n"
    calls = "__device__ int f(int a, int b) { return __vsubss4(a, b); }\n__device__ int g(int a) { return __dp4a(a, a, 0); }\n"
    for guard, lines in (("#ifdef USE_ROCM", [7]), ("#ifndef USE_ROCM", [6, 7])):  # the latter: CUDA's copy only
        code = f"{guard}\n{polyfill}#endif\n{calls}"
        assert [f.line for f in lint_text(code, "snippet.cu") if f.rule == "missing-intrinsic"] == lines, guard


def test_bf16_conversions_and_vector_atomics_name_what_hip_has():
    code = ("__device__ void store2(__nv_bfloat162* o, float a, float b) { *o = __floats2bfloat162_rn(a, b); }\n"
            "__device__ void acc(float* g, float a, float b) { atomicAdd((float2*) g, make_float2(a, b)); }\n")
    details = [f.detail for f in lint_text(code, "snippet.cu") if f.rule == "missing-intrinsic"]
    assert len(details) == 2
    assert "__float22bfloat162_rn(make_float2(a, b))" in details[0]
    assert "float2 / float4" in details[1] and "atomicAdd(&p->x, v.x)" in details[1]


def test_one_uninitialised_broadcast_is_one_finding_naming_each_shuffle():
    code = ("__global__ void claim(int* next, int* out) {\n"
            "  int slot;\n"
            "  if (threadIdx.x % warpSize == 0) slot = atomicAdd(next, 1);\n"
            "  slot = __shfl(slot, 0);\n"
            "  out[slot] = threadIdx.x;\n"
            "  if (threadIdx.x % warpSize == 0) slot = atomicAdd(next, 1);\n"
            "  slot = __shfl(slot, 0);\n"
            "  out[slot] = -1;\n}\n")
    found = [f for f in lint_text(code, "snippet.cu") if f.rule == "uninit-shuffle"]
    assert [(f.line, f.detail) for f in found] == [(2, "`slot` is broadcast from lane 0 at lines 4, 7")]


def test_a_place_two_checks_reach_is_one_finding():
    # two kernels each with their own per-warp array of one name: the second kernel's read is reached from both
    kernel = ("__global__ void {name}(const float* x, float* y) {{\n"
              "  __shared__ float partial[32];\n"
              "  const int lane = threadIdx.x % warpSize;\n"
              "  float v = x[threadIdx.x];\n"
              "  for (int o = warpSize / 2; o > 0; o /= 2) v += __shfl_xor(v, o);\n"
              "  if (lane == 0) partial[threadIdx.x / warpSize] = v;\n"
              "  __syncthreads();\n"
              "  if (threadIdx.x < warpSize) y[blockIdx.x] = partial[lane];\n}}\n")
    code = kernel.format(name="sum_rows") + kernel.format(name="sum_cols")
    lines = [f.line for f in lint_text(code, "snippet.cu") if f.rule == "lane-indexed-warp-array"]
    assert lines == [8, 17]


def test_each_calls_mask_names_the_declaration_of_its_own_function():
    code = ("__device__ float warp_max(float v) {\n"
            "  unsigned mask = 0xffffffffu;\n"
            "  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_down_sync(mask, v, o));\n"
            "  return v;\n}\n"
            "__device__ float warp_sum(float v) {\n"
            "  unsigned mask = 0xffffffffu;\n"
            "  for (int o = 16; o > 0; o >>= 1) v += __shfl_down_sync(mask, v, o);\n"
            "  return v;\n}\n")
    calls = {f.line: f.detail for f in lint_text(code, "snippet.cu") if f.rule == "mask-32bit" and "(line" in f.detail}
    assert calls == {3: "`mask` (line 2) is a 32-bit mask", 8: "`mask` (line 7) is a 32-bit mask"}


def test_a_warp_size_constant_squared_or_halved_into_rows_is_flagged_where_it_is_used():
    # `dev::kWarpSize` comes from another header (32 for CUDA, the wavefront's 64 in its HIP twin)
    code = ("#include \"dev/limits.hpp\"\n"
            "__global__ void pair_hits(const int* bits, int* out, int n) {\n"
            "  __shared__ int stage[dev::kWarpSize][dev::kWarpSize][16];\n"  # 64 KiB at 32 lanes, 256 KiB at 64
            "  __shared__ float tile[dev::kWarpSize][dev::kWarpSize];\n"  # 16 KiB at 64: fits
            "  for (int r = threadIdx.y; r < dev::kWarpSize; r += dev::kWarpSize / 2)\n"
            "    stage[threadIdx.y][r][threadIdx.x % 16] = bits[r];\n"
            "  for (int r = threadIdx.y; r < n; r += blockDim.y) out[r] = stage[0][r % 16][0];\n"
            "}\n"
            "void launch_pairs(const int* bits, int* out, int n, cudaStream_t s) {\n"
            "  dim3 threads(dev::kWarpSize, dev::kWarpSize);\n"
            "  dim3 rows(dev::kWarpSize, dev::max_warps / 2);\n"
            "  pair_hits<<<n, rows, 0, s>>>(bits, out, n);\n"
            "}\n")
    found = {f.line: f.detail for f in lint_text(code, "snippet.cu") if f.rule == "warp-size-define"}
    assert sorted(found) == [3, 5, 10], found
    assert "256 KiB" in found[3] and "2048 threads" in found[5] and "4096" in found[10]


@pytest.mark.parametrize("code", [
    "constexpr int kSubWarpSize = 16;\nvoid f() { dim3 b(kSubWarpSize, kSubWarpSize); }",  # a logical width of 16
    "void f() { dim3 b(WARP_SIZE, 1024 / WARP_SIZE); }",  # warps per block as rows
    "__shared__ float tile[WARP_SIZE][WARP_SIZE + 1];",  # a padded tile: 16.25 KiB at 64 lanes
    # a row loop stepping by a quarter: a block of warp_size x warp_size / 4 fits at 64 lanes (1024 threads)
    ("__global__ void k(float* x) {\n  for (int r = threadIdx.y; r < 64; r += warp_size / 4) x[r] = 0;\n}\n"
     "void f(float* x) { dim3 b(warp_size, warp_size / 4); k<<<1, b>>>(x); }"),
    # the rows are not warp-wide: a block 16 threads across
    ("__global__ void k(float* x) {\n  for (int r = threadIdx.y; r < 64; r += warp_size / 2) x[r] = 0;\n}\n"
     "void f(float* x) { dim3 b(16, 16); k<<<1, b>>>(x); }"),
])
def test_warp_size_uses_that_fit_a_wavefront_stay_quiet(code):
    assert [f for f in lint_text(code, "snippet.cu") if f.rule == "warp-size-define"] == []


def test_host_warp_size_flags_a_local_alias_where_it_is_set_and_no_member_of_its_name():
    code = ("dim3 block_dim_for(int cols) {\n  const int x = GPU_WARP_SIZE;\n  return dim3(x, cols / x);\n}\n"
            "int blocks(dim3 block_dim, int n) {\n  return n / block_dim.x;\n}\n")
    assert [f.line for f in lint_text(code, "snippet.cu") if f.rule == "host-warp-size"] == [2]


def test_strip_comments_keeps_lines_and_strings():
    text = 'a; // x\n/* two\nlines */ b = "//keep";\n'
    stripped = strip_comments(text)
    assert stripped.count("\n") == text.count("\n")
    assert '"//keep"' in stripped and "x" not in stripped.split("\n")[0]


@pytest.mark.parametrize(("expr", "value"), [
    ("kStages * (kBlockM + kBlockN) * kBlockK * sizeof(float)", 98304),
    ("96 * 1024u", 98304),
    ("(1 << 16) + 1", 65537),
    ("static_cast<size_t>(kBlockM) * 2", 256),
    ("smem_bytes", None),
    ("kBlockM / 0", None),
])
def test_evaluate_int(expr, value):
    constants = source_constants("constexpr int kBlockM = 128, kBlockN = 128;\n#define kBlockK 32\nconst int kStages = 3;")
    assert evaluate_int(expr, constants) == value


def test_findings_carry_severity_fix_and_source_line():
    finding = lint_text("int lane = threadIdx.x % 32;\n", "k.cu")[0]
    assert (finding.path, finding.line, finding.column, finding.severity) == ("k.cu", 1, 24, "error")
    assert finding.code == "int lane = threadIdx.x % 32;"
    assert "warpSize" in RULES_BY_ID[finding.rule].fix


def test_unknown_dynamic_shared_memory_is_a_warning():
    finding, = lint_file(CORPUS / "large_smem.cu")[-1:]
    assert finding.rule == "lds-limit" and finding.severity == "warning" and "smem_bytes" in finding.message


def _build_flag_file(tail_lines: int) -> str:
    """A header whose warp-size constant sits under `#ifdef WITH_CUDA`, followed by `tail_lines` lines of host code."""
    return ("#pragma once\n#ifdef WITH_CUDA\nconstexpr int kWarpSize = 32;\n"
            "__device__ float sum(float v) { return v + __shfl_xor_sync(0xffffffffu, v, 1); }\n#endif\n"
            + "".join(f"int host_{i}(int x) {{ return x + {i}; }}\n" for i in range(tail_lines)))


def test_a_hip_build_that_defines_cuda_arch_has_answered_its_guards():
    """Legion's first HIP build passed `-D__CUDA_ARCH__=600`: its `#ifdef __CUDA_ARCH__` device paths are AMD's, and
    no guard is flagged; the same file under plain hipcc is."""
    from tiletune.port.preprocessor import Build

    code = ("__device__ inline void add(double* p, double v) {\n#ifdef __CUDA_ARCH__\n  atomicAdd(p, v);\n#else\n"
            "  *p += v;\n#endif\n}\n")
    assert [f.line for f in lint_text(code, "redop.h") if f.rule == "cuda-arch-guard"] == [2]
    assert not [f for f in lint_text(code, "redop.h", build=Build(defined=frozenset({"__CUDA_ARCH__"})))
                if f.rule == "cuda-arch-guard"]


def _nest(outer: str, inner: str, outer_pragma: bool = True, inner_pragma: bool = True) -> str:
    """A kernel with two nested loops `for (k...; outer)` and `for (j...; inner)`, each under `#pragma unroll` or not."""
    def pragma(on: bool) -> str:
        return "#pragma unroll\n" if on else ""
    return ("__global__ void conv(float* y, const float* x, const float* w, int n, int m) {\n  float v = 0;\n"
            f"{pragma(outer_pragma)}  for (int k = 0; k < {outer}; ++k) {{\n"
            f"{pragma(inner_pragma)}    for (int j = 0; j < {inner}; ++j) v += w[k * 8 + j] * x[j];\n"
            "  }\n  y[threadIdx.x] = v;\n}\n")


@pytest.mark.parametrize(("code", "flagged"), [
    (_nest("n", "m"), [3]),  # both bounds at run time: the outer loop is not unrolled (clang 15, gfx90a)
    (_nest("n", "m", inner_pragma=False), []),  # the inner loop not unrolled: the outer one is
    (_nest("n", "4"), []),  # the inner one unrolled whole: the outer one is innermost again
    (_nest("8", "m"), []),  # a constant outer bound: unrolled whole
    (_nest("n", "m", outer_pragma=False), []),
    # bounds that are template parameters, named in an array parameter's extents (fast-hadamard-transform's
    # `float x[kNChunks][1 << kLogN]`): constants, not parameters
    ("template <int kLogN, int kN> __device__ void f(float x[kN][1 << kLogN]) {\n#pragma unroll\n"
     "  for (int i = 0; i < kLogN; ++i) {\n#pragma unroll\n    for (int j = 0; j < kLogN; ++j) x[0][i + j] += 1;\n  }\n}\n", []),
])
def test_unroll_of_a_loop_around_one_unrolled_at_run_time(code, flagged):
    """hip-clang warns 'loop not unrolled' for a `#pragma unroll` loop with a run-time bound around another one: the
    inner loop gets a remainder loop and the outer one is no longer innermost (the variants checked with clang 15
    for gfx90a; PyTorch's depthwise convolution dropped these pragmas under ROCm)."""
    assert [f.line for f in lint_text(code, "conv.cu") if f.rule == "unroll-unknown-trip"] == flagged


@pytest.mark.parametrize(("std", "fires"), [(11, False), (14, False), (17, True), (20, True)])
def test_register_is_flagged_where_the_hip_build_compiles_cxx17(std, fires):
    """clang rejects `register` from C++17 (hipcc's default) and only warns before: SHOC's HIP build compiles its
    `register float v0 = ...` kernels with `-std=c++11`."""
    code = "__global__ void add(float* x) {\n  register float v = x[threadIdx.x];\n  x[threadIdx.x] = v + 1;\n}\n"
    found = [f.line for f in lint_text(code, "flops.cu", build=Build(std=std)) if f.rule == "register-storage"]
    assert found == ([2] if fires else [])


@pytest.mark.parametrize(("tail_lines", "linted_inside"), [(0, True), (40, False)], ids=["whole-file", "one-block"])
def test_a_whole_file_under_a_cuda_build_flag_is_linted_as_the_port_will_compile_it(tail_lines, linted_inside):
    """`cuda-build-flag` asks to widen `#ifdef WITH_CUDA` to the HIP build: when it guards the whole file the code
    under it is linted too (its 32-lane constant and 32-bit mask); a block in a larger file may stay CUDA's, and is
    left alone."""
    from tiletune.port.preprocessor import Build

    rules = {f.rule for f in lint_text(_build_flag_file(tail_lines), "policy.hpp", build=Build(undefined=frozenset({"WITH_CUDA"})))}
    assert "cuda-build-flag" in rules
    assert ("warp-size-define" in rules) is linted_inside and ("mask-32bit" in rules) is linted_inside, rules


def test_device_code_under_the_pass_test_is_linted_and_under_a_version_test_is_not():
    """A 32-lane scan under `#ifdef __CUDA_ARCH__` (the device pass, which the port keeps as `__HIP_DEVICE_COMPILE__`)
    is flagged along with the guard (and the 32-bit mask parameter); under `#if __CUDA_ARCH__ >= 800` AMD compiles it
    out, so only the guard is."""
    body = ("__device__ int scan(int x, unsigned mask) {\n{guard}\n  unsigned lane = threadIdx.x & 0x1f;\n"
            "  int y = __shfl_up_sync(mask, x, 1);\n  if (lane >= 1) x += y;\n#endif\n  return x;\n}\n")
    found = {(f.line, f.rule) for f in lint_text(body.replace("{guard}", "#ifdef __CUDA_ARCH__"), "scan.cuh")}
    assert found == {(1, "mask-32bit"), (2, "cuda-arch-guard"), (3, "warp-size-literal"), (4, "mask-32bit")}
    found = {(f.line, f.rule) for f in lint_text(body.replace("{guard}", "#if __CUDA_ARCH__ >= 800"), "scan.cuh")}
    assert found == {(2, "cuda-arch-guard")}


SCAN_BLOCK = """template <typename T>
__device__ void warpScan(T* c, unsigned i, unsigned mask) {
  T x = c[i];
  for (int offset = 1; offset < warpSize; offset <<= 1) {
    T y = __shfl_up_sync(mask, x, offset);
    if ((threadIdx.x % warpSize) >= offset) x += y;
  }
  c[i] = x;
}
template <typename T>
__device__ void blockScan(T* c, unsigned size, T* ws) {
  auto first = threadIdx.x, laneId = threadIdx.x % warpSize;
  for (auto i = first; i < size; i += blockDim.x) {
    warpScan(c, i, 0xffffffffu);
    auto warpId = i / 32;
    if (31 == laneId) ws[warpId] = c[i];
  }
  __syncthreads();
  if (threadIdx.x < 32)
    warpScan(ws, threadIdx.x, 0xffffffffu);
  __syncthreads();
  for (auto j = first; j * 32 < size; j += blockDim.x) c[j * 32] += ws[j];
}
"""


def test_a_thread_index_under_another_name_a_last_lane_test_and_a_warp_call_under_a_barrier_are_warp_arithmetic():
    """`auto first = threadIdx.x; for (auto i = first; ...) i / 32` is a warp id; `31 == lane` picks the last of 32
    lanes; `if (threadIdx.x < 32) warpScan(...); __syncthreads();` runs a warp-level function of the file, no tree
    step. `j * 32` on the same alias lays out data: not flagged."""
    found = {(f.line, f.rule) for f in lint_text(SCAN_BLOCK, "scan.cuh") if f.rule == "warp-size-literal"}
    assert found == {(15, "warp-size-literal"), (16, "warp-size-literal"), (19, "warp-size-literal")}


def test_directives_between_a_return_type_and_the_name_are_no_part_of_the_type():
    """ELPA writes `__global__ void` in both branches of an `#ifdef` (one with `__launch_bounds__`) before the kernel's
    name: a void function, not one returning `endif`; a non-void one written the same way is still flagged."""
    code = ("template <typename T, unsigned int blk>\n#ifdef WITH_HIPCUB\n__global__ void\n__launch_bounds__(blk)\n#else\n"
            "__global__ void\n#endif\nkernel(T* q)\n{\n  q[threadIdx.x] = 0;\n}\n"
            "#if defined(USE_FAST)\n__device__ float\n#else\n__device__ double\n#endif\nhalf_of(float x)\n{\n  x *= 0.5f;\n}\n")
    assert [(f.line, f.rule) for f in lint_text(code, "k.cu")] == [(20, "missing-return")]
