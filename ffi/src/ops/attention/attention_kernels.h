// Device code of jax_vmm_decode_attention as the host handlers see it (the header of the
// host / device-code pair attention_cuda.cc / attention_kernels.cu): what the kernels
// read and write, and one launch function per stage.
//
// Launch shape depends on static shapes only (attention_plan.h): split grid = (splits,
// head groups, batch), combine grid = (q_heads, batch). Each block reads its sequence's
// length from device memory and returns at once when it has no chunk, so a CUDA graph
// captured once stays correct while the sequences grow (host code does not run on
// graph replay).
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

namespace jax_vmm::attention {

// Everything the kernels read and write: device pointers and static shapes.
struct KernelParams {
  const void* q;  // (B, Hq, D) or (B, S, Hq, D)
  const void* k;  // (B, T, Hkv, D)
  const void* v;
  const int32_t* lengths;  // (B,)
  void* out;               // q's shape
  float* ws_acc;           // [P][D], P = B * S * Hq * splits (workspace layout of attention_plan.h)
  float* ws_m;             // [P]
  float* ws_l;             // [P]
  int batch, max_tokens, q_heads, kv_heads, head_dim;
  int token_heads;  // head rows between a sequence's consecutive tokens (Shapes::token_heads)
  int group;        // q_heads / kv_heads
  int head_group;  // query rows per tensor-core block (S = 1: heads)
  int chunk, splits;
  float scale_log2;  // softmax scale * log2(e): logits are kept in log2 units
};

// The general attention's parameters (Semantics in attention_ffi.h): the kRows kernels
// take this struct; the decode kernels keep KernelParams as it was (a kernel parameter's
// size and layout steer ptxas's register allocation of the tensor-core kernels).
struct RowKernelParams : KernelParams {
  bool rows = false;                   // false: plain decode (S = 1, no option)
  int row_blocks = 0;                  // tensor-core blocks per (sequence, KV head)
  int q_len = 1;                       // S
  const int32_t* q_lengths = nullptr;  // (B,) or null (every row live)
  int window = 0;                      // 0 = none
  float softcap = 0.f;                 // 0 = none
  float scale = 0.f;                   // the softmax scale (softcap applies before log2 units)
};

enum class ElementType { kF32, kBF16, kF16 };

// Which split kernel runs (see attention_kernels.cu).
enum class SplitKernel {
  kTensorCore,         // bf16/fp16, head_dim 64/128/256, two tiles in flight where it fits
  kTensorCoreOneTile,  // the same with one tile in flight per warp (benchmarking)
  kSimple,             // any dtype and head_dim, CUDA cores
};

// The split stage: partial results of every live split into the workspace. kTensorCore*
// need kBF16/kF16 and head_dim 64, 128 or 256 (the host checks).
cudaError_t LaunchSplitKernel(const RowKernelParams& p, ElementType type, SplitKernel kernel,
                              cudaStream_t stream);

// The combine stage: the output from the live splits (zeros for length 0).
cudaError_t LaunchCombineKernel(const RowKernelParams& p, ElementType type, cudaStream_t stream);

}  // namespace jax_vmm::attention
