// tiletune syntax-level stub of ATen/hip/Exceptions.h (see torch_stubs/README.md)
#pragma once
#include "c10/hip/HIPException.h"
