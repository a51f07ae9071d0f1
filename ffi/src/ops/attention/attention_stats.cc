#include "ops/attention/attention_stats.h"

namespace jax_vmm::attention {

Counters& GetCounters() {
  static Counters counters;
  return counters;
}

}  // namespace jax_vmm::attention
