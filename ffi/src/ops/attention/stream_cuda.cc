// CUDA handlers of jax_vmm_decode_attention_v2 (host code; the kernels are in
// stream_kernels.cu): streaming decode attention over bf16/fp16 or float8_e4m3fn KV
// caches, its partials and combine counters in jax_vmm's graph-safe scratch. Python
// wrapper: jax_vmm/ops/attention.py (impl "stream", "stream_combine", "stream_tma"; fp8 caches
// always come here).
//
// Target jax_vmm_decode_attention_v2 {initialize: raise the kernel's shared-memory limit
// and grow the scratch to the plan's size (never under capture); execute: fetch the
// scratch, clear the counters, launch}, kCmdBufferCompatible.
#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstdint>
#include <string>

#include "common/cuda_error.h"
#include "jax_vmm/scratch.h"
#include "ops/attention/attention_cuda.h"
#include "ops/attention/attention_stats.h"
#include "ops/attention/attention_targets.h"
#include "ops/attention/stream_check.h"
#include "ops/attention/stream_cuda.h"
#include "ops/attention/stream_ffi.h"
#include "ops/attention/stream_kernels.h"
#include "ops/attention/stream_plan.h"

namespace jax_vmm::attention::stream {
namespace {

ffi::Error CudaFailure(const char* what, cudaError_t e) { return CudaFfiError(kCudaName, what, e); }

ffi::Error Invalid(const std::string& what) {
  return ffi::Error::InvalidArgument(std::string(kCudaName) + ": " + what);
}

// Validated operands, plan and kernel choice of one call.
struct Call {
  Shapes shapes;
  Plan plan;
  KernelChoice kernel;
  int stages = 0;
};

// The ring depth: `requested` (2..kMaxStages), or with 0 as many slots as fit in the
// shared memory each CTA gets when the plan's CTAs share the SMs; fills call->stages and
// call->kernel.smem.
ffi::Error ChooseStages(int64_t requested, int sms, Call* call) {
  const Shapes& sh = call->shapes;
  const int rows = call->kernel.two_head_tiles ? 16 : 8;
  const size_t stage_bytes = StageBytes(sh.head_dim, call->kernel.kv, call->kernel.bulk);
  const size_t fixed = FixedSharedBytes(sh.batch, rows, sh.head_dim);
  const int64_t resident = std::max<int64_t>(1, (call->plan.ctas + sms - 1) / sms);
  const size_t budget =
      std::min(kMaxSmemPerCta, kSmemPerSm / std::min<int64_t>(resident, 4) - kSmemReservedPerCta);
  int64_t s = requested;
  if (s <= 0) {
    s = budget > fixed ? static_cast<int64_t>((budget - fixed) / stage_bytes) : 0;
    if (call->kernel.kv == KvStorage::kFp8) s = std::min<int64_t>(s, kFp8AutoStages);
    s = std::min<int64_t>(kMaxStages, std::max<int64_t>(2, s));
  }
  if (std::string why = StagesFit(s, sh.batch, rows, sh.head_dim, call->kernel.kv,
                                   call->kernel.bulk);
      !why.empty()) {
    return Invalid(why);
  }
  call->stages = static_cast<int>(s);
  call->kernel.smem = fixed + s * stage_bytes;
  return ffi::Error::Success();
}

ffi::Error Prepare(int device, const ffi::AnyBuffer& q, const ffi::AnyBuffer& k,
                   const ffi::AnyBuffer& v, const ffi::Buffer<ffi::S32>& lengths,
                   const ffi::AnyBuffer& k_scale, const ffi::AnyBuffer& v_scale,
                   const ffi::AnyBuffer& out, const StreamAttrs& attrs, Call* call) {
  if (attrs.bulk != 0 && attrs.bulk != 1) {
    return Invalid("bulk must be 0 or 1, got " + std::to_string(attrs.bulk));
  }
  if (ffi::Error e = CheckCombine(kCudaName, attrs.combine); e.failure()) return e;
  KernelChoice& kc = call->kernel;
  if (ffi::Error e = CheckStreamOperands(kCudaName, q, k, v, lengths, k_scale, v_scale, out,
                                         &call->shapes, &kc.kv);
      e.failure()) {
    return e;
  }
  call->shapes.token_heads = attrs.token_heads;
  const Shapes& sh = call->shapes;
  if (std::string why = Unsupported(sh); !why.empty()) return Invalid(why + " (use impl='auto')");
  if (sh.head_dim != 64 && sh.head_dim != 128 && sh.head_dim != 256) {
    return Invalid("head_dim must be 64, 128 or 256; got " + std::to_string(sh.head_dim));
  }
  int sms = 0;
  if (cudaError_t e = SmCount(device, &sms); e != cudaSuccess) {
    return CudaFailure("cudaDeviceGetAttribute(MultiProcessorCount)", e);
  }
  const int64_t storage_bytes = StorageBytes(kc.kv);
  call->plan = MakeStreamPlan(sh, storage_bytes, DefaultCtas(sms, sh.head_dim, storage_bytes),
                              attrs.ctas, attrs.min_tiles);
  kc.q_bf16 = q.element_type() == ffi::DataType::BF16;
  kc.head_dim = static_cast<int>(sh.head_dim);
  kc.two_head_tiles = call->plan.head_group > 8;
  kc.bulk = attrs.bulk == 1;
  kc.ctas = static_cast<unsigned>(call->plan.ctas);
  return ChooseStages(attrs.stages, sms, call);
}

StreamParams MakeParams(const ffi::AnyBuffer& q, const ffi::AnyBuffer& k, const ffi::AnyBuffer& v,
                        const ffi::Buffer<ffi::S32>& lengths, const ffi::AnyBuffer& k_scale,
                        const ffi::AnyBuffer& v_scale, ffi::AnyBuffer& out, void* ws,
                        const Call& call, const StreamAttrs& attrs) {
  const Shapes& sh = call.shapes;
  const Plan& pl = call.plan;
  StreamParams p;
  p.q = q.untyped_data();
  p.k = k.untyped_data();
  p.v = v.untyped_data();
  p.lengths = lengths.typed_data();
  p.k_scale = static_cast<const float*>(k_scale.untyped_data());
  p.v_scale = static_cast<const float*>(v_scale.untyped_data());
  p.out = out.untyped_data();
  uint8_t* w = static_cast<uint8_t*>(ws);
  p.ws_acc = reinterpret_cast<float*>(w + pl.acc_offset);
  p.ws_m = reinterpret_cast<float*>(w + pl.m_offset);
  p.ws_l = reinterpret_cast<float*>(w + pl.l_offset);
  p.counters = reinterpret_cast<unsigned*>(w + pl.counter_offset);
  p.batch = static_cast<int>(sh.batch);
  p.max_tokens = static_cast<int>(sh.max_tokens);
  p.q_heads = static_cast<int>(sh.q_heads);
  p.kv_heads = static_cast<int>(sh.kv_heads);
  p.token_heads = static_cast<int>(TokenHeads(sh));
  p.group = static_cast<int>(sh.q_heads / sh.kv_heads);
  p.head_group = static_cast<int>(pl.head_group);
  p.unit_groups = static_cast<int>(pl.unit_groups);
  p.min_tiles = static_cast<int>(pl.min_tiles);
  p.stages = call.stages;
  p.fused = attrs.combine == kCombineFused;
  p.scale_log2 = attrs.scale * 1.4426950408889634f;
  return p;
}

ffi::Error BeginExecute(cudaStream_t stream, int32_t device, const ffi::AnyBuffer& q,
                        const ffi::AnyBuffer& k, const ffi::AnyBuffer& v,
                        const ffi::Buffer<ffi::S32>& lengths, const ffi::AnyBuffer& k_scale,
                        const ffi::AnyBuffer& v_scale, const ffi::AnyBuffer& out,
                        const StreamAttrs& attrs, Call* call) {
  CountExecute(stream);
  return Prepare(device, q, k, v, lengths, k_scale, v_scale, out, attrs, call);
}

ffi::Error InitializeImpl(cudaStream_t stream, int32_t device, ffi::AnyBuffer q, ffi::AnyBuffer k,
                          ffi::AnyBuffer v, ffi::Buffer<ffi::S32> lengths, ffi::AnyBuffer k_scale,
                          ffi::AnyBuffer v_scale, ffi::Result<ffi::AnyBuffer> out, float scale,
                          int64_t ctas, int64_t stages, int64_t min_tiles, int64_t combine,
                          int64_t bulk) {
  return CudaInitialize(stream, device, q, k, v, lengths, k_scale, v_scale, *out,
                        StreamAttrs{scale, ctas, stages, min_tiles, combine, bulk});
}

ffi::Error ExecuteImpl(cudaStream_t stream, int32_t device, ffi::AnyBuffer q, ffi::AnyBuffer k,
                       ffi::AnyBuffer v, ffi::Buffer<ffi::S32> lengths, ffi::AnyBuffer k_scale,
                       ffi::AnyBuffer v_scale, ffi::Result<ffi::AnyBuffer> out, float scale,
                       int64_t ctas, int64_t stages, int64_t min_tiles, int64_t combine,
                       int64_t bulk) {
  return CudaExecute(stream, device, q, k, v, lengths, k_scale, v_scale, *out,
                     StreamAttrs{scale, ctas, stages, min_tiles, combine, bulk});
}

}  // namespace

ffi::Error CudaInitialize(cudaStream_t stream, int32_t device, const ffi::AnyBuffer& q,
                          const ffi::AnyBuffer& k, const ffi::AnyBuffer& v,
                          const ffi::Buffer<ffi::S32>& lengths, const ffi::AnyBuffer& k_scale,
                          const ffi::AnyBuffer& v_scale, const ffi::AnyBuffer& out,
                          const StreamAttrs& attrs) {
  GetCounters().cuda_initialize_calls.fetch_add(1, std::memory_order_relaxed);
  Call call;
  if (ffi::Error e = Prepare(device, q, k, v, lengths, k_scale, v_scale, out, attrs, &call);
      e.failure()) {
    return e;
  }
  if (call.shapes.batch == 0) return ffi::Error::Success();
  if (cudaError_t e = PrepareStreamKernel(call.kernel); e != cudaSuccess) {
    return CudaFailure("cudaFuncSetAttribute(MaxDynamicSharedMemorySize)", e);
  }
  // Never under capture: the one place where the workspace may grow for a graph.
  std::string err =
      scratch::Reserve(device, stream, static_cast<size_t>(call.plan.workspace_bytes));
  if (!err.empty()) {
    return ffi::Error::Internal(std::string(kCudaName) +
                                ": growing the graph-safe scratch: " + err);
  }
  return ffi::Error::Success();
}

ffi::Error CudaBeginExecute(cudaStream_t stream, int32_t device, const ffi::AnyBuffer& q,
                            const ffi::AnyBuffer& k, const ffi::AnyBuffer& v,
                            const ffi::Buffer<ffi::S32>& lengths, const ffi::AnyBuffer& k_scale,
                            const ffi::AnyBuffer& v_scale, const ffi::AnyBuffer& out,
                            const StreamAttrs& attrs) {
  Call call;
  return BeginExecute(stream, device, q, k, v, lengths, k_scale, v_scale, out, attrs, &call);
}

ffi::Error CudaExecute(cudaStream_t stream, int32_t device, const ffi::AnyBuffer& q,
                       const ffi::AnyBuffer& k, const ffi::AnyBuffer& v,
                       const ffi::Buffer<ffi::S32>& lengths, const ffi::AnyBuffer& k_scale,
                       const ffi::AnyBuffer& v_scale, ffi::AnyBuffer out,
                       const StreamAttrs& attrs) {
  Call call;
  if (ffi::Error e =
          BeginExecute(stream, device, q, k, v, lengths, k_scale, v_scale, out, attrs, &call);
      e.failure()) {
    return e;
  }
  if (call.shapes.batch == 0) return ffi::Error::Success();
  void* ws = nullptr;
  std::string err =
      scratch::Get(device, stream, static_cast<size_t>(call.plan.workspace_bytes), &ws);
  if (!err.empty()) {
    return ffi::Error::Internal(std::string(kCudaName) + ": graph-safe scratch: " + err);
  }
  const StreamParams p = MakeParams(q, k, v, lengths, k_scale, v_scale, out, ws, call, attrs);
  if (p.fused) {
    // The per-unit arrival counters must start at zero: the scratch is shared with other
    // calls (a memset node when captured).
    const size_t bytes =
        static_cast<size_t>(call.shapes.batch * call.plan.unit_groups) * sizeof(unsigned);
    if (cudaError_t e = cudaMemsetAsync(p.counters, 0, bytes, stream); e != cudaSuccess) {
      return CudaFailure("cudaMemsetAsync(counters)", e);
    }
  }
  if (cudaError_t e = LaunchStreamKernels(p, call.kernel, stream); e != cudaSuccess) {
    return CudaFailure("kernel launch", e);
  }
  GetCounters().cuda_tensor_core_launches.fetch_add(1, std::memory_order_relaxed);
  return ffi::Error::Success();
}

}  // namespace jax_vmm::attention::stream

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    DecodeAttentionStreamCudaInitialize, jax_vmm::attention::stream::InitializeImpl,
    jax_vmm::attention::stream::BindStreamAttrs(
        jax_vmm::attention::stream::BindStreamInputs(
            jax_vmm::attention::BindCudaContext(xla::ffi::Ffi::BindInitialize()))
            .Ret<xla::ffi::AnyBuffer>()));  // out

XLA_FFI_DEFINE_HANDLER_SYMBOL(DecodeAttentionStreamCudaExecute,
                              jax_vmm::attention::stream::ExecuteImpl,
                              jax_vmm::attention::stream::BindStreamAttrs(
                                  jax_vmm::attention::stream::BindStreamInputs(
                                      jax_vmm::attention::BindCudaContext(xla::ffi::Ffi::Bind()))
                                      .Ret<xla::ffi::AnyBuffer>()),  // out
                              {xla::ffi::Traits::kCmdBufferCompatible});

namespace jax_vmm::attention {

void AddStreamCudaTargets(FfiRegistry& registry) {
  registry.Add(
      "jax_vmm_decode_attention_v2", "CUDA",
      FfiRegistry::Stages{DecodeAttentionStreamCudaInitialize, DecodeAttentionStreamCudaExecute});
}

}  // namespace jax_vmm::attention
