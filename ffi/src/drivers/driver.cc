// The Driver interface's convenience forms, and the factory by name.
#include "jax_vmm/driver.h"

#include "jax_vmm/errors.h"

namespace jax_vmm {

void MapWhole(Driver& driver, uintptr_t va, PhysicalHandle handle, size_t bytes) {
  const MapPiece piece{handle, 0, bytes};
  driver.MapRun(va, &piece, 1);
}

void UnmapWhole(Driver& driver, uintptr_t va, size_t bytes) noexcept {
  driver.UnmapRun(va, &bytes, 1);
}

std::unique_ptr<Driver> MakeDriver(const std::string& kind, int device, size_t chunk_bytes) {
  if (kind == "host") return MakeHostDriver(chunk_bytes);
  if (kind == "cuda") return MakeCudaDriver(device, chunk_bytes);
  throw InvalidArgument("unknown driver '" + kind + "'; expected 'host' or 'cuda'");
}

}  // namespace jax_vmm
