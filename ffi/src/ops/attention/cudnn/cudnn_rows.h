// The one small kernel each cuDNN attention call launches before its graph: it writes the
// per-sequence lengths the graph reads and zeroes the output rows the graph will not
// write, so that padded query rows and sequences of length 0 give zeros as
// jax_vmm.attention promises. One launch instead of a clamp before the graph and a zeroing
// after it: each is a node of the command buffer, and at small shapes a node costs about
// what the attention does.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

namespace jax_vmm::cudnn {

struct RowsPlan {
  const int32_t* lengths = nullptr;    // (B,) cached tokens per sequence
  const int32_t* q_lengths = nullptr;  // (B,) query rows per sequence
  // Optional: the tokens each sequence ensured (a KVCache layer); a length past it is
  // clamped to it and counted in *clamped.
  const int32_t* limits = nullptr;
  unsigned long long* clamped = nullptr;
  int32_t max_tokens = 0;  // T: lengths are clamped to [0, T]
  // (2, B): row 0 the lengths read, n = min(clamp(lengths, 0, T), limits); row 1 the
  // query rows computed, min(clamp(q_lengths, 0, S), n). The graph reads these.
  int32_t* read = nullptr;
  int64_t batch = 0, q_tokens = 0;
  // (B, S, row_bytes) output; rows s >= read[1][b] are zeroed. Null: no zeroing.
  void* out = nullptr;
  int64_t row_bytes = 0;  // a multiple of 16 (H_q * D * 2 with D % 8 == 0)
};

cudaError_t LaunchPrepareRows(const RowsPlan& plan, cudaStream_t stream);

}  // namespace jax_vmm::cudnn
