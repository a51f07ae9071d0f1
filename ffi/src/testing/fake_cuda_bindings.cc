// jax_vmm._core.testing's view of the fake CUDA driver (fake_cuda.h): arenas of the real
// CudaDriver over it, its state, armed failures, and its raw entry points (each call made
// with the primary context current, as the driver makes them) so that tests can show the
// fake refuses what the real driver refuses.
#include <nanobind/nanobind.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/pair.h>
#include <nanobind/stl/shared_ptr.h>
#include <nanobind/stl/string.h>

#include <cstdint>
#include <memory>
#include <optional>
#include <stdexcept>
#include <string>
#include <vector>

#include "drivers/cuda/cuda_driver.h"
#include "jax_vmm/arena.h"
#include "testing/fake_cuda.h"
#include "testing/testing_module.h"

namespace nb = nanobind;

namespace jax_vmm::testing {
namespace {

using cuda::CUresult;
namespace fake = fake_cuda;

// cuInit, a primary context reference and that context current for one scope.
class FakeContextScope {
 public:
  FakeContextScope() : api_(fake::FakeApi()) {
    Check(api_.cuInit(0), "cuInit");
    Check(api_.cuDevicePrimaryCtxRetain(&ctx_, 0), "cuDevicePrimaryCtxRetain");
    const CUresult r = api_.cuCtxPushCurrent(ctx_);
    if (r != cuda::CUDA_SUCCESS) {
      api_.cuDevicePrimaryCtxRelease(0);
      Check(r, "cuCtxPushCurrent");
    }
  }
  ~FakeContextScope() {
    cuda::CUcontext popped = nullptr;
    api_.cuCtxPopCurrent(&popped);
    api_.cuDevicePrimaryCtxRelease(0);
  }
  FakeContextScope(const FakeContextScope&) = delete;
  FakeContextScope& operator=(const FakeContextScope&) = delete;
  const cuda::Api& api() const { return api_; }

 private:
  static void Check(CUresult r, const char* call) {
    if (r != cuda::CUDA_SUCCESS) {
      throw std::runtime_error(std::string("fake CUDA: ") + call + " failed with CUresult " +
                               std::to_string(r));
    }
  }
  const cuda::Api& api_;
  cuda::CUcontext ctx_ = nullptr;
};

nb::dict StatsDict(const fake::Stats& s) {
  nb::dict d;
  nb::dict calls;
  for (const auto& [name, n] : s.calls) calls[name.c_str()] = n;
  d["calls"] = calls;
  d["live_reservations"] = s.live_reservations;
  d["live_mappings"] = s.live_mappings;
  d["live_allocations"] = s.live_allocations;
  d["live_handles"] = s.live_handles;
  d["live_metadata_allocs"] = s.live_metadata_allocs;
  d["live_host_allocs"] = s.live_host_allocs;
  d["live_streams"] = s.live_streams;
  d["primary_context_refs"] = s.primary_context_refs;
  d["partial_map_refusals"] = s.partial_map_refusals;
  d["illegal_addresses"] = s.illegal_addresses;
  d["used_bytes"] = s.used_bytes;
  return d;
}

void BindFakeState(nb::module_& m) {
  m.def("fake_cuda_results", []() {
    nb::dict d;
    for (const auto& [name, code] : fake::ResultCodes()) d[name.c_str()] = code;
    return d;
  });
  m.def("fake_cuda_granularity", []() { return fake::kGranularity; });
  m.def("fake_cuda_total_bytes", []() { return fake::kTotalBytes; });
  m.def(
      "fake_cuda_stats", []() { return StatsDict(fake::GetStats()); },
      "Counters of the fake CUDA driver (calls per entry point, live objects, refusals).");
  m.def("fake_cuda_mappings", []() {
    nb::list out;
    for (const fake::Mapping& p : fake::Mappings()) {
      out.append(nb::make_tuple(static_cast<uint64_t>(p.va), p.bytes, p.handle));
    }
    return out;
  });
  m.def("fake_cuda_allocations", []() {
    nb::list out;
    for (const fake::Allocation& a : fake::Allocations()) {
      out.append(nb::make_tuple(a.handle, a.bytes, a.mappings, a.released));
    }
    return out;
  });
  m.def(
      "fake_cuda_map_log",
      [](bool clear) {
        nb::list out;
        for (const fake::MapCall& c : fake::MapLog()) {
          out.append(nb::make_tuple(static_cast<uint64_t>(c.va), c.bytes, c.offset, c.handle,
                                    c.allocation_bytes, c.result));
        }
        if (clear) fake::ClearMapLog();
        return out;
      },
      nb::arg("clear") = false,
      "(va, bytes, offset, handle, allocation_bytes, result) of every cuMemMap call.");
  m.def("fake_cuda_fail_nth", &fake::FailNth, nb::arg("entry"), nb::arg("nth"), nb::arg("result"),
        "The nth (1-based) future call of entry returns result; nth=0 disarms it.");
  m.def("fake_cuda_disarm", &fake::DisarmAll);
  m.def(
      "fake_cuda_access", [](uint64_t va) { return fake::AccessOf(static_cast<uintptr_t>(va)); },
      nb::arg("va"), "(result, flags) of cuMemGetAccess at va.");
  m.def(
      "fake_cuda_read",
      [](uint64_t va, size_t nbytes) {
        std::vector<char> buf(nbytes);
        const CUresult r = fake::Read(static_cast<uintptr_t>(va), buf.data(), nbytes);
        return nb::make_tuple(r, nb::bytes(buf.data(), r == cuda::CUDA_SUCCESS ? nbytes : 0));
      },
      nb::arg("va"), nb::arg("nbytes"),
      "(result, bytes) of fake-device memory, read under the copy rules (READ needed).");
  m.def(
      "fake_cuda_write",
      [](uint64_t va, nb::bytes data) {
        return fake::Write(static_cast<uintptr_t>(va), data.c_str(), data.size());
      },
      nb::arg("va"), nb::arg("data"), "Writes under the copy rules (READWRITE needed).");
}

// The raw entry points, for the tests of the fake's own rules.
void BindFakeEntryPoints(nb::module_& m) {
  m.def(
      "fake_cuda_reserve",
      [](size_t bytes, size_t alignment) {
        FakeContextScope c;
        cuda::CUdeviceptr va = 0;
        const CUresult r = c.api().cuMemAddressReserve(&va, bytes, alignment, 0, 0);
        return std::make_pair(r, static_cast<uint64_t>(va));
      },
      nb::arg("bytes"), nb::arg("alignment") = 0);
  m.def("fake_cuda_address_free", [](uint64_t va, size_t bytes) {
    FakeContextScope c;
    return c.api().cuMemAddressFree(va, bytes);
  });
  m.def("fake_cuda_create", [](size_t bytes) {
    FakeContextScope c;
    cuda::CUmemAllocationProp prop{};
    prop.type = cuda::CU_MEM_ALLOCATION_TYPE_PINNED;
    prop.location.type = cuda::CU_MEM_LOCATION_TYPE_DEVICE;
    prop.location.id = 0;
    cuda::CUmemGenericAllocationHandle h = 0;
    const CUresult r = c.api().cuMemCreate(&h, bytes, &prop, 0);
    return std::make_pair(r, static_cast<uint64_t>(h));
  });
  m.def("fake_cuda_release", [](uint64_t handle) {
    FakeContextScope c;
    return c.api().cuMemRelease(handle);
  });
  m.def(
      "fake_cuda_map",
      [](uint64_t va, size_t bytes, size_t offset, uint64_t handle) {
        FakeContextScope c;
        return c.api().cuMemMap(va, bytes, offset, handle, 0);
      },
      nb::arg("va"), nb::arg("bytes"), nb::arg("offset"), nb::arg("handle"));
  m.def("fake_cuda_unmap", [](uint64_t va, size_t bytes) {
    FakeContextScope c;
    return c.api().cuMemUnmap(va, bytes);
  });
  m.def(
      "fake_cuda_set_access",
      [](uint64_t va, size_t bytes, int flags) {
        FakeContextScope c;
        cuda::CUmemAccessDesc desc{};
        desc.location.type = cuda::CU_MEM_LOCATION_TYPE_DEVICE;
        desc.location.id = 0;
        desc.flags = flags;
        return c.api().cuMemSetAccess(va, bytes, &desc, 1);
      },
      nb::arg("va"), nb::arg("bytes"), nb::arg("flags"));
  m.def("fake_cuda_stream_create", [] {
    FakeContextScope c;
    cuda::CUstream stream = nullptr;
    const CUresult r = c.api().cuStreamCreate(&stream, 0);
    return std::make_pair(r, static_cast<uint64_t>(reinterpret_cast<uintptr_t>(stream)));
  });
  m.def("fake_cuda_stream_destroy", [](uint64_t stream) {
    FakeContextScope c;
    return c.api().cuStreamDestroy(reinterpret_cast<cuda::CUstream>(stream));
  });
  m.def(
      "fake_cuda_memset",
      [](uint64_t va, int value, size_t bytes) {
        FakeContextScope c;
        return c.api().cuMemsetD8Async(va, static_cast<unsigned char>(value), bytes, nullptr);
      },
      nb::arg("va"), nb::arg("value"), nb::arg("bytes"));
}

}  // namespace

void BindFakeCuda(nb::module_& m) {
  BindFakeState(m);
  BindFakeEntryPoints(m);
  m.def(
      "create_fake_cuda_arena",
      [](size_t reserve_bytes, size_t chunk_bytes, size_t handle_bytes, bool zero_fill,
         std::optional<bool> defer_zero_reads) {
        return Arena::Create(MakeCudaDriverWith(fake::FakeApi(), 0, chunk_bytes), reserve_bytes,
                             ArenaOptions{handle_bytes, zero_fill, defer_zero_reads});
      },
      nb::arg("reserve_bytes"), nb::arg("chunk_bytes") = 0, nb::arg("handle_bytes") = 0,
      nb::arg("zero_fill") = true, nb::arg("defer_zero_reads") = false,
      nb::call_guard<nb::gil_scoped_release>(),
      "A core Arena over the real CUDA driver code running on the fake CUDA driver. "
      "defer_zero_reads=None: as a production arena, from JAX_VMM_DEFER_ZERO_READS.");
}

}  // namespace jax_vmm::testing
