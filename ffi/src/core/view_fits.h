// The size check of Arena.view: shared by the production view binding and the testing
// layer's legacy views, which live in different extension modules.
#pragma once

#include <cstdint>
#include <vector>

#include "jax_vmm/arena.h"

namespace jax_vmm {

// Throws InvalidArgument unless `shape` of `bits`-bit elements fits in buffer b.
void CheckViewFits(const BufferInfo& b, const std::vector<size_t>& shape, uint8_t bits);

}  // namespace jax_vmm
