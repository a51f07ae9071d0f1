// Python bindings of the KV cache object behind jax_vmm.KVArena (ops/kv_cache/kv_cache.h):
// its uid, the table of ensured tokens, the read-clamp counter, close, and a registry
// query for tests and messages.
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/shared_ptr.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "jax_vmm/arena.h"
#include "jax_vmm/errors.h"
#include "ops/kv_cache/kv_cache.h"
#include "python/bindings.h"
#include "xla/ffi/api/ffi.h"

namespace nb = nanobind;

namespace jax_vmm {
namespace {

using kvcache::KvCache;

// The XLA element type of a numpy dtype name (what the handlers compare tokens against).
int XlaDtype(const std::string& name) {
  using T = xla::ffi::DataType;
  static const std::map<std::string, T> types = {{"float32", T::F32},
                                                 {"float16", T::F16},
                                                 {"bfloat16", T::BF16},
                                                 {"float64", T::F64},
                                                 {"float8_e4m3fn", T::F8E4M3FN},
                                                 {"uint8", T::U8},
                                                 {"uint16", T::U16},
                                                 {"uint32", T::U32},
                                                 {"uint64", T::U64},
                                                 {"int8", T::S8},
                                                 {"int16", T::S16},
                                                 {"int32", T::S32},
                                                 {"int64", T::S64},
                                                 {"bool", T::PRED}};
  auto it = types.find(name);
  if (it == types.end()) {
    throw InvalidArgument("KV cache: dtype " + name + " has no XLA element type here");
  }
  return static_cast<int>(it->second);
}

std::shared_ptr<KvCache> Create(std::shared_ptr<Arena> arena, const std::vector<int64_t>& k_ids,
                                const std::vector<int64_t>& v_ids, int64_t max_seqs,
                                bool per_sequence, int64_t max_tokens, int64_t kv_heads,
                                int64_t head_dim, const std::string& dtype, size_t itemsize,
                                int device_ordinal, uint64_t shared_uid, bool interleaved) {
  kvcache::Geometry g;
  g.interleaved = interleaved;
  g.num_layers = static_cast<int64_t>(k_ids.size());
  g.max_seqs = max_seqs;
  g.per_sequence = per_sequence;
  g.max_tokens = max_tokens;
  g.kv_heads = kv_heads;
  g.head_dim = head_dim;
  g.dtype = XlaDtype(dtype);
  g.element_bytes = itemsize;
  return KvCache::Create(std::move(arena), k_ids, v_ids, g, device_ordinal, shared_uid);
}

const char* LookupName(kvcache::CacheLookup l) {
  switch (l) {
    case kvcache::CacheLookup::kFound:
      return "found";
    case kvcache::CacheLookup::kClosed:
      return "closed";
    case kvcache::CacheLookup::kGone:
      return "gone";
    case kvcache::CacheLookup::kOtherDevice:
      break;
  }
  return "other_device";
}

}  // namespace

void BindKvCache(nb::module_& m) {
  nb::class_<KvCache>(m, "KvCache",
                      "The C++ side of a KV arena: the identity the KVCache pytree carries, the "
                      "table of ensured tokens the kernels check, the read-clamp counter. "
                      "Thread-safe. Use jax_vmm.KVArena rather than this class.")
      .def_prop_ro("uid", &KvCache::uid)
      .def_prop_ro("device_ordinal", &KvCache::device_ordinal)
      .def_prop_ro("closed", &KvCache::closed)
      // The table calls keep the GIL: they are one small copy (~10 us) on the driver's
      // metadata stream, and giving the GIL up to the commit-ahead thread for that long
      // costs the dispatching thread more in the hand-back than it saves. Nothing they
      // wait for (the cache's mutex, that stream) is held by a thread that needs the GIL.
      .def("set_limit", &KvCache::SetLimit, nb::arg("seq"), nb::arg("tokens"),
           "Tokens ensured for a sequence: the writers' table before it returns, the "
           "readers' in dispatch order (CUDA).")
      .def("set_limits", &KvCache::SetLimits, nb::arg("tokens"),
           "Every sequence's ensured tokens at once: one copy to the device.")
      .def(
          "raise_limits",
          [](KvCache& c, nb::ndarray<const int64_t, nb::ndim<1>, nb::c_contig, nb::device::cpu> t) {
            return c.RaiseLimits(t.data(), t.shape(0));
          },
          nb::arg("tokens").noconvert(),
          "Raises each sequence's entry to tokens[seq] (an int64 array, one per sequence) "
          "where that is higher: one copy to the device if any changed. Returns whether one "
          "did.")
      .def("limits", &KvCache::Limits)
      .def("begin_epoch", &KvCache::BeginEpoch,
           "Keeps the table for readers of the current epoch and advances it (host driver: "
           "a release that does not wait for the work in flight). Returns the new epoch.")
      .def("forget_epochs_before", &KvCache::ForgetEpochsBefore, nb::arg("epoch"),
           "Drops the tables kept for epochs before `epoch` (their work has finished).")
      .def_prop_ro("epoch", &KvCache::epoch)
      .def("set_floor", &KvCache::SetFloor, nb::arg("seq"), nb::arg("tokens"),
           "Tokens of a sequence below which writes are dropped (its shared prefix).")
      .def("floors", &KvCache::Floors)
      .def("read_clamps", &KvCache::ReadClamps, nb::call_guard<nb::gil_scoped_release>())
      .def("reset_read_clamps", &KvCache::ResetReadClamps, nb::call_guard<nb::gil_scoped_release>())
      .def("close", &KvCache::Close, nb::call_guard<nb::gil_scoped_release>());
  m.def("create_kv_cache", &Create, nb::arg("arena"), nb::arg("k_ids"), nb::arg("v_ids"),
        nb::arg("max_seqs"), nb::arg("per_sequence"), nb::arg("max_tokens"), nb::arg("kv_heads"),
        nb::arg("head_dim"), nb::arg("dtype"), nb::arg("itemsize"), nb::arg("device_ordinal"),
        nb::arg("shared_uid") = 0, nb::arg("interleaved") = false,
        "A KV cache over layer buffers of `arena`, registered under a new uid, or (shared_uid) "
        "a shard joining the live cache of that uid on another device ordinal. interleaved: "
        "k_ids and v_ids name one buffer holding every layer (kvcache::Geometry).");
  m.def(
      "find_kv_cache",
      [](uint64_t uid, int device_ordinal) {
        std::shared_ptr<KvCache> c;
        return std::string(LookupName(kvcache::FindKvCache(uid, device_ordinal, &c)));
      },
      nb::arg("uid"), nb::arg("device_ordinal"),
      "What a handler on this device ordinal finds under the uid: 'found', 'closed', 'gone' "
      "or 'other_device'.");
}

}  // namespace jax_vmm
