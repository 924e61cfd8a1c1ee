// tiletune syntax-level stub of torch/extension.h (see torch_stubs/README.md): host-side declarations only
#pragma once
#include "ATen/ATen.h"
#define TORCH_LIBRARY(ns, m) static void tiletune_torch_library_##ns(int& m)
#define PYBIND11_MODULE(name, m) static void tiletune_pybind11_module_##name(int& m)
