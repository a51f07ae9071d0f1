// Emulation of the bug graph-safe scratch exists to prevent (the seed's per-stream
// workspace): every growth moves the workspace to a new block and frees the outgrown one
// at once, in both modes. Tests turn it on to show that they detect a captured graph that
// replays into freed memory. A freed VMM block keeps its virtual range reserved
// (read-only zeros): a stale write faults instead of landing in memory something else
// reused. Installed through scratch/growth_policy.h. Thread-safe.
#pragma once

namespace jax_vmm::testing {

void SetScratchFreeOnGrowth(bool enabled);
bool ScratchFreeOnGrowth();

}  // namespace jax_vmm::testing
