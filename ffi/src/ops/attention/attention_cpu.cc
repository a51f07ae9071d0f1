// CPU handler of jax_vmm_decode_attention: the same split-K algorithm and plan as the
// CUDA handler (attention_plan.h), in plain C++ with float32 accumulation. It reads
// K/V only for tokens < length of each sequence (lengths clamped to [0, T]); length 0
// gives zeros. S query rows per sequence, q_lengths, window and softcap: Semantics
// (attention_ffi.h).
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

// One call: operands, shapes, plan, options, and the partials' workspace (float32 layout
// of attention_plan.h: acc[P][D] | m[P] | l[P]).
struct CpuCall {
  const void* q = nullptr;
  const void* k = nullptr;
  const void* v = nullptr;
  const int32_t* lengths = nullptr;
  void* out = nullptr;
  Converter cv{ffi::DataType::F32};
  Shapes sh;
  Plan plan;
  Semantics sem;
  float scale = 0;       // the softmax scale (softcap path: logits in natural units first)
  float scale_log2 = 0;  // exp(x) = exp2(x * log2(e)): logits in log2 units
  float* ws_acc = nullptr;
  float* ws_m = nullptr;
  float* ws_l = nullptr;
};

constexpr float kNegInf = -std::numeric_limits<float>::infinity();
constexpr float kLog2e = 1.4426950408889634f;

// The running softmax state of the rows (query i, head g) that share one KV head -- S * G
// of them, row r = i * G + g -- each with the token range [lo, hi) it attends to, and
// row buffers, reused across splits.
struct RowState {
  RowState(int64_t R, int64_t D, int64_t chunk)
      : qf(R * D), row(D), logits(R * chunk), m(R), l(R), acc(R * D), lo(R), hi(R) {}
  std::vector<float> qf, row, logits, m, l, acc;
  std::vector<int64_t> lo, hi;
};

// The logit of a row's dot product, in log2 units.
float Logit(const CpuCall& c, float dot) {
  if (c.sem.softcap == 0.f) return dot * c.scale_log2;
  return c.sem.softcap * std::tanh(dot * c.scale / c.sem.softcap) * kLog2e;
}

// Folds tokens [t0, t0 + n) of sequence b, KV head kvh, into the running state of the R
// rows; tokens outside a row's range are masked (never weighted).
void FoldChunk(const CpuCall& c, int64_t b, int64_t kvh, int64_t t0, int64_t n, int64_t R,
               RowState& st) {
  const int64_t T = c.sh.max_tokens, D = c.sh.head_dim, row = TokenStride(c.sh);
  const int64_t chunk = c.plan.chunk;
  for (int64_t i = 0; i < n; ++i) {  // scores, in log2 units
    const int64_t t = t0 + i;
    c.cv.Row(c.k, (b * T + t) * row + kvh * D, D, st.row.data());
    for (int64_t r = 0; r < R; ++r) {
      float& x = st.logits[r * chunk + i];
      if (t < st.lo[r] || t >= st.hi[r]) {
        x = kNegInf;
        continue;
      }
      float dot = 0.0f;
      for (int64_t d = 0; d < D; ++d) dot += st.qf[r * D + d] * st.row[d];
      x = Logit(c, dot);
    }
  }
  for (int64_t r = 0; r < R; ++r) {  // chunk softmax, folded into the running state
    float mx = kNegInf;
    for (int64_t i = 0; i < n; ++i) mx = std::max(mx, st.logits[r * chunk + i]);
    const float m_new = std::max(st.m[r], mx);
    const float ref = m_new == kNegInf ? 0.0f : m_new;  // no live token yet: p = alpha = 0
    const float alpha = std::exp2(st.m[r] - ref);
    float sum = 0.0f;
    for (int64_t i = 0; i < n; ++i) {
      float& x = st.logits[r * chunk + i];
      x = std::exp2(x - ref);
      sum += x;
    }
    st.m[r] = m_new;
    st.l[r] = st.l[r] * alpha + sum;
    for (int64_t d = 0; d < D; ++d) st.acc[r * D + d] *= alpha;
  }
  for (int64_t i = 0; i < n; ++i) {
    const int64_t t = t0 + i;
    c.cv.Row(c.v, (b * T + t) * row + kvh * D, D, st.row.data());
    for (int64_t r = 0; r < R; ++r) {
      if (t < st.lo[r] || t >= st.hi[r]) continue;
      const float p = st.logits[r * chunk + i];
      for (int64_t d = 0; d < D; ++d) st.acc[r * D + d] += p * st.row[d];
    }
  }
}

// Partial index of row r (query i = r / G, head kvh * G + r % G) of sequence b, split s.
int64_t PartialIndex(const CpuCall& c, int64_t b, int64_t kvh, int64_t r, int64_t s) {
  const int64_t G = c.sh.q_heads / c.sh.kv_heads;
  const int64_t i = r / G, h = kvh * G + r % G;
  return ((b * c.sh.q_len + i) * c.sh.q_heads + h) * c.plan.splits + s;
}

// The partials of split s (chunks s, s + splits, ...) of sequence b for the R rows of KV
// head kvh, written into the workspace. Chunks wholly outside [lo, hi) (every row's
// range) are skipped; a row without a live token keeps m = -inf, l = 0, acc = 0.
void ComputeSplit(const CpuCall& c, int64_t b, int64_t kvh, int64_t s, int64_t len, int64_t R,
                  int64_t lo, int64_t hi, RowState& st) {
  const int64_t D = c.sh.head_dim, S = c.plan.splits, chunk = c.plan.chunk;
  std::fill(st.m.begin(), st.m.end(), kNegInf);
  std::fill(st.l.begin(), st.l.end(), 0.0f);
  std::fill(st.acc.begin(), st.acc.end(), 0.0f);
  for (int64_t ch = s; ch < CeilDiv(len, chunk); ch += S) {
    const int64_t t0 = ch * chunk, n = std::min(chunk, len - t0);
    if (t0 + n <= lo || t0 >= hi) continue;
    FoldChunk(c, b, kvh, t0, n, R, st);
  }
  for (int64_t r = 0; r < R; ++r) {
    const int64_t pi = PartialIndex(c, b, kvh, r, s);
    c.ws_m[pi] = st.m[r];
    c.ws_l[pi] = st.l[r];
    std::memcpy(c.ws_acc + pi * D, st.acc.data() + r * D, D * sizeof(float));
  }
}

// out[b] from the `live` splits of every row of sequence b; splits without a live token
// (m = -inf) weigh nothing, and a row without any gets zeros. A NaN logit (NaN in q, or in
// K at a live token) makes its split's l NaN, even where the max skipped it: that row is
// NaN, as softmax's, so a diverged sequence never looks empty.
void CombineSequence(const CpuCall& c, int64_t b, int64_t live, std::vector<float>& outf) {
  const int64_t rows = c.sh.q_len * c.sh.q_heads, D = c.sh.head_dim, S = c.plan.splits;
  for (int64_t h = 0; h < rows; ++h) {
    std::fill(outf.begin(), outf.end(), 0.0f);
    const int64_t base = (b * rows + h) * S;
    float mx = kNegInf;
    bool nan = false;
    for (int64_t s = 0; s < live; ++s) {
      mx = std::max(mx, c.ws_m[base + s]);
      nan |= std::isnan(c.ws_l[base + s]);
    }
    if (nan) {
      std::fill(outf.begin(), outf.end(), std::numeric_limits<float>::quiet_NaN());
    } else if (mx != kNegInf) {
      float total = 0.0f;
      for (int64_t s = 0; s < live; ++s) {
        if (c.ws_m[base + s] == kNegInf) continue;
        const float w = std::exp2(c.ws_m[base + s] - mx);
        total += c.ws_l[base + s] * w;
        for (int64_t d = 0; d < D; ++d) outf[d] += c.ws_acc[(base + s) * D + d] * w;
      }
      for (int64_t d = 0; d < D; ++d) outf[d] /= total;
    }
    c.cv.Store(c.out, (b * rows + h) * D, D, outf.data());
  }
}

// The query rows of sequence b: how many are live (the last q_len of its len tokens).
int64_t LiveRows(const CpuCall& c, int64_t b, int64_t len) {
  const int64_t S = c.sh.q_len;
  const int64_t want = c.sem.q_lengths != nullptr ? c.sem.q_lengths[b] : S;
  return std::clamp<int64_t>(want, 0, std::min(S, len));
}

void Compute(const CpuCall& c) {
  const int64_t T = c.sh.max_tokens, Hq = c.sh.q_heads, Hkv = c.sh.kv_heads, D = c.sh.head_dim;
  const int64_t G = Hq / Hkv, S = c.plan.splits, Q = c.sh.q_len, R = Q * G;
  RowState st(R, D, c.plan.chunk);
  std::vector<float> outf(D);
  for (int64_t b = 0; b < c.sh.batch; ++b) {
    const int64_t len = std::clamp<int64_t>(c.lengths[b], 0, T);
    const int64_t live = std::min(S, CeilDiv(len, c.plan.chunk));
    const int64_t qn = LiveRows(c, b, len);
    int64_t lo_all = len, hi_all = 0;  // the union of the rows' ranges
    for (int64_t r = 0; r < R; ++r) {
      const int64_t i = r / G;
      const int64_t p = len - qn + i;  // the row's position; rows i >= qn attend to nothing
      st.hi[r] = i < qn ? p + 1 : 0;
      st.lo[r] = i < qn ? (c.sem.window > 0 ? std::max<int64_t>(0, p - c.sem.window + 1) : 0) : 0;
      if (st.hi[r] > st.lo[r]) {
        lo_all = std::min(lo_all, st.lo[r]);
        hi_all = std::max(hi_all, st.hi[r]);
      }
    }
    for (int64_t kvh = 0; kvh < Hkv; ++kvh) {
      for (int64_t r = 0; r < R; ++r) {
        c.cv.Row(c.q, ((b * Q + r / G) * Hq + kvh * G + r % G) * D, D, st.qf.data() + r * D);
      }
      for (int64_t s = 0; s < live; ++s) ComputeSplit(c, b, kvh, s, len, R, lo_all, hi_all, st);
    }
    CombineSequence(c, b, live, outf);
  }
}

ffi::Error DecodeAttentionCpuImpl(ffi::AnyBuffer q, ffi::AnyBuffer k, ffi::AnyBuffer v,
                                  ffi::Buffer<ffi::S32> lengths, ffi::Result<ffi::AnyBuffer> out,
                                  float scale, int64_t chunk, int64_t splits, int64_t impl,
                                  OptionalLengths q_lengths, int64_t window, float softcap) {
  Semantics sem;
  if (ffi::Error e = MakeSemantics(kCpuName, q.dimensions()[0], q_lengths, window, softcap, &sem);
      e.failure()) {
    return e;
  }
  return RunCpu(q, k, v, lengths, *out, nullptr, scale, chunk, splits, sem, impl);
}

ffi::Error DecodeAttentionCpuXlaWorkspaceImpl(ffi::AnyBuffer q, ffi::AnyBuffer k, ffi::AnyBuffer v,
                                              ffi::Buffer<ffi::S32> lengths,
                                              ffi::Result<ffi::AnyBuffer> out,
                                              ffi::Result<ffi::AnyBuffer> workspace, float scale,
                                              int64_t chunk, int64_t splits, int64_t impl,
                                              OptionalLengths q_lengths, int64_t window,
                                              float softcap) {
  Semantics sem;
  if (ffi::Error e = MakeSemantics(kCpuName, q.dimensions()[0], q_lengths, window, softcap, &sem);
      e.failure()) {
    return e;
  }
  ffi::AnyBuffer ws = *workspace;
  return RunCpu(q, k, v, lengths, *out, &ws, scale, chunk, splits, sem, impl);
}

}  // namespace

ffi::Error RunCpu(ffi::AnyBuffer q, ffi::AnyBuffer k, ffi::AnyBuffer v,
                  ffi::Buffer<ffi::S32> lengths, ffi::AnyBuffer out, ffi::AnyBuffer* workspace,
                  float scale, int64_t chunk, int64_t splits, const Semantics& sem,
                  int64_t impl, int64_t token_heads) {
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
  c.sh.token_heads = token_heads;
  c.plan = MakePlan(c.sh, kCpuParallelUnits, chunk, splits);
  if (ffi::Error err = CheckImpl(kCpuName, impl, c.cv.dtype, c.sh.head_dim); err.failure()) {
    return err;
  }
  if (ffi::Error err = CheckLaunchLimits(kCpuName, c.sh, c.plan,
                                         UsesTensorCores(c.cv.dtype, c.sh.head_dim, impl));
      err.failure()) {
    return err;
  }
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
  const int64_t partials = c.sh.batch * c.sh.q_len * c.sh.q_heads * c.plan.splits;
  c.ws_acc = ws;
  c.ws_m = ws + partials * c.sh.head_dim;
  c.ws_l = c.ws_m + partials;
  c.sem = sem;
  c.scale = scale;
  c.scale_log2 = scale * kLog2e;
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
