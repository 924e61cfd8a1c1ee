// A run-time compiled elementwise kernel: NVRTC builds it, a cache keeps the result, the driver API loads it.
#include <cuda.h>
#include <nvrtc.h>

#include <fstream>
#include <iostream>
#include <string>
#include <vector>

class JitKernel {
 public:
  void set(const char* name, const char* image) {  // kept for reloading: copied up to the first NUL
    name_ = name;
    image_ = image;
    cuModuleLoadData(&module_, image_.data());
    cuModuleGetFunction(&function_, module_, name_.c_str());
  }

 private:
  std::string name_, image_;
  CUmodule module_ = nullptr;
  CUfunction function_ = nullptr;
};

bool compile_map(const std::string& source, const std::string& name, std::string* image_out, bool verbose) {
  nvrtcProgram program;
  nvrtcCreateProgram(&program, source.c_str(), "map.cu", 0, nullptr, nullptr);
  if (nvrtcCompileProgram(program, 0, nullptr) != NVRTC_SUCCESS) return false;
  size_t size;
  nvrtcGetPTXSize(program, &size);
  std::vector<char> buffer(size);
  char* ptx = &buffer[0];  // expect: code-object-text
  nvrtcGetPTX(program, ptx);
  nvrtcDestroyProgram(&program);
  if (verbose) std::cout << ptx << std::endl;  // expect: code-object-text
  *image_out = ptx;  // expect: code-object-text
  return true;
}

void save_to_cache(const std::string& path, const std::string& ptx) {
  std::ofstream cache(path, std::ios::binary);
  cache.write(ptx.c_str(), ptx.size());  // with its size: every byte kept
}

JitKernel build(const std::string& source, const std::string& name) {
  std::string ptx;
  compile_map(source, name, &ptx, false);
  save_to_cache(name + ".ptx", ptx);
  JitKernel kernel;
  kernel.set(name.c_str(), ptx.c_str());  // expect: code-object-text
  return kernel;
}
