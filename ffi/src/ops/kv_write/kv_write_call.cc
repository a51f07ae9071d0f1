// Host side of a kv_write call (see kv_write_call.h).
#include "ops/kv_write/kv_write_call.h"

#include <cstring>
#include <string>

#include "common/format.h"
#include "jax_vmm/arena.h"
#include "ops/kv_cache/kv_cache.h"

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

const char* OpName(Op op) {
  switch (op) {
    case Op::kWrite:
      return "jax_vmm.kv_write";
    case Op::kWriteThrough:
      return "jax_vmm.kv_write_through";
    case Op::kCacheWrite:
      break;
  }
  return "jax_vmm.kv_write (KVCache layer)";
}

std::string BufferName(const std::string& name, const BufferRef& ref) {
  return "buffer '" + name + "' (uid " + std::to_string(ref.buffer_uid) + ") of arena " +
         std::to_string(ref.arena_uid);
}

// Why the dest of one side cannot be written, for the error message.
std::string StaleDestMessage(Op op, const char* driver_kind, char side, const SideInput& in) {
  const std::string pre = std::string(OpName(op)) + ": dest_" + side + " is ";
  const std::string remedy =
      ": a KVDest names the buffers of one arena for good. Make a new one with "
      "kv.dest(layer) of an open KV arena (a step traced with the old dest must be traced "
      "again)";
  BufferRef ref;
  std::string name;
  switch (FindArenaBufferByUid(in.dest_uid, &ref, &name)) {
    case UidLookup::kClosed:
      return pre + BufferName(name, ref) + ", which was closed" + remedy;
    case UidLookup::kGone: {
      std::string now;
      if (FindArenaBuffer(in.dest, 1, &ref) &&
          FindArenaBufferByUid(ref.buffer_uid, &ref, &name) == UidLookup::kFound) {
        now = " (the address now holds " + BufferName(name, ref) +
              "; addresses are reused, uids never are)";
      }
      return pre + "buffer uid " + std::to_string(in.dest_uid) + " at " + Hex(in.dest) +
             ", which no longer exists: its arena was destroyed or the buffer freed" + now + remedy;
    }
    case UidLookup::kFound:
      break;
  }
  if (!Usable(ref, driver_kind)) {
    return pre + BufferName(name, ref) + ", memory of a " + ref.driver_kind +
           " arena, but the call runs on " + driver_kind +
           ": pass the dest of a KV arena on the device the step runs on";
  }
  return pre + BufferName(name, ref) + " at " + Hex(ref.buffer_base) + " of " +
         std::to_string(ref.buffer_bytes) + " bytes, but the call names address " + Hex(in.dest) +
         " and a cache of " + std::to_string(in.bytes) +
         " bytes: pass a dest made by kv.dest(layer) for the cache you write";
}

// The buffer the dest's uid names, if its address and size are the dest's.
bool ResolveDest(const SideInput& in, const char* driver_kind, BufferRef* ref) {
  std::string name;
  return FindArenaBufferByUid(in.dest_uid, ref, &name, Pin(driver_kind)) == UidLookup::kFound &&
         ref->buffer_base == in.dest && ref->buffer_bytes >= in.bytes && Usable(*ref, driver_kind);
}

// The arena buffer that holds the `bytes` XLA handed over at `handed`.
bool ResolveHanded(void* handed, size_t bytes, const char* driver_kind, BufferRef* ref) {
  return handed != nullptr &&
         FindArenaBuffer(reinterpret_cast<uintptr_t>(handed), bytes, ref, Pin(driver_kind)) &&
         Usable(*ref, driver_kind);
}

// A handed buffer inside some arena's reservation that is not the side's target: a view
// of another buffer (with a dest of this one), of a freed buffer or of a closed arena.
// Writing it as plain memory would skip its page checks (unbacked pages are read-only).
std::string StaleHandedMessage(Op op, char side, const SideInput& in, const BufferRef* found) {
  std::string what = "a view of a freed buffer or of a closed arena";
  BufferRef ref;
  std::string name;
  if (found != nullptr &&
      FindArenaBufferByUid(found->buffer_uid, &ref, &name) == UidLookup::kFound) {
    what = BufferName(name, ref);
  }
  std::string dest;
  if (in.dest != 0 && FindArenaBufferByUid(in.dest_uid, &ref, &name) == UidLookup::kFound) {
    dest = " but dest names " + BufferName(name, ref);
  }
  return std::string(OpName(op)) + ": the cache operand " + side + " (handed over at " +
         Hex(reinterpret_cast<uintptr_t>(in.handed)) + ") is " + what + dest +
         ". Pass the views of the buffers you write (kv.k[layer], kv.v[layer] of an open "
         "arena, taken after any close() or free()) with their own dest=kv.dest(layer)";
}

// A target that is a buffer of a KV cache is checked against the cache's table of
// ensured tokens; an error message when the call sees the buffer with a token size the
// cache does not have (the table could not say which token is which), or "".
std::string AttachLimits(Op op, char side_name, const BufferRef& ref, uint64_t token_bytes,
                         Side* side) {
  const std::shared_ptr<kvcache::KvCache> cache = kvcache::FindKvCacheOfBuffer(ref.buffer_uid);
  if (cache == nullptr) return "";
  const kvcache::Geometry& g = cache->geometry();
  if (g.interleaved && op != Op::kCacheWrite) {
    return std::string(OpName(op)) + ": the cache " + side_name +
           " is a buffer of KV cache " + std::to_string(cache->uid()) +
           ", which interleaves every layer in one buffer (kv_arena(..., "
           "layout='interleaved')): write it through its cache, kv_write(kv.cache()[layer], "
           "...), not through arrays";
  }
  if (token_bytes != g.token_bytes()) {
    return std::string(OpName(op)) + ": the cache " + side_name +
           " is a view of a buffer of KV cache " + std::to_string(cache->uid()) +
           " whose tokens are " + std::to_string(g.token_bytes()) +
           " bytes, but the call writes tokens of " + std::to_string(token_bytes) +
           " bytes: write it through views of its own shape (kv.k[layer], kv.v[layer])";
  }
  side->limits = cache->device_limits();
  side->floors = cache->device_floors();
  side->limit_offset = reinterpret_cast<uintptr_t>(side->dst) - ref.buffer_base;
  side->seq_bytes = g.seq_bytes();
  side->cache_row_bytes = g.row_bytes();
  side->slot_bytes = g.row_bytes();  // the token size, or interleaved: every layer's row
  // The table outlives the call: a closed cache keeps it (zeroed) while its arena lives,
  // and a CUDA graph that bakes it in pins it.
  if (std::strcmp(ref.driver_kind, "cuda") == 0) cache->PinMetadataForGraphs();
  return "";
}

// Fills the target of side `s` (0 = k, 1 = v); an error message, or "".
std::string ResolveSide(Op op, const char* driver_kind, bool require_arena, int s,
                        const SideInput& in, uint64_t token_bytes, Side* side, Resolution* out) {
  const char side_name = s == 0 ? 'k' : 'v';
  *side = Side{};
  side->slot_bytes = token_bytes;
  side->src = static_cast<const uint8_t*>(in.src);
  side->status = in.status;
  const uintptr_t handed = reinterpret_cast<uintptr_t>(in.handed);
  BufferRef handed_ref;
  const bool handed_arena = ResolveHanded(in.handed, in.bytes, driver_kind, &handed_ref);
  const bool in_reservation = in.handed != nullptr && InArenaReservation(handed, in.bytes);
  BufferRef ref;
  if (in.dest != 0) {
    if (!ResolveDest(in, driver_kind, &ref))
      return StaleDestMessage(op, driver_kind, side_name, in);
    side->dst = reinterpret_cast<uint8_t*>(in.dest + in.dest_offset);
    if (in_reservation && !(handed_arena && handed_ref.buffer_uid == in.dest_uid)) {
      return StaleHandedMessage(op, side_name, in, handed_arena ? &handed_ref : nullptr);
    }
  } else if (handed_arena) {
    ref = handed_ref;
    side->dst = static_cast<uint8_t*>(in.handed);
  } else if (in_reservation) {
    return StaleHandedMessage(op, side_name, in, nullptr);
  } else {
    out->non_arena = true;
    if (op == Op::kWrite) {
      side->dst = static_cast<uint8_t*>(in.handed);  // a plain functional write
    } else if (require_arena) {
      return std::string(OpName(op)) +
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
  return AttachLimits(op, side_name, ref, token_bytes, side);
}

}  // namespace

std::string ResolveSides(Op op, const char* driver_kind, bool require_arena, const SideInput in[2],
                         Params* p, Resolution* out) {
  *out = Resolution{};
  for (int s = 0; s < 2; ++s) {
    std::string err =
        ResolveSide(op, driver_kind, require_arena, s, in[s], p->token_bytes, &p->side[s], out);
    if (!err.empty()) return err;
  }
  return "";
}

std::string PrepareCall(Op op, const char* driver_kind, bool require_arena, const CallOperands& in,
                        Params* p, Resolution* r) {
  const char* name = op == Op::kWriteThrough ? "jax_vmm_kv_write_through" : "jax_vmm_kv_write";
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
