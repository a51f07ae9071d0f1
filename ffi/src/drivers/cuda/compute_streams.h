// The streams XLA runs a CUDA device's work on, as its FFI handlers see them.
//
// A device wait (CudaDriver::Synchronize) waits for these streams rather than for the
// whole context: cuCtxSynchronize also waits on a stream that XLA is capturing into a
// command buffer on another thread, which the driver refuses and which invalidates that
// capture (the decode step then fails with cudaErrorStreamCaptureInvalidated). XLA
// captures on a stream of its own and launches the recorded graphs on its compute stream,
// so waiting for the compute stream covers every kernel and graph it dispatched. (JAX's
// own device-to-host copies, e.g. np.asarray of a view, run on its transfer streams; the
// Python thread that asked for one waits for it before it can release anything.)
//
// jax_vmm's Python layer runs the jax_vmm_register_compute_stream handler once per device
// when it creates the first arena there, before that arena's first device wait, and
// forgets the device's streams when the JAX client that owns them goes (its destruction
// destroys them; a wait on a destroyed stream may crash the process), at the latest at exit.
// Streams are kept per entry-point table as well as per ordinal: XLA's belong to libcuda's
// (GetApi()), and the testing layer's emulated driver (testing/fake_cuda.h) is device 0 of
// its own table, so on a GPU machine it must not see (and wait on) the real device 0's.
// Thread-safe (one process-wide table under a mutex).
#pragma once

#include <vector>

#include "common/ffi_registry.h"
#include "drivers/cuda/cuda_api.h"

namespace jax_vmm::cuda {

// Adds `stream` (a CUstream of `api`) to the streams of CUDA device `ordinal`; a no-op
// when known.
void RegisterComputeStream(const Api& api, int ordinal, void* stream);

// The streams registered for `ordinal` of `api`, in registration order (empty when none
// are).
std::vector<void*> ComputeStreams(const Api& api, int ordinal);

// Removes and returns the streams of `ordinal` of `api`: their JAX client is going (or, in
// jax_vmm.testing, a test removes them for a while and puts them back with
// RegisterComputeStream).
std::vector<void*> ForgetComputeStreams(const Api& api, int ordinal);

// jax_vmm_register_compute_stream on "CUDA": operand and result an int32 scalar (aliased,
// so nothing is written); it records the stream XLA runs it on. Not command-buffer
// compatible on purpose: XLA runs it on the compute stream itself, never under capture.
void AddComputeStreamTargets(FfiRegistry& registry);

}  // namespace jax_vmm::cuda
