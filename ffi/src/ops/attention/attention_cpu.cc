// CPU handler of jax_vmm_decode_attention: the same split-K algorithm and plan as the
// CUDA handler (attention_plan.h), in plain C++ with float32 accumulation. It reads
// K/V only for tokens < length of each sequence (lengths clamped to [0, T]); length 0
// gives zeros.
//
// Targets (the CUDA handler has the same three):
//   jax_vmm_decode_attention                 partials in a local buffer
//   jax_vmm_decode_attention_xla_workspace   partials in a second (workspace) result,
//                                            sized by Python from the same plan
//   jax_vmm_decode_attention_prefilled       a fifth operand `out_init` that Python
//                                            aliases to the output: the output buffer
//                                            starts with its contents (tests pass NaN to
//                                            prove that every element is written)
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <string>
#include <vector>

#include "ops/attention/attention_check.h"
#include "ops/attention/attention_plan.h"
#include "ops/attention/attention_stats.h"
#include "ops/attention/attention_targets.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace jax_vmm::attention {
namespace {

constexpr const char* kName = "jax_vmm_decode_attention (cpu)";

// -- 16-bit float conversions (IEEE binary16 and bfloat16), round to nearest even --

float Bf16ToFloat(uint16_t h) {
  uint32_t bits = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

uint16_t FloatToBf16(float f) {
  uint32_t bits;
  std::memcpy(&bits, &f, 4);
  if ((bits & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((bits >> 16) | 0x40);  // NaN
  bits += 0x7fffu + ((bits >> 16) & 1u);
  return static_cast<uint16_t>(bits >> 16);
}

float HalfToFloat(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t exp = (h >> 10) & 0x1fu;
  const uint32_t man = h & 0x3ffu;
  float out;
  if (exp == 0) {
    out = std::ldexp(static_cast<float>(man), -24);  // zero or subnormal
  } else if (exp == 31) {
    out = man ? std::numeric_limits<float>::quiet_NaN() : std::numeric_limits<float>::infinity();
  } else {
    out = std::ldexp(static_cast<float>(man | 0x400u), static_cast<int>(exp) - 25);
  }
  uint32_t bits;
  std::memcpy(&bits, &out, 4);
  bits |= sign;
  std::memcpy(&out, &bits, 4);
  return out;
}

uint16_t FloatToHalf(float f) {
  uint32_t bits;
  std::memcpy(&bits, &f, 4);
  const uint16_t sign = static_cast<uint16_t>((bits >> 16) & 0x8000u);
  const float a = std::fabs(f);
  if (std::isnan(f)) return static_cast<uint16_t>(sign | 0x7e00u);
  if (a >= 65520.0f) return static_cast<uint16_t>(sign | 0x7c00u);  // rounds to infinity
  if (a < 6.103515625e-05f) {
    // Subnormal range: units of 2^-24, nearbyint rounds half to even.
    return static_cast<uint16_t>(sign | static_cast<uint16_t>(std::nearbyint(a * 16777216.0f)));
  }
  int e;
  const float m = std::frexp(a, &e);  // a = m * 2^e, m in [0.5, 1)
  // 11 significant bits: mantissa in units of 2^(e-11); rounding may carry into the
  // exponent, which the bit layout below absorbs (0x400 overflow adds one to exp).
  uint32_t mant = static_cast<uint32_t>(std::nearbyint(m * 2048.0f));  // [1024, 2048]
  uint32_t exp = static_cast<uint32_t>(e - 1 + 15);
  uint32_t out = (exp << 10) + (mant - 1024u);
  return static_cast<uint16_t>(sign | out);
}

struct Converter {
  ffi::DataType dtype;
  void Row(const void* base, int64_t offset, int64_t n, float* dst) const {
    switch (dtype) {
      case ffi::DataType::F32:
        std::memcpy(dst, static_cast<const float*>(base) + offset, n * sizeof(float));
        return;
      case ffi::DataType::BF16: {
        const uint16_t* p = static_cast<const uint16_t*>(base) + offset;
        for (int64_t i = 0; i < n; ++i) dst[i] = Bf16ToFloat(p[i]);
        return;
      }
      default: {  // F16 (validated)
        const uint16_t* p = static_cast<const uint16_t*>(base) + offset;
        for (int64_t i = 0; i < n; ++i) dst[i] = HalfToFloat(p[i]);
        return;
      }
    }
  }
  void Store(void* base, int64_t offset, int64_t n, const float* src) const {
    switch (dtype) {
      case ffi::DataType::F32:
        std::memcpy(static_cast<float*>(base) + offset, src, n * sizeof(float));
        return;
      case ffi::DataType::BF16: {
        uint16_t* p = static_cast<uint16_t*>(base) + offset;
        for (int64_t i = 0; i < n; ++i) p[i] = FloatToBf16(src[i]);
        return;
      }
      default: {
        uint16_t* p = static_cast<uint16_t*>(base) + offset;
        for (int64_t i = 0; i < n; ++i) p[i] = FloatToHalf(src[i]);
        return;
      }
    }
  }
};

// The computation, with partials in `ws` (plan.workspace_bytes, float32 layout of
// attention_plan.h).
void Compute(const ffi::AnyBuffer& q, const ffi::AnyBuffer& k, const ffi::AnyBuffer& v,
             const int32_t* lengths, ffi::AnyBuffer& out, const Shapes& sh, const Plan& plan,
             float scale, bool debug_read_all, float* ws) {
  const Converter cv{q.element_type()};
  const int64_t B = sh.batch, T = sh.max_tokens, Hq = sh.q_heads, Hkv = sh.kv_heads,
                D = sh.head_dim;
  const int64_t G = Hq / Hkv, S = plan.splits, chunk = plan.chunk;
  const int64_t P = B * Hq * S;
  float* ws_acc = ws;
  float* ws_m = ws + P * D;
  float* ws_l = ws_m + P;
  const float scale_log2 = scale * 1.4426950408889634f;  // exp(x) = exp2(x * log2(e))
  const float neg_inf = -std::numeric_limits<float>::infinity();

  std::vector<float> qf(G * D), row(D), logits(G * chunk), m(G), l(G), acc(G * D), outf(D);
  for (int64_t b = 0; b < B; ++b) {
    const int64_t len = std::clamp<int64_t>(lengths[b], 0, T);
    const int64_t nchunks = CeilDiv(len, chunk);
    for (int64_t kvh = 0; kvh < Hkv; ++kvh) {
      cv.Row(q.untyped_data(), (b * Hq + kvh * G) * D, G * D, qf.data());
      for (int64_t s = 0; s < std::min(S, nchunks); ++s) {
        std::fill(m.begin(), m.end(), neg_inf);
        std::fill(l.begin(), l.end(), 0.0f);
        std::fill(acc.begin(), acc.end(), 0.0f);
        for (int64_t c = s; c < nchunks; c += S) {
          const int64_t t0 = c * chunk, n = std::min(chunk, len - t0);
          for (int64_t i = 0; i < n; ++i) {  // scores, in log2 units
            cv.Row(k.untyped_data(), ((b * T + t0 + i) * Hkv + kvh) * D, D, row.data());
            for (int64_t g = 0; g < G; ++g) {
              float dot = 0.0f;
              for (int64_t d = 0; d < D; ++d) dot += qf[g * D + d] * row[d];
              logits[g * chunk + i] = dot * scale_log2;
            }
          }
          for (int64_t g = 0; g < G; ++g) {  // chunk softmax, folded into the running state
            float mx = neg_inf;
            for (int64_t i = 0; i < n; ++i) mx = std::max(mx, logits[g * chunk + i]);
            const float m_new = std::max(m[g], mx);
            const float alpha = std::exp2(m[g] - m_new);
            float sum = 0.0f;
            for (int64_t i = 0; i < n; ++i) {
              float& x = logits[g * chunk + i];
              x = std::exp2(x - m_new);
              sum += x;
            }
            m[g] = m_new;
            l[g] = l[g] * alpha + sum;
            for (int64_t d = 0; d < D; ++d) acc[g * D + d] *= alpha;
          }
          for (int64_t i = 0; i < n; ++i) {
            cv.Row(v.untyped_data(), ((b * T + t0 + i) * Hkv + kvh) * D, D, row.data());
            for (int64_t g = 0; g < G; ++g) {
              const float p = logits[g * chunk + i];
              for (int64_t d = 0; d < D; ++d) acc[g * D + d] += p * row[d];
            }
          }
        }
        for (int64_t g = 0; g < G; ++g) {
          const int64_t pi = (b * Hq + kvh * G + g) * S + s;
          ws_m[pi] = m[g];
          ws_l[pi] = l[g];
          std::memcpy(ws_acc + pi * D, acc.data() + g * D, D * sizeof(float));
        }
      }
    }
    // Combine the live splits of every head of this sequence.
    const int64_t live = std::min(S, nchunks);
    for (int64_t h = 0; h < Hq; ++h) {
      std::fill(outf.begin(), outf.end(), 0.0f);
      if (live > 0) {
        const int64_t base = (b * Hq + h) * S;
        float mx = neg_inf;
        for (int64_t s = 0; s < live; ++s) mx = std::max(mx, ws_m[base + s]);
        float total = 0.0f;
        for (int64_t s = 0; s < live; ++s) {
          const float w = std::exp2(ws_m[base + s] - mx);
          total += ws_l[base + s] * w;
          for (int64_t d = 0; d < D; ++d) outf[d] += ws_acc[(base + s) * D + d] * w;
        }
        for (int64_t d = 0; d < D; ++d) outf[d] /= total;
      }
      cv.Store(out.untyped_data(), (b * Hq + h) * D, D, outf.data());
    }
    if (debug_read_all) {
      // Test-only: touch every token of the sequence, as a kernel that ignored the
      // lengths would. The "tail never read" test must see this crash.
      volatile uint8_t sink = 0;
      const size_t seq_bytes = static_cast<size_t>(T * Hkv * D) * ffi::ByteWidth(q.element_type());
      const uint8_t* kb = static_cast<const uint8_t*>(k.untyped_data()) + b * seq_bytes;
      const uint8_t* vb = static_cast<const uint8_t*>(v.untyped_data()) + b * seq_bytes;
      for (size_t i = 0; i < seq_bytes; i += 64) sink = static_cast<uint8_t>(sink + kb[i] + vb[i]);
    }
  }
}

ffi::Error Run(ffi::AnyBuffer q, ffi::AnyBuffer k, ffi::AnyBuffer v, ffi::Buffer<ffi::S32> lengths,
               ffi::AnyBuffer out, ffi::AnyBuffer* workspace, float scale, int64_t chunk,
               int64_t splits, int64_t debug) {
  GetCounters().cpu_calls.fetch_add(1, std::memory_order_relaxed);
  Shapes sh;
  if (ffi::Error err = CheckOperands(kName, q, k, v, lengths, out, &sh); err.failure()) return err;
  const Plan plan = MakePlan(sh, kCpuParallelUnits, chunk, splits);
  if (sh.batch == 0) return ffi::Error::Success();
  std::vector<float> local;
  float* ws;
  if (workspace != nullptr) {
    if (ffi::Error err = CheckWorkspace(kName, workspace->size_bytes(), plan); err.failure()) {
      return err;
    }
    ws = static_cast<float*>(workspace->untyped_data());
  } else {
    local.resize(plan.workspace_bytes / sizeof(float));
    ws = local.data();
  }
  if (debug & kDebugSkipOutput) return ffi::Error::Success();
  Compute(q, k, v, lengths.typed_data(), out, sh, plan, scale, (debug & kDebugReadAllTokens) != 0,
          ws);
  return ffi::Error::Success();
}

ffi::Error DecodeAttentionCpuImpl(ffi::AnyBuffer q, ffi::AnyBuffer k, ffi::AnyBuffer v,
                                  ffi::Buffer<ffi::S32> lengths, ffi::Result<ffi::AnyBuffer> out,
                                  float scale, int64_t chunk, int64_t splits, int64_t impl,
                                  int64_t debug) {
  (void)impl;  // CUDA-only choice; accepted so both platforms share one attribute set
  return Run(q, k, v, lengths, *out, nullptr, scale, chunk, splits, debug);
}

ffi::Error DecodeAttentionCpuXlaWorkspaceImpl(ffi::AnyBuffer q, ffi::AnyBuffer k, ffi::AnyBuffer v,
                                              ffi::Buffer<ffi::S32> lengths,
                                              ffi::Result<ffi::AnyBuffer> out,
                                              ffi::Result<ffi::AnyBuffer> workspace, float scale,
                                              int64_t chunk, int64_t splits, int64_t impl,
                                              int64_t debug) {
  (void)impl;
  ffi::AnyBuffer ws = *workspace;
  return Run(q, k, v, lengths, *out, &ws, scale, chunk, splits, debug);
}

ffi::Error DecodeAttentionCpuPrefilledImpl(ffi::AnyBuffer q, ffi::AnyBuffer k, ffi::AnyBuffer v,
                                           ffi::Buffer<ffi::S32> lengths, ffi::AnyBuffer out_init,
                                           ffi::Result<ffi::AnyBuffer> out, float scale,
                                           int64_t chunk, int64_t splits, int64_t impl,
                                           int64_t debug) {
  (void)impl;
  (void)out_init;  // aliased to `out` by XLA; never read
  return Run(q, k, v, lengths, *out, nullptr, scale, chunk, splits, debug);
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(DecodeAttentionCpu, DecodeAttentionCpuImpl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::AnyBuffer>()         // q
                                  .Arg<ffi::AnyBuffer>()         // k
                                  .Arg<ffi::AnyBuffer>()         // v
                                  .Arg<ffi::Buffer<ffi::S32>>()  // lengths
                                  .Ret<ffi::AnyBuffer>()         // out
                                  .Attr<float>("scale")
                                  .Attr<int64_t>("chunk")
                                  .Attr<int64_t>("splits")
                                  .Attr<int64_t>("impl")
                                  .Attr<int64_t>("debug"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(DecodeAttentionCpuXlaWorkspace, DecodeAttentionCpuXlaWorkspaceImpl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::AnyBuffer>()  // out
                                  .Ret<ffi::AnyBuffer>()  // workspace (uint8)
                                  .Attr<float>("scale")
                                  .Attr<int64_t>("chunk")
                                  .Attr<int64_t>("splits")
                                  .Attr<int64_t>("impl")
                                  .Attr<int64_t>("debug"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(DecodeAttentionCpuPrefilled, DecodeAttentionCpuPrefilledImpl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::AnyBuffer>()  // out_init (aliased to out)
                                  .Ret<ffi::AnyBuffer>()  // out
                                  .Attr<float>("scale")
                                  .Attr<int64_t>("chunk")
                                  .Attr<int64_t>("splits")
                                  .Attr<int64_t>("impl")
                                  .Attr<int64_t>("debug"));

void AddCpuTargets(FfiRegistry& registry) {
  registry.Add("jax_vmm_decode_attention", "cpu", DecodeAttentionCpu);
  registry.Add("jax_vmm_decode_attention_prefilled", "cpu", DecodeAttentionCpuPrefilled);
  registry.Add("jax_vmm_decode_attention_xla_workspace", "cpu", DecodeAttentionCpuXlaWorkspace);
}

}  // namespace jax_vmm::attention
