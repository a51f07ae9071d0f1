// Host side of a kv_write call, shared by the CPU and CUDA handlers: geometry checks and
// where each side's tokens go (the resolution of dest / handed buffers against the arena
// registry), before any memory is touched.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

#include "ops/kv_write/kv_write.h"

namespace jax_vmm::kv {

// Shape facts every handler checks again (Python checks them at trace time; the
// handler must never trust them when touching memory).
struct Geometry {
  int64_t n = 0;
  int64_t num_slots = 0;
  uint64_t token_bytes = 0;
};

// Dimensions as the FFI hands them over, kept independent of the XLA headers here.
struct Dims {
  const int64_t* d = nullptr;
  int64_t rank = 0;
  size_t bytes = 0;
  int dtype = 0;
};

// Empty string when (k, v, new_k, new_v, slots[, status]) fit together; else the error.
std::string CheckGeometry(const char* op, const Dims& k, const Dims& v, const Dims& new_k,
                          const Dims& new_v, const Dims& slots, const Dims* status, Geometry* out);

// kWrite / kWriteThrough: the array-level calls (jax_vmm.kv_write(k, v, ...),
// kv_write_through); kCacheWrite: kv_write on a KVCache layer, whose sides name their
// buffers by dest alone (no buffer is handed over: the arena is not an XLA value).
enum class Op { kWrite, kWriteThrough, kCacheWrite };

// The static destination attributes of a call (0 = none).
struct Dest {
  uint64_t k = 0, v = 0;          // buffer addresses
  uint64_t k_uid = 0, v_uid = 0;  // buffer uids: the identity
};

// What the handler knows about one side before the writes.
struct SideInput {
  uintptr_t dest = 0;         // the static destination attribute, 0 = none
  uint64_t dest_uid = 0;      // its buffer uid
  void* handed = nullptr;     // kv_write: the output buffer; write-through: the operand
  size_t bytes = 0;           // size of the cache (k or v)
  const void* src = nullptr;  // new tokens
  int32_t* status = nullptr;  // write-through's status row, or null
  uint64_t dest_offset = 0;   // where the layer starts in dest's buffer (interleaved caches)
};

struct Resolution {
  bool alias_miss = false;  // kv_write: the output is not the target (XLA copied the cache)
  bool non_arena = false;   // no arena target at all: only XLA's buffer was written
};

// Fills p->side[0..1] for a call of `op` on `driver_kind` ("host" or "cuda"). Returns an
// error message (empty on success): a dest whose uid names no buffer of an open arena (or
// whose address or size does not match that buffer); a handed buffer that lies in an
// arena's reservation but is not the target (a view of another buffer, of a freed buffer
// or of a closed arena: writing it would skip its page checks); or (require_arena) a
// write-through without arena. A target that is a KV cache's buffer gets that cache's
// table of ensured tokens (Side::limits), whatever the op.
std::string ResolveSides(Op op, const char* driver_kind, bool require_arena, const SideInput in[2],
                         Params* p, Resolution* out);

// One call's operands as the handler received them (kv_write_ffi.h unpacks them from the
// FFI buffers).
struct CallOperands {
  Dims k, v, new_k, new_v, slots;
  const Dims* status = nullptr;  // write-through's status result, else null
  const int32_t* slot_values = nullptr;
  SideInput side[2];
};

// Everything a handler does before touching memory: checks the geometry of
// (k, v, new_k, new_v, slots[, status]), fills *p (slots, sizes) and resolves both
// sides. Returns an error message, empty on success.
std::string PrepareCall(Op op, const char* driver_kind, bool require_arena, const CallOperands& in,
                        Params* p, Resolution* r);

}  // namespace jax_vmm::kv
