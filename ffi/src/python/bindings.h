// Each feature binds its own Python functions in its own file; module.cc calls these.
// Add a line here and in module.cc when a feature needs Python-facing functions.
#pragma once

#include <nanobind/nanobind.h>

#include <cstdint>
#include <vector>

#include "jax_vmm/arena.h"

namespace jax_vmm {
// Throws InvalidArgument unless `shape` of `bits`-bit elements fits in buffer b
// (arena_bindings.cc; the testing layer's legacy views check the same).
void CheckViewFits(const BufferInfo& b, const std::vector<size_t>& shape, uint8_t bits);

void BindArena(nanobind::module_& m);      // arena_bindings.cc
void BindScratch(nanobind::module_& m);    // scratch_bindings.cc
void BindOps(nanobind::module_& m);        // ops_bindings.cc (kv_write / attention stats)
void BindAttention(nanobind::module_& m);  // attention_bindings.cc
void BindKvCache(nanobind::module_& m);    // kv_cache_bindings.cc
void BindEnsurePlan(nanobind::module_& m);  // ensure_plan_bindings.cc (KVArena.ensure_all)
}  // namespace jax_vmm
