// The kv_write CPU handlers (see kv_write_cpu.h) and their FFI targets.
#include "ops/kv_write/kv_write_cpu.h"

#include <cstring>
#include <string>

#include "ops/kv_write/kv_write_call.h"
#include "ops/kv_write/kv_write_targets.h"

namespace jax_vmm::kv {

ffi::Error RunOnHost(Op op, Handler h, const CallOperands& in, bool require_arena,
                     const std::function<void(const Params&, Counters&)>& write) {
  Counters& counters = GetCounters(h);
  counters.calls.fetch_add(1);
  Params p;
  Resolution r;
  std::string err = PrepareCall(op, "host", require_arena, in, &p, &r);
  if (!err.empty()) return ffi::Error::InvalidArgument(err);
  CountResolution(h, r);
  write(p, counters);
  return ffi::Error::Success();
}

ffi::Error PrepareWriteResultsOnHost(const char* op, const ffi::AnyBuffer& k,
                                     const ffi::AnyBuffer& v, ffi::AnyBuffer& k_out,
                                     ffi::AnyBuffer& v_out) {
  if (ffi::Error e = CheckWriteResults(op, k, v, k_out, v_out); e.failure()) return e;
  if (k_out.untyped_data() != k.untyped_data()) {
    std::memcpy(k_out.untyped_data(), k.untyped_data(), k.size_bytes());
  }
  if (v_out.untyped_data() != v.untyped_data()) {
    std::memcpy(v_out.untyped_data(), v.untyped_data(), v.size_bytes());
  }
  return ffi::Error::Success();
}

ffi::Error CpuWrite(HostTokenWriter write, ffi::AnyBuffer k, ffi::AnyBuffer v, ffi::AnyBuffer new_k,
                    ffi::AnyBuffer new_v, ffi::Buffer<ffi::S32> slots,
                    ffi::Result<ffi::AnyBuffer> k_out, ffi::Result<ffi::AnyBuffer> v_out,
                    const Dest& dest) {
  if (ffi::Error e = PrepareWriteResultsOnHost("jax_vmm_kv_write", k, v, *k_out, *v_out);
      e.failure()) {
    return e;
  }
  const CallOperands in =
      WriteOperands(k, v, new_k, new_v, slots, k_out->untyped_data(), v_out->untyped_data(), dest);
  return RunOnHost(Op::kWrite, Handler::kWrite, in, false, write);
}

ffi::Error CpuWriteThrough(HostTokenWriter write, ffi::AnyBuffer k, ffi::AnyBuffer v,
                           ffi::AnyBuffer new_k, ffi::AnyBuffer new_v, ffi::Buffer<ffi::S32> slots,
                           ffi::Result<ffi::Buffer<ffi::S32>> status, bool require_arena,
                           const Dest& dest) {
  const Dims status_dims = DimsOfS32(*status);
  if (ffi::Error e = CheckStatusResult(status_dims); e.failure()) return e;
  const CallOperands in =
      WriteThroughOperands(k, v, new_k, new_v, slots, *status, status_dims, dest);
  return RunOnHost(Op::kWriteThrough, Handler::kWriteThrough, in, require_arena, write);
}

}  // namespace jax_vmm::kv

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxVmmKvWriteCpu,
                              jax_vmm::kv::CpuWriteImpl<jax_vmm::kv::CheckedTokens>,
                              jax_vmm::kv::BindWrite(xla::ffi::Ffi::Bind()));

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxVmmKvWriteThroughCpu,
                              jax_vmm::kv::CpuWriteThroughImpl<jax_vmm::kv::CheckedTokens>,
                              jax_vmm::kv::BindWriteThrough(xla::ffi::Ffi::Bind()));

namespace jax_vmm::kv {

void AddCpuTargets(FfiRegistry& registry) {
  registry.Add("jax_vmm_kv_write_through", "cpu", JaxVmmKvWriteThroughCpu);
  registry.Add("jax_vmm_kv_write", "cpu", JaxVmmKvWriteCpu);
}

}  // namespace jax_vmm::kv
