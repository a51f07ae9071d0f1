// Each feature binds its own Python functions in its own file; module.cc calls these.
// Add a line here and in module.cc when a feature needs Python-facing functions.
#pragma once

#include <nanobind/nanobind.h>

namespace jax_vmm {
void BindArena(nanobind::module_& m);       // arena_bindings.cc
void BindBudget(nanobind::module_& m);      // budget_bindings.cc (MemoryBudget)
void BindScratch(nanobind::module_& m);     // scratch_bindings.cc
void BindOps(nanobind::module_& m);         // ops_bindings.cc (kv_write / attention stats)
void BindAttention(nanobind::module_& m);   // attention_bindings.cc
void BindKvCache(nanobind::module_& m);     // kv_cache_bindings.cc
void BindEnsurePlan(nanobind::module_& m);  // ensure_plan_bindings.cc (KVArena.ensure_all)
}  // namespace jax_vmm
