// Kernel traits of a block-scan kernel: tile sizes and the shared memory of its CUB primitives.
#pragma once

#include <algorithm>
#include <cub/block/block_load.cuh>
#include <cub/block/block_scan.cuh>
#include <cub/block/block_store.cuh>
#include <cuda/std/type_traits>  // expect: libcudacxx

template <int kNThreads_, int kNItems_, typename input_t_>
struct ScanTraits {
    using input_t = input_t_;
    static constexpr int kNThreads = kNThreads_;
    static constexpr int kNItems = kNItems_;
    static constexpr int kNBytes = sizeof(input_t);
    static constexpr int kNElts = kNBytes == 4 ? 4 : std::min(8, kNItems);  // expect: constexpr-std-minmax
    static constexpr int kNLoads = kNItems / kNElts;
    using BlockLoadT = cub::BlockLoad<input_t, kNThreads, kNItems, cub::BLOCK_LOAD_WARP_TRANSPOSE>;
    using BlockStoreT = cub::BlockStore<input_t, kNThreads, kNItems, cub::BLOCK_STORE_WARP_TRANSPOSE>;
    using BlockScanT = cub::BlockScan<float, kNThreads>;
    static constexpr int kSmemIOSize = std::max({sizeof(typename BlockLoadT::TempStorage),  // expect: constexpr-std-minmax
                                                 sizeof(typename BlockStoreT::TempStorage)});
    static constexpr int kSmemSize = kSmemIOSize + sizeof(typename BlockScanT::TempStorage);
    using value_t = cuda::std::remove_cv_t<input_t>;  // the include above is the one place to fix
};

// The block's running prefix through the traits' CUB scan, built as a temporary.
template <typename Ktraits>
__device__ float block_prefix(typename Ktraits::BlockScanT::TempStorage& storage, float value) {
    float total;
    Ktraits::BlockScanT(storage).InclusiveSum(value, value, total);  // expect: dependent-template-name
    typename Ktraits::BlockScanT(storage).InclusiveSum(value, value, total);
    return total;
}

// A vector cast through a static member template of a class template named by the parameters.
template <typename To, typename From>
struct VecCast {
    template <int N>
    __device__ static void cast(To* dst, const From* src) {
        for (int i = 0; i < N; ++i) dst[i] = static_cast<To>(src[i]);
    }
};

template <typename From, typename To, int N>
__device__ void cast_tile(To* dst, const From* src) {
    VecCast<To, From>::cast<N>(dst, src);  // expect: dependent-template-name
    VecCast<To, From>::template cast<N>(dst, src);
}

// Host code: std::max outside a constexpr initialiser is fine.
inline int launch_chunks(int seqlen, int chunk) { return std::max(1, (seqlen + chunk - 1) / chunk); }
