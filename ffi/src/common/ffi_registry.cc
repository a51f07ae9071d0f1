#include "common/ffi_registry.h"

#include "jax_vmm/errors.h"

namespace jax_vmm {

void FfiRegistry::Add(const std::string& name, const std::string& platform,
                      XLA_FFI_Handler* execute) {
  Add(name, platform, Stages{nullptr, execute});
}

void FfiRegistry::Add(const std::string& name, const std::string& platform, Stages stages) {
  targets_.push_back(Target{name, platform, stages});
}

std::vector<FfiRegistry::Target> FfiRegistry::ForPlatform(const std::string& platform) const {
  if (platform != "cpu" && platform != "CUDA") {
    throw InvalidArgument("registrations: unknown platform '" + platform +
                          "'; expected 'cpu' or 'CUDA'");
  }
  std::vector<Target> out;
  for (const Target& t : targets_) {
    if (t.platform == platform) out.push_back(t);
  }
  return out;
}

}  // namespace jax_vmm
