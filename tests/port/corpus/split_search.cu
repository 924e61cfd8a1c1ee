// Gradient-boosted tree split search: one warp per feature scans its histogram bins and keeps the best gain with a
// CUB warp arg-max; a grid-stride pass clears the per-node buffers. Written for 32-lane warps.
#include <cub/cub.cuh>

template <typename T, typename I>  // expect: device-link
__device__ T quantile(const T* values, const I* order, I n, double q);  // defined in quantile.cu

template <int kBlockSize>
__global__ void best_split(const float* gains, int n_bins, int* best_bin, float* best_gain) {
    static_assert(
        kBlockSize == 32,  // expect: warp-size-assert
        "one block is one warp: the arg-max below reduces block_size == warp_size lanes");
    using ArgMax = cub::WarpReduce<cub::KeyValuePair<int, float>>;
    __shared__ typename ArgMax::TempStorage storage;
    float gain = threadIdx.x < n_bins ? gains[blockIdx.x * n_bins + threadIdx.x] : -1.f;
    auto best = ArgMax(storage).Reduce({threadIdx.x, gain}, cub::ArgMax());  // expect: builtin-index-narrowing
    if (threadIdx.x == 0) {
        best_bin[blockIdx.x] = best.key;
        best_gain[blockIdx.x] = best.value;
    }
}

__global__ void clear_nodes(float* sums, int nodes, int width) {
    for (auto node = blockIdx.y; node < nodes; node += gridDim.y) {  // expect: auto-builtin-index
        for (int i = threadIdx.x; i < width; i += blockDim.x) {
            sums[node * width + i] = 0.f;
        }
    }
}

__global__ void node_quantile(const float* values, const int* order, int n, float* out) {
    dim3 at{threadIdx.x, blockIdx.x, 0};
    out[at.y] = quantile(values, order, n, 0.5);
}

// histogram prefix sums: the block-wide scan lives in the project's algorithms header
__global__ void bin_offsets(const double* counts, double* offsets, int n_bins) {
    __shared__ double warp_partials[32];  // expect: warp-buffer-passed-on
    double count = threadIdx.x < n_bins ? counts[blockIdx.x * n_bins + threadIdx.x] : 0.0;
    double offset = BlockExclusivePrefixSum<double>(count, warp_partials);
    if (threadIdx.x < n_bins) {
        offsets[blockIdx.x * n_bins + threadIdx.x] = offset;
    }
}

__global__ void report_best(const float* best_gain, int nodes) {
    if (threadIdx.x == 0 && blockIdx.x == 0) {
        std::printf("best gain of node 0: %f of %d\n", best_gain[0], nodes);  // expect: device-std-printf
    }
}
