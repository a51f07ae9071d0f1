#include "drivers/cuda/zero_allocation.h"

#include <cctype>
#include <cstdlib>
#include <map>
#include <mutex>
#include <string>
#include <utility>

#include "drivers/cuda/cuda_device.h"
#include "jax_vmm/errors.h"

namespace jax_vmm::cuda {

size_t ZeroPieceBytes(size_t total_bytes, size_t granularity, size_t ceiling) {
  size_t piece = granularity;
  while (piece * 2 <= ceiling && piece * 2 <= total_bytes / 512) piece *= 2;
  return piece;
}

size_t ZeroPieceCeilingFromEnv() {
  const char* env = std::getenv("JAX_VMM_ZERO_PIECE_MAX_BYTES");
  if (env == nullptr || *env == '\0') return kDefaultZeroPieceCeiling;
  char* end = nullptr;
  const unsigned long long v = std::strtoull(env, &end, 10);
  if (!std::isdigit(static_cast<unsigned char>(env[0])) || *end != '\0' || v == 0) {
    throw InvalidArgument(std::string("jax_vmm: JAX_VMM_ZERO_PIECE_MAX_BYTES=") + env +
                          " is not a positive number of bytes; unset it for the default (" +
                          std::to_string(kDefaultZeroPieceCeiling) + ")");
  }
  return static_cast<size_t>(v);
}

ZeroAllocations::ZeroAllocations(const Api& api, int ordinal, CUdevice dev, size_t granularity,
                                 size_t max_piece)
    : ctx_(api, dev, ordinal), granularity_(granularity), max_piece_(max_piece) {
  ContextGuard g(api, ctx_.get(), ordinal);
  for (size_t bytes = granularity; bytes <= max_piece; bytes *= 2) Make(api, ordinal, dev, bytes);
}

CUmemGenericAllocationHandle ZeroAllocations::handle(size_t bytes) const {
  size_t k = 0;
  for (size_t size = granularity_; size < bytes; size *= 2) ++k;
  if (k >= by_size_.size() || (granularity_ << k) != bytes) return 0;
  return by_size_[k]->get();
}

// Fresh allocations carry no content guarantee: each is filled once through a temporary
// read-write mapping.
void ZeroAllocations::Make(const Api& api, int ordinal, CUdevice dev, size_t bytes) {
  by_size_.push_back(std::make_unique<OwnedHandle>(api, ctx_.get(), ordinal));
  OwnedHandle& handle = *by_size_.back();
  const CUmemAllocationProp prop = DeviceAllocationProp(dev);
  CUresult r = api.cuMemCreate(handle.out(), bytes, &prop, 0);
  if (r == CUDA_ERROR_OUT_OF_MEMORY) {
    throw OutOfMemory("jax_vmm: cuMemCreate of a " + std::to_string(bytes) +
                          "-byte zero allocation on CUDA device " + std::to_string(ordinal) +
                          ": out of GPU memory",
                      bytes, 0);
  }
  if (r != CUDA_SUCCESS) {
    ThrowDriver(api, ordinal, "cuMemCreate(zero allocation, size=" + std::to_string(bytes) + ")",
                r);
  }
  CUdeviceptr va = 0;
  r = api.cuMemAddressReserve(&va, bytes, 0, 0, 0);
  if (r != CUDA_SUCCESS) {
    ThrowDriver(api, ordinal, "cuMemAddressReserve(size=" + std::to_string(bytes) + ")", r);
  }
  ScopedReservation temp(api, ordinal, va, bytes, bytes);
  r = api.cuMemMap(va, bytes, 0, handle.get(), 0);
  if (r != CUDA_SUCCESS) ThrowDriver(api, ordinal, "cuMemMap(zero allocation, temporary)", r);
  temp.count_mapped();
  const CUmemAccessDesc rw = DeviceAccess(dev, CU_MEM_ACCESS_FLAGS_PROT_READWRITE);
  r = api.cuMemSetAccess(va, bytes, &rw, 1);
  if (r != CUDA_SUCCESS) {
    ThrowDriver(api, ordinal, "cuMemSetAccess(zero allocation, READWRITE)", r);
  }
  OwnedStream stream(api, ctx_.get(), ordinal);
  r = api.cuMemsetD8Async(va, 0, bytes, stream.get());
  if (r == CUDA_SUCCESS) r = api.cuStreamSynchronize(stream.get());
  if (r != CUDA_SUCCESS) ThrowDriver(api, ordinal, "cuMemsetD8(zero allocation)", r);
  // `temp` unmaps and frees the temporary range; the allocation lives on in `handle`.
}

std::shared_ptr<const ZeroAllocations> ZeroAllocations::ForDevice(const Api& api, int ordinal,
                                                                  CUdevice dev,
                                                                  size_t granularity) {
  static std::mutex mu;
  // By entry-point table too: a driver over the testing layer's host emulation never
  // shares zero allocations with one over libcuda.
  static std::map<std::pair<const Api*, int>, std::weak_ptr<const ZeroAllocations>> by_device;
  std::lock_guard<std::mutex> lock(mu);
  std::weak_ptr<const ZeroAllocations>& cached = by_device[{&api, ordinal}];
  if (auto live = cached.lock()) return live;
  size_t free_bytes = 0, total_bytes = 0;
  {
    PrimaryContext ctx(api, dev, ordinal);
    ContextGuard g(api, ctx.get(), ordinal);
    const CUresult r = api.cuMemGetInfo(&free_bytes, &total_bytes);
    if (r != CUDA_SUCCESS) ThrowDriver(api, ordinal, "cuMemGetInfo", r);
  }
  const size_t max_piece = ZeroPieceBytes(total_bytes, granularity, ZeroPieceCeilingFromEnv());
  auto made = std::make_shared<const ZeroAllocations>(api, ordinal, dev, granularity, max_piece);
  cached = made;
  return made;
}

}  // namespace jax_vmm::cuda
