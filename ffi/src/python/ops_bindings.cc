// Python bindings of the kv_write statistics (see ops/kv_write/kv_write_stats.h).
#include <nanobind/nanobind.h>

#include <cstdint>

#include "ops/kv_write/kv_write_stats.h"
#include "python/bindings.h"

namespace nb = nanobind;

namespace jax_vmm {
namespace {

nb::dict CountersDict(const kv::Counters& c) {
  nb::dict d;
  d["calls"] = c.calls.load();
  d["captured_calls"] = c.captured_calls.load();
  d["alias_misses"] = c.alias_misses.load();
  d["non_arena"] = c.non_arena.load();
  return d;
}

}  // namespace

void BindOps(nb::module_& m) {
  m.def(
      "kv_write_stats",
      []() {
        nb::dict d;
        d["kv_write_through"] = CountersDict(kv::GetCounters(kv::Handler::kWriteThrough));
        d["kv_write"] = CountersDict(kv::GetCounters(kv::Handler::kWrite));
        d["kv_cache_write"] = CountersDict(kv::GetCounters(kv::Handler::kCacheWrite));
        uint64_t device = 0;
        {
          nb::gil_scoped_release release;
          device = kv::DeviceDroppedWrites();
        }
        int64_t host = 0;
        for (kv::Handler h :
             {kv::Handler::kWriteThrough, kv::Handler::kWrite, kv::Handler::kCacheWrite}) {
          host += kv::GetCounters(h).host_dropped.load();
        }
        d["dropped_writes"] = static_cast<uint64_t>(host) + device;
        return d;
      },
      "Host counters of the kv_write handlers (calls, captured calls, alias misses, "
      "non-arena operands) and the dropped token writes counted on the host and devices "
      "(reading the device counter synchronises the devices).");
  m.def("kv_write_reset_stats", []() {
    nb::gil_scoped_release release;
    kv::ResetCounters();
  });
}

}  // namespace jax_vmm
