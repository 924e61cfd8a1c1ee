// A JIT for elementwise expressions: the kernel source is generated at run time and compiled by NVRTC for the
// device the process runs on, then loaded with the driver API.
#include <cuda.h>
#include <cuda_runtime.h>
#include <nvrtc.h>

#include <stdexcept>
#include <string>
#include <vector>

static void check(nvrtcResult result) {
  if (result != NVRTC_SUCCESS) throw std::runtime_error(nvrtcGetErrorString(result));
}

CUmodule compile_elementwise(const std::string& source, const std::string& name) {
  nvrtcProgram program;
  check(nvrtcCreateProgram(&program, source.c_str(), name.c_str(), 0, nullptr, nullptr));
  int device = 0;
  cudaGetDevice(&device);
  cudaDeviceProp prop;
  cudaGetDeviceProperties(&prop, device);
  std::vector<std::string> options = {"--std=c++17"};
  options.push_back("--device-as-default-execution-space");  // expect: nvrtc-option
  options.push_back("--use_fast_math");  // expect: nvrtc-option
  options.push_back("-arch=compute_" + std::to_string(prop.major * 10 + prop.minor));  // expect: nvrtc-option
  std::vector<const char*> flags;
  for (const std::string& option : options) flags.push_back(option.c_str());
  check(nvrtcCompileProgram(program, static_cast<int>(flags.size()), flags.data()));
  size_t size = 0;
  check(nvrtcGetPTXSize(program, &size));
  std::vector<char> image(size);
  check(nvrtcGetPTX(program, image.data()));
  check(nvrtcDestroyProgram(&program));
  CUmodule module;
  if (cuModuleLoadData(&module, image.data()) != CUDA_SUCCESS) throw std::runtime_error("cannot load " + name);
  return module;
}
