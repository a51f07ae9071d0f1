// See view_fits.h.
#include "core/view_fits.h"

#include <cstdint>
#include <string>

#include "jax_vmm/errors.h"

namespace jax_vmm {

void CheckViewFits(const BufferInfo& b, const std::vector<size_t>& shape, uint8_t bits) {
  unsigned __int128 bytes = bits / 8;  // 128 bits: no shape of 64-bit sizes overflows it
  bool overflow = false;
  for (size_t s : shape) {
    bytes *= s;
    overflow = overflow || bytes > SIZE_MAX;
  }
  if (overflow || bytes > b.nbytes) {
    throw InvalidArgument(
        "Arena.view: shape needs " +
        (overflow ? std::string("more than 2^64") : std::to_string(static_cast<size_t>(bytes))) +
        " bytes but buffer '" + b.name + "' has " + std::to_string(b.nbytes));
  }
}

}  // namespace jax_vmm
