// Backward pass of a tile-based gaussian splatting rasterizer: per-pixel colour gradients are summed over the
// gaussians each warp touched, one atomic per gaussian. Uses cooperative-groups APIs HIP lacks and standard-library
// members hip-clang refuses in device code.
#include <array>
#include <cooperative_groups.h>
#include <cooperative_groups/reduce.h>  // expect: cg-missing-api

namespace cg = cooperative_groups;

struct Distortion {
    std::array<float, 6> poly;  // k0..k5 of the radial model
};

struct Radial {
    float dpoly[5];

    __host__ __device__ explicit Radial(const Distortion& dist) {
        for (int i = 1; i < 6; ++i) {
            dpoly[i - 1] = i * dist.poly.at(i);  // expect: device-std-throw
        }
    }
};

template <int N>
struct Shape {
    __host__ __device__ static int64_t elements() {
        constexpr auto dims = std::array{N, 3};  // expect: device-ctad
        return dims[0] * dims[1];
    }
};

__device__ float warp_sum(cg::thread_block_tile<32> warp, float v) {
    return cg::reduce(warp, v, cg::plus<float>());  // expect: cg-missing-api
}

__global__ void splat_backward(const int32_t* ids, const float* grad_pixels, float* grad_colors, int n_pixels) {
    auto block = cg::this_thread_block();
    auto warp = cg::tiled_partition<32>(block);
    int pixel = blockIdx.x * blockDim.x + threadIdx.x;
    float g = pixel < n_pixels ? grad_pixels[pixel] : 0.f;
    int32_t gaussian = pixel < n_pixels ? ids[pixel] : -1;
    auto same = cg::labeled_partition(warp, gaussian);  // expect: cg-missing-api
    float total = cg::reduce(same, g, cg::plus<float>());  // expect: cg-missing-api
    if (same.thread_rank() == 0 && gaussian >= 0) {
        atomicAdd_block(&grad_colors[gaussian], total);  // expect: missing-intrinsic
    }
}
