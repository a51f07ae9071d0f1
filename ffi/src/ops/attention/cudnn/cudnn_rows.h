// The small kernels around a cuDNN attention graph. cuDNN's padding mask leaves every row
// of a sequence of length 0 unwritten, and writes rows past q_lengths of the other
// sequences with values of its own; jax_vmm.attention promises zeros in both.
//
// - PrepareRows, before the graph, when lengths must be clamped to a KVCache layer's
//   ensured tokens or when the call is plain decode (S = 1 and q_lengths = 1: then the only
//   rows not computed are those of length-0 sequences, so zeroing them before the graph is
//   enough, and the call needs one small kernel, not two).
// - ZeroRows, after the graph, for every other call: rows s >= min(q_lengths, lengths).
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
  // (B, S, row_bytes) output: every row of a sequence with n = 0 is zeroed. Null: none.
  void* out = nullptr;
  int64_t row_bytes = 0;  // a multiple of 16 (H_q * D * 2 with D % 8 == 0)
};

cudaError_t LaunchPrepareRows(const RowsPlan& plan, cudaStream_t stream);

// Zeroes query rows s >= min(q_lengths[b], lengths[b]) of out (B, S, row_bytes).
cudaError_t LaunchZeroRows(void* out, const int32_t* q_lengths, const int32_t* lengths,
                           int64_t batch, int64_t q_tokens, int64_t row_bytes,
                           cudaStream_t stream);

}  // namespace jax_vmm::cudnn
