// jax_vmm._core_testing (see testing_module.h): the testing FFI targets, fault injection
// into arenas, the scratch probe's counters, simulated capture, the free-on-growth
// emulation of scratch, the streaming attention's partition and the fake CUDA driver
// (fake_cuda_bindings.cc). The Python side and its documentation: jax_vmm/testing.py.
#include "testing/testing_module.h"

#include <nanobind/ndarray.h>
#include <nanobind/stl/shared_ptr.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/tuple.h>
#include <nanobind/stl/vector.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <stdexcept>
#include <string>
#include <tuple>
#include <vector>

#include "common/fast_divmod.h"
#include "common/ffi_registry.h"
#include "core/view_fits.h"
#include "drivers/cuda/compute_streams.h"
#include "drivers/cuda/zero_allocation.h"
#include "drivers/cuda/zero_layout.h"
#include "drivers/host_map_budget.h"
#include "jax_vmm/arena.h"
#include "jax_vmm/errors.h"
#include "jax_vmm/memory_budget.h"
#include "ops/attention/stream_plan.h"
#include "ops/kv_cache/kv_cache.h"
#include "python/registrations.h"
#include "scratch/simulated_capture.h"
#include "testing/fake_cuda.h"
#include "testing/fault_injecting_driver.h"
#include "testing/scratch_free_on_growth.h"
#include "testing/scratch_probe.h"
#include "testing/testing_targets.h"

namespace nb = nanobind;

namespace jax_vmm::testing {
namespace {

void BindFaultInjection(nb::module_& m);
void BindZeroLayout(nb::module_& m);
void BindComputeStreams(nb::module_& m);
void BindScratchHooks(nb::module_& m);
void BindLegacyViews(nb::module_& m);
void BindStreamPartition(nb::module_& m);
void BindFastDivmod(nb::module_& m);

// The testing layer's FFI targets (testing_targets.h), for registrations().
FfiRegistry TestingTargets() {
  FfiRegistry registry;
  AddUncheckedKvWriteCpuTargets(registry);
  AddAddressOnlyKvWriteCpuTargets(registry);
  AddTokenKernelKvWriteCpuTargets(registry);
  AddDebugAttentionCpuTargets(registry);
  AddDebugStreamCpuTargets(registry);
  AddNoLimitsCacheCpuTargets(registry);
  AddProbeCpuTargets(registry);
  AddHostGateCpuTargets(registry);
#ifdef JAX_VMM_HAVE_CUDA_KERNELS
  AddUncheckedKvWriteCudaTargets(registry);
  AddAddressOnlyKvWriteCudaTargets(registry);
  AddTokenKernelKvWriteCudaTargets(registry);
  AddDebugAttentionCudaTargets(registry);
  AddDebugStreamCudaTargets(registry);
  AddNoLimitsCacheCudaTargets(registry);
  AddProbeCudaTargets(registry);
#endif
  return registry;
}

void BindTestingHooks(nb::module_& m) {
  BindRegistrations(m, TestingTargets());
  BindFaultInjection(m);
  BindZeroLayout(m);
  BindComputeStreams(m);
  BindScratchHooks(m);
  BindLegacyViews(m);
  BindStreamPartition(m);
  BindFastDivmod(m);
  BindFakeCuda(m);
}

// The mapping limit set_host_map_limit() stands in for vm.max_map_count.
std::atomic<size_t> g_host_map_limit{0};

void BindFaultInjection(nb::module_& m) {
  nb::exception<InjectedFault>(m, "InjectedFault", PyExc_RuntimeError);
  m.def(
      "create_fault_injecting_arena",
      [](const std::string& driver, int device, size_t reserve_bytes, size_t chunk_bytes,
         size_t handle_bytes, bool zero_fill) {
        return CreateFaultInjectingArena(driver, device, reserve_bytes, chunk_bytes,
                                         ArenaOptions{handle_bytes, zero_fill});
      },
      nb::arg("driver"), nb::arg("device"), nb::arg("reserve_bytes"), nb::arg("chunk_bytes") = 0,
      nb::arg("handle_bytes") = 0, nb::arg("zero_fill") = true,
      nb::call_guard<nb::gil_scoped_release>(),
      "create_arena() with its driver wrapped in a fault-injecting driver.");
  m.def(
      "arm_fault",
      [](Arena& arena, const std::string& op, int64_t nth, bool out_of_memory) {
        const DriverOp parsed = ParseDriverOp(op);
        FaultsOf(arena).Arm(parsed, nth, out_of_memory);
      },
      nb::arg("arena"), nb::arg("op"), nb::arg("nth"), nb::arg("out_of_memory") = false,
      "Fail the nth (1-based) future driver call of op.");
  m.def(
      "disarm_faults", [](Arena& arena) { FaultsOf(arena).Disarm(); }, nb::arg("arena"),
      "Disarm every op, repair release, lift every switch and the device hold.");
  m.def(
      "break_release", [](Arena& arena, bool broken) { FaultsOf(arena).BreakRelease(broken); },
      nb::arg("arena"), nb::arg("broken"),
      "While broken, the driver's release and unmap calls do nothing (rollbacks leak).");
  m.def(
      "skip_device_waits", [](Arena& arena, bool skip) { FaultsOf(arena).SkipDeviceWaits(skip); },
      nb::arg("arena"), nb::arg("skip"),
      "While set, device waits do nothing and releases unmap at once (no drain, no deferral).");
  m.def(
      "defer_reclaim", [](Arena& arena, bool defer) { FaultsOf(arena).DeferReclaim(defer); },
      nb::arg("arena"), nb::arg("defer"),
      "While set, unmapping claims to need a device wait (the host driver defers like CUDA).");
  m.def(
      "kv_cache_tables",
      [](const kvcache::KvCache& c) {
        if (std::string(c.driver_kind()) != "host") {
          throw InvalidArgument("kv_cache_tables: reads the host backend's tables only");
        }
        const size_t n = static_cast<size_t>(c.geometry().max_seqs);
        auto copy = [n](const int32_t* p) { return std::vector<int32_t>(p, p + n); };
        return std::make_tuple(copy(c.device_limits()), copy(c.device_read_limits()),
                               copy(c.device_floors()));
      },
      nb::arg("cache"),
      "(writers' table, readers' table, floors) of a host KV cache, as the kernels see them.");
  m.def(
      "unorder_table_writes",
      [](Arena& arena, bool unordered) { FaultsOf(arena).UnorderTableWrites(unordered); },
      nb::arg("arena"), nb::arg("unordered"),
      "While set, table changes land at once instead of in dispatch order.");
  m.def(
      "hold_device", [](Arena& arena, bool hold) { FaultsOf(arena).HoldDevice(hold); },
      nb::arg("arena"), nb::arg("hold"), nb::call_guard<nb::gil_scoped_release>(),
      "While held, device waits block (a device that is still busy).");
  m.def(
      "device_syncs", [](Arena& arena) { return FaultsOf(arena).syncs(); }, nb::arg("arena"),
      "Device waits (Synchronize calls) made through this arena's driver so far.");
  m.def(
      "injected_faults", [](Arena& arena) { return FaultsOf(arena).injected(); }, nb::arg("arena"),
      "Faults thrown into this arena's driver so far.");
  m.def(
      "set_host_map_limit",
      [](size_t limit) {
        g_host_map_limit.store(limit);
        const host::MapLimitSource source = [] { return g_host_map_limit.load(); };
        host::SetMapLimitSource(limit != 0 ? source : nullptr);
      },
      nb::arg("limit"),
      "The mapping limit host arenas check against instead of vm.max_map_count (0: the real "
      "one).");
  m.def("set_budget_check_bypassed", &testing::SetBudgetCheckBypassed, nb::arg("bypassed"),
        "While set, memory budgets never refuse a commit (they still count).");
  m.def("set_host_available_bytes", &testing::SetHostAvailableBytes, nb::arg("bytes"),
        "The host driver takes `bytes` (0: /proc/meminfo's) as the memory available and "
        "checks every commit against it.");
  m.def("set_host_fresh_memory_poisoned", &testing::SetHostFreshMemoryPoisoned,
        nb::arg("poisoned"),
        "While set, memory the host driver commits holds 0xFF bytes (NaN), not zeros.");
}

// The CUDA driver's zero-mapping bookkeeping, for tests without a GPU.
void BindZeroLayout(nb::module_& m) {
  using cuda::ZeroLayout;
  using cuda::ZeroPiece;
  auto to_list = [](const std::vector<ZeroPiece>& pieces) {
    nb::list out;
    for (const ZeroPiece& p : pieces) out.append(nb::make_tuple(p.va, p.bytes));
    return out;
  };
  auto from_list = [](const std::vector<std::tuple<uint64_t, size_t>>& pieces) {
    std::vector<ZeroPiece> out;
    for (const auto& [va, bytes] : pieces) out.push_back({static_cast<uintptr_t>(va), bytes});
    return out;
  };
  nb::class_<ZeroLayout>(m, "ZeroLayout")
      .def(nb::init<uintptr_t, size_t, size_t, size_t>(), nb::arg("base"), nb::arg("bytes"),
           nb::arg("max_piece"), nb::arg("unit"))
      .def("tile", [to_list](const ZeroLayout& z, uint64_t va,
                             size_t bytes) { return to_list(z.Tile(va, bytes)); })
      .def("plan_clear",
           [to_list](const ZeroLayout& z, uint64_t va, size_t bytes) {
             const ZeroLayout::Clear c = z.PlanClear(va, bytes);
             return nb::make_tuple(to_list(c.unmap), to_list(c.remap), c.hull_va, c.hull_bytes);
           })
      .def("add",
           [from_list](ZeroLayout& z, const std::vector<std::tuple<uint64_t, size_t>>& p) {
             z.Add(from_list(p));
           })
      .def("remove",
           [from_list](ZeroLayout& z, const std::vector<std::tuple<uint64_t, size_t>>& p) {
             z.Remove(from_list(p));
           })
      .def("pieces", [to_list](const ZeroLayout& z) { return to_list(z.pieces()); })
      .def("covered", &ZeroLayout::Covered);
  m.def("zero_piece_bytes", &cuda::ZeroPieceBytes, nb::arg("total_bytes"), nb::arg("granularity"),
        nb::arg("ceiling") = cuda::kDefaultZeroPieceCeiling);
  m.def("zero_piece_ceiling_from_env", &cuda::ZeroPieceCeilingFromEnv);
}

void BindComputeStreams(nb::module_& m) {
  auto as_ints = [](const std::vector<void*>& streams) {
    std::vector<uint64_t> out;
    for (void* s : streams) out.push_back(reinterpret_cast<uintptr_t>(s));
    return out;
  };
  // emulated: the streams of the fake driver's device (its own table), not libcuda's.
  auto api = [](bool emulated) -> const cuda::Api& {
    return emulated ? fake_cuda::FakeApi() : cuda::GetApi();
  };
  m.def(
      "compute_streams",
      [as_ints, api](int ordinal, bool emulated) {
        return as_ints(cuda::ComputeStreams(api(emulated), ordinal));
      },
      nb::arg("ordinal"), nb::arg("emulated") = false,
      "The XLA compute streams registered for CUDA device `ordinal`.");
  m.def(
      "forget_compute_streams",
      [as_ints, api](int ordinal, bool emulated) {
        return as_ints(cuda::ForgetComputeStreams(api(emulated), ordinal));
      },
      nb::arg("ordinal"), nb::arg("emulated") = false,
      "Removes and returns them: device waits fall back to cuCtxSynchronize meanwhile.");
  m.def(
      "register_compute_streams",
      [api](int ordinal, const std::vector<uint64_t>& streams, bool emulated) {
        for (uint64_t s : streams) {
          cuda::RegisterComputeStream(api(emulated), ordinal, reinterpret_cast<void*>(s));
        }
      },
      nb::arg("ordinal"), nb::arg("streams"), nb::arg("emulated") = false,
      "Puts forgotten streams back.");
}

void BindScratchHooks(nb::module_& m) {
  m.def("set_host_gate", &SetHostGate, nb::arg("open"),
        "Open or close the gate of jax_vmm_testing_host_gate (host_gate_cpu.cc).");
  m.def("host_gate_held", &HostGateHeld, "Calls of jax_vmm_testing_host_gate waiting now.");
  m.def(
      "scratch_get",
      [](int device, uint64_t stream, size_t nbytes, bool capturing) {
        void* ptr = nullptr;
        std::string err;
        {
          nb::gil_scoped_release release;
          err = scratch::GetWithCaptureState(device, reinterpret_cast<void*>(stream), nbytes,
                                             capturing, &ptr);
        }
        if (!err.empty()) throw std::runtime_error(err);
        return static_cast<uint64_t>(reinterpret_cast<uintptr_t>(ptr));
      },
      nb::arg("device"), nb::arg("stream"), nb::arg("nbytes"), nb::arg("capturing"),
      "scratch Get() with the capture state given; returns the workspace address.");
  m.def("scratch_set_free_on_growth", &SetScratchFreeOnGrowth, nb::arg("enabled"));
  m.def("scratch_free_on_growth", &ScratchFreeOnGrowth);
  m.def("scratch_probe_stats", []() {
    nb::dict d;
    d["calls"] = ProbeCounters().calls.load();
    d["captured_calls"] = ProbeCounters().captured_calls.load();
    d["initialize_calls"] = ProbeCounters().initialize_calls.load();
    return d;
  });
}

// Views as they were before view leases: a nanobind ndarray that owns a reference to the
// Python arena object. Its DLPack deleter takes the GIL (to drop that reference), on
// whatever thread XLA releases the view, and it counts as no live view of its buffer.
void BindLegacyViews(nb::module_& m) {
  m.def(
      "legacy_view",
      [](nb::handle arena_object, int64_t buffer_id, std::vector<size_t> shape, uint8_t code,
         uint8_t bits, int device_type, int device_id) {
        Arena& arena = nb::cast<Arena&>(arena_object);
        const BufferInfo b = arena.Buffer(buffer_id);
        CheckViewFits(b, shape, bits);
        return nb::ndarray<>(reinterpret_cast<void*>(b.address), shape.size(), shape.data(),
                             arena_object, nullptr, nb::dlpack::dtype{code, bits, 1}, device_type,
                             device_id);
      },
      nb::rv_policy::reference, nb::arg("arena"), nb::arg("buffer_id"), nb::arg("shape"),
      nb::arg("code"), nb::arg("bits"), nb::arg("device_type"), nb::arg("device_id"),
      "Arena.view as it was before view leases (GIL-taking deleter, no lease).");
}

// The streaming kernel's partition as the kernel computes it (stream_plan.h), for the
// tests of its invariants.
void BindStreamPartition(nb::module_& m) {
  m.def(
      "attention_stream_partition",
      [](const std::vector<int64_t>& lengths, int64_t max_tokens, int64_t unit_groups, int64_t ctas,
         int64_t min_tiles, int64_t tile_tokens) {
        namespace stream = attention::stream;
        const int B = static_cast<int>(lengths.size());
        std::vector<int> prefix(B + 1, 0);
        for (int b = 0; b < B; ++b) {
          const int len = static_cast<int>(std::clamp<int64_t>(lengths[b], 0, max_tokens));
          prefix[b + 1] = prefix[b] + stream::TilesOf(len, static_cast<int>(tile_tokens));
        }
        const int G = static_cast<int>(unit_groups);
        const int total = G * prefix[B];
        const int C =
            stream::EffectiveCtas(static_cast<int>(ctas), total, static_cast<int>(min_tiles));
        nb::list out;
        for (int c = 0; c < C && total > 0; ++c) {
          nb::list pieces;
          const int g1 = stream::RangeStart(c + 1, total, C);
          for (int g = stream::RangeStart(c, total, C); g < g1;) {
            const stream::UnitTile u = stream::LocateTile(prefix.data(), B, G, g);
            const int tiles = prefix[u.b + 1] - prefix[u.b];
            const int start = g - u.tile, end = std::min(g1, start + tiles);
            const bool whole = u.tile == 0 && end == start + tiles;
            pieces.append(nb::make_tuple(
                u.b, u.hg, u.tile, end - g, whole ? -1 : stream::SlotOf(u.tile == 0),
                stream::OwnerOf(start, total, C), stream::OwnerOf(start + tiles - 1, total, C)));
            g = end;
          }
          out.append(pieces);
        }
        return out;
      },
      nb::arg("lengths"), nb::arg("max_tokens"), nb::arg("unit_groups"), nb::arg("ctas"),
      nb::arg("min_tiles"), nb::arg("tile_tokens") = attention::stream::kTileTokens,
      "Per CTA, the pieces (b, hg, first_tile, tiles, slot or -1 for a whole unit, "
      "first_owner, last_owner) of the streaming kernel's partition.");
}

// The kv_write kernel's index division (common/fast_divmod.h), run on the host with the
// device's arithmetic: quotients of every dividend for one divisor.
void BindFastDivmod(nb::module_& m) {
  m.def(
      "fast_div",
      [](uint32_t divisor, nb::ndarray<const uint32_t, nb::ndim<1>, nb::c_contig> dividends) {
        if (divisor == 0 || divisor >= (uint32_t{1} << 31)) {
          throw std::invalid_argument("fast_div: divisor must be in [1, 2^31)");
        }
        const FastDivmod div(divisor);
        std::vector<uint32_t> out(dividends.shape(0));
        for (size_t i = 0; i < out.size(); ++i) {
          const uint32_t n = dividends.data()[i];
          if (n >= (uint32_t{1} << 31)) {
            throw std::invalid_argument("fast_div: dividends must be in [0, 2^31)");
          }
          out[i] = div.Div(n);
        }
        return out;
      },
      nb::arg("divisor"), nb::arg("dividends"),
      "FastDivmod(divisor).Div(n) for each n (uint32, C-contiguous, each < 2^31).");
}

}  // namespace

}  // namespace jax_vmm::testing

NB_MODULE(_core_testing, m) {
  m.doc() = "Test-only hooks of jax_vmm's C++ core; use them through jax_vmm.testing.";
  // The classes and exceptions these functions take and return (Arena, ...) are bound by
  // jax_vmm._core; both modules link the one core library, so they share its state.
  nb::module_::import_("jax_vmm._core");
  jax_vmm::testing::BindTestingHooks(m);
}
