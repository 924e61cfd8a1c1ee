// A warp-level top-k in the style of CTC beam decoders: each lane keeps a sorted buffer, a filtered variant
// stages candidates and merges them when full. Shared-memory sizes are computed on the host from the same
// constexpr helpers the kernels use.
#pragma once
#include <cstddef>

namespace topk {

template <typename I>
constexpr __device__ I log2_floor(I n, I acc = I(0)) {
  return n <= 1 ? acc : log2_floor(n / 2, acc + 1);
}

template <typename I>
constexpr inline __device__ I round_up_256(I n) {
  return (n + 255) / 256 * 256;
}

template <int Capacity, typename T>
struct lane_sorter {
  static constexpr int kLevels = log2_floor(Capacity);  // expect: constexpr-device-only
  T vals[Capacity];

  template <int Len>
  __device__ void merge_in(const T* incoming) {
#pragma unroll
    for (int i = 0; i < Len; ++i) {
      if (incoming[i] > vals[Capacity - 1]) vals[Capacity - 1] = incoming[i];
    }
  }
};

template <int Capacity, int Buffer, typename T>
struct filtered_sorter : public lane_sorter<Capacity, T> {
  T staged[Buffer];
  int count = 0;

  __device__ void add(T v) {
    staged[count++] = v;
    if (count == Buffer) {
      this->merge_in<Buffer>(staged);  // expect: dependent-template-name
      count = 0;
    }
  }
};

template <typename T>
size_t staging_bytes(int rows, int buffer) {
  return round_up_256(rows * buffer * sizeof(T));  // expect: constexpr-device-only
}

}  // namespace topk
