#include "testing/scratch_free_on_growth.h"

#include "scratch/growth_policy.h"

namespace jax_vmm::testing {
namespace {

class FreeOnGrowth final : public scratch::internal::GrowthPolicy {
 public:
  bool GrowsInPlace() const override { return false; }
  bool Retire(const scratch::internal::OutgrownBlock& block) const override {
    block.release();  // graphs captured before the growth may still point here
    return false;
  }
};

const FreeOnGrowth& Policy() {
  static const FreeOnGrowth policy;
  return policy;
}

}  // namespace

void SetScratchFreeOnGrowth(bool enabled) {
  scratch::internal::SetGrowthPolicy(enabled ? &Policy() : nullptr);
}

bool ScratchFreeOnGrowth() { return scratch::internal::InstalledGrowthPolicy() == &Policy(); }

}  // namespace jax_vmm::testing
