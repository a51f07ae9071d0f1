// Host side of a kv_write call (see kv_write_call.h).
#include "ops/kv_write/kv_write_call.h"

#include <cstring>
#include <string>

#include "common/format.h"
#include "jax_vmm/arena.h"

namespace jax_vmm::kv {
namespace {

std::string Shape(const Dims& d) { return ShapeString(d.d, static_cast<size_t>(d.rank)); }

int64_t Product(const Dims& d, int64_t from, int64_t to) {
  int64_t p = 1;
  for (int64_t i = from; i < to; ++i) p *= d.d[i];
  return p;
}

}  // namespace

std::string CheckGeometry(const char* op, const Dims& k, const Dims& v, const Dims& new_k,
                          const Dims& new_v, const Dims& slots, const Dims* status, Geometry* out) {
  const std::string pre = std::string(op) + ": ";
  if (k.rank < 3) {
    return pre + "the cache k must have rank >= 3 (..., num_kv_heads, head_dim), got shape " +
           Shape(k);
  }
  if (k.rank != v.rank || std::memcmp(k.d, v.d, sizeof(int64_t) * k.rank) != 0 ||
      k.dtype != v.dtype) {
    return pre + "k and v must have the same shape and dtype, got " + Shape(k) + " and " + Shape(v);
  }
  if (new_k.rank != 3 || new_v.rank != 3 || new_k.d[1] != k.d[k.rank - 2] ||
      new_k.d[2] != k.d[k.rank - 1] || std::memcmp(new_k.d, new_v.d, sizeof(int64_t) * 3) != 0 ||
      new_k.dtype != k.dtype || new_v.dtype != k.dtype) {
    return pre + "new_k/new_v must be (n, " + std::to_string(k.d[k.rank - 2]) + ", " +
           std::to_string(k.d[k.rank - 1]) + ") in the cache's dtype, got " + Shape(new_k) +
           " and " + Shape(new_v);
  }
  const int64_t n = new_k.d[0];
  if (slots.rank != 1 || slots.d[0] != n) {
    return pre + "slots must be int32 of shape (" + std::to_string(n) + ",), got " + Shape(slots);
  }
  if (status != nullptr && (status->rank != 2 || status->d[0] != 2 || status->d[1] != n)) {
    return pre + "status must be int32 of shape (2, " + std::to_string(n) + "), got " +
           Shape(*status);
  }
  const int64_t row = Product(k, k.rank - 2, k.rank);
  const int64_t elems = Product(k, 0, k.rank);
  if (row <= 0 || k.bytes % static_cast<size_t>(elems == 0 ? 1 : elems) != 0) {
    return pre + "cannot derive the element size of k";
  }
  out->n = n;
  out->num_slots = elems / row;
  out->token_bytes = static_cast<uint64_t>(k.bytes / static_cast<size_t>(elems)) * row;
  if (new_k.bytes != static_cast<size_t>(n) * out->token_bytes) {
    return pre + "new_k holds " + std::to_string(new_k.bytes) + " bytes, expected " +
           std::to_string(n * out->token_bytes);
  }
  return "";
}

namespace {

// CUDA handlers may be recorded into graphs that outlive the arena: pin its metadata.
bool Pin(const char* driver_kind) { return std::strcmp(driver_kind, "cuda") == 0; }

// Whether a buffer FindArenaBuffer found can be a handler's target on `driver_kind`.
bool Usable(const BufferRef& ref, const char* driver_kind) {
  return std::strcmp(ref.driver_kind, driver_kind) == 0 && ref.page_table != nullptr &&
         ref.chunk_bytes != 0;
}

// The arena buffer that starts exactly at `dest` and holds `bytes`.
bool ResolveDest(uintptr_t dest, size_t bytes, const char* driver_kind, BufferRef* ref) {
  return FindArenaBuffer(dest, bytes, ref, Pin(driver_kind)) && ref->buffer_base == dest &&
         Usable(*ref, driver_kind);
}

// The arena buffer that holds the `bytes` XLA handed over at `handed`.
bool ResolveHanded(void* handed, size_t bytes, const char* driver_kind, BufferRef* ref) {
  return handed != nullptr &&
         FindArenaBuffer(reinterpret_cast<uintptr_t>(handed), bytes, ref, Pin(driver_kind)) &&
         Usable(*ref, driver_kind);
}

// Fills the target of side `s` (0 = k, 1 = v); an error message, or "".
std::string ResolveSide(Op op, const char* driver_kind, bool require_arena, int s,
                        const SideInput& in, Side* side, Resolution* out) {
  const char* name = op == Op::kWrite ? "jax_vmm.kv_write" : "jax_vmm.kv_write_through";
  *side = Side{};
  side->src = static_cast<const uint8_t*>(in.src);
  side->status = in.status;
  BufferRef ref;
  if (in.dest != 0) {
    if (!ResolveDest(in.dest, in.bytes, driver_kind, &ref)) {
      return std::string(name) + ": dest_" + (s == 0 ? "k" : "v") + " " + Hex(in.dest) +
             " is not the start of a live jax_vmm arena buffer of at least " +
             std::to_string(in.bytes) + " bytes on this platform (" + driver_kind +
             "). The arena was closed, or the dest belongs to another cache: pass "
             "dest=kv.dest(layer) of the open KV arena whose views you write.";
    }
    side->dst = reinterpret_cast<uint8_t*>(in.dest);
  } else if (ResolveHanded(in.handed, in.bytes, driver_kind, &ref)) {
    side->dst = static_cast<uint8_t*>(in.handed);
  } else {
    out->non_arena = true;
    if (op == Op::kWrite) {
      side->dst = static_cast<uint8_t*>(in.handed);  // a plain functional write
    } else if (require_arena) {
      return std::string(name) +
             ": the cache operand is not memory of a jax_vmm arena (XLA handed the custom "
             "call a copy) and no dest was given. Pass dest=kv.dest(layer), or the arena "
             "views (kv.k[l], kv.v[l]) directly as jit arguments that no other op updates.";
    }
    return "";
  }
  side->page_table = ref.page_table;
  side->arena_base = ref.arena_base;
  side->chunk_bytes = ref.chunk_bytes;
  side->drop_counter = ref.drop_counter;
  if (op == Op::kWrite && in.handed != side->dst) {
    side->dst2 = static_cast<uint8_t*>(in.handed);
    out->alias_miss = true;
  }
  return "";
}

}  // namespace

std::string ResolveSides(Op op, const char* driver_kind, bool require_arena, const SideInput in[2],
                         Params* p, Resolution* out) {
  *out = Resolution{};
  for (int s = 0; s < 2; ++s) {
    std::string err = ResolveSide(op, driver_kind, require_arena, s, in[s], &p->side[s], out);
    if (!err.empty()) return err;
  }
  return "";
}

std::string PrepareCall(Op op, const char* driver_kind, bool require_arena, const CallOperands& in,
                        Params* p, Resolution* r) {
  const char* name = op == Op::kWrite ? "jax_vmm_kv_write" : "jax_vmm_kv_write_through";
  Geometry g;
  std::string err = CheckGeometry(name, in.k, in.v, in.new_k, in.new_v, in.slots, in.status, &g);
  if (!err.empty()) return err;
  p->slots = in.slot_values;
  p->n = g.n;
  p->num_slots = g.num_slots;
  p->token_bytes = g.token_bytes;
  return ResolveSides(op, driver_kind, require_arena, in.side, p, r);
}

}  // namespace jax_vmm::kv
