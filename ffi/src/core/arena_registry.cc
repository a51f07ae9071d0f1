#include "core/arena_registry.h"

#include <algorithm>
#include <mutex>
#include <vector>

namespace jax_vmm {
namespace {

// Every live arena, so FFI handlers can map a raw pointer back to its buffer.
struct Registry {
  std::mutex mu;
  std::vector<const Arena*> arenas;
};

Registry& GetRegistry() {
  static Registry registry;
  return registry;
}

}  // namespace

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

}  // namespace jax_vmm
