// The kv_write CUDA handlers (contract in kv_write.h). Both are command-buffer
// compatible: host code only resolves pointers and launches one kernel (plus, only if
// XLA ever failed to alias kv_write's output, one copy); everything that changes between
// steps (slots, the page table, counters) is read or written by the kernel from device
// memory, so a replayed graph validates and counts like a live call.
//
// The bodies take the kernel launch as an argument so that the testing layer builds its
// unchecked variant from the same host code; production binds LaunchKvWrite
// (kv_write_kernels.h).
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>
#include <functional>

#include "ops/kv_write/kv_write.h"
#include "ops/kv_write/kv_write_call.h"
#include "ops/kv_write/kv_write_ffi.h"
#include "ops/kv_write/kv_write_stats.h"
#include "xla/ffi/api/ffi.h"

namespace jax_vmm::kv {

using KernelLauncher = cudaError_t (*)(const Params&, cudaStream_t);

// What every CUDA handler does once its operands are unpacked: counts the call (and a
// capturing stream), prepares it (kv_write_call.h), counts the resolution, then
// launch(params) starts the kernel.
ffi::Error RunOnDevice(Op op, Handler h, cudaStream_t stream, const CallOperands& in,
                       bool require_arena, const std::function<cudaError_t(const Params&)>& launch);

// kv_write's results: checks their sizes and, should XLA not alias them with k and v,
// copies k and v into them on `stream` (the op's meaning). `op` names the op in errors.
ffi::Error PrepareWriteResultsOnDevice(const char* op, const ffi::AnyBuffer& k,
                                       const ffi::AnyBuffer& v, ffi::AnyBuffer& k_out,
                                       ffi::AnyBuffer& v_out, cudaStream_t stream);

ffi::Error CudaWrite(KernelLauncher launch, cudaStream_t stream, ffi::AnyBuffer k, ffi::AnyBuffer v,
                     ffi::AnyBuffer new_k, ffi::AnyBuffer new_v, ffi::Buffer<ffi::S32> slots,
                     ffi::Result<ffi::AnyBuffer> k_out, ffi::Result<ffi::AnyBuffer> v_out,
                     const Dest& dest);

ffi::Error CudaWriteThrough(KernelLauncher launch, cudaStream_t stream, ffi::AnyBuffer k,
                            ffi::AnyBuffer v, ffi::AnyBuffer new_k, ffi::AnyBuffer new_v,
                            ffi::Buffer<ffi::S32> slots, ffi::Result<ffi::Buffer<ffi::S32>> status,
                            bool require_arena, const Dest& dest);

// The handler functions XLA_FFI_DEFINE_HANDLER_SYMBOL binds (with
// BindWrite(Bind().Ctx<PlatformStream>()) and BindWriteThrough of kv_write_ffi.h).
template <KernelLauncher kLaunch>
ffi::Error CudaWriteImpl(cudaStream_t stream, ffi::AnyBuffer k, ffi::AnyBuffer v,
                         ffi::AnyBuffer new_k, ffi::AnyBuffer new_v, ffi::Buffer<ffi::S32> slots,
                         ffi::Result<ffi::AnyBuffer> k_out, ffi::Result<ffi::AnyBuffer> v_out,
                         uint64_t dest_k, uint64_t dest_v, uint64_t dest_k_uid,
                         uint64_t dest_v_uid) {
  return CudaWrite(kLaunch, stream, k, v, new_k, new_v, slots, k_out, v_out,
                   Dest{dest_k, dest_v, dest_k_uid, dest_v_uid});
}

template <KernelLauncher kLaunch>
ffi::Error CudaWriteThroughImpl(cudaStream_t stream, ffi::AnyBuffer k, ffi::AnyBuffer v,
                                ffi::AnyBuffer new_k, ffi::AnyBuffer new_v,
                                ffi::Buffer<ffi::S32> slots,
                                ffi::Result<ffi::Buffer<ffi::S32>> status, bool require_arena,
                                uint64_t dest_k, uint64_t dest_v, uint64_t dest_k_uid,
                                uint64_t dest_v_uid) {
  return CudaWriteThrough(kLaunch, stream, k, v, new_k, new_v, slots, status, require_arena,
                          Dest{dest_k, dest_v, dest_k_uid, dest_v_uid});
}

// The context the CUDA handlers bind before their operands: the stream.
inline auto BindCudaContext() { return ffi::Ffi::Bind().Ctx<ffi::PlatformStream<cudaStream_t>>(); }

}  // namespace jax_vmm::kv
