// kv_write CUDA handlers (contract in kv_write_common.h). Both are command-buffer
// compatible: host code only resolves pointers and launches one kernel; everything that
// changes between steps (slots, the page table, counters) is read or written by the
// kernel from device memory, so a replayed graph validates and counts like a live call.
#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstdint>
#include <mutex>
#include <set>
#include <string>

#include "jax_vmm/ffi_targets.h"
#include "kv_write_common.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace jax_vmm::kv {
namespace {

// Dropped token writes on this device (all buffers, both handlers); read by
// kv_write_stats() through cudaMemcpyFromSymbol.
__device__ unsigned long long g_dropped_writes;

constexpr int kThreads = 256;

// One kernel for both calls. Each group of `tpt` threads handles one token of one side
// (blockIdx.y: 0 = k, 1 = v) at a time, grid-striding over tokens.
//   kApply == false (write-through): validate, record the status, count drops, and
//                    copy valid tokens when side.dst is set (arena memory).
//   kApply == true  (kv_write alias miss): copy the tokens whose status is kValid.
template <typename V, bool kApply>
__global__ void __launch_bounds__(kThreads) KvKernel(Params p, int tpt) {
  const Side& s = p.side[blockIdx.y];
  if (kApply && s.dst == nullptr) return;
  const int group = threadIdx.x / tpt;
  const int lane = threadIdx.x % tpt;
  const int groups = blockDim.x / tpt;
  const int64_t vecs = static_cast<int64_t>(p.token_bytes / sizeof(V));
  for (int64_t t = static_cast<int64_t>(blockIdx.x) * groups + group; t < p.n;
       t += static_cast<int64_t>(gridDim.x) * groups) {
    const int32_t slot = p.slots[t];
    int32_t st;
    if (kApply) {
      st = s.status[t];
    } else {
      st = CheckToken(slot, p, s);
      if (lane == 0) {
        s.status[t] = st;
        if (st == kDroppedOutOfRange || st == kDroppedUnbacked) {
          atomicAdd(&g_dropped_writes, 1ULL);
          if (s.drop_counter != nullptr) atomicAdd(s.drop_counter, 1ULL);
        }
      }
    }
    if (st != kValid || s.dst == nullptr) continue;
    const V* src = reinterpret_cast<const V*>(s.src + static_cast<uint64_t>(t) * p.token_bytes);
    V* dst = reinterpret_cast<V*>(s.dst + static_cast<uint64_t>(slot) * p.token_bytes);
    for (int64_t i = lane; i < vecs; i += tpt) dst[i] = src[i];
  }
}

// The widest copy unit that divides the token size and every base address.
int VectorBytes(const Params& p) {
  uintptr_t align = p.token_bytes;
  for (const Side& s : p.side) {
    align |= reinterpret_cast<uintptr_t>(s.src);
    if (s.dst != nullptr) align |= reinterpret_cast<uintptr_t>(s.dst);
  }
  for (int v : {16, 8, 4, 2}) {
    if (align % v == 0) return v;
  }
  return 1;
}

template <bool kApply>
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
    case 16: KvKernel<uint4, kApply><<<grid, kThreads, 0, stream>>>(p, tpt); break;
    case 8: KvKernel<uint2, kApply><<<grid, kThreads, 0, stream>>>(p, tpt); break;
    case 4: KvKernel<uint32_t, kApply><<<grid, kThreads, 0, stream>>>(p, tpt); break;
    case 2: KvKernel<uint16_t, kApply><<<grid, kThreads, 0, stream>>>(p, tpt); break;
    default: KvKernel<uint8_t, kApply><<<grid, kThreads, 0, stream>>>(p, tpt); break;
  }
  return cudaGetLastError();
}

ffi::Error CudaFailure(const char* op, const char* what, cudaError_t err) {
  return ffi::Error::Internal(std::string(op) + ": " + what + " failed: " + cudaGetErrorName(err) +
                              " (" + cudaGetErrorString(err) + ")");
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
    return CudaFailure(op, "cudaStreamIsCapturing", e);
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

ffi::Error WriteThroughImpl(cudaStream_t stream, ffi::AnyBuffer k, ffi::AnyBuffer v,
                            ffi::AnyBuffer new_k, ffi::AnyBuffer new_v,
                            ffi::Buffer<ffi::S32> slots, ffi::Result<ffi::Buffer<ffi::S32>> status,
                            bool require_arena) {
  constexpr const char* kOp = "jax_vmm_kv_write_through";
  bool capturing = false;
  if (ffi::Error e = CountCall(Handler::kWriteThrough, stream, kOp, &capturing); e.failure()) {
    return e;
  }
  const Dims status_dims = DimsOfS32(*status);
  Geometry g;
  std::string err = CheckGeometry(kOp, DimsOf(k), DimsOf(v), DimsOf(new_k), DimsOf(new_v),
                                  DimsOfS32(slots), &status_dims, &g);
  if (!err.empty()) return ffi::Error::InvalidArgument(err);

  Params p;
  p.slots = slots.typed_data();
  p.n = g.n;
  p.num_slots = g.num_slots;
  p.token_bytes = g.token_bytes;
  p.unchecked = DebugUnchecked();
  ffi::AnyBuffer* caches[2] = {&k, &v};
  ffi::AnyBuffer* news[2] = {&new_k, &new_v};
  bool all_arena = true;
  for (int s = 0; s < 2; ++s) {
    Side& side = p.side[s];
    all_arena = ResolveArenaSide(caches[s]->untyped_data(), caches[s]->size_bytes(), "cuda",
                                 &side) && all_arena;
    side.src = static_cast<const uint8_t*>(news[s]->untyped_data());
    side.status = status->typed_data() + s * g.n;
  }
  if (!all_arena) {
    GetCounters(Handler::kWriteThrough).non_arena.fetch_add(1);
    if (require_arena) {
      return ffi::Error::InvalidArgument(
          "jax_vmm.kv_write_through: the cache operand is not memory of a jax_vmm arena "
          "(XLA handed the custom call a copy). Pass the arena views (kv.k[l], kv.v[l]) "
          "directly as jit arguments and do not update them elsewhere in the same program.");
    }
  }
  if (cudaError_t e = Launch<false>(p, stream); e != cudaSuccess) {
    return CudaFailure(kOp, "kernel launch", e);
  }
  return ffi::Error::Success();
}

ffi::Error WriteImpl(cudaStream_t stream, ffi::AnyBuffer k, ffi::AnyBuffer v,
                     ffi::AnyBuffer new_k, ffi::AnyBuffer new_v, ffi::Buffer<ffi::S32> slots,
                     ffi::Buffer<ffi::S32> status, ffi::Result<ffi::AnyBuffer> k_out,
                     ffi::Result<ffi::AnyBuffer> v_out) {
  constexpr const char* kOp = "jax_vmm_kv_write";
  bool capturing = false;
  if (ffi::Error e = CountCall(Handler::kWrite, stream, kOp, &capturing); e.failure()) return e;
  const Dims status_dims = DimsOfS32(status);
  Geometry g;
  std::string err = CheckGeometry(kOp, DimsOf(k), DimsOf(v), DimsOf(new_k), DimsOf(new_v),
                                  DimsOfS32(slots), &status_dims, &g);
  if (!err.empty()) return ffi::Error::InvalidArgument(err);
  if (k_out->size_bytes() != k.size_bytes() || v_out->size_bytes() != v.size_bytes()) {
    return ffi::Error::InvalidArgument("jax_vmm_kv_write: outputs must match k and v");
  }

  Params p;
  p.slots = slots.typed_data();
  p.n = g.n;
  p.num_slots = g.num_slots;
  p.token_bytes = g.token_bytes;
  ffi::AnyBuffer* ins[2] = {&k, &v};
  ffi::Result<ffi::AnyBuffer>* outs[2] = {&k_out, &v_out};
  ffi::AnyBuffer* news[2] = {&new_k, &new_v};
  bool miss = false;
  for (int s = 0; s < 2; ++s) {
    void* out = (*outs[s])->untyped_data();
    const size_t bytes = (*outs[s])->size_bytes();
    // XLA aliases the output with operand s; if it ever did not, keep the op's meaning.
    if (out != ins[s]->untyped_data()) {
      if (cudaError_t e = cudaMemcpyAsync(out, ins[s]->untyped_data(), bytes,
                                          cudaMemcpyDeviceToDevice, stream);
          e != cudaSuccess) {
        return CudaFailure(kOp, "cudaMemcpyAsync", e);
      }
    }
    Side probe;
    const bool arena = ResolveArenaSide(out, bytes, "cuda", &probe);
    Side& side = p.side[s];
    // Arena output: the write-through call already wrote into this very buffer.
    side.dst = arena ? nullptr : static_cast<uint8_t*>(out);
    side.src = static_cast<const uint8_t*>(news[s]->untyped_data());
    side.status = const_cast<int32_t*>(status.typed_data()) + s * g.n;
    miss = miss || !arena;
  }
  // Donated arena: in place, nothing to do. Under capture we still record the (then
  // empty) kernel so that XLA never gets an empty traced graph for this command.
  if (!miss && !capturing) return ffi::Error::Success();
  if (miss) GetCounters(Handler::kWrite).alias_misses.fetch_add(1);
  if (cudaError_t e = Launch<true>(p, stream); e != cudaSuccess) {
    return CudaFailure(kOp, "kernel launch", e);
  }
  return ffi::Error::Success();
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

[[maybe_unused]] const bool kHooksInstalled = [] {
  SetDeviceDropHooks(DeviceDropHooks{ReadDeviceDrops, ResetDeviceDrops});
  return true;
}();

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
                                  .Attr<bool>("require_arena"),
                              {ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxVmmKvWriteCuda, jax_vmm::kv::WriteImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<ffi::AnyBuffer>()         // k
                                  .Arg<ffi::AnyBuffer>()         // v
                                  .Arg<ffi::AnyBuffer>()         // new_k
                                  .Arg<ffi::AnyBuffer>()         // new_v
                                  .Arg<ffi::Buffer<ffi::S32>>()  // slots
                                  .Arg<ffi::Buffer<ffi::S32>>()  // status (2, n)
                                  .Ret<ffi::AnyBuffer>()         // k (aliases operand 0)
                                  .Ret<ffi::AnyBuffer>(),        // v (aliases operand 1)
                              {ffi::Traits::kCmdBufferCompatible});

JAX_VMM_FFI_TARGET("jax_vmm_kv_write_through", "CUDA", JaxVmmKvWriteThroughCuda);
JAX_VMM_FFI_TARGET("jax_vmm_kv_write", "CUDA", JaxVmmKvWriteCuda);
