// The CPU target jax_vmm_testing_host_gate (testing_targets.h): y = x, once the gate is
// open. A test closes the gate, dispatches a step that passes a value through it, and
// knows the step is in flight (held on an XLA:CPU thread, its dispatch returned) until
// it opens the gate: no timing is involved. A guard opens it after 60 s, so a test whose
// call waits for the held step fails instead of hanging.
#include <chrono>
#include <condition_variable>
#include <cstring>
#include <mutex>

#include "testing/testing_targets.h"
#include "xla/ffi/api/ffi.h"

namespace jax_vmm::testing {
namespace {

namespace ffi = xla::ffi;

struct Gate {
  std::mutex mu;
  std::condition_variable cv;
  bool open = true;
  int held = 0;  // calls waiting at the gate now
};

Gate& TheGate() {
  static Gate* gate = new Gate();  // never destroyed: an XLA thread may wait at exit
  return *gate;
}

ffi::Error HostGateImpl(ffi::AnyBuffer x, ffi::Result<ffi::AnyBuffer> y) {
  Gate& g = TheGate();
  {
    std::unique_lock<std::mutex> lock(g.mu);
    ++g.held;
    g.cv.notify_all();
    g.cv.wait_for(lock, std::chrono::seconds(60), [&] { return g.open; });
    --g.held;
  }
  if (x.untyped_data() != y->untyped_data()) {
    std::memcpy(y->untyped_data(), x.untyped_data(), x.size_bytes());
  }
  return ffi::Error::Success();
}

}  // namespace

void SetHostGate(bool open) {
  Gate& g = TheGate();
  std::lock_guard<std::mutex> lock(g.mu);
  g.open = open;
  g.cv.notify_all();
}

int HostGateHeld() {
  Gate& g = TheGate();
  std::lock_guard<std::mutex> lock(g.mu);
  return g.held;
}

}  // namespace jax_vmm::testing

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxVmmTestingHostGateCpu, jax_vmm::testing::HostGateImpl,
                              xla::ffi::Ffi::Bind()
                                  .Arg<xla::ffi::AnyBuffer>()
                                  .Ret<xla::ffi::AnyBuffer>());

void jax_vmm::testing::AddHostGateCpuTargets(FfiRegistry& registry) {
  registry.Add("jax_vmm_testing_host_gate", "cpu", JaxVmmTestingHostGateCpu);
}
