// The XLA FFI targets of one module, by platform: what registrations(platform) hands to
// Python (jax_vmm/base/ffi.py registers each with jax.ffi.register_ffi_target).
//
// Filled explicitly at module initialisation: every op folder has an Add*Targets(registry)
// function per platform (ops/*/..._targets.h), called from python/module.cc (production)
// or python/testing_module.cc (the testing layer). No static initialisers.
//
// Thread-safety: Add() while the module initialises, then read-only.
#pragma once

#include <string>
#include <vector>

#include "xla/ffi/api/c_api.h"

namespace jax_vmm {

class FfiRegistry {
 public:
  // The stages of one target; `initialize` is optional (null: an execute-only target).
  struct Stages {
    XLA_FFI_Handler* initialize = nullptr;
    XLA_FFI_Handler* execute = nullptr;
  };
  struct Target {
    std::string name;
    std::string platform;  // "cpu" or "CUDA", as jax.ffi.register_ffi_target spells them
    Stages stages;
  };

  void Add(const std::string& name, const std::string& platform, XLA_FFI_Handler* execute);
  void Add(const std::string& name, const std::string& platform, Stages stages);

  // The targets of `platform`; throws InvalidArgument for a platform other than "cpu"
  // and "CUDA".
  std::vector<Target> ForPlatform(const std::string& platform) const;

 private:
  std::vector<Target> targets_;
};

}  // namespace jax_vmm
