// The seam that decides what growth does with the memory a workspace moves away from.
// Private to scratch/ and the testing layer.
//
// Graph-safe scratch keeps every outgrown block for the life of the process (a captured
// CUDA graph may still point at it) and grows a grow-in-place workspace at its tail
// where the reservation allows: the default policy, the only one production code uses.
// The testing layer (testing/scratch_free_on_growth.cc) installs one that moves the
// workspace on every growth and gives the outgrown block back at once, re-creating the
// bug this module exists to prevent, so that tests can show they detect a graph that
// replays into freed memory.
#pragma once

#include <cstddef>
#include <functional>

namespace jax_vmm::scratch::internal {

// A block a workspace has just moved away from.
struct OutgrownBlock {
  int device = 0;
  size_t bytes = 0;  // physical bytes it holds
  // Gives those bytes back now. A VMM block keeps its virtual range reserved (reading
  // zeros, writes fault), so a stale writer faults instead of landing in reused memory.
  std::function<void()> release;
};

class GrowthPolicy {
 public:
  virtual ~GrowthPolicy() = default;
  // False: every growth moves the workspace to a new, exactly-sized block.
  virtual bool GrowsInPlace() const = 0;
  // True: the block stays allocated (a retired block). False: the policy gave its memory
  // back with block.release() (a freed block).
  virtual bool Retire(const OutgrownBlock& block) const = 0;
};

// Installs `policy` for every growth from now on; nullptr restores the default. The
// caller keeps the policy alive while it is installed. Thread-safe (the table lock).
void SetGrowthPolicy(const GrowthPolicy* policy);
// The installed policy, nullptr for the default.
const GrowthPolicy* InstalledGrowthPolicy();

}  // namespace jax_vmm::scratch::internal
