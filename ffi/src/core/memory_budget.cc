// MemoryBudget and BudgetCharge (contract in jax_vmm/memory_budget.h).
#include "jax_vmm/memory_budget.h"

#include <algorithm>
#include <atomic>
#include <string>
#include <utility>
#include <vector>

#include "common/format.h"
#include "jax_vmm/arena.h"

namespace jax_vmm {

namespace {
std::atomic<bool> g_check_bypassed{false};
}  // namespace

namespace testing {
void SetBudgetCheckBypassed(bool bypassed) { g_check_bypassed.store(bypassed); }
}  // namespace testing

// -- BudgetCharge ------------------------------------------------------------------------

BudgetCharge::~BudgetCharge() {
  if (budget_ && bytes_ > 0) budget_->Uncharge(arena_uid_, bytes_);
}

BudgetCharge::BudgetCharge(BudgetCharge&& other) noexcept
    : budget_(std::move(other.budget_)), arena_uid_(other.arena_uid_), bytes_(other.bytes_) {
  other.bytes_ = 0;
}

BudgetCharge& BudgetCharge::operator=(BudgetCharge&& other) noexcept {
  if (this == &other) return *this;
  if (budget_ && bytes_ > 0) budget_->Uncharge(arena_uid_, bytes_);
  budget_ = std::move(other.budget_);
  arena_uid_ = other.arena_uid_;
  bytes_ = other.bytes_;
  other.bytes_ = 0;
  return *this;
}

BudgetCharge BudgetCharge::Split(size_t bytes) {
  if (!budget_) return {};
  if (bytes > bytes_) {
    throw InvalidArgument("BudgetCharge.Split: " + Bytes(bytes) + " asked of a charge of " +
                          Bytes(bytes_) + " (internal error)");
  }
  bytes_ -= bytes;
  return BudgetCharge(budget_, arena_uid_, bytes);
}

// -- MemoryBudget ------------------------------------------------------------------------

std::shared_ptr<MemoryBudget> MemoryBudget::Create(size_t cap_bytes, const std::string& driver_kind,
                                                   int device_ordinal,
                                                   const std::string& device_name) {
  if (cap_bytes == 0) {
    throw InvalidArgument(
        "MemoryBudget: bytes must be > 0 (the physical memory its arenas may "
        "hold together)");
  }
  const std::string name =
      device_name.empty() ? driver_kind + " device " + std::to_string(device_ordinal) : device_name;
  return std::shared_ptr<MemoryBudget>(
      new MemoryBudget(cap_bytes, driver_kind, device_ordinal, name));
}

MemoryBudget::MemoryBudget(size_t cap_bytes, std::string driver_kind, int device_ordinal,
                           std::string device_name)
    : cap_bytes_(cap_bytes),
      driver_kind_(std::move(driver_kind)),
      device_ordinal_(device_ordinal),
      device_name_(std::move(device_name)) {}

void MemoryBudget::Join(const std::shared_ptr<Arena>& arena, const std::string& label) {
  std::lock_guard<std::mutex> lock(mu_);
  auto [it, added] = members_.try_emplace(arena->uid());
  if (!added && !it->second.left) {
    throw InvalidArgument("MemoryBudget: arena " + std::to_string(arena->uid()) +
                          " is already a member");
  }
  it->second.arena = arena;
  it->second.label = label;
  it->second.left = false;
}

void MemoryBudget::Leave(uint64_t arena_uid) noexcept {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = members_.find(arena_uid);
  if (it == members_.end()) return;
  if (it->second.held == 0) {
    members_.erase(it);
  } else {
    it->second.left = true;
  }
}

BudgetCharge MemoryBudget::Charge(uint64_t arena_uid, size_t bytes, const std::string& what) {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = members_.find(arena_uid);
  if (it == members_.end()) {
    throw InvalidArgument("MemoryBudget: arena " + std::to_string(arena_uid) +
                          " is not a member (internal error)");
  }
  if (bytes > cap_bytes_ - std::min(used_, cap_bytes_) && !g_check_bypassed.load()) {
    const std::string who =
        it->second.label.empty() ? "arena " + std::to_string(arena_uid) : it->second.label;
    throw BudgetExceeded(who + ": " + what + ": over the memory budget of " + Bytes(cap_bytes_) +
                             " on " + device_name_ +
                             ": asked for " + Bytes(bytes) +
                             " more while the budget's arenas "
                             "hold " +
                             Bytes(used_) + " (" + DescribeLocked() +
                             "). Nothing was committed. Release memory in one of these "
                             "arenas (release, shrink, sleep, offload, close), or create the "
                             "budget larger",
                         bytes, cap_bytes_ - std::min(used_, cap_bytes_));
  }
  Member& m = it->second;
  m.held += bytes;
  m.peak = std::max(m.peak, m.held);
  used_ += bytes;
  peak_ = std::max(peak_, used_);
  return BudgetCharge(shared_from_this(), arena_uid, bytes);
}

void MemoryBudget::Uncharge(uint64_t arena_uid, size_t bytes) noexcept {
  std::lock_guard<std::mutex> lock(mu_);
  used_ -= std::min(used_, bytes);
  auto it = members_.find(arena_uid);
  if (it == members_.end()) return;
  it->second.held -= std::min(it->second.held, bytes);
  if (it->second.left && it->second.held == 0) members_.erase(it);
}

size_t MemoryBudget::ReclaimOthers(uint64_t arena_uid) {
  std::vector<std::shared_ptr<Arena>> others;
  {
    std::lock_guard<std::mutex> lock(mu_);
    for (const auto& [uid, m] : members_) {
      if (uid == arena_uid || m.held == 0) continue;
      if (auto a = m.arena.lock()) others.push_back(std::move(a));
    }
  }
  size_t bytes = 0;
  for (const auto& a : others) bytes += a->ReclaimForBudget();
  return bytes;  // `others` may hold the last reference: destroyed here, unlocked
}

BudgetStats MemoryBudget::Stats() const {
  std::lock_guard<std::mutex> lock(mu_);
  BudgetStats s;
  s.cap_bytes = cap_bytes_;
  s.used_bytes = used_;
  s.peak_bytes = peak_;
  s.driver_kind = driver_kind_;
  s.device_ordinal = device_ordinal_;
  for (const auto& [uid, m] : members_) {
    if (!m.left) s.arenas.push_back({uid, m.label, m.held, m.peak});
  }
  return s;
}

std::string MemoryBudget::DescribeLocked() const {
  std::string out;
  for (const auto& [uid, m] : members_) {
    if (!out.empty()) out += ", ";
    out += (m.label.empty() ? "arena " + std::to_string(uid) : m.label) + " holds " +
           Bytes(m.held) + (m.left ? " (closed, being given back)" : "");
  }
  return out.empty() ? "no arena" : out;
}

}  // namespace jax_vmm
