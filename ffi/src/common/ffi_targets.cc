#include "common/ffi_targets.h"

namespace jax_vmm {
std::vector<FfiTarget>& FfiTargets() {
  static std::vector<FfiTarget> targets;  // filled by static registrars before main
  return targets;
}
}  // namespace jax_vmm
