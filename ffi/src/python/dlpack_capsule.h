// A DLPack capsule ("dltensor", the DLManagedTensor ABI of dlpack.h) over memory that a
// C++ object keeps alive. Its deleter only drops that object: it never touches Python
// (no GIL), so a consumer (XLA) may release the tensor from any thread, also while the
// interpreter shuts down.
#pragma once

#include <nanobind/nanobind.h>

#include <cstdint>
#include <memory>
#include <vector>

namespace jax_vmm {

struct DlpackView {
  void* data = nullptr;
  std::vector<int64_t> shape;  // row-major, compact
  uint8_t dtype_code = 0;      // DLDataTypeCode
  uint8_t dtype_bits = 0;
  int32_t device_type = 0;  // DLDeviceType: 1 CPU, 2 CUDA
  int32_t device_id = 0;
};

// A new PyCapsule named "dltensor" holding `view`; `keepalive` lives until the consumer
// calls the tensor's deleter (or, unconsumed, until the capsule is collected).
nanobind::object MakeDlpackCapsule(const DlpackView& view, std::shared_ptr<const void> keepalive);

}  // namespace jax_vmm
