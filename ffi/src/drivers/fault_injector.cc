#include <string>

#include "jax_vmm/driver.h"
#include "jax_vmm/errors.h"

namespace jax_vmm {

const char* DriverOpName(DriverOp op) {
  switch (op) {
    case DriverOp::kCreate:
      return "create";
    case DriverOp::kMap:
      return "map";
    case DriverOp::kSetAccess:
      return "set_access";
    default:
      return "unknown";
  }
}

void FaultInjector::Arm(DriverOp op, int64_t nth, bool as_out_of_memory) {
  const int i = static_cast<int>(op);
  as_oom_[i].store(as_out_of_memory);
  countdown_[i].store(nth > 0 ? nth : 0);
}

void FaultInjector::DisarmAll() {
  for (int i = 0; i < static_cast<int>(DriverOp::kCount); ++i) countdown_[i].store(0);
}

void FaultInjector::Check(DriverOp op, size_t bytes) {
  const int i = static_cast<int>(op);
  int64_t left = countdown_[i].load();
  // Decrement only while armed; the call that brings it from 1 to 0 fails.
  while (left > 0 && !countdown_[i].compare_exchange_weak(left, left - 1)) {
  }
  if (left != 1) return;
  injected_.fetch_add(1);
  if (as_oom_[i].load()) {
    throw OutOfMemory("injected out-of-memory in driver " + std::string(DriverOpName(op)) + " of " +
                          std::to_string(bytes) + " bytes",
                      bytes, 0);
  }
  throw InjectedFault(std::string("injected fault in driver ") + DriverOpName(op) + " of " +
                      std::to_string(bytes) + " bytes (fault-injection hook)");
}

}  // namespace jax_vmm
