// XLA's FFI *record* stage for jax_vmm's CUDA targets.
//
// Inside a command buffer (CUDA graph) XLA traces a custom call without a record stage into
// a child graph, and re-records and updates that child graph whenever the command buffer is
// updated, which a step whose results are new buffers does at every call (docs/design.md,
// "Record stages"). A handler with a record stage instead tells XLA which commands it adds,
// or that it adds none, and costs nothing at an update that moves none of its commands.
//
// JAX cannot register such a handler: jax.ffi.register_ffi_target hands jaxlib's GPU plugin
// four stages and drops a "record" entry. So the recorded targets are registered from
// inside the plugin's XLA: the bootstrap target below, run once on a GPU, calls the
// XLA_FFI_Handler_Register of the XLA that runs it with each whole bundle.
// jax_vmm/base/record_stages.py runs the bootstrap and picks the recorded target names once
// it reports "registered"; until then (or on a jaxlib whose headers have no record stage,
// such as 0.10) the plain targets run.
//
// Thread-safety: Add() while the module initialises; the bootstrap registers once per
// process (std::call_once); Status() may be called from any thread.
#pragma once

#if __has_include("xla/ffi/api/record_c_api.h")
#define JAX_VMM_HAVE_FFI_RECORD 1
#endif

#include <string>

#include "xla/ffi/api/c_api.h"

namespace jax_vmm::record_stage {

// A CUDA target with a record stage, registered by the bootstrap under `name`.
struct Target {
  const char* name;  // a string literal
  XLA_FFI_Handler* execute;
  XLA_FFI_Handler* record;
};

// Adds a target for the bootstrap to register (module initialisation only).
void Add(Target target);

// The handler of the bootstrap target ("jax_vmm_register_record_stages" on "CUDA"): at its
// execute stage it registers every added target with the calling XLA, once per process.
XLA_FFI_Handler* BootstrapHandler();

// "registered"; "pending" before the bootstrap ran; "unavailable: <why>" when this build's
// jaxlib headers have no record stage; "failed: <XLA's error>" when XLA refused a target.
std::string Status();

}  // namespace jax_vmm::record_stage
