// Get() with the capture state given by the caller instead of asked from the stream:
// how the testing layer drives capture resolution on the host, where no stream captures.
// Private to scratch/ and the testing layer.
#pragma once

#include <cstddef>
#include <string>

namespace jax_vmm::scratch {

// As Get() (jax_vmm/scratch.h), with `capturing` standing for the stream's capture state.
std::string GetWithCaptureState(int device, void* stream, size_t bytes, bool capturing, void** ptr);

}  // namespace jax_vmm::scratch
