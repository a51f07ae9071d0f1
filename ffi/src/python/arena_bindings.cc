// Python bindings of Arena, the drivers' factory functions and the device query.
#include <nanobind/nanobind.h>
#include <nanobind/stl/pair.h>
#include <nanobind/stl/shared_ptr.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/tuple.h>
#include <nanobind/stl/vector.h>

#include <cstdint>
#include <memory>
#include <string>
#include <utility>

#include "core/view_fits.h"
#include "jax_vmm/arena.h"
#include "jax_vmm/driver.h"
#include "jax_vmm/errors.h"
#include "python/bindings.h"
#include "python/dlpack_capsule.h"

namespace nb = nanobind;

namespace jax_vmm {

namespace {

nb::dict BufferDict(const BufferInfo& b) {
  nb::dict d;
  d["id"] = b.id;
  d["uid"] = b.uid;
  d["name"] = b.name;
  d["offset"] = b.offset;
  d["nbytes"] = b.nbytes;
  d["backed_bytes"] = b.backed_bytes;
  d["address"] = static_cast<uint64_t>(b.address);
  return d;
}

nb::dict StatsDict(const ArenaStats& s) {
  nb::dict d;
  d["driver"] = s.driver_kind;
  d["device_ordinal"] = s.device_ordinal;
  d["granularity"] = s.granularity;
  d["chunk_bytes"] = s.chunk_bytes;
  d["handle_bytes"] = s.handle_bytes;
  d["zero_fill"] = s.zero_fill;
  d["reserved_bytes"] = s.reserved_bytes;
  d["placed_bytes"] = s.placed_bytes;
  d["backed_bytes"] = s.backed_bytes;
  d["peak_backed_bytes"] = s.peak_backed_bytes;
  d["held_bytes"] = s.held_bytes;
  d["parked_bytes"] = s.parked_bytes;
  d["retired_bytes"] = s.retired_bytes;
  d["alias_bytes"] = s.alias_bytes;
  d["shared_bytes"] = s.shared_bytes;
  d["chunks_shared"] = s.chunks_shared;
  d["num_buffers"] = s.num_buffers;
  d["commit_calls"] = s.commit_calls;
  d["decommit_calls"] = s.decommit_calls;
  d["commit_seconds"] = s.commit_seconds;
  d["decommit_seconds"] = s.decommit_seconds;
  d["chunks_created"] = s.chunks_created;
  d["chunks_released"] = s.chunks_released;
  d["chunks_revived"] = s.chunks_revived;
  d["handles_created"] = s.handles_created;
  d["handles_released"] = s.handles_released;
  d["set_access_calls"] = s.set_access_calls;
  d["failed_commits"] = s.failed_commits;
  d["commit_drains"] = s.commit_drains;
  d["commits_ahead"] = s.commits_ahead;
  d["deferred_releases"] = s.deferred_releases;
  d["reclaim_syncs"] = s.reclaim_syncs;
  d["live_views"] = s.live_views;
  d["held_range_bytes"] = s.held_range_bytes;
  d["views_exported"] = s.views_exported;
  d["unbacked_reads_zero"] = s.unbacked_reads_zero;
  d["asleep"] = s.asleep;
  d["sleep_image_bytes"] = s.sleep_image_bytes;
  d["offloaded_bytes"] = s.offloaded_bytes;
  d["host_cached_bytes"] = s.host_cached_bytes;
  d["pending_transfers"] = s.pending_transfers;
  d["closed"] = s.closed;
  return d;
}

// A DLPack capsule over a buffer whose deleter drops a view lease (no GIL): the view
// keeps the arena's reservation alive and counts as a live view of the buffer. Taking
// the lease may wait for the device (deferred releases finish first): without the GIL.
nb::object View(Arena& a, int64_t buffer_id, std::vector<size_t> shape, uint8_t code, uint8_t bits,
                int device_type, int device_id) {
  const BufferInfo b = a.Buffer(buffer_id);
  CheckViewFits(b, shape, bits);
  DlpackView view;
  view.data = reinterpret_cast<void*>(b.address);
  view.shape.assign(shape.begin(), shape.end());
  view.dtype_code = code;
  view.dtype_bits = bits;
  view.device_type = device_type;
  view.device_id = device_id;
  std::shared_ptr<ViewLease> lease;
  {
    nb::gil_scoped_release release;
    lease = a.LeaseView(buffer_id);
  }
  return MakeDlpackCapsule(view, std::move(lease));
}

nb::dict RefDict(const BufferRef& ref) {
  nb::dict d;
  d["buffer_base"] = static_cast<uint64_t>(ref.buffer_base);
  d["buffer_bytes"] = ref.buffer_bytes;
  d["buffer_id"] = ref.buffer_id;
  d["buffer_uid"] = ref.buffer_uid;
  d["arena_uid"] = ref.arena_uid;
  d["driver_kind"] = std::string(ref.driver_kind);
  d["device_ordinal"] = ref.device_ordinal;
  return d;
}

std::vector<Arena::Range> ToRanges(const std::vector<std::tuple<int64_t, size_t, size_t>>& r) {
  std::vector<Arena::Range> ranges;
  for (const auto& [id, start, stop] : r) ranges.push_back({id, start, stop});
  return ranges;
}

std::vector<Arena::SpanPair> ToSpanPairs(
    const std::vector<std::tuple<int64_t, size_t, int64_t, size_t, size_t>>& s) {
  std::vector<Arena::SpanPair> spans;
  for (const auto& [src, src_start, dst, dst_start, bytes] : s) {
    spans.push_back({src, src_start, dst, dst_start, bytes});
  }
  return spans;
}

nb::tuple TransferTuple(TransferState state, const std::string& error) {
  return nb::make_tuple(static_cast<int>(state), error);
}

nb::object FindBuffer(uint64_t address, size_t nbytes) {
  BufferRef ref;
  if (!FindArenaBuffer(static_cast<uintptr_t>(address), nbytes, &ref)) return nb::none();
  return RefDict(ref);
}

nb::object FindBufferByUid(uint64_t uid) {
  BufferRef ref;
  std::string name;
  const UidLookup found = FindArenaBufferByUid(uid, &ref, &name);
  if (found == UidLookup::kGone) return nb::none();
  nb::dict d = RefDict(ref);
  d["name"] = name;
  d["closed"] = found == UidLookup::kClosed;
  return d;
}

nb::tuple CudaDevices() {
  std::string error;
  nb::list devices;
  for (const CudaDeviceInfo& d : QueryCudaDevices(&error)) {
    nb::dict e;
    e["ordinal"] = d.ordinal;
    e["name"] = d.name;
    e["vmm_supported"] = d.vmm_supported;
    e["granularity_min"] = d.granularity_min;
    e["granularity_recommended"] = d.granularity_recommended;
    e["free_bytes"] = d.free_bytes;
    e["total_bytes"] = d.total_bytes;
    devices.append(e);
  }
  return nb::make_tuple(devices, error);
}

// Properties and queries of the Arena class.
void BindArenaQueries(nb::class_<Arena>& c) {
  c.def_prop_ro("uid", &Arena::uid)
      .def_prop_ro("base", [](const Arena& a) { return static_cast<uint64_t>(a.base()); })
      .def_prop_ro("reserved_bytes", &Arena::reserved_bytes)
      .def_prop_ro("chunk_bytes", &Arena::chunk_bytes)
      .def_prop_ro("handle_bytes", &Arena::handle_bytes)
      .def_prop_ro("zero_fill", &Arena::zero_fill)
      .def_prop_ro("asleep", &Arena::asleep)
      .def_prop_ro("granularity", [](const Arena& a) { return a.driver().granularity(); })
      .def_prop_ro("driver_kind", [](const Arena& a) { return std::string(a.driver().kind()); })
      .def_prop_ro("device_ordinal", [](const Arena& a) { return a.driver().device_ordinal(); })
      .def_prop_ro("closed", &Arena::closed)
      .def("backed_prefix", &Arena::BackedPrefix)
      .def("buffer", [](const Arena& a, int64_t id) { return BufferDict(a.Buffer(id)); })
      .def("buffers",
           [](const Arena& a) {
             nb::list out;
             for (const auto& b : a.Buffers()) out.append(BufferDict(b));
             return out;
           })
      .def("stats",
           [](const Arena& a) {
             nb::dict d = StatsDict(a.Stats());
             const MemInfo mi = a.driver().mem_info();
             d["device_free_bytes"] = mi.free_bytes;
             d["device_total_bytes"] = mi.total_bytes;
             return d;
           })
      .def("drop_count", &Arena::DropCount)
      .def(
          "transfer_state",
          [](const Arena& a, uint64_t ticket) {
            std::string error;
            const TransferState state = a.TransferStatus(ticket, &error);
            return TransferTuple(state, error);
          },
          "(state, error) of a transfer: 0 offloading, 1 offloaded, 2 restoring, 3 restored, "
          "4 failed.")
      .def("live_views", nb::overload_cast<>(&Arena::LiveViews, nb::const_),
           "View leases alive, of every buffer (freed ones included).")
      .def("buffer_live_views", nb::overload_cast<int64_t>(&Arena::LiveViews, nb::const_),
           nb::arg("buffer_id"))
      .def("view", &View,
           "A DLPack capsule over a buffer (pass to jax.dlpack.from_dlpack); its deleter "
           "releases a view lease and needs no GIL.");
}

// The methods of the Arena class that change it (the GIL is released around driver work).
void BindArenaChanges(nb::class_<Arena>& c) {
  c.def(
       "allocate",
       [](Arena& a, size_t nbytes, const std::string& name) {
         BufferInfo info;
         {
           nb::gil_scoped_release release;
           info = a.Allocate(nbytes, name);
         }
         return BufferDict(info);
       },
       nb::arg("nbytes"), nb::arg("name") = "")
      .def(
          "commit_ranges",
          [](Arena& a, const std::vector<std::tuple<int64_t, size_t, size_t>>& r) {
            const std::vector<Arena::Range> ranges = ToRanges(r);
            nb::gil_scoped_release release;
            return a.CommitRanges(ranges);
          },
          "All-or-nothing commit of (buffer_id, start, stop) ranges.")
      .def(
          "commit_ahead",
          [](Arena& a, const std::vector<std::tuple<int64_t, size_t, size_t>>& r) -> int64_t {
            const std::vector<Arena::Range> ranges = ToRanges(r);
            nb::gil_scoped_release release;
            size_t added = 0;
            return a.CommitAhead(ranges, &added) ? static_cast<int64_t>(added) : -1;
          },
          "commit_ranges from a background thread; -1 (skipped) once raw views were handed out.")
      .def(
          "share_spans",
          [](Arena& a, const std::vector<std::tuple<int64_t, size_t, int64_t, size_t, size_t>>& s) {
            const std::vector<Arena::SpanPair> spans = ToSpanPairs(s);
            std::vector<Arena::Range> not_shared;
            size_t shared = 0;
            {
              nb::gil_scoped_release release;
              shared = a.ShareSpans(spans, &not_shared);
            }
            std::vector<std::tuple<int64_t, size_t, size_t>> out;
            for (const Arena::Range& r : not_shared) out.emplace_back(r.buffer_id, r.start, r.stop);
            return std::make_pair(shared, out);
          },
          "Map (src_id, src_start, dst_id, dst_start, bytes) spans' memory at their dst too; "
          "returns (bytes mapped, [(dst_id, start, stop) left out: the caller copies]).")
      .def(
          "copy_spans",
          [](Arena& a, const std::vector<std::tuple<int64_t, size_t, int64_t, size_t, size_t>>& s) {
            const std::vector<Arena::SpanPair> spans = ToSpanPairs(s);
            nb::gil_scoped_release release;
            a.CopySpans(spans);
          },
          "Copy (src_id, src_start, dst_id, dst_start, bytes) spans after the device's work.")
      .def(
          "zero_ranges",
          [](Arena& a, const std::vector<std::tuple<int64_t, size_t, size_t>>& r) {
            const std::vector<Arena::Range> ranges = ToRanges(r);
            nb::gil_scoped_release release;
            return a.ZeroRanges(ranges);
          },
          "Zero the backed, unshared bytes of (buffer_id, start, stop) ranges after the "
          "device's work; returns the bytes zeroed.")
      .def(
          "shared_bytes",
          [](const Arena& a, const std::vector<std::tuple<int64_t, size_t, size_t>>& r) {
            const std::vector<Arena::Range> ranges = ToRanges(r);
            nb::gil_scoped_release release;
            return a.SharedBytes(ranges);
          },
          "Bytes of the chunks in (buffer_id, start, stop) ranges still mapped elsewhere too.")
      .def("free", &Arena::Free, nb::call_guard<nb::gil_scoped_release>())
      .def("commit", &Arena::Commit, nb::call_guard<nb::gil_scoped_release>())
      .def("decommit", &Arena::Decommit, nb::arg("buffer_id"), nb::arg("start"), nb::arg("stop"),
           nb::arg("wait") = false, nb::call_guard<nb::gil_scoped_release>())
      .def(
          "decommit_ranges",
          [](Arena& a, const std::vector<std::tuple<int64_t, size_t, size_t>>& r, bool wait,
             bool defer_unmap) {
            const std::vector<Arena::Range> ranges = ToRanges(r);
            nb::gil_scoped_release release;
            return a.DecommitRanges(ranges, wait, defer_unmap);
          },
          nb::arg("ranges"), nb::arg("wait") = false, nb::arg("defer_unmap") = false,
          "Decommit of (buffer_id, start, stop) ranges in one call; defer_unmap (host): "
          "retire what goes, for reclaim_retired_before.")
      .def("reclaim", &Arena::Reclaim, nb::call_guard<nb::gil_scoped_release>())
      .def_prop_ro("views_exported", &Arena::views_exported)
      .def_prop_ro("unbacked_reads_zero", &Arena::unbacked_reads_zero)
      .def("begin_host_wait", &Arena::BeginHostWait,
           "Host driver: a wait for the work in flight begins; returns its number.")
      .def("reclaim_retired_before",
           nb::overload_cast<uint64_t>(&Arena::ReclaimRetiredBefore), nb::arg("sync"),
           nb::call_guard<nb::gil_scoped_release>(),
           "Gives back what was retired before host wait `sync` began; returns its bytes.")
      .def("sleep", &Arena::Sleep, nb::arg("keep_contents"),
           nb::call_guard<nb::gil_scoped_release>())
      .def("wake", &Arena::Wake, nb::call_guard<nb::gil_scoped_release>())
      .def(
          "offload",
          [](Arena& a, const std::vector<std::tuple<int64_t, size_t, size_t>>& r) {
            const std::vector<Arena::Range> ranges = ToRanges(r);
            nb::gil_scoped_release release;
            return a.Offload(ranges);
          },
          "Offload of (buffer_id, start, stop) ranges; returns the transfer's ticket.")
      .def("restore", &Arena::Restore, nb::arg("ticket"), nb::arg("wait"),
           nb::call_guard<nb::gil_scoped_release>())
      .def(
          "wait_transfer",
          [](const Arena& a, uint64_t ticket) {
            std::string error;
            TransferState state;
            {
              nb::gil_scoped_release release;
              state = a.WaitTransfer(ticket, &error);
            }
            return TransferTuple(state, error);
          },
          "Blocks while the transfer is in flight; returns (state, error).")
      .def("drop_transfer", &Arena::DropTransfer, nb::call_guard<nb::gil_scoped_release>())
      .def("free_host_cache", &Arena::FreeHostCache, nb::call_guard<nb::gil_scoped_release>())
      .def(
          "copy_in",
          [](Arena& a, int64_t id, size_t offset, uint64_t src, size_t bytes) {
            nb::gil_scoped_release release;
            a.CopyIn(id, offset, reinterpret_cast<const void*>(static_cast<uintptr_t>(src)), bytes);
          },
          nb::arg("buffer_id"), nb::arg("offset"), nb::arg("src"), nb::arg("nbytes"),
          "Copy nbytes from address src (host or device memory) into a backed buffer range.")
      .def("close", &Arena::Close, nb::call_guard<nb::gil_scoped_release>())
      .def("pin_metadata_for_graphs", &Arena::PinMetadataForGraphs,
           "Keep the page table and drop counters allocated after destruction: compiled "
           "code holds this arena's addresses (kv_write's static dest).")
      .def("reset_drop_count", &Arena::ResetDropCount);
}

}  // namespace

void BindArena(nb::module_& m) {
  nb::class_<Arena> arena(m, "Arena",
                          "A reserved virtual range with buffers committed chunk by chunk. "
                          "Thread-safe. Use jax_vmm.Arena (Python) rather than this class.");
  BindArenaQueries(arena);
  BindArenaChanges(arena);
  m.def(
      "create_arena",
      [](const std::string& driver, int device, size_t reserve_bytes, size_t chunk_bytes,
         size_t handle_bytes, bool zero_fill) {
        return Arena::Create(MakeDriver(driver, device, chunk_bytes), reserve_bytes,
                             ArenaOptions{handle_bytes, zero_fill});
      },
      nb::arg("driver"), nb::arg("device"), nb::arg("reserve_bytes"), nb::arg("chunk_bytes") = 0,
      nb::arg("handle_bytes") = 0, nb::arg("zero_fill") = true,
      nb::call_guard<nb::gil_scoped_release>());
  m.def("find_arena_buffer", &FindBuffer, nb::arg("address"), nb::arg("nbytes"),
        "The live (open) arena buffer holding [address, address + nbytes), or None.");
  m.def("find_arena_buffer_by_uid", &FindBufferByUid, nb::arg("uid"),
        "The buffer with this uid (with its name and whether its arena is closed), or None "
        "when no live arena has it.");
  m.def(
      "resolve_chunk_bytes",
      [](const std::string& driver, int device, size_t chunk_bytes) {
        return MakeDriver(driver, device, chunk_bytes)->chunk_bytes();
      },
      "The chunk size an arena with these arguments would use (0 = the driver default).");
  m.def("query_cuda_devices", &CudaDevices,
        "([device dicts], error): what the CUDA driver offers; error says why the list is empty.");
}

}  // namespace jax_vmm
