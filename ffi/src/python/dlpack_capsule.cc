// DLPack capsules whose deleter needs no GIL (see dlpack_capsule.h).
#include "python/dlpack_capsule.h"

#include <Python.h>

#include <utility>

namespace nb = nanobind;

namespace jax_vmm {
namespace {

// The DLPack 0.x ABI (dlpack.h): plain C structs, stable across versions.
struct DLDevice {
  int32_t device_type;
  int32_t device_id;
};
struct DLDataType {
  uint8_t code;
  uint8_t bits;
  uint16_t lanes;
};
struct DLTensor {
  void* data;
  DLDevice device;
  int32_t ndim;
  DLDataType dtype;
  int64_t* shape;
  int64_t* strides;
  uint64_t byte_offset;
};
struct DLManagedTensor {
  DLTensor dl_tensor;
  void* manager_ctx;
  void (*deleter)(DLManagedTensor* self);
};

constexpr const char* kName = "dltensor";
constexpr const char* kUsedName = "used_dltensor";  // what a consumer renames it to

// Owns everything the tensor points to; deleting it is the whole deleter.
struct Holder {
  DLManagedTensor managed{};
  std::vector<int64_t> shape;
  std::vector<int64_t> strides;
  std::shared_ptr<const void> keepalive;
};

void DeleteHolder(DLManagedTensor* self) { delete static_cast<Holder*>(self->manager_ctx); }

// The capsule's destructor: a capsule never consumed still owns its tensor. Runs with
// the GIL (it is a Python object), but the deleter it calls does not need it.
void DestroyCapsule(PyObject* capsule) {
  if (PyCapsule_IsValid(capsule, kUsedName)) return;
  auto* managed = static_cast<DLManagedTensor*>(PyCapsule_GetPointer(capsule, kName));
  if (managed == nullptr) {
    PyErr_Clear();
    return;
  }
  managed->deleter(managed);
}

}  // namespace

nb::object MakeDlpackCapsule(const DlpackView& view, std::shared_ptr<const void> keepalive) {
  auto holder = std::make_unique<Holder>();
  holder->shape = view.shape;
  holder->strides.assign(view.shape.size(), 1);
  for (size_t i = view.shape.size(); i-- > 1;) {
    holder->strides[i - 1] = holder->strides[i] * view.shape[i];
  }
  holder->keepalive = std::move(keepalive);
  DLTensor& t = holder->managed.dl_tensor;
  t.data = view.data;
  t.device = {view.device_type, view.device_id};
  t.ndim = static_cast<int32_t>(holder->shape.size());
  t.dtype = {view.dtype_code, view.dtype_bits, 1};
  t.shape = holder->shape.data();
  t.strides = holder->strides.data();
  t.byte_offset = 0;
  holder->managed.manager_ctx = holder.get();
  holder->managed.deleter = DeleteHolder;
  PyObject* capsule = PyCapsule_New(&holder->managed, kName, DestroyCapsule);
  if (capsule == nullptr) throw nb::python_error();
  holder.release();  // the capsule (or its consumer) owns it now
  return nb::steal(capsule);
}

}  // namespace jax_vmm
