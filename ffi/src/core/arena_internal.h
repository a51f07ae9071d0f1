// Shared by the arena's placement code (arena.cc) and its commit (arena_commit.cc).
// Private to core/.
#pragma once

#include <cstddef>
#include <cstdint>

#include "jax_vmm/arena.h"
#include "jax_vmm/driver.h"

namespace jax_vmm {

// One committed chunk: owns its physical handle and, once mapped, its mapping. The
// destructor undoes both, so a half-built commit unwinds itself on any exception.
struct Arena::Chunk {
  Chunk(Driver* d, uintptr_t address) : driver(d), va(address) { handle = driver->Create(); }
  ~Chunk() {
    if (mapped) driver->Unmap(va);
    driver->Release(handle);
  }
  Chunk(const Chunk&) = delete;
  Chunk& operator=(const Chunk&) = delete;

  Driver* driver;
  uintptr_t va;
  PhysicalHandle handle = 0;
  bool mapped = false;
};

// Throws InvalidArgument unless 0 <= start <= stop <= info.nbytes; `op` names the call.
void CheckRange(const BufferInfo& info, size_t start, size_t stop, const char* op);

}  // namespace jax_vmm
