// The nanobind module jax_vmm._core: exception mapping, FFI target capsules, and the
// per-feature bindings (arena_bindings.cc, scratch_bindings.cc, ops_bindings.cc, ...).
// It holds no test code: the test hooks are the separate extension jax_vmm._core_testing
// (testing/testing_module.cc), over the same core library.
#include <nanobind/nanobind.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/tuple.h>
#include <nanobind/stl/vector.h>

#include <cstdlib>
#include <string>

#include "common/ffi_record_stage.h"
#include "common/ffi_registry.h"
#include "drivers/cuda/compute_streams.h"
#include "jax_vmm/errors.h"
#include "jax_vmm/memory_budget.h"
#include "ops/attention/attention_targets.h"
#include "ops/kv_cache/kv_cache_targets.h"
#include "ops/kv_write/kv_write_targets.h"
#include "python/bindings.h"
#include "python/registrations.h"
#include "scratch/device_platform.h"
#ifdef JAX_VMM_HAVE_CUDNN
#include "ops/attention/cudnn/cudnn_attention.h"
#include "python/cudnn_bindings.h"
#endif

namespace nb = nanobind;

namespace jax_vmm {
namespace {

// The JAX allocator settings that decide how much device memory an arena can get.
std::string JaxAllocatorSettings() {
  std::string out;
  for (const char* name : {"XLA_PYTHON_CLIENT_PREALLOCATE", "XLA_PYTHON_CLIENT_MEM_FRACTION",
                           "XLA_PYTHON_CLIENT_ALLOCATOR"}) {
    const char* value = std::getenv(name);
    out += std::string(out.empty() ? "" : ", ") + name + "=" + (value ? value : "<unset>");
  }
  return out;
}

PyObject* g_out_of_memory_type = nullptr;

void TranslateOutOfMemory(const std::exception_ptr& p, void*) {
  try {
    std::rethrow_exception(p);
  } catch (const OutOfMemory& e) {
    // A budget's cap is the user's own: the JAX allocator settings do not explain it.
    const bool budget = dynamic_cast<const BudgetExceeded*>(&e) != nullptr;
    std::string msg = std::string(e.what()) + ".";
    if (!budget) {
      msg += " JAX allocator settings: " + JaxAllocatorSettings() +
             ". JAX preallocates 75% of GPU memory by default, leaving the arena the "
             "rest: set XLA_PYTHON_CLIENT_PREALLOCATE=false or a lower "
             "XLA_PYTHON_CLIENT_MEM_FRACTION before importing jax, or commit less.";
    }
    PyObject* exc = PyObject_CallFunction(g_out_of_memory_type, "s", msg.c_str());
    if (exc == nullptr) return;
    PyObject* req = PyLong_FromSize_t(e.requested_bytes);
    PyObject* fre = PyLong_FromSize_t(e.free_bytes);
    PyObject_SetAttrString(exc, "requested_bytes", req);
    PyObject_SetAttrString(exc, "free_bytes", fre);
    Py_XDECREF(req);
    Py_XDECREF(fre);
    PyErr_SetObject(g_out_of_memory_type, exc);
    Py_DECREF(exc);
  }
}

// Every production FFI target of this build.
FfiRegistry ProductionTargets() {
  FfiRegistry registry;
  kv::AddCpuTargets(registry);
  kv::AddFp8CpuTargets(registry);
  attention::AddCpuTargets(registry);
  attention::AddStreamCpuTargets(registry);
  attention::AddCacheCpuTargets(registry);
  kvcache::AddCpuTargets(registry);
  cuda::AddComputeStreamTargets(registry);  // host code only: in every build
#ifdef JAX_VMM_HAVE_CUDA_KERNELS
  kv::AddCudaTargets(registry);
  kv::AddFp8CudaTargets(registry);
  attention::AddCudaTargets(registry);
  attention::AddStreamCudaTargets(registry);
  attention::AddCacheCudaTargets(registry);
  kvcache::AddCudaTargets(registry);
  // After every target with a record stage was added (common/ffi_record_stage.h).
  registry.Add("jax_vmm_register_record_stages", "CUDA", record_stage::BootstrapHandler());
#endif
#ifdef JAX_VMM_HAVE_CUDNN
  cudnn::AddCudnnTargets(registry);
#endif
  return registry;
}

}  // namespace
}  // namespace jax_vmm

NB_MODULE(_core, m) {
  using namespace jax_vmm;
  m.doc() = "jax_vmm C++ core: virtual-memory arenas, drivers and XLA FFI handlers";

  nb::exception<ArenaClosed>(m, "ArenaClosedError", PyExc_RuntimeError);
  nb::exception<ArenaAsleep>(m, "ArenaAsleepError", PyExc_RuntimeError);
  nb::exception<ReservationFull>(m, "ReservationFullError", PyExc_RuntimeError);
  nb::exception<DriverError>(m, "DriverError", PyExc_RuntimeError);
  nb::exception<ForkedProcess>(m, "ForkedProcessError", PyExc_RuntimeError);
  // InvalidArgument derives from std::invalid_argument, which nanobind maps to ValueError.
  static nb::object oom_type =
      nb::steal(PyErr_NewExceptionWithDoc("jax_vmm._core.OutOfMemoryError",
                                          "Physical memory could not be committed. Attributes: "
                                          "requested_bytes, free_bytes.",
                                          PyExc_MemoryError, nullptr));
  m.attr("OutOfMemoryError") = oom_type;
  g_out_of_memory_type = oom_type.ptr();
  nb::register_exception_translator(TranslateOutOfMemory);

  BindRegistrations(m, ProductionTargets());
  m.def("record_stage_status", &record_stage::Status,
        "'registered' once the bootstrap target registered jax_vmm's targets with XLA's FFI "
        "record stage; 'pending' before; 'unavailable: ...' or 'failed: ...' otherwise.");
#ifdef JAX_VMM_HAVE_CUDA_KERNELS
  m.def("check_views_record_calls", &kvcache::CheckViewsRecordCalls,
        "Record-stage runs of jax_vmm_kv_cache_check_views_recorded in this process.");
  m.attr("built_with_cuda_kernels") = true;
  kv::InstallCudaDropHooks();
  scratch::internal::InstallCudaPlatform();
#else
  m.attr("built_with_cuda_kernels") = false;
#endif
#ifdef JAX_VMM_HAVE_CUDNN
  m.attr("built_with_cudnn") = true;
  BindCudnn(m);
#else
  m.attr("built_with_cudnn") = false;
#endif

  // A JAX client that goes destroys its streams: jax_vmm/base/compute_streams.py forgets them
  // first, so that no later device wait (an arena destroyed at exit) touches a dead stream.
  m.def(
      "forget_compute_streams",
      [](int ordinal) { return cuda::ForgetComputeStreams(cuda::GetApi(), ordinal).size(); },
      nb::arg("ordinal"),
      "Forget the XLA compute streams registered for CUDA device `ordinal` (their JAX client "
      "is going); device waits there wait for the whole context until one is registered "
      "again. Returns how many were forgotten.");

  BindArena(m);
  BindBudget(m);
  BindScratch(m);
  BindOps(m);
  BindAttention(m);
  BindKvCache(m);
  BindEnsurePlan(m);
}
