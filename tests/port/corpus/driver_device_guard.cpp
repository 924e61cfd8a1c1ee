// A torch extension's device guard that asks the CUDA driver which device the thread's context is on, loading the
// driver library lazily so that CPU-only installs never need it.
#include <dlfcn.h>
#include <stdexcept>
#include <string>

#include <cuda.h>
#include <cuda_runtime.h>

typedef CUresult (*GetDeviceFn)(CUdevice* device);
static void* driver = nullptr;
static GetDeviceFn get_device = nullptr;

static void load_driver() {
  driver = dlopen("libcuda.so.1", RTLD_LAZY);  // expect: cuda-library-dlopen
  if (!driver) throw std::runtime_error("cannot load the CUDA driver");
  get_device = (GetDeviceFn)dlsym(driver, "cuCtxGetDevice");  // expect: cuda-library-dlopen
  if (!get_device) throw std::runtime_error("cannot find cuCtxGetDevice");
}

int current_device_or(int fallback) {
  if (!driver) load_driver();
  CUdevice device;
  if (get_device(&device) != CUDA_SUCCESS) return fallback;
  return static_cast<int>(device);
}
