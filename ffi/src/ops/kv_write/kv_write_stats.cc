#include "ops/kv_write/kv_write_stats.h"

#include "ops/kv_write/kv_write_call.h"

namespace jax_vmm::kv {
namespace {

DeviceDropHooks& Hooks() {
  static DeviceDropHooks hooks;
  return hooks;
}

}  // namespace

Counters& GetCounters(Handler h) {
  static Counters counters[static_cast<int>(Handler::kCount)];
  return counters[static_cast<int>(h)];
}

void CountResolution(Handler h, const Resolution& r) {
  if (r.alias_miss) GetCounters(h).alias_misses.fetch_add(1);
  if (r.non_arena) GetCounters(h).non_arena.fetch_add(1);
}

void SetDeviceDropHooks(const DeviceDropHooks& hooks) { Hooks() = hooks; }

uint64_t DeviceDroppedWrites() { return Hooks().read ? Hooks().read() : 0; }

void ResetCounters() {
  for (int i = 0; i < static_cast<int>(Handler::kCount); ++i) {
    Counters& c = GetCounters(static_cast<Handler>(i));
    c.calls = 0;
    c.captured_calls = 0;
    c.alias_misses = 0;
    c.non_arena = 0;
    c.host_dropped = 0;
  }
  if (Hooks().reset) Hooks().reset();
}

}  // namespace jax_vmm::kv
