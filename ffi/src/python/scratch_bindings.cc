// Python bindings of the graph-safe scratch API (jax_vmm/scratch.h), used by
// jax_vmm/ops/scratch.py.
#include <nanobind/nanobind.h>
#include <nanobind/stl/string.h>

#include <cstdint>
#include <stdexcept>
#include <string>

#include "jax_vmm/errors.h"
#include "jax_vmm/scratch.h"
#include "python/bindings.h"

namespace nb = nanobind;

namespace jax_vmm {
namespace {

using scratch::ScratchMode;

ScratchMode ParseMode(const std::string& mode) {
  if (mode == "default") return ScratchMode::kDefault;
  if (mode == "grow") return ScratchMode::kGrowInPlace;
  if (mode == "retire") return ScratchMode::kRetire;
  throw InvalidArgument("scratch mode must be 'default', 'grow' or 'retire', got '" + mode + "'");
}

nb::dict StatsDict(const scratch::WorkspaceStats& s) {
  nb::dict d;
  d["device"] = s.device == scratch::kHostDevice
                    ? nb::str("cpu")
                    : nb::str(("cuda:" + std::to_string(s.device)).c_str());
  d["stream"] = static_cast<uint64_t>(s.stream);
  d["generation"] = s.generation;
  d["current"] = s.current;
  d["mode"] = scratch::ModeName(s.mode);
  d["vmm"] = s.vmm;
  d["address"] = static_cast<uint64_t>(s.address);
  d["capacity"] = s.capacity;
  d["reserved_bytes"] = s.reserved_bytes;
  d["backed_bytes"] = s.backed_bytes;
  d["retired_blocks"] = s.retired_blocks;
  d["retired_bytes"] = s.retired_bytes;
  d["growth_events"] = s.growth_events;
  d["freed_blocks"] = s.freed_blocks;
  d["capture_refusals"] = s.capture_refusals;
  d["fallback_reason"] = s.fallback_reason;
  return d;
}

void ThrowIfError(const std::string& err) {
  if (!err.empty()) throw std::runtime_error(err);
}

}  // namespace

void BindScratch(nb::module_& m) {
  m.def(
      "scratch_stats",
      []() {
        nb::list out;
        for (const auto& s : scratch::Stats()) out.append(StatsDict(s));
        return out;
      },
      "One dict per workspace: device, stream, mode, address, capacity, backed and "
      "retired bytes, growth events, capture refusals.");
  m.def("scratch_set_mode", [](const std::string& mode) { scratch::SetMode(ParseMode(mode)); });
  m.def("scratch_get_mode", []() { return std::string(scratch::ModeName(scratch::GetMode())); });
  m.def("scratch_set_reserve_bytes", [](size_t n) { scratch::SetReserveBytes(n); });
  m.def("scratch_get_reserve_bytes", []() { return scratch::GetReserveBytes(); });
  m.def(
      "scratch_reserve",
      [](int device, size_t nbytes, uint64_t stream) {
        nb::gil_scoped_release release;
        ThrowIfError(scratch::Reserve(device, reinterpret_cast<void*>(stream), nbytes));
      },
      nb::arg("device"), nb::arg("nbytes"), nb::arg("stream") = 0,
      "Grow the workspace of (device, stream) to nbytes; device -1 is the host.");
}

}  // namespace jax_vmm
