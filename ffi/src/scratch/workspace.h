// One graph-safe scratch workspace (see jax_vmm/scratch.h for the contract). Private to
// scratch/.
//
// A workspace starts empty; its first growth picks the strategy:
//   grow-in-place: a Driver reservation; each growth maps one new allocation of exactly
//                  the added bytes at the tail (one create, one map, one set-access: a
//                  workspace is only ever given back whole, so nothing needs finer
//                  handles), so the address never changes;
//   retire:        one exactly-sized block (a Driver range where the device has VMM, else
//                  a plain allocation); a larger one replaces it.
// What happens to a block the workspace moves away from is the growth policy's call
// (growth_policy.h): by default it is retired, kept for the life of the process.
//
// Thread-safety: none by itself; the workspace table's mutex guards every call.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "jax_vmm/driver.h"
#include "jax_vmm/scratch.h"
#include "scratch/device_platform.h"
#include "scratch/growth_policy.h"

namespace jax_vmm::scratch::internal {

class Workspace {
 public:
  Workspace(int device, uintptr_t stream, int64_t generation, const DevicePlatform& platform);

  void* ptr() const { return reinterpret_cast<void*>(stats_.address); }
  size_t capacity() const { return stats_.capacity; }
  WorkspaceStats& stats() { return stats_; }
  const WorkspaceStats& stats() const { return stats_; }

  // Makes at least `bytes` usable; an error message, or "" on success. Never called
  // under stream capture.
  std::string GrowTo(size_t bytes, ScratchMode requested, size_t reserve_bytes,
                     const GrowthPolicy& policy);

 private:
  // One allocation mapped in a range.
  struct Piece {
    PhysicalHandle handle = 0;
    size_t bytes = 0;
  };
  // A virtual range with allocations mapped back to back from its start.
  struct Range {
    uintptr_t va = 0;
    size_t reserved = 0;
    size_t mapped = 0;          // bytes mapped from va (the sum of the pieces)
    std::vector<Piece> pieces;  // in address order
  };

  std::string ChooseMode(ScratchMode requested);
  std::string MapChunks(Range& range, size_t want_chunks);
  void ReleaseChunks(Range& range) noexcept;
  std::string NewRange(size_t reserve, size_t want_chunks, Range* out);
  std::string GrowRange(size_t bytes, size_t reserve_bytes, const GrowthPolicy& policy);
  std::string GrowPlain(size_t bytes, const GrowthPolicy& policy);
  void Outgrow(const OutgrownBlock& block, const GrowthPolicy& policy);

  const DevicePlatform& platform_;
  WorkspaceStats stats_;
  std::unique_ptr<Driver> driver_;  // null: no VMM on this device (plain retire blocks)
  Range current_;
  std::vector<Range> outgrown_;  // retired (still mapped) or freed (virtual range kept)
};

}  // namespace jax_vmm::scratch::internal
