// XLA FFI handlers of the cuDNN attention backend: jax_vmm's attention semantics
// (cudnn_sdpa.h) over dense BSHD q/k/v, on cuDNN graphs built at the initialize stage, with
// their workspace in jax_vmm's graph-safe scratch so that captured command buffers keep a
// valid workspace pointer across scratch growth.
//
// Operands: q (B, S, H_q, D), k and v (B, T, H_kv, D), lengths s32 (B,), q_lengths s32
// (B,) [, out_in (B, S, H_q, D): the _into form, aliased to the result]. Attributes:
// scale (f32), softcap (f32, 0 = none), window (i64, 0 = none), zero_rows (i64, 1 = zero
// the rows cuDNN leaves unwritten).
#include <cuda_runtime_api.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <string>
#include <utility>

#include "jax_vmm/scratch.h"
#include "ops/attention/cudnn/cudnn_attention.h"
#include "ops/attention/cudnn/cudnn_rows.h"
#include "ops/attention/cudnn/cudnn_sdpa.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace jax_vmm::cudnn {
namespace {

constexpr const char* kName = "jax_vmm_cudnn_attention (CUDA)";

std::atomic<int64_t> g_initialize{0}, g_initialize_ns{0}, g_execute{0}, g_captured{0};

ffi::Error Invalid(const std::string& what) {
  return ffi::Error::InvalidArgument(std::string(kName) + ": " + what);
}

std::string Dims(const ffi::AnyBuffer& b) {
  std::string s = "(";
  for (size_t i = 0; i < b.dimensions().size(); ++i) {
    s += (i ? ", " : "") + std::to_string(b.dimensions()[i]);
  }
  return s + ")";
}

// Compares without building strings: XLA runs the initialize stage at every execution of
// a step, so its success path stays free of allocations.
bool SameDims(const ffi::AnyBuffer& a, const ffi::AnyBuffer& b) {
  const auto ad = a.dimensions(), bd = b.dimensions();
  return ad.size() == bd.size() && std::equal(ad.begin(), ad.end(), bd.begin());
}

// Validates the operands (the Python wrapper checks the same, with friendlier messages)
// and fills the graph key.
ffi::Error Check(int32_t device, const ffi::AnyBuffer& q, const ffi::AnyBuffer& k,
                 const ffi::AnyBuffer& v, const ffi::Buffer<ffi::S32>& lengths,
                 const ffi::Buffer<ffi::S32>& q_lengths, const ffi::AnyBuffer& out, float scale,
                 float softcap, int64_t window, SdpaKey* key) {
  if (q.dimensions().size() != 4 || k.dimensions().size() != 4) {
    return Invalid("q must be (B, S, H_q, D) and k, v (B, T, H_kv, D); got q " + Dims(q) +
                   ", k " + Dims(k));
  }
  const auto qd = q.dimensions(), kd = k.dimensions();
  if (!SameDims(k, v)) return Invalid("k " + Dims(k) + " and v " + Dims(v) + " differ");
  if (!SameDims(out, q)) return Invalid("out " + Dims(out) + " must have q's shape " + Dims(q));
  const ffi::DataType t = q.element_type();
  if ((t != ffi::DataType::BF16 && t != ffi::DataType::F16) || k.element_type() != t ||
      v.element_type() != t || out.element_type() != t) {
    return Invalid("q, k, v and out must all be bfloat16 or all float16");
  }
  const int64_t B = qd[0], S = qd[1], Hq = qd[2], D = qd[3], T = kd[1], Hkv = kd[2];
  if (kd[0] != B || kd[3] != D || Hkv <= 0 || Hq % Hkv != 0) {
    return Invalid("k " + Dims(k) + " does not match q " + Dims(q) +
                   " (same B and D, H_q a multiple of H_kv)");
  }
  if (D % 8 != 0 || D > 256) return Invalid("head_dim must be a multiple of 8 up to 256");
  if (lengths.element_count() != static_cast<size_t>(B) ||
      q_lengths.element_count() != static_cast<size_t>(B)) {
    return Invalid("lengths and q_lengths must be (B,) = (" + std::to_string(B) + ",)");
  }
  if (B > 65535 || S > INT32_MAX || T > INT32_MAX) {
    return Invalid("batch must be <= 65535 and S, T < 2^31");
  }
  if (window < 0 || !(softcap >= 0.0f) || !(scale == scale)) {
    return Invalid("window must be >= 0 and softcap >= 0 (0 = none), scale a number");
  }
  key->device = device;
  key->io = t == ffi::DataType::BF16 ? IoType::kBF16 : IoType::kF16;
  key->batch = B;
  key->q_tokens = S;
  key->max_tokens = T;
  key->q_heads = Hq;
  key->kv_heads = Hkv;
  key->head_dim = D;
  key->window = window;
  key->softcap = softcap;
  key->scale = scale;
  return ffi::Error::Success();
}

bool Capturing(cudaStream_t stream) {
  cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
  return cudaStreamIsCapturing(stream, &status) == cudaSuccess &&
         status != cudaStreamCaptureStatusNone;
}

}  // namespace

InitializeTimer::InitializeTimer() : start_ns_(NowNs()) {}

InitializeTimer::~InitializeTimer() {
  g_initialize.fetch_add(1, std::memory_order_relaxed);
  g_initialize_ns.fetch_add(NowNs() - start_ns_, std::memory_order_relaxed);
}

int64_t InitializeTimer::NowNs() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(
             std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

ffi::Error Initialize(cudaStream_t stream, int32_t device, const ffi::AnyBuffer& q,
                      const ffi::AnyBuffer& k, const ffi::AnyBuffer& v,
                      const ffi::Buffer<ffi::S32>& lengths, const ffi::Buffer<ffi::S32>& q_lengths,
                      const ffi::AnyBuffer& out, float scale, float softcap, int64_t window,
                      int64_t kv_token_heads) {
  SdpaKey key;
  if (ffi::Error err =
          Check(device, q, k, v, lengths, q_lengths, out, scale, softcap, window, &key);
      err.failure()) {
    return err;
  }
  key.kv_token_heads = kv_token_heads;
  if (key.batch == 0 || key.q_tokens == 0) return ffi::Error::Success();
  // XLA initializes thunks before it records command buffers: build here, never under
  // capture, and grow the scratch the graph's workspace will come from. The capture query
  // is a driver call, made only when the graph is not built yet.
  std::string err;
  const SdpaGraph* graph = FindGraph(key, &err);
  if (graph == nullptr && err.empty()) err = GetGraph(key, !Capturing(stream), &graph);
  if (!err.empty()) return ffi::Error::Internal(std::string(kName) + ": " + err);
  const int64_t ws = WorkspaceBytes(*graph);
  if (ws > 0) {
    if (err = scratch::Reserve(device, stream, static_cast<size_t>(ws)); !err.empty()) {
      return ffi::Error::Internal(std::string(kName) + ": growing the graph-safe scratch: " + err);
    }
  }
  return ffi::Error::Success();
}

ffi::Error Execute(cudaStream_t stream, int32_t device, const ffi::AnyBuffer& q,
                   const ffi::AnyBuffer& k, const ffi::AnyBuffer& v,
                   const ffi::Buffer<ffi::S32>& lengths, const ffi::Buffer<ffi::S32>& q_lengths,
                   ffi::AnyBuffer out, float scale, float softcap, int64_t window,
                   int64_t zero_rows, int64_t kv_token_heads, bool kv_owned) {
  g_execute.fetch_add(1, std::memory_order_relaxed);
  const bool capturing = Capturing(stream);
  if (capturing) g_captured.fetch_add(1, std::memory_order_relaxed);
  SdpaKey key;
  if (ffi::Error err =
          Check(device, q, k, v, lengths, q_lengths, out, scale, softcap, window, &key);
      err.failure()) {
    return err;
  }
  key.kv_token_heads = kv_token_heads;
  if (key.batch == 0 || key.q_tokens == 0) return ffi::Error::Success();
  const SdpaGraph* graph = nullptr;
  if (std::string err = GetGraph(key, !capturing, &graph); !err.empty()) {
    return ffi::Error::Internal(std::string(kName) + ": " + err);
  }
  SdpaPointers p;
  p.q = q.untyped_data();
  p.k = k.untyped_data();
  p.v = v.untyped_data();
  p.lengths = lengths.typed_data();
  p.q_lengths = q_lengths.typed_data();
  p.out = out.untyped_data();
  const int64_t ws = WorkspaceBytes(*graph);
  if (ws > 0) {
    // Grows only outside capture; under capture it refuses (with a message) rather than
    // bake a pointer that a later growth would retire.
    if (std::string err = scratch::Get(device, stream, static_cast<size_t>(ws), &p.workspace);
        !err.empty()) {
      return ffi::Error::Internal(std::string(kName) + ": graph-safe scratch: " + err);
    }
  }
  if (kv_owned && !IsPlainDecode(key)) {
    const int64_t stride = (kv_token_heads > 0 ? kv_token_heads : key.kv_heads) * key.head_dim;
    if (cudaError_t e = LaunchZeroNonFiniteTail(
            k.untyped_data(), v.untyped_data(), p.lengths, key.batch,
            key.max_tokens, stride, key.kv_heads * key.head_dim, key.io == IoType::kF16, stream);
        e != cudaSuccess) {
      return ffi::Error::Internal(std::string(kName) +
                                  ": launching the kernel that clears the tile past the "
                                  "lengths failed: " + cudaGetErrorString(e));
    }
  }
  if (std::string err = cudnn::Execute(*graph, device, stream, p); !err.empty()) {
    return ffi::Error::Internal(std::string(kName) + ": " + err);
  }
  if (zero_rows != 0) {
    const int64_t row_bytes = key.q_heads * key.head_dim * 2;
    if (cudaError_t e = LaunchZeroRows(p.out, p.q_lengths, p.lengths, key.batch, key.q_tokens,
                                       row_bytes, stream);
        e != cudaSuccess) {
      return ffi::Error::Internal(std::string(kName) + ": zero-rows kernel launch failed: " +
                                  cudaGetErrorString(e));
    }
  }
  return ffi::Error::Success();
}

namespace {

ffi::Error InitializeImpl(cudaStream_t stream, int32_t device, ffi::AnyBuffer q, ffi::AnyBuffer k,
                          ffi::AnyBuffer v, ffi::Buffer<ffi::S32> lengths,
                          ffi::Buffer<ffi::S32> q_lengths, ffi::Result<ffi::AnyBuffer> out,
                          float scale, float softcap, int64_t window, int64_t zero_rows) {
  (void)zero_rows;
  InitializeTimer timer;
  return Initialize(stream, device, q, k, v, lengths, q_lengths, *out, scale, softcap, window);
}

ffi::Error ExecuteImpl(cudaStream_t stream, int32_t device, ffi::AnyBuffer q, ffi::AnyBuffer k,
                       ffi::AnyBuffer v, ffi::Buffer<ffi::S32> lengths,
                       ffi::Buffer<ffi::S32> q_lengths, ffi::Result<ffi::AnyBuffer> out,
                       float scale, float softcap, int64_t window, int64_t zero_rows) {
  return Execute(stream, device, q, k, v, lengths, q_lengths, *out, scale, softcap, window,
                 zero_rows);
}

// The _into form: out_in is the buffer XLA aliases to the result; it is not read.
ffi::Error InitializeIntoImpl(cudaStream_t stream, int32_t device, ffi::AnyBuffer q,
                              ffi::AnyBuffer k, ffi::AnyBuffer v, ffi::Buffer<ffi::S32> lengths,
                              ffi::Buffer<ffi::S32> q_lengths, ffi::AnyBuffer out_in,
                              ffi::Result<ffi::AnyBuffer> out, float scale, float softcap,
                              int64_t window, int64_t zero_rows) {
  (void)out_in;
  (void)zero_rows;
  InitializeTimer timer;
  return Initialize(stream, device, q, k, v, lengths, q_lengths, *out, scale, softcap, window);
}

ffi::Error ExecuteIntoImpl(cudaStream_t stream, int32_t device, ffi::AnyBuffer q, ffi::AnyBuffer k,
                           ffi::AnyBuffer v, ffi::Buffer<ffi::S32> lengths,
                           ffi::Buffer<ffi::S32> q_lengths, ffi::AnyBuffer out_in,
                           ffi::Result<ffi::AnyBuffer> out, float scale, float softcap,
                           int64_t window, int64_t zero_rows) {
  (void)out_in;
  return Execute(stream, device, q, k, v, lengths, q_lengths, *out, scale, softcap, window,
                 zero_rows);
}

template <typename B>
auto BindCommon(B&& b) {
  return std::forward<B>(b)
      .template Ctx<ffi::PlatformStream<cudaStream_t>>()
      .template Ctx<ffi::DeviceOrdinal>()
      .template Arg<ffi::AnyBuffer>()           // q
      .template Arg<ffi::AnyBuffer>()           // k
      .template Arg<ffi::AnyBuffer>()           // v
      .template Arg<ffi::Buffer<ffi::S32>>()    // lengths
      .template Arg<ffi::Buffer<ffi::S32>>();   // q_lengths
}

template <typename B>
auto BindAttrs(B&& b) {
  return std::forward<B>(b)
      .template Attr<float>("scale")
      .template Attr<float>("softcap")
      .template Attr<int64_t>("window")
      .template Attr<int64_t>("zero_rows");
}

}  // namespace

HandlerStats GetHandlerStats() {
  HandlerStats s;
  s.initialize_calls = g_initialize.load();
  s.initialize_ns = g_initialize_ns.load();
  s.execute_calls = g_execute.load();
  s.captured_calls = g_captured.load();
  return s;
}

}  // namespace jax_vmm::cudnn

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    CudnnAttentionInitialize, jax_vmm::cudnn::InitializeImpl,
    jax_vmm::cudnn::BindAttrs(
        jax_vmm::cudnn::BindCommon(xla::ffi::Ffi::BindInitialize()).Ret<xla::ffi::AnyBuffer>()));

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    CudnnAttentionExecute, jax_vmm::cudnn::ExecuteImpl,
    jax_vmm::cudnn::BindAttrs(
        jax_vmm::cudnn::BindCommon(xla::ffi::Ffi::Bind()).Ret<xla::ffi::AnyBuffer>()),
    {xla::ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    CudnnAttentionIntoInitialize, jax_vmm::cudnn::InitializeIntoImpl,
    jax_vmm::cudnn::BindAttrs(jax_vmm::cudnn::BindCommon(xla::ffi::Ffi::BindInitialize())
                                  .Arg<xla::ffi::AnyBuffer>()  // out_in
                                  .Ret<xla::ffi::AnyBuffer>()));

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    CudnnAttentionIntoExecute, jax_vmm::cudnn::ExecuteIntoImpl,
    jax_vmm::cudnn::BindAttrs(jax_vmm::cudnn::BindCommon(xla::ffi::Ffi::Bind())
                                  .Arg<xla::ffi::AnyBuffer>()  // out_in
                                  .Ret<xla::ffi::AnyBuffer>()),
    {xla::ffi::Traits::kCmdBufferCompatible});

namespace jax_vmm::cudnn {

void AddCudnnTargets(FfiRegistry& registry) {
  registry.Add("jax_vmm_cudnn_attention", "CUDA",
               FfiRegistry::Stages{CudnnAttentionInitialize, CudnnAttentionExecute});
  registry.Add("jax_vmm_cudnn_attention_into", "CUDA",
               FfiRegistry::Stages{CudnnAttentionIntoInitialize, CudnnAttentionIntoExecute});
  AddCudnnCacheTargets(registry);
}

}  // namespace jax_vmm::cudnn
