// MemoryBudget: one cap on the physical memory that several arenas of one device hold.
//
// An arena that joined a budget takes every new physical allocation from it before the
// driver creates the memory, and gives it back after the driver released it (the charge
// is owned by the allocation, core/arena_internal.h Arena::Mapping). So what the budget
// counts is what the arenas hold: backed + parked + retired (released, waiting for the
// device), on every path that creates memory (commit, commit ahead, prefetch, wake,
// restore). Host staging memory (sleep images, offloaded contents) is not device memory
// and is not counted.
//
// A charge past the cap throws BudgetExceeded before any driver call. An arena that hits
// the cap first takes back the memory that deferred releases still hold, its own and the
// other members' (waiting for the device, Arena::ReclaimForBudget), and tries once more.
//
// Thread-safety: every method may be called from any thread. One mutex guards the
// counters and the member list; it is a leaf lock (held across no driver call, no arena
// lock taken under it), so a charge or uncharge from an arena's commit, reclaimer thread
// or destructor never waits for another arena.
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "jax_vmm/errors.h"

namespace jax_vmm {

class Arena;
class MemoryBudget;

// A commit (or wake, or restore) would take a budget past its cap. Nothing changed.
// -> jax_vmm.OutOfMemoryError, without the JAX allocator hint (the cap is the user's).
class BudgetExceeded : public OutOfMemory {
 public:
  using OutOfMemory::OutOfMemory;
};

// Bytes taken from a budget by one arena; given back on destruction. Move-only. An empty
// charge (no budget) is free to make, split and destroy.
class BudgetCharge {
 public:
  BudgetCharge() = default;
  ~BudgetCharge();
  BudgetCharge(BudgetCharge&& other) noexcept;
  BudgetCharge& operator=(BudgetCharge&& other) noexcept;
  BudgetCharge(const BudgetCharge&) = delete;
  BudgetCharge& operator=(const BudgetCharge&) = delete;

  // Moves `bytes` (<= bytes()) of this charge into a new one (one allocation's share).
  // On an empty charge: an empty charge.
  BudgetCharge Split(size_t bytes);
  size_t bytes() const { return bytes_; }

 private:
  friend class MemoryBudget;
  BudgetCharge(std::shared_ptr<MemoryBudget> budget, uint64_t arena_uid, size_t bytes)
      : budget_(std::move(budget)), arena_uid_(arena_uid), bytes_(bytes) {}
  std::shared_ptr<MemoryBudget> budget_;
  uint64_t arena_uid_ = 0;
  size_t bytes_ = 0;
};

struct BudgetMemberStats {
  uint64_t arena_uid = 0;
  std::string label;
  size_t held_bytes = 0;
  size_t peak_bytes = 0;
};

struct BudgetStats {
  size_t cap_bytes = 0;
  size_t used_bytes = 0;  // held by every arena, members and ones that left
  size_t peak_bytes = 0;
  std::string driver_kind;
  int device_ordinal = 0;
  std::vector<BudgetMemberStats> arenas;  // members, in joining order
};

class MemoryBudget : public std::enable_shared_from_this<MemoryBudget> {
 public:
  // cap_bytes > 0 (else InvalidArgument); the device the members must be on. `device_name`
  // is how errors name it ("cpu:1"); empty: "<driver_kind> device <ordinal>" (the host
  // driver's ordinal is 0 for every CPU device, so the caller names it).
  static std::shared_ptr<MemoryBudget> Create(size_t cap_bytes, const std::string& driver_kind,
                                              int device_ordinal,
                                              const std::string& device_name = "");
  MemoryBudget(const MemoryBudget&) = delete;
  MemoryBudget& operator=(const MemoryBudget&) = delete;

  // Adds a member (Arena::JoinBudget checks the device and the arena's state).
  void Join(const std::shared_ptr<Arena>& arena, const std::string& label);
  // The member leaves the stats (its memory, if any is left, stays counted in
  // used_bytes until given back). Idempotent.
  void Leave(uint64_t arena_uid) noexcept;

  // Takes `bytes` for the member, or throws BudgetExceeded naming `what` (the operation and
  // its buffers), the cap, the device, what every member holds and what was asked.
  BudgetCharge Charge(uint64_t arena_uid, size_t bytes, const std::string& what);

  // Waits for every other member's deferred releases (Arena::ReclaimForBudget). Call
  // without holding any arena's lock. Returns the bytes they gave back.
  size_t ReclaimOthers(uint64_t arena_uid);

  BudgetStats Stats() const;
  size_t cap_bytes() const { return cap_bytes_; }
  const std::string& driver_kind() const { return driver_kind_; }
  int device_ordinal() const { return device_ordinal_; }

 private:
  friend class BudgetCharge;
  MemoryBudget(size_t cap_bytes, std::string driver_kind, int device_ordinal,
               std::string device_name);
  void Uncharge(uint64_t arena_uid, size_t bytes) noexcept;
  std::string DescribeLocked() const;  // "arena 'x' holds 1.0 MiB (peak 2.0 MiB), ..."

  struct Member {
    std::weak_ptr<Arena> arena;
    std::string label;
    size_t held = 0;
    size_t peak = 0;
    bool left = false;  // kept until its last bytes come back, out of the stats
  };
  const size_t cap_bytes_;
  const std::string driver_kind_;
  const int device_ordinal_;
  const std::string device_name_;
  mutable std::mutex mu_;
  size_t used_ = 0;
  size_t peak_ = 0;
  std::map<uint64_t, Member> members_;  // by arena uid (uids grow: joining order)
};

namespace testing {
// Test-only: while set, Charge never refuses (it still counts), so tests can show that
// they catch an arena going past its budget. Thread-safe.
void SetBudgetCheckBypassed(bool bypassed);
}  // namespace testing

}  // namespace jax_vmm
