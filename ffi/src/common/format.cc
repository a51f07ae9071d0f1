#include "common/format.h"

#include <cinttypes>
#include <cstdio>

namespace jax_vmm {

std::string Hex(uint64_t value) {
  char buf[24];
  std::snprintf(buf, sizeof(buf), "0x%" PRIx64, value);
  return buf;
}

std::string Bytes(size_t n) { return std::to_string(n) + " bytes"; }

std::string ShapeString(const int64_t* dims, size_t rank) {
  std::string s = "(";
  for (size_t i = 0; i < rank; ++i) s += (i ? ", " : "") + std::to_string(dims[i]);
  return s + (rank == 1 ? ",)" : ")");
}

}  // namespace jax_vmm
