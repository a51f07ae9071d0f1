// Shared by the kv_write CPU and CUDA handlers: geometry checks, token validation
// (callable from host and device code), arena lookup and statistics.
//
// Two custom calls implement jax_vmm.kv_write (see jax_vmm/ops.py for why):
//   jax_vmm_kv_write_through(k, v, new_k, new_v, slots) -> status s32[2, n]
//       Validates every token against its buffer (range; page table when the operand is
//       arena memory), writes valid tokens into the operand when it IS arena memory,
//       counts dropped writes, and records per token and side:
//         0 padding (slot < 0), 1 valid, 2 dropped: slot out of range,
//         3 dropped: slot on an unbacked chunk.
//   jax_vmm_kv_write(k, v, new_k, new_v, slots, status) -> (k, v) aliased {0:0, 1:1}
//       When its output is arena memory the tokens are already there (written by the
//       first call into the same buffer); otherwise (an "alias miss": XLA copied the
//       cache) it writes the status==1 tokens into the output.
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
  uint8_t* dst = nullptr;          // buffer to write tokens into; null: write nothing
  const uint8_t* src = nullptr;    // new tokens, n * token_bytes
  const uint8_t* page_table = nullptr;  // arena page table, null when dst is not arena
  uintptr_t arena_base = 0;
  uint64_t chunk_bytes = 1;
  unsigned long long* drop_counter = nullptr;  // the arena buffer's, or null
  int32_t* status = nullptr;       // n entries (written by write-through, read by apply)
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
                          const Dims& new_v, const Dims& slots, const Dims* status,
                          Geometry* out);

// Fills `side` for writing into `operand` when it is arena memory of `driver_kind`
// ("host" or "cuda"). Returns false (side.dst = null) when it is not.
bool ResolveArenaSide(void* operand, size_t bytes, const char* driver_kind, Side* side);

// ---------------------------------------------------------------- statistics
enum class Handler : int { kWriteThrough = 0, kWrite = 1, kCount = 2 };

// Host-side counters, incremented when a handler runs on the host: every call of a
// CPU handler; for CUDA, every launch or graph recording (graph replays run no host
// code and are not counted). Lock-free, thread-safe.
struct Counters {
  std::atomic<int64_t> calls{0};
  std::atomic<int64_t> captured_calls{0};  // cudaStreamIsCapturing said yes
  std::atomic<int64_t> alias_misses{0};    // kv_write: output was not arena memory
  std::atomic<int64_t> non_arena{0};       // write-through: operand was not arena memory
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
