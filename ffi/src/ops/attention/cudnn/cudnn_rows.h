// Kernels around a cuDNN graph that keep jax_vmm.attention's contract where cuDNN's own
// differs: rows it leaves unwritten, and bytes past the lengths that it reads.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

namespace jax_vmm::cudnn {

// Zeroes the output rows cuDNN leaves unwritten: query rows s >= min(q_lengths[b],
// lengths[b]) of out (B, S, row_bytes), so that padded query rows and sequences of
// length 0 give zeros. row_bytes must be a multiple of 16 (H_q * D * 2 with D % 8 == 0).
cudaError_t LaunchZeroRows(void* out, const int32_t* q_lengths, const int32_t* lengths,
                           int64_t batch, int64_t q_tokens, int64_t row_bytes,
                           cudaStream_t stream);

// Replaces with +0 every NaN or infinity of K and V in the tokens past each sequence's
// length up to the end of its kReadTileTokens tile: t in [n, min(roundup(n, tile), T)),
// n = clamp(lengths[b], 0, T). cuDNN's multi-query, windowed and soft-capped graphs read
// whole tiles and mask only the scores, so a masked probability (0) times a NaN value
// still makes the row NaN; its plain decode graph stops at the length and needs none of
// this. Finite values stay as they are: a later call with longer lengths reads what was
// written there, unless it was NaN or inf. Token (b, t) starts at element
// (b * T + t) * token_stride of k and of v and has row_elems 16-bit values (bfloat16, or
// float16 when fp16). Only for memory jax_vmm owns (a KV arena's layer): never for XLA's
// operands, which are immutable.
inline constexpr int64_t kReadTileTokens = 128;  // READ_TILE_TOKENS in jax_vmm/kv/backing.py
cudaError_t LaunchZeroNonFiniteTail(void* k, void* v, const int32_t* lengths, int64_t batch,
                                    int64_t max_tokens, int64_t token_stride, int64_t row_elems,
                                    bool fp16, cudaStream_t stream);

}  // namespace jax_vmm::cudnn
