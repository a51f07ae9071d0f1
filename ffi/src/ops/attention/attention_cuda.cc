// CUDA handlers of jax_vmm_decode_attention (host code; the kernels are in
// attention_kernels.cu): split-K ("flash-decoding") decode attention that reads only
// each sequence's live tokens, with its split partials in jax_vmm's graph-safe scratch.
//
// Handlers
//   jax_vmm_decode_attention               {initialize: grow the scratch to the plan's
//       size (never under capture); execute: fetch it and launch}, kCmdBufferCompatible.
//   jax_vmm_decode_attention_xla_workspace {execute}: partials in a second XLA output.
#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstdint>
#include <map>
#include <mutex>
#include <string>

#include "common/cuda_error.h"
#include "jax_vmm/scratch.h"
#include "ops/attention/attention_check.h"
#include "ops/attention/attention_cuda.h"
#include "ops/attention/attention_ffi.h"
#include "ops/attention/attention_kernels.h"
#include "ops/attention/attention_plan.h"
#include "ops/attention/attention_stats.h"
#include "ops/attention/attention_targets.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace jax_vmm::attention {
namespace {

constexpr const char* kName = "jax_vmm_decode_attention (CUDA)";

ffi::Error CudaFailure(const char* what, cudaError_t e) { return CudaFfiError(kName, what, e); }

// Validated operands + plan + kernel choice of one call.
struct Call {
  Shapes shapes;
  Plan plan;
  ffi::DataType dtype = ffi::DataType::INVALID;
  SplitKernel kernel = SplitKernel::kSimple;
};

// The split kernel the `impl` attribute asks for, given what the call supports.
ffi::Error ChooseKernel(int64_t impl, Call* call) {
  if (ffi::Error e = CheckImpl(kName, impl, call->dtype, call->shapes.head_dim); e.failure()) {
    return e;
  }
  if (!UsesTensorCores(call->dtype, call->shapes.head_dim, impl)) {
    call->kernel = SplitKernel::kSimple;
  } else {
    call->kernel = static_cast<Impl>(impl) == Impl::kTensorCoreOneTile
                       ? SplitKernel::kTensorCoreOneTile
                       : SplitKernel::kTensorCore;
  }
  return ffi::Error::Success();
}

ffi::Error Prepare(int device, const ffi::AnyBuffer& q, const ffi::AnyBuffer& k,
                   const ffi::AnyBuffer& v, const ffi::Buffer<ffi::S32>& lengths,
                   const ffi::AnyBuffer& out, int64_t chunk, int64_t splits, int64_t impl,
                   Call* call) {
  if (ffi::Error err = CheckOperands(kName, q, k, v, lengths, out, &call->shapes); err.failure()) {
    return err;
  }
  call->dtype = q.element_type();
  if (ffi::Error err = ChooseKernel(impl, call); err.failure()) return err;
  int sms = 0;
  if (chunk <= 0 || splits <= 0) {
    if (cudaError_t e = SmCount(device, &sms); e != cudaSuccess) {
      return CudaFailure("cudaDeviceGetAttribute(MultiProcessorCount)", e);
    }
  }
  call->plan = MakePlan(call->shapes, sms, chunk, splits);
  return CheckLaunchLimits(kName, call->shapes, call->plan, call->kernel != SplitKernel::kSimple);
}

// The partials' memory: the XLA workspace result when there is one, else the scratch
// workspace grown at the initialize stage (Get() only grows when the stream is not
// capturing and refuses, with a message, when a capture would need more than is mapped).
ffi::Error ResolveWorkspace(cudaStream_t stream, int32_t device, ffi::AnyBuffer* workspace,
                            const Plan& plan, void** ws) {
  if (workspace != nullptr) {
    if (ffi::Error err = CheckWorkspace(kName, workspace->size_bytes(), plan); err.failure()) {
      return err;
    }
    *ws = workspace->untyped_data();
    return ffi::Error::Success();
  }
  std::string err = scratch::Get(device, stream, static_cast<size_t>(plan.workspace_bytes), ws);
  if (!err.empty()) {
    return ffi::Error::Internal(std::string(kName) + ": graph-safe scratch: " + err);
  }
  return ffi::Error::Success();
}

RowKernelParams MakeKernelParams(const ffi::AnyBuffer& q, const ffi::AnyBuffer& k,
                                 const ffi::AnyBuffer& v, const ffi::Buffer<ffi::S32>& lengths,
                                 ffi::AnyBuffer& out, void* ws, const Call& call, float scale,
                                 const Semantics& sem) {
  const Shapes& sh = call.shapes;
  const Plan& pl = call.plan;
  RowKernelParams p;
  p.q = q.untyped_data();
  p.k = k.untyped_data();
  p.v = v.untyped_data();
  p.lengths = lengths.typed_data();
  p.out = out.untyped_data();
  const int64_t partials = sh.batch * sh.q_len * sh.q_heads * pl.splits;
  p.ws_acc = static_cast<float*>(ws);
  p.ws_m = p.ws_acc + partials * sh.head_dim;
  p.ws_l = p.ws_m + partials;
  p.batch = static_cast<int>(sh.batch);
  p.max_tokens = static_cast<int>(sh.max_tokens);
  p.q_heads = static_cast<int>(sh.q_heads);
  p.kv_heads = static_cast<int>(sh.kv_heads);
  p.head_dim = static_cast<int>(sh.head_dim);
  p.token_heads = static_cast<int>(TokenHeads(sh));
  p.group = static_cast<int>(sh.q_heads / sh.kv_heads);
  p.head_group = static_cast<int>(pl.head_group);
  p.chunk = static_cast<int>(pl.chunk);
  p.splits = static_cast<int>(pl.splits);
  p.scale_log2 = scale * 1.4426950408889634f;
  p.row_blocks = static_cast<int>(pl.row_blocks);
  p.rows = !sem.Plain(sh.q_len);
  p.q_len = static_cast<int>(sh.q_len);
  p.q_lengths = sem.q_lengths;
  p.window = static_cast<int>(std::min<int64_t>(sem.window, INT32_MAX));
  p.softcap = sem.softcap;
  p.scale = scale;
  return p;
}

ElementType ElementTypeOf(ffi::DataType t) {
  switch (t) {
    case ffi::DataType::BF16:
      return ElementType::kBF16;
    case ffi::DataType::F16:
      return ElementType::kF16;
    default:  // F32 (CheckOperands admits nothing else)
      return ElementType::kF32;
  }
}

ffi::Error Launch(const RowKernelParams& p, const Call& call, cudaStream_t stream) {
  const ElementType type = ElementTypeOf(call.dtype);
  cudaError_t e = LaunchSplitKernel(p, type, call.kernel, stream);
  Counters& counters = GetCounters();
  if (call.kernel == SplitKernel::kSimple) {
    counters.cuda_simple_launches.fetch_add(1, std::memory_order_relaxed);
  } else {
    counters.cuda_tensor_core_launches.fetch_add(1, std::memory_order_relaxed);
  }
  if (e != cudaSuccess) return CudaFailure("split kernel launch", e);
  e = LaunchCombineKernel(p, type, stream);
  if (e != cudaSuccess) return CudaFailure("combine kernel launch", e);
  return ffi::Error::Success();
}

// Statistics, validation and plan of one execute call.
ffi::Error BeginExecute(cudaStream_t stream, int32_t device, const ffi::AnyBuffer& q,
                        const ffi::AnyBuffer& k, const ffi::AnyBuffer& v,
                        const ffi::Buffer<ffi::S32>& lengths, const ffi::AnyBuffer& out,
                        int64_t chunk, int64_t splits, int64_t impl, Call* call) {
  CountExecute(stream);
  return Prepare(device, q, k, v, lengths, out, chunk, splits, impl, call);
}

ffi::Error InitializeImpl(cudaStream_t stream, int32_t device, ffi::AnyBuffer q, ffi::AnyBuffer k,
                          ffi::AnyBuffer v, ffi::Buffer<ffi::S32> lengths,
                          ffi::Result<ffi::AnyBuffer> out, float scale, int64_t chunk,
                          int64_t splits, int64_t impl, OptionalLengths q_lengths, int64_t window,
                          float softcap) {
  (void)scale;
  (void)q_lengths;  // the plan depends on shapes only; execute checks the options
  (void)window;
  (void)softcap;
  return CudaInitialize(stream, device, q, k, v, lengths, *out, chunk, splits, impl);
}

ffi::Error ExecuteImpl(cudaStream_t stream, int32_t device, ffi::AnyBuffer q, ffi::AnyBuffer k,
                       ffi::AnyBuffer v, ffi::Buffer<ffi::S32> lengths,
                       ffi::Result<ffi::AnyBuffer> out, float scale, int64_t chunk, int64_t splits,
                       int64_t impl, OptionalLengths q_lengths, int64_t window, float softcap) {
  Semantics sem;
  if (ffi::Error e = MakeSemantics(kName, q.dimensions()[0], q_lengths, window, softcap, &sem);
      e.failure()) {
    return e;
  }
  return CudaExecute(stream, device, q, k, v, lengths, *out, nullptr, scale, chunk, splits, impl,
                     sem);
}

ffi::Error ExecuteXlaWorkspaceImpl(cudaStream_t stream, int32_t device, ffi::AnyBuffer q,
                                   ffi::AnyBuffer k, ffi::AnyBuffer v,
                                   ffi::Buffer<ffi::S32> lengths, ffi::Result<ffi::AnyBuffer> out,
                                   ffi::Result<ffi::AnyBuffer> workspace, float scale,
                                   int64_t chunk, int64_t splits, int64_t impl,
                                   OptionalLengths q_lengths, int64_t window, float softcap) {
  Semantics sem;
  if (ffi::Error e = MakeSemantics(kName, q.dimensions()[0], q_lengths, window, softcap, &sem);
      e.failure()) {
    return e;
  }
  ffi::AnyBuffer ws = *workspace;
  return CudaExecute(stream, device, q, k, v, lengths, *out, &ws, scale, chunk, splits, impl, sem);
}

}  // namespace

cudaError_t SmCount(int device, int* out) {
  static std::mutex mu;
  static std::map<int, int> cache;
  std::lock_guard<std::mutex> lock(mu);
  auto it = cache.find(device);
  if (it != cache.end()) {
    *out = it->second;
    return cudaSuccess;
  }
  int n = 0;
  const cudaError_t e = cudaDeviceGetAttribute(&n, cudaDevAttrMultiProcessorCount, device);
  if (e != cudaSuccess) return e;
  cache[device] = n;
  *out = n;
  return cudaSuccess;
}

void CountExecute(cudaStream_t stream) {
  Counters& counters = GetCounters();
  counters.cuda_execute_calls.fetch_add(1, std::memory_order_relaxed);
  cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
  if (cudaStreamIsCapturing(stream, &capture) == cudaSuccess &&
      capture == cudaStreamCaptureStatusActive) {
    counters.cuda_captured_calls.fetch_add(1, std::memory_order_relaxed);
  }
}

ffi::Error CudaInitialize(cudaStream_t stream, int32_t device, const ffi::AnyBuffer& q,
                          const ffi::AnyBuffer& k, const ffi::AnyBuffer& v,
                          const ffi::Buffer<ffi::S32>& lengths, const ffi::AnyBuffer& out,
                          int64_t chunk, int64_t splits, int64_t impl) {
  GetCounters().cuda_initialize_calls.fetch_add(1, std::memory_order_relaxed);
  Call call;
  if (ffi::Error err = Prepare(device, q, k, v, lengths, out, chunk, splits, impl, &call);
      err.failure()) {
    return err;
  }
  if (call.shapes.batch == 0) return ffi::Error::Success();
  // Never under capture (XLA initializes thunks before it records command buffers): the
  // one place where the workspace may grow for a graph that will bake its address.
  std::string err =
      scratch::Reserve(device, stream, static_cast<size_t>(call.plan.workspace_bytes));
  if (!err.empty()) {
    return ffi::Error::Internal(std::string(kName) + ": growing the graph-safe scratch: " + err);
  }
  return ffi::Error::Success();
}

ffi::Error CudaBeginExecute(cudaStream_t stream, int32_t device, const ffi::AnyBuffer& q,
                            const ffi::AnyBuffer& k, const ffi::AnyBuffer& v,
                            const ffi::Buffer<ffi::S32>& lengths, const ffi::AnyBuffer& out,
                            int64_t chunk, int64_t splits, int64_t impl) {
  Call call;
  return BeginExecute(stream, device, q, k, v, lengths, out, chunk, splits, impl, &call);
}

ffi::Error CudaExecute(cudaStream_t stream, int32_t device, const ffi::AnyBuffer& q,
                       const ffi::AnyBuffer& k, const ffi::AnyBuffer& v,
                       const ffi::Buffer<ffi::S32>& lengths, ffi::AnyBuffer out,
                       ffi::AnyBuffer* workspace, float scale, int64_t chunk, int64_t splits,
                       int64_t impl, const Semantics& sem, int64_t token_heads) {
  Call call;
  if (ffi::Error err =
          BeginExecute(stream, device, q, k, v, lengths, out, chunk, splits, impl, &call);
      err.failure()) {
    return err;
  }
  call.shapes.token_heads = token_heads;
  if (call.shapes.batch == 0) return ffi::Error::Success();
  void* ws = nullptr;
  if (ffi::Error err = ResolveWorkspace(stream, device, workspace, call.plan, &ws); err.failure()) {
    return err;
  }
  return Launch(MakeKernelParams(q, k, v, lengths, out, ws, call, scale, sem), call, stream);
}

}  // namespace jax_vmm::attention

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    DecodeAttentionCudaInitialize, jax_vmm::attention::InitializeImpl,
    jax_vmm::attention::BindAttrs(
        jax_vmm::attention::BindInputs(
            jax_vmm::attention::BindCudaContext(xla::ffi::Ffi::BindInitialize()))
            .Ret<xla::ffi::AnyBuffer>()));  // out

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    DecodeAttentionCudaExecute, jax_vmm::attention::ExecuteImpl,
    jax_vmm::attention::BindAttrs(
        jax_vmm::attention::BindInputs(jax_vmm::attention::BindCudaContext(xla::ffi::Ffi::Bind()))
            .Ret<xla::ffi::AnyBuffer>()),  // out
    {xla::ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    DecodeAttentionCudaXlaWorkspaceExecute, jax_vmm::attention::ExecuteXlaWorkspaceImpl,
    jax_vmm::attention::BindAttrs(
        jax_vmm::attention::BindInputs(jax_vmm::attention::BindCudaContext(xla::ffi::Ffi::Bind()))
            .Ret<xla::ffi::AnyBuffer>()    // out
            .Ret<xla::ffi::AnyBuffer>()),  // workspace (uint8)
    {xla::ffi::Traits::kCmdBufferCompatible});

namespace jax_vmm::attention {

void AddCudaTargets(FfiRegistry& registry) {
  registry.Add("jax_vmm_decode_attention", "CUDA",
               FfiRegistry::Stages{DecodeAttentionCudaInitialize, DecodeAttentionCudaExecute});
  registry.Add("jax_vmm_decode_attention_xla_workspace", "CUDA",
               DecodeAttentionCudaXlaWorkspaceExecute);
}

}  // namespace jax_vmm::attention
