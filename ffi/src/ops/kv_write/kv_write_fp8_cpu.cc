// The kv_write_fp8 CPU handler (kv_write_fp8.h) and its FFI target: kv_write's CPU path
// (kv_write_cpu.h) with a store that quantizes; bit-identical to jax_vmm.quantize_fp8.
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "common/float_convert.h"
#include "ops/kv_write/kv_write_cache.h"
#include "ops/kv_write/kv_write_cpu.h"
#include "ops/kv_write/kv_write_fp8.h"
#include "ops/kv_write/kv_write_targets.h"

namespace jax_vmm::kv {
namespace {

// Element e of a new token in its source dtype, as float.
float LoadSource(ffi::DataType type, const uint8_t* token, uint64_t e) {
  uint16_t h;
  switch (type) {
    case ffi::DataType::F32: {
      float f;
      std::memcpy(&f, token + 4 * e, 4);
      return f;
    }
    case ffi::DataType::BF16:
      std::memcpy(&h, token + 2 * e, 2);
      return Bf16ToFloat(h);
    default:  // F16 (checked)
      std::memcpy(&h, token + 2 * e, 2);
      return HalfToFloat(h);
  }
}

// Writes the prepared operands `in` (AsFp8Sources applied) quantizing with the per-head
// scales (host memory).
ffi::Error WriteFp8OnHost(Op op, Handler h, const CallOperands& in, ffi::DataType src,
                          const float* k_scale, const float* v_scale) {
  const int src_bytes = SourceBytes(src);
  const int64_t head_dim = in.k.d[in.k.rank - 1], heads = in.k.d[in.k.rank - 2];
  const float* scales[2] = {k_scale, v_scale};
  std::vector<float> inv[2];  // per side and head: 1 / scale, as the GPU multiplies
  for (int si = 0; si < 2; ++si) {
    for (int64_t hd = 0; hd < heads; ++hd) inv[si].push_back(1.0f / scales[si][hd]);
  }
  return RunOnHost(op, h, in, false, [&](const Params& p, Counters& c) {
    ForEachValidToken<CheckedTokens>(p, c, [&](int si, int64_t t, uint8_t* dst) {
      const uint8_t* token = p.side[si].src + static_cast<uint64_t>(t) * p.token_bytes * src_bytes;
      for (uint64_t e = 0; e < p.token_bytes; ++e) {
        dst[e] = FloatToFp8E4M3(LoadSource(src, token, e) * inv[si][e / head_dim]);
      }
    });
  });
}

ffi::Error CpuWriteFp8Impl(ffi::AnyBuffer k, ffi::AnyBuffer v, ffi::AnyBuffer new_k,
                           ffi::AnyBuffer new_v, ffi::Buffer<ffi::S32> slots,
                           ffi::AnyBuffer k_scale, ffi::AnyBuffer v_scale,
                           ffi::Result<ffi::AnyBuffer> k_out, ffi::Result<ffi::AnyBuffer> v_out,
                           uint64_t dest_k, uint64_t dest_v, uint64_t dest_k_uid,
                           uint64_t dest_v_uid) {
  const Dest dest{dest_k, dest_v, dest_k_uid, dest_v_uid};
  ffi::DataType src = ffi::DataType::F32;
  if (std::string err = CheckFp8Write(k, v, new_k, new_v, k_scale, v_scale, &src); !err.empty()) {
    return ffi::Error::InvalidArgument(err);
  }
  if (ffi::Error e = PrepareWriteResultsOnHost(kFp8Name, k, v, *k_out, *v_out); e.failure()) {
    return e;
  }
  const CallOperands in = Fp8WriteOperands(k, v, new_k, new_v, slots, k_out->untyped_data(),
                                           v_out->untyped_data(), dest, SourceBytes(src));
  return WriteFp8OnHost(Op::kWrite, Handler::kWrite, in, src,
                        static_cast<const float*>(k_scale.untyped_data()),
                        static_cast<const float*>(v_scale.untyped_data()));
}

// kv_write_fp8 on a KVCache layer (kv_write_cache.h).
ffi::Error CpuCacheWriteFp8Impl(int32_t device, ffi::AnyBuffer new_k, ffi::AnyBuffer new_v,
                                ffi::Buffer<ffi::S32> slots, ffi::AnyBuffer token,
                                ffi::AnyBuffer k_scale, ffi::AnyBuffer v_scale,
                                ffi::Result<ffi::AnyBuffer> token_out, uint64_t cache_uid,
                                int64_t layer) {
  CacheWriteCall call;
  ffi::DataType src = ffi::DataType::F32;
  if (std::string err = PrepareCacheWriteFp8("host", device, cache_uid, layer, new_k, new_v, slots,
                                             k_scale, v_scale, &call, &src);
      !err.empty()) {
    return ffi::Error::InvalidArgument(err);
  }
  PassTokenOnHost(token, *token_out);
  return WriteFp8OnHost(Op::kCacheWrite, Handler::kCacheWrite, call.in, src,
                        static_cast<const float*>(k_scale.untyped_data()),
                        static_cast<const float*>(v_scale.untyped_data()));
}

}  // namespace
}  // namespace jax_vmm::kv

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxVmmKvWriteFp8Cpu, jax_vmm::kv::CpuWriteFp8Impl,
                              jax_vmm::kv::BindWriteFp8(xla::ffi::Ffi::Bind()));

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxVmmKvCacheWriteFp8Cpu, jax_vmm::kv::CpuCacheWriteFp8Impl,
                              jax_vmm::kv::BindCacheWriteFp8(xla::ffi::Ffi::Bind()));

namespace jax_vmm::kv {

void AddFp8CpuTargets(FfiRegistry& registry) {
  registry.Add("jax_vmm_kv_write_fp8", "cpu", JaxVmmKvWriteFp8Cpu);
  registry.Add("jax_vmm_kv_cache_write_fp8", "cpu", JaxVmmKvCacheWriteFp8Cpu);
}

}  // namespace jax_vmm::kv
