// Statistics of the kv_write handlers: host counters per handler, and the dropped writes
// the CUDA kernels count on the devices (read through hooks the module init installs).
#pragma once

#include <atomic>
#include <cstdint>

namespace jax_vmm::kv {

struct Resolution;

// kCacheWrite: kv_write on a KVCache layer (plain and fp8).
enum class Handler : int { kWriteThrough = 0, kWrite = 1, kCacheWrite = 2, kCount = 3 };

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

// Counts what ResolveSides (kv_write_call.h) found: an alias miss, a non-arena call.
void CountResolution(Handler h, const Resolution& r);

// Dropped token writes counted on devices (the CUDA kernels keep a counter per device);
// the module init installs the hooks (kv_write_kernels.cu). Reading synchronises the
// devices.
struct DeviceDropHooks {
  uint64_t (*read)() = nullptr;
  void (*reset)() = nullptr;
};
void SetDeviceDropHooks(const DeviceDropHooks& hooks);
uint64_t DeviceDroppedWrites();  // 0 without CUDA kernels
void ResetCounters();            // host counters and device counters

}  // namespace jax_vmm::kv
