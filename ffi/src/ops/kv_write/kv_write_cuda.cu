// kv_write CUDA handlers (contract in kv_write_common.h). Both are command-buffer
// compatible: host code only resolves pointers and launches one kernel (plus, only if
// XLA ever failed to alias kv_write's output, one copy); everything that
// changes between steps (slots, the page table, counters) is read or written by the
// kernel from device memory, so a replayed graph validates and counts like a live call.
#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstdint>
#include <mutex>
#include <set>
#include <string>

#include "common/cuda_error.h"
#include "ops/kv_write/kv_write_common.h"
#include "ops/kv_write/kv_write_targets.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace jax_vmm::kv {
namespace {

// Dropped token writes on this device (all buffers, both handlers); read by
// kv_write_stats() through cudaMemcpyFromSymbol.
__device__ unsigned long long g_dropped_writes;

constexpr int kThreads = 256;

// Each group of `tpt` threads handles one token of one side (blockIdx.y: 0 = k, 1 = v)
// at a time, grid-striding over tokens: validate, record the status, count drops, copy
// valid tokens into the target and the second destination (see kv_write_common.h).
template <typename V>
__global__ void __launch_bounds__(kThreads) KvKernel(Params p, int tpt) {
  const Side& s = p.side[blockIdx.y];
  const int group = threadIdx.x / tpt;
  const int lane = threadIdx.x % tpt;
  const int groups = blockDim.x / tpt;
  const int64_t vecs = static_cast<int64_t>(p.token_bytes / sizeof(V));
  for (int64_t t = static_cast<int64_t>(blockIdx.x) * groups + group; t < p.n;
       t += static_cast<int64_t>(gridDim.x) * groups) {
    const int32_t slot = p.slots[t];
    const int32_t st = CheckToken(slot, p, s);
    if (lane == 0) {
      if (s.status != nullptr) s.status[t] = st;
      if (st == kDroppedOutOfRange || st == kDroppedUnbacked) {
        atomicAdd(&g_dropped_writes, 1ULL);
        if (s.drop_counter != nullptr) atomicAdd(s.drop_counter, 1ULL);
      }
    }
    if (st != kValid) continue;
    const uint64_t offset = static_cast<uint64_t>(slot) * p.token_bytes;
    const V* src = reinterpret_cast<const V*>(s.src + static_cast<uint64_t>(t) * p.token_bytes);
    if (s.dst != nullptr) {
      V* dst = reinterpret_cast<V*>(s.dst + offset);
      for (int64_t i = lane; i < vecs; i += tpt) dst[i] = src[i];
    }
    if (s.dst2 != nullptr) {
      V* dst = reinterpret_cast<V*>(s.dst2 + offset);
      for (int64_t i = lane; i < vecs; i += tpt) dst[i] = src[i];
    }
  }
}

// The widest copy unit that divides the token size and every base address.
int VectorBytes(const Params& p) {
  uintptr_t align = p.token_bytes;
  for (const Side& s : p.side) {
    align |= reinterpret_cast<uintptr_t>(s.src);
    align |= reinterpret_cast<uintptr_t>(s.dst) | reinterpret_cast<uintptr_t>(s.dst2);
  }
  for (int v : {16, 8, 4, 2}) {
    if (align % v == 0) return v;
  }
  return 1;
}

cudaError_t Launch(const Params& p, cudaStream_t stream) {
  if (p.n == 0) return cudaSuccess;
  const int vb = VectorBytes(p);
  const int64_t vecs = static_cast<int64_t>(p.token_bytes) / vb;
  int tpt = 1;
  while (tpt < vecs && tpt < kThreads) tpt *= 2;
  const int groups = kThreads / tpt;
  const int64_t blocks = std::min<int64_t>((p.n + groups - 1) / groups, 65535);
  const dim3 grid(static_cast<unsigned>(blocks), 2);
  switch (vb) {
    case 16:
      KvKernel<uint4><<<grid, kThreads, 0, stream>>>(p, tpt);
      break;
    case 8:
      KvKernel<uint2><<<grid, kThreads, 0, stream>>>(p, tpt);
      break;
    case 4:
      KvKernel<uint32_t><<<grid, kThreads, 0, stream>>>(p, tpt);
      break;
    case 2:
      KvKernel<uint16_t><<<grid, kThreads, 0, stream>>>(p, tpt);
      break;
    default:
      KvKernel<uint8_t><<<grid, kThreads, 0, stream>>>(p, tpt);
      break;
  }
  return cudaGetLastError();
}

Dims DimsOf(const ffi::AnyBuffer& b) {
  auto d = b.dimensions();
  return Dims{d.begin(), static_cast<int64_t>(d.size()), b.size_bytes(),
              static_cast<int>(b.element_type())};
}

Dims DimsOfS32(const ffi::Buffer<ffi::S32>& b) {
  auto d = b.dimensions();
  return Dims{d.begin(), static_cast<int64_t>(d.size()),
              static_cast<size_t>(b.element_count()) * sizeof(int32_t),
              static_cast<int>(ffi::DataType::S32)};
}

// Devices whose counter kv_write_stats() must read.
std::mutex g_devices_mu;
std::set<int>& SeenDevices() {
  static std::set<int> devices;
  return devices;
}

// Counts the call and whether the stream is capturing; remembers the device.
ffi::Error CountCall(Handler h, cudaStream_t stream, const char* op, bool* capturing) {
  Counters& c = GetCounters(h);
  c.calls.fetch_add(1);
  cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
  if (cudaError_t e = cudaStreamIsCapturing(stream, &capture); e != cudaSuccess) {
    return CudaFfiError(op, "cudaStreamIsCapturing", e);
  }
  *capturing = capture != cudaStreamCaptureStatusNone;
  if (*capturing) c.captured_calls.fetch_add(1);
  int device = 0;
  if (cudaGetDevice(&device) == cudaSuccess) {
    std::lock_guard<std::mutex> lock(g_devices_mu);
    SeenDevices().insert(device);
  }
  return ffi::Error::Success();
}

// The common part of both handlers once the buffers are known.
ffi::Error Run(Op op, Handler h, cudaStream_t stream, const Dims dims[5], const Dims* status_dims,
               const int32_t* slots, const SideInput in[2], bool require_arena) {
  const char* name = op == Op::kWrite ? "jax_vmm_kv_write" : "jax_vmm_kv_write_through";
  bool capturing = false;
  if (ffi::Error e = CountCall(h, stream, name, &capturing); e.failure()) return e;
  Params p;
  Resolution r;
  std::string err = PrepareCall(op, "cuda", require_arena, dims, status_dims, slots, in, &p, &r);
  if (!err.empty()) return ffi::Error::InvalidArgument(err);
  if (r.alias_miss) GetCounters(h).alias_misses.fetch_add(1);
  if (r.non_arena) GetCounters(h).non_arena.fetch_add(1);
  if (cudaError_t e = Launch(p, stream); e != cudaSuccess) {
    return CudaFfiError(name, "kernel launch", e);
  }
  return ffi::Error::Success();
}

ffi::Error WriteImpl(cudaStream_t stream, ffi::AnyBuffer k, ffi::AnyBuffer v, ffi::AnyBuffer new_k,
                     ffi::AnyBuffer new_v, ffi::Buffer<ffi::S32> slots,
                     ffi::Result<ffi::AnyBuffer> k_out, ffi::Result<ffi::AnyBuffer> v_out,
                     uint64_t dest_k, uint64_t dest_v) {
  const Dims dims[5] = {DimsOf(k), DimsOf(v), DimsOf(new_k), DimsOf(new_v), DimsOfS32(slots)};
  if (k_out->size_bytes() != k.size_bytes() || v_out->size_bytes() != v.size_bytes()) {
    return ffi::Error::InvalidArgument("jax_vmm_kv_write: outputs must match k and v");
  }
  // XLA aliases each output with its operand; if it ever did not, keep the op's meaning.
  ffi::AnyBuffer* ins[2] = {&k, &v};
  void* outs[2] = {k_out->untyped_data(), v_out->untyped_data()};
  for (int s = 0; s < 2; ++s) {
    if (outs[s] == ins[s]->untyped_data()) continue;
    if (cudaError_t e = cudaMemcpyAsync(outs[s], ins[s]->untyped_data(), ins[s]->size_bytes(),
                                        cudaMemcpyDeviceToDevice, stream);
        e != cudaSuccess) {
      return CudaFfiError("jax_vmm_kv_write", "cudaMemcpyAsync", e);
    }
  }
  const SideInput in[2] = {{dest_k, outs[0], k.size_bytes(), new_k.untyped_data(), nullptr},
                           {dest_v, outs[1], v.size_bytes(), new_v.untyped_data(), nullptr}};
  return Run(Op::kWrite, Handler::kWrite, stream, dims, nullptr, slots.typed_data(), in, false);
}

ffi::Error WriteThroughImpl(cudaStream_t stream, ffi::AnyBuffer k, ffi::AnyBuffer v,
                            ffi::AnyBuffer new_k, ffi::AnyBuffer new_v, ffi::Buffer<ffi::S32> slots,
                            ffi::Result<ffi::Buffer<ffi::S32>> status, bool require_arena,
                            uint64_t dest_k, uint64_t dest_v) {
  const Dims dims[5] = {DimsOf(k), DimsOf(v), DimsOf(new_k), DimsOf(new_v), DimsOfS32(slots)};
  const Dims status_dims = DimsOfS32(*status);
  if (status_dims.rank != 2 || status_dims.d[0] != 2) {
    return ffi::Error::InvalidArgument("jax_vmm_kv_write_through: status must be (2, n)");
  }
  const int64_t n = status_dims.d[1];
  const SideInput in[2] = {
      {dest_k, k.untyped_data(), k.size_bytes(), new_k.untyped_data(), status->typed_data()},
      {dest_v, v.untyped_data(), v.size_bytes(), new_v.untyped_data(), status->typed_data() + n}};
  return Run(Op::kWriteThrough, Handler::kWriteThrough, stream, dims, &status_dims,
             slots.typed_data(), in, require_arena);
}

// Device counters for kv_write_stats(): summed over the devices the handlers ran on.
uint64_t ReadDeviceDrops() {
  std::set<int> devices;
  {
    std::lock_guard<std::mutex> lock(g_devices_mu);
    devices = SeenDevices();
  }
  int previous = 0;
  cudaGetDevice(&previous);
  uint64_t total = 0;
  for (int d : devices) {
    unsigned long long value = 0;
    if (cudaSetDevice(d) == cudaSuccess &&
        cudaMemcpyFromSymbol(&value, g_dropped_writes, sizeof(value)) == cudaSuccess) {
      total += value;
    }
  }
  cudaSetDevice(previous);
  return total;
}

void ResetDeviceDrops() {
  std::set<int> devices;
  {
    std::lock_guard<std::mutex> lock(g_devices_mu);
    devices = SeenDevices();
  }
  int previous = 0;
  cudaGetDevice(&previous);
  const unsigned long long zero = 0;
  for (int d : devices) {
    if (cudaSetDevice(d) == cudaSuccess) {
      cudaMemcpyToSymbol(g_dropped_writes, &zero, sizeof(zero));
    }
  }
  cudaSetDevice(previous);
}

}  // namespace
}  // namespace jax_vmm::kv

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxVmmKvWriteThroughCuda, jax_vmm::kv::WriteThroughImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<ffi::AnyBuffer>()         // k
                                  .Arg<ffi::AnyBuffer>()         // v
                                  .Arg<ffi::AnyBuffer>()         // new_k
                                  .Arg<ffi::AnyBuffer>()         // new_v
                                  .Arg<ffi::Buffer<ffi::S32>>()  // slots
                                  .Ret<ffi::Buffer<ffi::S32>>()  // status (2, n)
                                  .Attr<bool>("require_arena")
                                  .Attr<uint64_t>("dest_k")
                                  .Attr<uint64_t>("dest_v"),
                              {ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxVmmKvWriteCuda, jax_vmm::kv::WriteImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<ffi::AnyBuffer>()         // k
                                  .Arg<ffi::AnyBuffer>()         // v
                                  .Arg<ffi::AnyBuffer>()         // new_k
                                  .Arg<ffi::AnyBuffer>()         // new_v
                                  .Arg<ffi::Buffer<ffi::S32>>()  // slots
                                  .Ret<ffi::AnyBuffer>()         // k (aliases operand 0)
                                  .Ret<ffi::AnyBuffer>()         // v (aliases operand 1)
                                  .Attr<uint64_t>("dest_k")
                                  .Attr<uint64_t>("dest_v"),
                              {ffi::Traits::kCmdBufferCompatible});

namespace jax_vmm::kv {

void AddCudaTargets(FfiRegistry& registry) {
  registry.Add("jax_vmm_kv_write_through", "CUDA", JaxVmmKvWriteThroughCuda);
  registry.Add("jax_vmm_kv_write", "CUDA", JaxVmmKvWriteCuda);
}

void InstallCudaDropHooks() {
  SetDeviceDropHooks(DeviceDropHooks{ReadDeviceDrops, ResetDeviceDrops});
}

}  // namespace jax_vmm::kv
