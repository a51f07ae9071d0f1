// CPU handler of jax_vmm_decode_attention_v2: the streaming kernel's algorithm
// (stream_plan.h) in scalar C++ -- the same partition into CTAs, the same per-warp tile
// assignment and online softmax, the same fixed-order warp merge, workspace slots and
// last-arrival combine -- with float32 arithmetic. It is the CPU implementation of fp8
// (float8_e4m3fn) decode attention, and CI's model of the GPU path's bookkeeping.
#include "ops/attention/stream_cpu.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <string>
#include <vector>

#include "common/float_convert.h"
#include "ops/attention/attention_stats.h"
#include "ops/attention/attention_targets.h"
#include "ops/attention/stream_plan.h"

namespace jax_vmm::attention::stream {
namespace {

constexpr float kNegInf = -std::numeric_limits<float>::infinity();

float Element(const void* base, int64_t i, KvStorage kv) {
  switch (kv) {
    case KvStorage::kBf16:
      return Bf16ToFloat(static_cast<const uint16_t*>(base)[i]);
    case KvStorage::kF16:
      return HalfToFloat(static_cast<const uint16_t*>(base)[i]);
    default:
      return Fp8E4M3ToFloat(static_cast<const uint8_t*>(base)[i]);
  }
}

// One call: operands, plan, clamped lengths and their tile prefix, and the workspace in
// the GPU layout (floats).
struct Model {
  Shapes sh;
  Plan plan;
  KvStorage kv = KvStorage::kBf16;
  bool q_bf16 = false;
  const void *q = nullptr, *k = nullptr, *v = nullptr;
  const float *k_scale = nullptr, *v_scale = nullptr;
  void* out = nullptr;
  float scale_log2 = 0;
  std::vector<int> lens, prefix;
  std::vector<float> acc, m, l;
  std::vector<unsigned> counters;

  float Query(int64_t b, int64_t h, int64_t d) const {
    const uint16_t x = static_cast<const uint16_t*>(q)[(b * sh.q_heads + h) * sh.head_dim + d];
    return q_bf16 ? Bf16ToFloat(x) : HalfToFloat(x);
  }
  void Store(int64_t b, int64_t h, int64_t d, float x) const {
    uint16_t* o = static_cast<uint16_t*>(out);
    o[(b * sh.q_heads + h) * sh.head_dim + d] = q_bf16 ? FloatToBf16(x) : FloatToHalf(x);
  }
  int Tiles(int b) const { return prefix[b + 1] - prefix[b]; }

  // One piece: tiles [tile0, tile0 + count) of unit (b, hg), as the kernel's 4 warps
  // compute it (warp w takes the CTA-local tiles w, w + 4, ...; `local0` is the piece's
  // first CTA-local index), merged in warp order. Writes rows of (M, L, A).
  void Piece(int b, int hg, int tile0, int count, int local0, float* M, float* L, float* A) const {
    const int64_t D = sh.head_dim, GB = plan.head_group, G = sh.q_heads / sh.kv_heads;
    const int64_t kvh = hg * GB / G;
    const float ks = k_scale[kvh], vs = v_scale[kvh];
    std::vector<float> wm(kWarps * GB, kNegInf), wl(kWarps * GB, 0.f), wa(kWarps * GB * D, 0.f);
    const int tile_tokens = static_cast<int>(plan.tile_tokens);
    std::vector<float> qv(GB * D), s(tile_tokens);
    for (int64_t h = 0; h < GB; ++h) {
      for (int64_t d = 0; d < D; ++d) qv[h * D + d] = Query(b, hg * GB + h, d);
    }
    for (int i = 0; i < count; ++i) {
      const int w = (local0 + i) % kWarps;
      const int t0 = (tile0 + i) * tile_tokens;
      const int n = std::min(tile_tokens, lens[b] - t0);
      for (int64_t h = 0; h < GB; ++h) {
        float mx = kNegInf;
        for (int r = 0; r < n; ++r) {
          const int64_t row = (b * sh.max_tokens + t0 + r) * TokenStride(sh) + kvh * D;
          float dot = 0.f;
          for (int64_t d = 0; d < D; ++d) dot += qv[h * D + d] * Element(k, row + d, kv);
          s[r] = dot * ks * scale_log2;
          mx = std::max(mx, s[r]);
        }
        float& wmh = wm[w * GB + h];
        const float m_new = std::max(wmh, mx);
        const float alpha = std::exp2(wmh - m_new);
        wmh = m_new;
        float* a = &wa[(w * GB + h) * D];
        for (int64_t d = 0; d < D; ++d) a[d] *= alpha;
        float sum = 0.f;
        for (int r = 0; r < n; ++r) {
          const float p = std::exp2(s[r] - m_new);
          sum += p;
          const int64_t row = (b * sh.max_tokens + t0 + r) * TokenStride(sh) + kvh * D;
          for (int64_t d = 0; d < D; ++d) a[d] += p * Element(v, row + d, kv);
        }
        wl[w * GB + h] = wl[w * GB + h] * alpha + sum;
      }
    }
    for (int64_t h = 0; h < GB; ++h) {
      float mx = kNegInf;
      for (int w = 0; w < kWarps; ++w) mx = std::max(mx, wm[w * GB + h]);
      float tl = 0.f;
      for (int64_t d = 0; d < D; ++d) A[h * D + d] = 0.f;
      for (int w = 0; w < kWarps; ++w) {
        const float f = std::exp2(wm[w * GB + h] - mx);
        tl += wl[w * GB + h] * f;
        for (int64_t d = 0; d < D; ++d) A[h * D + d] += f * vs * wa[(w * GB + h) * D + d];
      }
      M[h] = mx;
      L[h] = tl;
    }
  }

  // Merges the pieces of unit (b, hg), owned by CTAs [first, last], into the output.
  void Combine(int b, int hg, int first, int last) const {
    const int64_t D = sh.head_dim, GB = plan.head_group;
    auto row_of = [&](int c, int64_t h) { return PartialRow(c, ContributorSlot(c, first), GB, h); };
    for (int64_t h = 0; h < GB; ++h) {
      float mx = kNegInf;
      for (int c = first; c <= last; ++c) mx = std::max(mx, m[row_of(c, h)]);
      float tl = 0.f;
      for (int c = first; c <= last; ++c) tl += l[row_of(c, h)] * std::exp2(m[row_of(c, h)] - mx);
      for (int64_t d = 0; d < D; ++d) {
        float a = 0.f;
        for (int c = first; c <= last; ++c) {
          const int64_t r = row_of(c, h);
          a += acc[r * D + d] * std::exp2(m[r] - mx);
        }
        Store(b, hg * GB + h, d, a / tl);
      }
    }
  }

  // A finished piece: a whole unit goes to the output, a part to its slot of CTA `cta`,
  // and the last part to arrive combines the unit.
  void Finish(int cta, int b, int hg, bool starts, bool ends, int first, int last,
              const std::vector<float>& pm, const std::vector<float>& pl,
              const std::vector<float>& pa) {
    const int64_t D = sh.head_dim, GB = plan.head_group;
    if (starts && ends) {
      for (int64_t h = 0; h < GB; ++h) {
        for (int64_t d = 0; d < D; ++d) Store(b, hg * GB + h, d, pa[h * D + d] / pl[h]);
      }
      return;
    }
    const int slot = SlotOf(starts);
    for (int64_t h = 0; h < GB; ++h) {
      const int64_t r = PartialRow(cta, slot, GB, h);
      m[r] = pm[h];
      l[r] = pl[h];
      std::memcpy(&acc[r * D], &pa[h * D], D * sizeof(float));
    }
    const int HG = static_cast<int>(plan.unit_groups);
    if (++counters[b * HG + hg] == static_cast<unsigned>(last - first + 1)) {
      Combine(b, hg, first, last);
    }
  }

  void Run() {
    const int B = static_cast<int>(sh.batch), HG = static_cast<int>(plan.unit_groups);
    const int64_t D = sh.head_dim, GB = plan.head_group;
    prefix.assign(B + 1, 0);
    const int tile_tokens = static_cast<int>(plan.tile_tokens);
    for (int b = 0; b < B; ++b) prefix[b + 1] = prefix[b] + TilesOf(lens[b], tile_tokens);
    const int total = HG * prefix[B];
    for (int b = 0; b < B; ++b) {
      if (lens[b] != 0) continue;
      for (int64_t h = 0; h < sh.q_heads; ++h) {
        for (int64_t d = 0; d < D; ++d) Store(b, h, d, 0.f);
      }
    }
    if (total == 0) return;
    const int C =
        EffectiveCtas(static_cast<int>(plan.ctas), total, static_cast<int>(plan.min_tiles));
    std::vector<float> pm(GB), pl(GB), pa(GB * D);
    for (int cta = 0; cta < C; ++cta) {
      const int g0 = RangeStart(cta, total, C), g1 = RangeStart(cta + 1, total, C);
      for (int g = g0; g < g1;) {
        const UnitTile u = LocateTile(prefix.data(), B, HG, g);
        const int unit_start = g - u.tile, unit_end = unit_start + Tiles(u.b);
        const int seg_end = std::min(g1, unit_end);
        Piece(u.b, u.hg, u.tile, seg_end - g, g - g0, pm.data(), pl.data(), pa.data());
        Finish(cta, u.b, u.hg, g == unit_start, seg_end == unit_end, OwnerOf(unit_start, total, C),
               OwnerOf(unit_end - 1, total, C), pm, pl, pa);
        g = seg_end;
      }
    }
  }
};

ffi::Error ExecuteImpl(ffi::AnyBuffer q, ffi::AnyBuffer k, ffi::AnyBuffer v,
                       ffi::Buffer<ffi::S32> lengths, ffi::AnyBuffer k_scale,
                       ffi::AnyBuffer v_scale, ffi::Result<ffi::AnyBuffer> out, float scale,
                       int64_t ctas, int64_t stages, int64_t min_tiles, int64_t combine,
                       int64_t bulk) {
  return RunCpu(q, k, v, lengths, k_scale, v_scale, *out,
                StreamAttrs{scale, ctas, stages, min_tiles, combine, bulk});
}

}  // namespace

ffi::Error ValidateCpu(const ffi::AnyBuffer& q, const ffi::AnyBuffer& k, const ffi::AnyBuffer& v,
                       const ffi::Buffer<ffi::S32>& lengths, const ffi::AnyBuffer& k_scale,
                       const ffi::AnyBuffer& v_scale, const ffi::AnyBuffer& out,
                       const StreamAttrs& attrs, Shapes* shapes, KvStorage* kv) {
  if (ffi::Error e =
          CheckStreamOperands(kCpuName, q, k, v, lengths, k_scale, v_scale, out, shapes, kv);
      e.failure()) {
    return e;
  }
  shapes->token_heads = attrs.token_heads;
  if (std::string why = Unsupported(*shapes); !why.empty()) {
    return ffi::Error::InvalidArgument(std::string(kCpuName) + ": " + why);
  }
  if (attrs.bulk != 0 && attrs.bulk != 1) {
    return ffi::Error::InvalidArgument(std::string(kCpuName) + ": bulk must be 0 or 1, got " +
                                       std::to_string(attrs.bulk));
  }
  return CheckCombine(kCpuName, attrs.combine);
}

ffi::Error RunCpu(const ffi::AnyBuffer& q, const ffi::AnyBuffer& k, const ffi::AnyBuffer& v,
                  const ffi::Buffer<ffi::S32>& lengths, const ffi::AnyBuffer& k_scale,
                  const ffi::AnyBuffer& v_scale, ffi::AnyBuffer out, const StreamAttrs& attrs) {
  // attrs.stages and attrs.bulk are CUDA choices (ring depth, how tiles are copied): the
  // arithmetic does not depend on them, but a ring a GPU cannot hold is refused here too.
  // combine: both ways merge identically here.
  GetCounters().cpu_calls.fetch_add(1, std::memory_order_relaxed);
  Model md;
  if (ffi::Error e = ValidateCpu(q, k, v, lengths, k_scale, v_scale, out, attrs, &md.sh, &md.kv);
      e.failure()) {
    return e;
  }
  md.plan = MakeStreamPlan(md.sh, StorageBytes(md.kv), kCpuCtas, attrs.ctas, attrs.min_tiles);
  // The CUDA handler's automatic ring is at least 2 deep, and checked for every batch.
  const int tile_rows = md.plan.head_group > 8 ? 16 : 8;
  if (std::string why = StagesFit(attrs.stages != 0 ? attrs.stages : 2, md.sh.batch, tile_rows,
                                  md.sh.head_dim, md.kv, attrs.bulk == 1);
      !why.empty()) {
    return ffi::Error::InvalidArgument(std::string(kCpuName) + ": " + why);
  }
  if (md.sh.batch == 0) return ffi::Error::Success();
  md.q_bf16 = q.element_type() == ffi::DataType::BF16;
  md.q = q.untyped_data();
  md.k = k.untyped_data();
  md.v = v.untyped_data();
  md.k_scale = static_cast<const float*>(k_scale.untyped_data());
  md.v_scale = static_cast<const float*>(v_scale.untyped_data());
  md.out = out.untyped_data();
  md.scale_log2 = attrs.scale * 1.4426950408889634f;
  md.lens.resize(md.sh.batch);
  for (int64_t b = 0; b < md.sh.batch; ++b) {
    md.lens[b] =
        static_cast<int>(std::clamp<int64_t>(lengths.typed_data()[b], 0, md.sh.max_tokens));
  }
  const int64_t rows = md.plan.ctas * 2 * md.plan.head_group;
  // Unwritten slots read as NaN: a combine that read a slot no piece wrote shows up.
  md.acc.assign(rows * md.sh.head_dim, std::numeric_limits<float>::quiet_NaN());
  md.m.assign(rows, std::numeric_limits<float>::quiet_NaN());
  md.l.assign(rows, std::numeric_limits<float>::quiet_NaN());
  md.counters.assign(md.sh.batch * md.plan.unit_groups, 0);
  md.Run();
  return ffi::Error::Success();
}

}  // namespace jax_vmm::attention::stream

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    DecodeAttentionStreamCpu, jax_vmm::attention::stream::ExecuteImpl,
    jax_vmm::attention::stream::BindStreamAttrs(
        jax_vmm::attention::stream::BindStreamInputs(xla::ffi::Ffi::Bind())
            .Ret<xla::ffi::AnyBuffer>()));  // out

namespace jax_vmm::attention {

void AddStreamCpuTargets(FfiRegistry& registry) {
  registry.Add("jax_vmm_decode_attention_v2", "cpu", DecodeAttentionStreamCpu);
}

}  // namespace jax_vmm::attention
