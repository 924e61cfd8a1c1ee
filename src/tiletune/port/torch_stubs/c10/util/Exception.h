// tiletune syntax-level stub of c10/util/Exception.h (see torch_stubs/README.md)
#pragma once
#define TORCH_CHECK(COND, ...) do { if (!(COND)) { throw 0; } } while (0)
#define TORCH_INTERNAL_ASSERT(COND, ...) TORCH_CHECK(COND)
#define AT_ERROR(...) throw 0
