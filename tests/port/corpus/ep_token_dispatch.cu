// Expert-parallel token dispatch over NVSHMEM: one warp per destination rank copies its tokens to the peer's
// receive buffer, bumps the peer's counter, and waits for the peer's answer with a cycle-count timeout.
#include <cstdint>
#include <nvshmem.h>  // expect: nvshmem
#include <nvshmemx.h>  // expect: nvshmem

constexpr long long kTimeoutCycles = 20000000000ll;

__device__ __forceinline__ int warp_sum(int v) {
  for (int offset = 16; offset > 0; offset /= 2) v += __shfl_xor_sync(0xffffffffu, v, offset);  // expect: warp-lane-loop, mask-32bit
  return v;
}

__global__ void dispatch(const int4* tokens, int4* recv, int64_t* recv_count, const int* dest, int num_tokens,
                         int hidden_int4, int rank) {
  const auto thread_id = static_cast<int>(threadIdx.x);
  const auto lane_id = thread_id % 32, warp_id = thread_id / 32;  // expect: warp-size-literal
  const int num_threads_per_rank = 32 * num_warps_per_rank();  // expect: warp-size-literal
  const int dst_rank = warp_id;
  int sent = 0;
  for (int i = lane_id; i < num_tokens; i += 32) {  // expect: warp-size-literal
    if (dest[i] != dst_rank) continue;
    nvshmem_int_put_nbi(reinterpret_cast<int*>(recv + i * hidden_int4),  // expect: nvshmem
                        reinterpret_cast<const int*>(tokens + i * hidden_int4), hidden_int4 * 4, dst_rank);
    ++sent;
  }
  sent = warp_sum(sent);
  if (lane_id == 0) nvshmemx_signal_op(reinterpret_cast<uint64_t*>(recv_count + rank), sent, NVSHMEM_SIGNAL_ADD, dst_rank);  // expect: nvshmem
  const auto start = clock64();  // expect: device-clock
  while (lane_id == 0 && atomicAdd(reinterpret_cast<unsigned long long*>(recv_count + dst_rank), 0ull) == 0) {
    if (clock64() - start > kTimeoutCycles) __trap();  // expect: device-clock
  }
  nvshmemx_barrier_all_block();  // expect: nvshmem
  (void)num_threads_per_rank;
}

void launch_dispatch(const int4* tokens, int4* recv, int64_t* count, const int* dest, int n, int hidden, int rank,
                     int ranks, cudaStream_t stream) {
  SETUP_LAUNCH_CONFIG(1, 32, stream);  // expect: block-32-threads
  dispatch<<<1, 32 * ranks, 0, stream>>>(tokens, recv, count, dest, n, hidden, rank);
}
