// Device code of the kv_write CUDA handlers as host code sees it (the header of the host /
// device-code pair kv_write_cuda.cc / kv_write_kernels.cu).
#pragma once

#include <cuda_runtime_api.h>

#include "ops/kv_write/kv_write.h"

namespace jax_vmm::kv {

// Launches the production kernel (CheckedTokens) for `p` on `stream`.
cudaError_t LaunchKvWrite(const Params& p, cudaStream_t stream);

// Remembers that a handler ran on `device`: its drop counter is then part of
// kv_write_stats(). Thread-safe.
void NoteDevice(int device);

}  // namespace jax_vmm::kv
