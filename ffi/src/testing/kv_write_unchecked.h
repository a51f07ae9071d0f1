// The token policy of the unchecked kv_write variant (testing_targets.h): padding is
// still skipped, every other slot is written, wherever it points.
#pragma once

#include <cstdint>

#include "ops/kv_write/kv_write.h"

namespace jax_vmm::testing {

struct UncheckedTokens {
  static JAX_VMM_HD int32_t Check(int32_t slot, const kv::Params&, const kv::Side&) {
    return slot < 0 ? kv::kPadding : kv::kValid;
  }
};

}  // namespace jax_vmm::testing
