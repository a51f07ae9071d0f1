// registrations(platform) of a nanobind module: its FfiRegistry as the dict that
// jax.ffi.register_ffi_target takes, {name: capsule} for an execute-only target and
// {name: {"initialize": capsule, "execute": capsule}} for a staged one (as jax's
// examples/ffi modules do).
#pragma once

#include <nanobind/nanobind.h>

#include "common/ffi_registry.h"

namespace jax_vmm {

// Defines m.registrations(platform) over `registry`, which the function keeps.
void BindRegistrations(nanobind::module_& m, FfiRegistry registry);

}  // namespace jax_vmm
