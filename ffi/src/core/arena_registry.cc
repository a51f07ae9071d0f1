#include "core/arena_registry.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <mutex>
#include <random>
#include <vector>

namespace jax_vmm {
namespace {

// Every live arena, so FFI handlers can map a raw pointer or a uid back to its buffer.
// Never destroyed: a view lease may drop the last reference to an arena on an XLA thread
// after static destructors ran at exit, and ~Arena unregisters itself.
struct Registry {
  std::mutex mu;
  std::vector<const Arena*> arenas;
};

Registry& GetRegistry() {
  static Registry* registry = new Registry;
  return *registry;
}

// A random start in [2^32, 2^62): uids of one process are consecutive and never repeat;
// those of two processes (a compilation cache shared between them, say) almost surely
// differ too.
uint64_t FirstUid() {
  std::random_device rd;
  const uint64_t noise =
      (uint64_t{rd()} << 32) ^ rd() ^
      static_cast<uint64_t>(std::chrono::steady_clock::now().time_since_epoch().count());
  return (uint64_t{1} << 32) + noise % ((uint64_t{1} << 62) - (uint64_t{1} << 32));
}

}  // namespace

uint64_t NewUid() {
  static std::atomic<uint64_t> next{FirstUid()};
  return next.fetch_add(1, std::memory_order_relaxed);
}

namespace internal {

void RegisterArena(const Arena* arena) {
  Registry& r = GetRegistry();
  std::lock_guard<std::mutex> lock(r.mu);
  r.arenas.push_back(arena);
}

void UnregisterArena(const Arena* arena) {
  Registry& r = GetRegistry();
  std::lock_guard<std::mutex> lock(r.mu);
  r.arenas.erase(std::remove(r.arenas.begin(), r.arenas.end(), arena), r.arenas.end());
}

}  // namespace internal

bool FindArenaBuffer(uintptr_t ptr, size_t bytes, BufferRef* out, bool pin_metadata) {
  Registry& r = GetRegistry();
  std::lock_guard<std::mutex> lock(r.mu);
  for (const Arena* arena : r.arenas) {
    if (arena->FindBufferLocked(ptr, bytes, out)) {
      if (pin_metadata) arena->PinMetadataForGraphs();
      return true;
    }
  }
  return false;
}

UidLookup FindArenaBufferByUid(uint64_t buffer_uid, BufferRef* out, std::string* name,
                               bool pin_metadata) {
  Registry& r = GetRegistry();
  std::lock_guard<std::mutex> lock(r.mu);
  for (const Arena* arena : r.arenas) {
    bool closed = false;
    if (arena->FindBufferByUidLocked(buffer_uid, out, name, &closed)) {
      if (closed) return UidLookup::kClosed;
      if (pin_metadata) arena->PinMetadataForGraphs();
      return UidLookup::kFound;
    }
  }
  return UidLookup::kGone;
}

bool InArenaReservation(uintptr_t ptr, size_t bytes) {
  Registry& r = GetRegistry();
  std::lock_guard<std::mutex> lock(r.mu);
  return std::any_of(r.arenas.begin(), r.arenas.end(),
                     [&](const Arena* a) { return a->Holds(ptr, bytes); });
}

}  // namespace jax_vmm
