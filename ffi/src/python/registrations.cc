#include "python/registrations.h"

#include <nanobind/stl/string.h>

#include <string>
#include <utility>

namespace nb = nanobind;

namespace jax_vmm {
namespace {

nb::capsule Capsule(XLA_FFI_Handler* handler) {
  return nb::capsule(reinterpret_cast<void*>(handler));
}

nb::dict RegistrationsDict(const FfiRegistry& registry, const std::string& platform) {
  nb::dict out;
  for (const FfiRegistry::Target& t : registry.ForPlatform(platform)) {
    if (t.stages.initialize == nullptr) {
      out[t.name.c_str()] = Capsule(t.stages.execute);
      continue;
    }
    nb::dict stages;
    stages["initialize"] = Capsule(t.stages.initialize);
    stages["execute"] = Capsule(t.stages.execute);
    out[t.name.c_str()] = stages;
  }
  return out;
}

}  // namespace

void BindRegistrations(nb::module_& m, FfiRegistry registry) {
  m.def(
      "registrations",
      [registry = std::move(registry)](const std::string& platform) {
        return RegistrationsDict(registry, platform);
      },
      nb::arg("platform"),
      "{target name: capsule, or {stage: capsule}} of every XLA FFI handler of this module "
      "on `platform` ('cpu' or 'CUDA'), for jax.ffi.register_ffi_target.");
}

}  // namespace jax_vmm
