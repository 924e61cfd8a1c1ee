// A GPU hash cache of slabs: a warp-sized tile probes one slab, the first lane whose key matches answers, and a
// counter hands out insertion slots; the launcher was written in a Windows editor that spaced its chevrons. Holds
// the C++ nvcc takes and hipcc refuses, next to the forms both take.
#include <cooperative_groups.h>
#include <cstdint>

namespace cg = cooperative_groups;

struct Probe {
    const uint64_t* keys;
    const float* values;
    float* out;
    int slots;
};

__forceinline__ __device__ unsigned long atomicAdd(unsigned long* address, unsigned long val) {  // expect: hip-builtin-redefinition
    return (unsigned long)atomicAdd((unsigned long long*)address, (unsigned long long)val);
}

__device__ unsigned long long atomicAdd(long long* address, long long val) {  // HIP has no such overload: kept
    return atomicAdd((unsigned long long*)address, (unsigned long long)val);
}

__global__ void lookup(const __grid_constant__ Probe probe, const uint64_t* queries, int n) {  // expect: grid-constant
    int q = blockIdx.x;
    if (q >= n) return;
    uint64_t key = queries[q];
    unsigned lane = threadIdx.x & 31;  // expect: warp-size-literal
    bool hit = lane < probe.slots && probe.keys[lane] == key;
    int found = __ffs(__ballot_sync(0xffffffffu, hit)) - 1;  // expect: ffs-ballot, mask-32bit, popc-32bit
    if (found >= 0 && lane == 0) probe.out[q] = probe.values[found];
}

__global__ void reserve(unsigned long* counter, unsigned long* slots, int n) {
    auto tile = cg::tiled_partition<32>(cg::this_thread_block());  // expect: warp-tile-32
    size_t position;  // expect: uninit-shuffle
    if (tile.thread_rank() == 0) position = atomicAdd(counter, 32ul);
    position = tile.shfl(position, 0);
    size_t base = 0;  // initialised: every lane holds a value before the broadcast
    if (tile.thread_rank() == 0) base = position;
    base = tile.shfl(base, 0);
    if (base + tile.thread_rank() < n) slots[base + tile.thread_rank()] = position;
}

__device__ float3 project_grad(float2 v, int2 size) {
    float3 partial = {0.5f * size.x * v.x, 0.5f * size.y * v.y};  // expect: vector-partial-init
    float3 whole = {0.5f * size.x * v.x, 0.5f * size.y * v.y, 0.f};
    float4 broadcast{1.f};  // direct-initialisation: HIP's explicit one-value constructor takes it
    return make_float3(partial.x + whole.x, partial.y + whole.y, broadcast.z);
}

void launch(const Probe& probe, const uint64_t* queries, int n, cudaStream_t stream) {
    lookup << <n, 32, 0, stream >> > (probe, queries, n);  // expect: spaced-kernel-launch
    lookup<<<n, 32, 0, stream>>>(probe, queries, n);  // expect: block-32-threads
    int shifted = n << 2;  // a shift, not a launch
    (void)shifted;
}
