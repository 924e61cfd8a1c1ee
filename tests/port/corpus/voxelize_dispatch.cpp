// hip-build: -D WITH_ROCM -U WITH_CUDA
// The dispatcher of a point-cloud voxelisation extension: the CUDA kernels are declared and called only under the
// project's own WITH_CUDA flag, which its ROCm build (setup.py: WITH_ROCM) does not define.
#include <torch/extension.h>

#ifdef WITH_CUDA  // expect: cuda-build-flag
int hard_voxelize_gpu(const at::Tensor& points, at::Tensor& voxels, int max_points);
#endif

#if defined(WITH_CUDA) || defined(WITH_ROCM)
int dynamic_voxelize_gpu(const at::Tensor& points, at::Tensor& coors);
#endif

#ifdef WITH_CUDA_NO_ATOMICS
// a fallback the build opts into: off is the normal case
#endif

int hard_voxelize(const at::Tensor& points, at::Tensor& voxels, int max_points) {
  if (points.device().is_cuda()) {
#ifdef WITH_CUDA  // expect: cuda-build-flag
    return hard_voxelize_gpu(points, voxels, max_points);
#else
    AT_ERROR("Not compiled with GPU support");
#endif
  }
  return 0;
}

int dynamic_voxelize(const at::Tensor& points, at::Tensor& coors) {
#if defined(WITH_CUDA) || defined(WITH_ROCM)
  if (points.device().is_cuda()) return dynamic_voxelize_gpu(points, coors);
#endif
  return 0;
}
