// CPU handler of jax_vmm_decode_attention: the same split-K algorithm and plan as the
// CUDA handler (attention_plan.h), in plain C++ with float32 accumulation. It reads
// K/V only for tokens < length of each sequence (lengths clamped to [0, T]); length 0
// gives zeros.
//
// Targets (the CUDA handler has the same two):
//   jax_vmm_decode_attention                 partials in a local buffer
//   jax_vmm_decode_attention_xla_workspace   partials in a second (workspace) result,
//                                            sized by Python from the same plan
#include "ops/attention/attention_cpu.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <vector>

#include "ops/attention/attention_check.h"
#include "ops/attention/attention_ffi.h"
#include "ops/attention/attention_plan.h"
#include "ops/attention/attention_stats.h"
#include "ops/attention/attention_targets.h"
#include "ops/attention/cpu_dtypes.h"

namespace jax_vmm::attention {
namespace {

// One call: operands, shapes, plan, and the partials' workspace (float32 layout of
// attention_plan.h: acc[P][D] | m[P] | l[P]).
struct CpuCall {
  const void* q = nullptr;
  const void* k = nullptr;
  const void* v = nullptr;
  const int32_t* lengths = nullptr;
  void* out = nullptr;
  Converter cv{ffi::DataType::F32};
  Shapes sh;
  Plan plan;
  float scale_log2 = 0;  // exp(x) = exp2(x * log2(e)): logits in log2 units
  float* ws_acc = nullptr;
  float* ws_m = nullptr;
  float* ws_l = nullptr;
};

// The running softmax state of the G query heads that share one KV head, and row
// buffers, reused across splits.
struct HeadGroupState {
  HeadGroupState(int64_t G, int64_t D, int64_t chunk)
      : qf(G * D), row(D), logits(G * chunk), m(G), l(G), acc(G * D) {}
  std::vector<float> qf, row, logits, m, l, acc;
};

constexpr float kNegInf = -std::numeric_limits<float>::infinity();

// Folds tokens [t0, t0 + n) of sequence b, KV head kvh, into the running state.
void FoldChunk(const CpuCall& c, int64_t b, int64_t kvh, int64_t t0, int64_t n,
               HeadGroupState& st) {
  const int64_t T = c.sh.max_tokens, Hkv = c.sh.kv_heads, D = c.sh.head_dim;
  const int64_t G = c.sh.q_heads / Hkv, chunk = c.plan.chunk;
  for (int64_t i = 0; i < n; ++i) {  // scores, in log2 units
    c.cv.Row(c.k, ((b * T + t0 + i) * Hkv + kvh) * D, D, st.row.data());
    for (int64_t g = 0; g < G; ++g) {
      float dot = 0.0f;
      for (int64_t d = 0; d < D; ++d) dot += st.qf[g * D + d] * st.row[d];
      st.logits[g * chunk + i] = dot * c.scale_log2;
    }
  }
  for (int64_t g = 0; g < G; ++g) {  // chunk softmax, folded into the running state
    float mx = kNegInf;
    for (int64_t i = 0; i < n; ++i) mx = std::max(mx, st.logits[g * chunk + i]);
    const float m_new = std::max(st.m[g], mx);
    const float alpha = std::exp2(st.m[g] - m_new);
    float sum = 0.0f;
    for (int64_t i = 0; i < n; ++i) {
      float& x = st.logits[g * chunk + i];
      x = std::exp2(x - m_new);
      sum += x;
    }
    st.m[g] = m_new;
    st.l[g] = st.l[g] * alpha + sum;
    for (int64_t d = 0; d < D; ++d) st.acc[g * D + d] *= alpha;
  }
  for (int64_t i = 0; i < n; ++i) {
    c.cv.Row(c.v, ((b * T + t0 + i) * Hkv + kvh) * D, D, st.row.data());
    for (int64_t g = 0; g < G; ++g) {
      const float p = st.logits[g * chunk + i];
      for (int64_t d = 0; d < D; ++d) st.acc[g * D + d] += p * st.row[d];
    }
  }
}

// The partials of split s (chunks s, s + splits, ...) of sequence b for the query heads
// of KV head kvh, written into the workspace.
void ComputeSplit(const CpuCall& c, int64_t b, int64_t kvh, int64_t s, int64_t len,
                  HeadGroupState& st) {
  const int64_t Hq = c.sh.q_heads, D = c.sh.head_dim, G = Hq / c.sh.kv_heads;
  const int64_t S = c.plan.splits, chunk = c.plan.chunk;
  std::fill(st.m.begin(), st.m.end(), kNegInf);
  std::fill(st.l.begin(), st.l.end(), 0.0f);
  std::fill(st.acc.begin(), st.acc.end(), 0.0f);
  for (int64_t ch = s; ch < CeilDiv(len, chunk); ch += S) {
    const int64_t t0 = ch * chunk;
    FoldChunk(c, b, kvh, t0, std::min(chunk, len - t0), st);
  }
  for (int64_t g = 0; g < G; ++g) {
    const int64_t pi = (b * Hq + kvh * G + g) * S + s;
    c.ws_m[pi] = st.m[g];
    c.ws_l[pi] = st.l[g];
    std::memcpy(c.ws_acc + pi * D, st.acc.data() + g * D, D * sizeof(float));
  }
}

// out[b] from the `live` splits of every head of sequence b (zeros when none is live).
void CombineSequence(const CpuCall& c, int64_t b, int64_t live, std::vector<float>& outf) {
  const int64_t Hq = c.sh.q_heads, D = c.sh.head_dim, S = c.plan.splits;
  for (int64_t h = 0; h < Hq; ++h) {
    std::fill(outf.begin(), outf.end(), 0.0f);
    if (live > 0) {
      const int64_t base = (b * Hq + h) * S;
      float mx = kNegInf;
      for (int64_t s = 0; s < live; ++s) mx = std::max(mx, c.ws_m[base + s]);
      float total = 0.0f;
      for (int64_t s = 0; s < live; ++s) {
        const float w = std::exp2(c.ws_m[base + s] - mx);
        total += c.ws_l[base + s] * w;
        for (int64_t d = 0; d < D; ++d) outf[d] += c.ws_acc[(base + s) * D + d] * w;
      }
      for (int64_t d = 0; d < D; ++d) outf[d] /= total;
    }
    c.cv.Store(c.out, (b * Hq + h) * D, D, outf.data());
  }
}

void Compute(const CpuCall& c) {
  const int64_t T = c.sh.max_tokens, Hq = c.sh.q_heads, Hkv = c.sh.kv_heads, D = c.sh.head_dim;
  const int64_t G = Hq / Hkv, S = c.plan.splits;
  HeadGroupState st(G, D, c.plan.chunk);
  std::vector<float> outf(D);
  for (int64_t b = 0; b < c.sh.batch; ++b) {
    const int64_t len = std::clamp<int64_t>(c.lengths[b], 0, T);
    const int64_t live = std::min(S, CeilDiv(len, c.plan.chunk));
    for (int64_t kvh = 0; kvh < Hkv; ++kvh) {
      c.cv.Row(c.q, (b * Hq + kvh * G) * D, G * D, st.qf.data());
      for (int64_t s = 0; s < live; ++s) ComputeSplit(c, b, kvh, s, len, st);
    }
    CombineSequence(c, b, live, outf);
  }
}

ffi::Error DecodeAttentionCpuImpl(ffi::AnyBuffer q, ffi::AnyBuffer k, ffi::AnyBuffer v,
                                  ffi::Buffer<ffi::S32> lengths, ffi::Result<ffi::AnyBuffer> out,
                                  float scale, int64_t chunk, int64_t splits, int64_t impl) {
  (void)impl;  // CUDA-only choice; accepted so both platforms share one attribute set
  return RunCpu(q, k, v, lengths, *out, nullptr, scale, chunk, splits);
}

ffi::Error DecodeAttentionCpuXlaWorkspaceImpl(ffi::AnyBuffer q, ffi::AnyBuffer k, ffi::AnyBuffer v,
                                              ffi::Buffer<ffi::S32> lengths,
                                              ffi::Result<ffi::AnyBuffer> out,
                                              ffi::Result<ffi::AnyBuffer> workspace, float scale,
                                              int64_t chunk, int64_t splits, int64_t impl) {
  (void)impl;
  ffi::AnyBuffer ws = *workspace;
  return RunCpu(q, k, v, lengths, *out, &ws, scale, chunk, splits);
}

}  // namespace

ffi::Error RunCpu(ffi::AnyBuffer q, ffi::AnyBuffer k, ffi::AnyBuffer v,
                  ffi::Buffer<ffi::S32> lengths, ffi::AnyBuffer out, ffi::AnyBuffer* workspace,
                  float scale, int64_t chunk, int64_t splits) {
  GetCounters().cpu_calls.fetch_add(1, std::memory_order_relaxed);
  CpuCall c;
  c.q = q.untyped_data();
  c.k = k.untyped_data();
  c.v = v.untyped_data();
  c.lengths = lengths.typed_data();
  c.out = out.untyped_data();
  c.cv.dtype = q.element_type();
  if (ffi::Error err = CheckOperands(kCpuName, q, k, v, lengths, out, &c.sh); err.failure()) {
    return err;
  }
  c.plan = MakePlan(c.sh, kCpuParallelUnits, chunk, splits);
  if (c.sh.batch == 0) return ffi::Error::Success();
  // Not zero-filled: only live splits are read, and each is written first. (The plan's
  // splits grow with max_tokens; clearing the whole workspace would make every call cost
  // time in proportion to the capacity, not to the live tokens.)
  std::unique_ptr<float[]> local;
  float* ws;
  if (workspace != nullptr) {
    if (ffi::Error err = CheckWorkspace(kCpuName, workspace->size_bytes(), c.plan); err.failure()) {
      return err;
    }
    ws = static_cast<float*>(workspace->untyped_data());
  } else {
    local.reset(new float[static_cast<size_t>(c.plan.workspace_bytes) / sizeof(float)]);
    ws = local.get();
  }
  const int64_t partials = c.sh.batch * c.sh.q_heads * c.plan.splits;
  c.ws_acc = ws;
  c.ws_m = ws + partials * c.sh.head_dim;
  c.ws_l = c.ws_m + partials;
  c.scale_log2 = scale * 1.4426950408889634f;
  Compute(c);
  return ffi::Error::Success();
}

}  // namespace jax_vmm::attention

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    DecodeAttentionCpu, jax_vmm::attention::DecodeAttentionCpuImpl,
    jax_vmm::attention::BindAttrs(
        jax_vmm::attention::BindInputs(xla::ffi::Ffi::Bind()).Ret<xla::ffi::AnyBuffer>()));  // out

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    DecodeAttentionCpuXlaWorkspace, jax_vmm::attention::DecodeAttentionCpuXlaWorkspaceImpl,
    jax_vmm::attention::BindAttrs(jax_vmm::attention::BindInputs(xla::ffi::Ffi::Bind())
                                      .Ret<xla::ffi::AnyBuffer>()     // out
                                      .Ret<xla::ffi::AnyBuffer>()));  // workspace (uint8)

namespace jax_vmm::attention {

void AddCpuTargets(FfiRegistry& registry) {
  registry.Add("jax_vmm_decode_attention", "cpu", DecodeAttentionCpu);
  registry.Add("jax_vmm_decode_attention_xla_workspace", "cpu", DecodeAttentionCpuXlaWorkspace);
}

}  // namespace jax_vmm::attention
