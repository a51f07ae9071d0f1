// Graph-safe scratch: a per (device, stream) workspace for custom calls whose address
// stays valid for every CUDA graph that captured it.
//
// Public header: other FFI authors may include it and link against jax_vmm's module.
//
// Usage from an XLA FFI handler (CUDA):
//   * at a stage that is never under stream capture (the handler's kInitialize stage,
//     or from Python with jax_vmm.ops.scratch.reserve() before the first call), call
//     Reserve(device, stream, bytes) with the size derived from static shapes;
//   * at kExecute, call Get(device, stream, bytes, &ptr). It grows the workspace when the
//     stream is not capturing. When the stream is capturing it never grows: if the
//     workspace is too small it returns an error message instead of allocating.
//
// Streams under capture. XLA records a command buffer by tracing the handler on a
// private trace stream and later replays the graph on the stream the executable runs
// on. So a Get() on a capturing stream that has no workspace of its own resolves to
//   1. the workspace this thread last used or reserved outside capture on that device
//      (XLA calls kInitialize, then records, on the same thread), else
//   2. the device's default workspace (stream == nullptr, what reserve() fills).
// Graphs replay in order on the executable's stream, so they may share that workspace.
//
// Strategies (ScratchMode):
//   kGrowInPlace  a reserved virtual range per workspace; growth maps one allocation of
//                 the added bytes at the tail (one create, map and set-access per growth),
//                 so the pointer never changes; memory = high-water mark. When the
//                 reservation itself is outgrown, a larger one is made and the old range
//                 is retired (kept mapped for the life of the process).
//   kRetire       plain blocks; growth allocates a larger block and retires the old one
//                 (kept until process exit, never freed), because a captured graph may
//                 still point at it. Memory = sum of every outgrown size.
// kDefault picks kGrowInPlace where the device supports VMM, else kRetire.
// Changing the mode retires the current workspaces (kept alive, never reused) so that
// the next Get() creates a workspace in the new mode.
//
// Lifetime: workspaces and retired blocks are never freed (captured graphs may outlive
// any owner we could name); the OS reclaims them at process exit.
//
// Thread-safety: all functions are thread-safe (one mutex for the workspace table).
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

namespace jax_vmm::scratch {

// Device id used for host (cpu platform) workspaces.
constexpr int kHostDevice = -1;

enum class ScratchMode : int { kDefault = 0, kGrowInPlace = 1, kRetire = 2 };

const char* ModeName(ScratchMode mode);

struct WorkspaceStats {
  int device = 0;
  uintptr_t stream = 0;                      // 0: the device's default workspace
  int64_t generation = 0;                    // bumped by SetMode(); older workspaces are retired
  bool current = true;                       // false once retired by a mode change
  ScratchMode mode = ScratchMode::kDefault;  // effective strategy; kDefault until allocated
  bool vmm = false;                          // memory from the VMM driver (else plain allocations)
  uintptr_t address = 0;                     // current workspace pointer
  size_t capacity = 0;                       // bytes usable at `address`
  size_t reserved_bytes = 0;                 // virtual range (grow-in-place), else == capacity
  size_t backed_bytes = 0;                   // physical bytes held, including retired blocks
  int64_t retired_blocks = 0;
  size_t retired_bytes = 0;
  int64_t growth_events = 0;
  int64_t freed_blocks = 0;      // outgrown blocks given back: 0 unless a test emulates the bug
  int64_t capture_refusals = 0;  // Get() calls refused because growth was needed under capture
  std::string fallback_reason;   // why kDefault resolved to kRetire, if it did
};

// Selects the strategy for workspaces created from now on. A change of mode retires
// all current workspaces (they stay allocated) and starts a new generation.
void SetMode(ScratchMode mode);
ScratchMode GetMode();

// Virtual bytes reserved per grow-in-place workspace (default 1 GiB, or the
// JAX_VMM_SCRATCH_RESERVE_BYTES environment variable). Applies to new reservations.
void SetReserveBytes(size_t bytes);
size_t GetReserveBytes();

// Grows the workspace of (device, stream) to at least `bytes`. `stream` may be nullptr
// (the device default workspace). Must not be called while `stream` is capturing.
// Returns an empty string on success, else the error.
std::string Reserve(int device, void* stream, size_t bytes);

// Returns in *ptr a workspace of at least `bytes` for (device, stream). Grows it when the
// stream is not capturing; when it is and no resolvable workspace is large enough,
// returns an error (and counts a capture refusal). Empty string on success.
std::string Get(int device, void* stream, size_t bytes, void** ptr);

std::vector<WorkspaceStats> Stats();

}  // namespace jax_vmm::scratch
