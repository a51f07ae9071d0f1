// Formatting shared by the error messages of every layer: addresses, byte counts, shapes.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

namespace jax_vmm {

// "0x7f12a0000000".
std::string Hex(uint64_t value);

// "4096 bytes".
std::string Bytes(size_t n);

// "(2, 16, 8)"; a rank-1 shape reads "(4,)" like a Python tuple, rank 0 "()".
std::string ShapeString(const int64_t* dims, size_t rank);

}  // namespace jax_vmm
