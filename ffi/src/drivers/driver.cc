// Default run forms of the Driver interface (drivers without batched calls), and the
// factory by name.
#include "jax_vmm/driver.h"

#include "jax_vmm/errors.h"

namespace jax_vmm {

void Driver::MapRun(uintptr_t va, const PhysicalHandle* handles, size_t count) {
  const size_t chunk = chunk_bytes();
  size_t done = 0;
  try {
    for (; done < count; ++done) Map(va + done * chunk, handles[done]);
  } catch (...) {
    UnmapRun(va, done);  // all-or-nothing: the chunks mapped so far read zeros again
    throw;
  }
}

void Driver::UnmapRun(uintptr_t va, size_t count) noexcept {
  const size_t chunk = chunk_bytes();
  for (size_t i = 0; i < count; ++i) Unmap(va + i * chunk);
}

std::unique_ptr<Driver> MakeDriver(const std::string& kind, int device, size_t chunk_bytes) {
  if (kind == "host") return MakeHostDriver(chunk_bytes);
  if (kind == "cuda") return MakeCudaDriver(device, chunk_bytes);
  throw InvalidArgument("unknown driver '" + kind + "'; expected 'host' or 'cuda'");
}

}  // namespace jax_vmm
