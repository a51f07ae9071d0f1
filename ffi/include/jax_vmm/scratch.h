// Graph-safe scratch: a per (device, stream) workspace for custom calls whose address
// stays valid for every CUDA graph that captured it.
//
// Public header: other FFI authors may include it and link against jax_vmm's module.
//
// Usage from an XLA FFI handler (CUDA):
//   * at a stage that is never under stream capture (the handler's kInitialize stage,
//     or from Python before the first call), call Reserve(device, stream, bytes) with
//     the size derived from static shapes;
//   * at kExecute, call Get(device, stream, bytes, &ptr); it never grows while the
//     stream is capturing: if the workspace is too small then, it returns an error
//     message instead of silently allocating.
//
// Strategies (ScratchMode):
//   kGrowInPlace  a large reserved virtual range per workspace; growth maps more chunks at
//                 the tail, so the pointer never changes; memory = high-water mark.
//   kRetire       plain blocks; growth allocates a larger block and *retires* the old
//                 one (kept until process exit, never freed), because a captured graph
//                 may still point at it. Memory = sum of every outgrown size.
// The default is kGrowInPlace where the device supports VMM, else kRetire.
//
// Thread-safety: all functions are thread-safe (one mutex per workspace table).
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

namespace jax_vmm::scratch {

enum class ScratchMode : int { kDefault = 0, kGrowInPlace = 1, kRetire = 2 };

struct WorkspaceStats {
  int device = 0;
  uintptr_t stream = 0;
  ScratchMode mode = ScratchMode::kDefault;
  uintptr_t address = 0;     // current workspace pointer
  size_t capacity = 0;       // bytes usable at `address`
  size_t backed_bytes = 0;   // physical bytes held, including retired blocks
  int64_t retired_blocks = 0;
  size_t retired_bytes = 0;
  int64_t growth_events = 0;
  int64_t capture_refusals = 0;  // Get() calls refused because growth was needed under capture
};

// Selects the strategy for workspaces created from now on (existing ones keep theirs).
void SetMode(ScratchMode mode);
ScratchMode GetMode();

// Grows the workspace of (device, stream) to at least `bytes`. Must not be called while
// `stream` is capturing. Returns an empty string on success, else the error.
std::string Reserve(int device, void* stream, size_t bytes);

// Returns in *ptr a workspace of at least `bytes` for (device, stream). Grows it when the
// stream is not capturing; when it is and the workspace is too small, returns an error.
std::string Get(int device, void* stream, size_t bytes, void** ptr);

std::vector<WorkspaceStats> Stats();

// Test only: when true, growth frees the outgrown block immediately (the seed's bug),
// so tests can show they detect a dangling pointer in a replayed graph.
void SetDebugFreeOnGrowth(bool enabled);

}  // namespace jax_vmm::scratch
