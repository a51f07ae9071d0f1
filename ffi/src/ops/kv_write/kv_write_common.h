// Shared by the kv_write CPU and CUDA handlers: geometry checks, where each side's tokens
// go, token validation (callable from host and device code) and statistics.
//
// Two custom calls (Python wrappers and the user contract: jax_vmm/ops.py):
//   jax_vmm_kv_write(k, v, new_k, new_v, slots) -> (k, v), outputs aliased {0:0, 1:1}
//   jax_vmm_kv_write_through(k, v, new_k, new_v, slots) -> status s32[2, n]
// Attributes dest_k / dest_v (u64, 0 = none) name the arena buffers to write: the
// static destination. Each side's *target* is that buffer, or without one the buffer XLA
// handed over (kv_write: its output; write-through: its operand) when it is arena memory.
// Tokens are validated against the target (slot range; page table), written into the
// target, and kv_write also writes them into its output when that is not the target (an
// "alias miss": XLA copied the cache, so the returned arrays hold the tokens too).
// Per token and side the status is 0 padding (slot < 0), 1 written,
// 2 dropped: slot out of range, 3 dropped: slot on an unbacked chunk.
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <string>

#ifdef __CUDACC__
#define JAX_VMM_HD __host__ __device__
#else
#define JAX_VMM_HD
#endif

namespace jax_vmm::kv {

enum TokenStatus : int32_t {
  kPadding = 0,
  kValid = 1,
  kDroppedOutOfRange = 2,
  kDroppedUnbacked = 3,
};

// Where one side (k or v) of a call reads and writes. Plain data: passed to kernels.
struct Side {
  uint8_t* dst = nullptr;               // the target: arena buffer, or a plain output; null: none
  uint8_t* dst2 = nullptr;              // kv_write's output when it is not the target, else null
  const uint8_t* src = nullptr;         // new tokens, n * token_bytes
  const uint8_t* page_table = nullptr;  // arena page table, null when dst is not arena
  uintptr_t arena_base = 0;
  uint64_t chunk_bytes = 1;
  unsigned long long* drop_counter = nullptr;  // the arena buffer's, or null
  int32_t* status = nullptr;                   // n entries (write-through), or null
};

struct Params {
  Side side[2];
  const int32_t* slots = nullptr;
  int64_t n = 0;
  int64_t num_slots = 0;
  uint64_t token_bytes = 0;
  bool unchecked = false;  // test-only debug switch: no range/page checks (see below)
};

// Validity of writing token `slot` into the buffer at `dst_base` (see TokenStatus).
JAX_VMM_HD inline int32_t CheckToken(int32_t slot, const Params& p, const Side& s) {
  if (slot < 0) return kPadding;
  if (p.unchecked) return kValid;  // debug switch: the protection removed
  if (slot >= p.num_slots) return kDroppedOutOfRange;
  if (s.page_table != nullptr) {
    const uint64_t start = reinterpret_cast<uintptr_t>(s.dst) - s.arena_base +
                           static_cast<uint64_t>(slot) * p.token_bytes;
    const uint64_t first = start / s.chunk_bytes;
    const uint64_t last = (start + p.token_bytes - 1) / s.chunk_bytes;
    for (uint64_t c = first; c <= last; ++c) {
      if (s.page_table[c] != 1) return kDroppedUnbacked;
    }
  }
  return kValid;
}

// Shape facts every handler checks again (Python checks them at trace time; the
// handler must never trust them when touching memory).
struct Geometry {
  int64_t n = 0;
  int64_t num_slots = 0;
  uint64_t token_bytes = 0;
};

// Dimensions as the FFI hands them over, kept independent of the XLA headers here.
struct Dims {
  const int64_t* d = nullptr;
  int64_t rank = 0;
  size_t bytes = 0;
  int dtype = 0;
};

// Empty string when (k, v, new_k, new_v, slots[, status]) fit together; else the error.
std::string CheckGeometry(const char* op, const Dims& k, const Dims& v, const Dims& new_k,
                          const Dims& new_v, const Dims& slots, const Dims* status, Geometry* out);

enum class Op { kWrite, kWriteThrough };

// What the handler knows about one side before the writes.
struct SideInput {
  uintptr_t dest = 0;         // the static destination attribute, 0 = none
  void* handed = nullptr;     // kv_write: the output buffer; write-through: the operand
  size_t bytes = 0;           // size of the cache (k or v)
  const void* src = nullptr;  // new tokens
  int32_t* status = nullptr;  // write-through's status row, or null
};

struct Resolution {
  bool alias_miss = false;  // kv_write: the output is not the target (XLA copied the cache)
  bool non_arena = false;   // no arena target at all: only XLA's buffer was written
};

// Fills p->side[0..1] for a call of `op` on `driver_kind` ("host" or "cuda"). Returns an
// error message (empty on success): a dest that is not a live arena buffer of at least
// `bytes` starting at that address, or (require_arena) a write-through without arena.
std::string ResolveSides(Op op, const char* driver_kind, bool require_arena, const SideInput in[2],
                         Params* p, Resolution* out);

// Everything a handler does before touching memory: checks the geometry of
// (k, v, new_k, new_v, slots[, status]), fills *p (slots, sizes, debug switch) and
// resolves both sides. Returns an error message, empty on success.
std::string PrepareCall(Op op, const char* driver_kind, bool require_arena, const Dims dims[5],
                        const Dims* status_dims, const int32_t* slots, const SideInput in[2],
                        Params* p, Resolution* r);

// ---------------------------------------------------------------- statistics
enum class Handler : int { kWriteThrough = 0, kWrite = 1, kCount = 2 };

// Host-side counters, incremented when a handler runs on the host: every call of a
// CPU handler; for CUDA, every launch or graph recording (graph replays run no host
// code and are not counted). Lock-free, thread-safe.
struct Counters {
  std::atomic<int64_t> calls{0};
  std::atomic<int64_t> captured_calls{0};  // cudaStreamIsCapturing said yes
  std::atomic<int64_t> alias_misses{0};    // kv_write: output was not the arena target
  std::atomic<int64_t> non_arena{0};       // no arena target (no dest, not arena memory)
  std::atomic<int64_t> host_dropped{0};    // CPU handlers: dropped token writes
};
Counters& GetCounters(Handler h);

// Dropped token writes counted on devices (the CUDA kernels keep a counter per device);
// kv_write_cuda.cu installs the hooks. Reading synchronises the devices.
struct DeviceDropHooks {
  uint64_t (*read)() = nullptr;
  void (*reset)() = nullptr;
};
void SetDeviceDropHooks(const DeviceDropHooks& hooks);
uint64_t DeviceDroppedWrites();  // 0 without CUDA kernels
void ResetCounters();            // host counters and device counters

// TEST ONLY: when true, the write-through handlers skip the range and page checks (they
// write wherever the slot points), so a test can show that its checks would notice.
void SetDebugUnchecked(bool enabled);
bool DebugUnchecked();

}  // namespace jax_vmm::kv
