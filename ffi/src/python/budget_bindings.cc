// Python bindings of MemoryBudget (jax_vmm/memory_budget.h) and of an arena joining one.
#include <nanobind/nanobind.h>
#include <nanobind/stl/shared_ptr.h>
#include <nanobind/stl/string.h>

#include <memory>
#include <string>

#include "jax_vmm/arena.h"
#include "jax_vmm/memory_budget.h"
#include "python/bindings.h"

namespace nb = nanobind;

namespace jax_vmm {

namespace {

nb::dict BudgetStatsDict(const BudgetStats& s) {
  nb::dict d;
  d["cap_bytes"] = s.cap_bytes;
  d["used_bytes"] = s.used_bytes;
  d["peak_bytes"] = s.peak_bytes;
  d["driver"] = s.driver_kind;
  d["device_ordinal"] = s.device_ordinal;
  nb::list arenas;
  for (const BudgetMemberStats& m : s.arenas) {
    nb::dict e;
    e["uid"] = m.arena_uid;
    e["label"] = m.label;
    e["held_bytes"] = m.held_bytes;
    e["peak_bytes"] = m.peak_bytes;
    arenas.append(e);
  }
  d["arenas"] = arenas;
  return d;
}

}  // namespace

void BindBudget(nb::module_& m) {
  nb::class_<MemoryBudget>(m, "MemoryBudget",
                           "A cap on the physical memory of several arenas of one device. "
                           "Thread-safe. Use jax_vmm.MemoryBudget (Python) rather than this class.")
      .def_prop_ro("cap_bytes", &MemoryBudget::cap_bytes)
      .def_prop_ro("driver_kind", &MemoryBudget::driver_kind)
      .def_prop_ro("device_ordinal", &MemoryBudget::device_ordinal)
      .def("stats", [](const MemoryBudget& b) { return BudgetStatsDict(b.Stats()); });
  m.def("create_memory_budget", &MemoryBudget::Create, nb::arg("cap_bytes"), nb::arg("driver"),
        nb::arg("device"), nb::arg("device_name") = "");
  m.def(
      "arena_join_budget",
      [](Arena& a, std::shared_ptr<MemoryBudget> budget, const std::string& label) {
        a.JoinBudget(std::move(budget), label);
      },
      nb::arg("arena"), nb::arg("budget"), nb::arg("label"),
      nb::call_guard<nb::gil_scoped_release>(),
      "Every later physical allocation of the arena comes from the budget.");
}

}  // namespace jax_vmm
