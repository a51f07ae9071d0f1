#include "drivers/cuda/compute_streams.h"

#include <algorithm>
#include <map>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace jax_vmm::cuda {
namespace {

using Key = std::pair<const Api*, int>;  // (entry-point table, device ordinal)

std::mutex g_mu;
std::map<Key, std::vector<void*>>& Table() {
  static auto* table = new std::map<Key, std::vector<void*>>();  // outlives exit-time waits
  return *table;
}

ffi::Error RegisterFromHandler(void* stream, int32_t ordinal, ffi::AnyBuffer in,
                               ffi::Result<ffi::AnyBuffer> out) {
  (void)in;
  (void)out;  // aliased to the operand: nothing to write
  if (stream == nullptr) {
    return ffi::Error::InvalidArgument(
        "jax_vmm_register_compute_stream: XLA handed over no stream for CUDA device " +
        std::to_string(ordinal));
  }
  RegisterComputeStream(GetApi(), ordinal, stream);  // XLA's streams are libcuda's
  return ffi::Error::Success();
}

}  // namespace

void RegisterComputeStream(const Api& api, int ordinal, void* stream) {
  std::lock_guard<std::mutex> lock(g_mu);
  std::vector<void*>& streams = Table()[Key(&api, ordinal)];
  if (std::find(streams.begin(), streams.end(), stream) == streams.end()) {
    streams.push_back(stream);
  }
}

std::vector<void*> ComputeStreams(const Api& api, int ordinal) {
  std::lock_guard<std::mutex> lock(g_mu);
  auto it = Table().find(Key(&api, ordinal));
  return it == Table().end() ? std::vector<void*>{} : it->second;
}

std::vector<void*> ForgetComputeStreams(const Api& api, int ordinal) {
  std::lock_guard<std::mutex> lock(g_mu);
  auto it = Table().find(Key(&api, ordinal));
  if (it == Table().end()) return {};
  std::vector<void*> streams = std::move(it->second);
  Table().erase(it);
  return streams;
}

}  // namespace jax_vmm::cuda

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxVmmRegisterComputeStream, jax_vmm::cuda::RegisterFromHandler,
                              xla::ffi::Ffi::Bind()
                                  .Ctx<xla::ffi::PlatformStream<void*>>()
                                  .Ctx<xla::ffi::DeviceOrdinal>()
                                  .Arg<xla::ffi::AnyBuffer>()
                                  .Ret<xla::ffi::AnyBuffer>());

namespace jax_vmm::cuda {

void AddComputeStreamTargets(FfiRegistry& registry) {
  registry.Add("jax_vmm_register_compute_stream", "CUDA", JaxVmmRegisterComputeStream);
}

}  // namespace jax_vmm::cuda
