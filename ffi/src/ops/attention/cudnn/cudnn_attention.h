// The cuDNN attention backend's FFI targets and counters (built only with
// JAX_VMM_HAVE_CUDNN; see cudnn_sdpa.h for the semantics).
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "common/ffi_registry.h"
#include "xla/ffi/api/ffi.h"

namespace jax_vmm::cudnn {

// jax_vmm_cudnn_attention and jax_vmm_cudnn_attention_into (the output aliased to a 6th
// operand) on "CUDA", each with an initialize stage that builds the graph and grows the
// graph-safe scratch.
void AddCudnnTargets(FfiRegistry& registry);

// jax_vmm_cudnn_attention_cache (cudnn_attention_cache_cuda.cc): the same over a KVCache
// layer's arena buffers, found by the cache's identity.
void AddCudnnCacheTargets(FfiRegistry& registry);

// The stages' bodies over any K/V buffers (the arrays' or a cache layer's): validate and
// build the graph, grow the scratch (Initialize; never under capture); validate, fetch the
// graph and the workspace, record the graph and the zero-rows kernel (Execute).
// kv_token_heads: SdpaKey::kv_token_heads of k and v (0: dense). kv_owned: k and v are
// jax_vmm's memory (a KV arena layer), so Execute may zero the non-finite values in the
// tile past each length before a graph that reads them (LaunchZeroNonFiniteTail).
xla::ffi::Error Initialize(cudaStream_t stream, int32_t device, const xla::ffi::AnyBuffer& q,
                           const xla::ffi::AnyBuffer& k, const xla::ffi::AnyBuffer& v,
                           const xla::ffi::Buffer<xla::ffi::S32>& lengths,
                           const xla::ffi::Buffer<xla::ffi::S32>& q_lengths,
                           const xla::ffi::AnyBuffer& out, float scale, float softcap,
                           int64_t window, int64_t kv_token_heads = 0);
xla::ffi::Error Execute(cudaStream_t stream, int32_t device, const xla::ffi::AnyBuffer& q,
                        const xla::ffi::AnyBuffer& k, const xla::ffi::AnyBuffer& v,
                        const xla::ffi::Buffer<xla::ffi::S32>& lengths,
                        const xla::ffi::Buffer<xla::ffi::S32>& q_lengths, xla::ffi::AnyBuffer out,
                        float scale, float softcap, int64_t window, int64_t zero_rows,
                        int64_t kv_token_heads = 0, bool kv_owned = false);

// Counts one initialize stage and its host time (the whole handler, the cache form's layer
// resolution included): XLA runs that stage at every execution of a step.
class InitializeTimer {
 public:
  InitializeTimer();
  ~InitializeTimer();
  InitializeTimer(const InitializeTimer&) = delete;
  InitializeTimer& operator=(const InitializeTimer&) = delete;

 private:
  static int64_t NowNs();
  int64_t start_ns_;
};

struct HandlerStats {
  int64_t initialize_calls = 0;
  int64_t initialize_ns = 0;  // host time of those stages
  int64_t execute_calls = 0;
  int64_t captured_calls = 0;  // execute calls on a capturing stream
};
HandlerStats GetHandlerStats();

}  // namespace jax_vmm::cudnn
