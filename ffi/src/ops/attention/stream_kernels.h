// Device code of jax_vmm_decode_attention_v2 as the host handlers see it (the header of
// the host / device-code pair stream_cuda.cc / stream_kernels.cu): what the kernels read
// and write, which instantiation runs, its shared memory, and the launch functions.
//
// The grid is the plan's CTA count (static shapes only); every CTA reads the lengths from
// device memory, so a CUDA graph captured once stays correct while the sequences grow.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>

#include "ops/attention/stream_plan.h"

namespace jax_vmm::attention::stream {

inline constexpr size_t kSmemPerSm = 228 * 1024;      // what the CTAs of one SM share
inline constexpr size_t kSmemReservedPerCta = 1024;   // the runtime's own share per CTA

// Everything the kernels read and write: device pointers, static shapes, the plan.
struct StreamParams {
  const void* q;  // (B, Hq, D), bf16 or f16
  const void* k;  // (B, T, Hkv, D), q's dtype or fp8
  const void* v;
  const int32_t* lengths;  // (B,)
  const float* k_scale;    // (Hkv,)
  const float* v_scale;    // (Hkv,)
  void* out;               // (B, Hq, D), q's dtype
  float* ws_acc;           // workspace parts (stream_plan.h)
  float* ws_m;
  float* ws_l;
  unsigned* counters;  // (B * unit_groups,), zero at launch (fused combine only)
  int batch, max_tokens, q_heads, kv_heads, group, head_group, unit_groups;
  int token_heads;  // head rows between a sequence's consecutive tokens (Shapes::token_heads)
  int min_tiles, stages;
  int fused;         // combine in the kernel (last arrival), else CombineKernel after it
  float scale_log2;  // softmax scale * log2(e)
};

// The instantiation of StreamKernel that serves a call, and its launch shape.
struct KernelChoice {
  KvStorage kv = KvStorage::kBf16;
  bool q_bf16 = true;           // q and the output: bfloat16, else float16
  int head_dim = 0;             // 64, 128 or 256
  bool two_head_tiles = false;  // head_group > 8
  bool bulk = false;            // tiles by bulk copies (impl stream_tma)
  unsigned ctas = 0;            // grid size
  size_t smem = 0;              // dynamic shared memory bytes
};

// Raises the chosen kernel's dynamic shared-memory limit to kMaxSmemPerCta (once per
// instantiation; a cudaFuncSetAttribute, so never under stream capture).
cudaError_t PrepareStreamKernel(const KernelChoice& choice);

// Launches the streaming kernel and, when not fused, the combine kernel.
cudaError_t LaunchStreamKernels(const StreamParams& p, const KernelChoice& choice,
                                cudaStream_t stream);

}  // namespace jax_vmm::attention::stream
