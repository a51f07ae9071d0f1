// The CUDA driver backend over a given entry-point table: the production path passes the
// table loaded from libcuda (MakeCudaDriver, driver.h); the testing layer passes a host
// emulation of the VMM API (testing/fake_cuda.h) so that this exact code runs without a GPU.
#pragma once

#include <cstddef>
#include <memory>

#include "drivers/cuda/cuda_api.h"
#include "jax_vmm/driver.h"

namespace jax_vmm {

// cuInit(0) through `api`, then a driver of device `ordinal` (chunk_bytes 0: the device's
// granularity). `api` must outlive the driver and everything made from it.
std::unique_ptr<Driver> MakeCudaDriverWith(const cuda::Api& api, int ordinal, size_t chunk_bytes);

}  // namespace jax_vmm
