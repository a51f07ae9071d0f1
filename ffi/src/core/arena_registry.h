// The process-wide list of live arenas behind FindArenaBuffer (arena.h). Private to
// core/: Arena::Create adds an arena, its destructor removes it. Thread-safe.
#pragma once

#include "jax_vmm/arena.h"

namespace jax_vmm::internal {

void RegisterArena(const Arena* arena);
void UnregisterArena(const Arena* arena);

}  // namespace jax_vmm::internal
