// The FFI targets of the testing layer, returned by _core.testing.registrations(platform)
// (testing_module.cc). Each is a production handler built with one protection removed, so
// that tests can show their checks would catch its absence (or one production choice
// forced, so that tests reach it); none is registered by the production module.
#pragma once

#include "common/ffi_registry.h"

namespace jax_vmm::testing {

// jax_vmm_testing_kv_write_unchecked, jax_vmm_testing_kv_write_through_unchecked: the
// kv_write handlers without the slot range and page checks (they write wherever a slot
// points). kv_write_unchecked_cpu.cc, kv_write_unchecked_cuda.cu.
void AddUncheckedKvWriteCpuTargets(FfiRegistry& registry);

// jax_vmm_testing_kv_write_address_only, jax_vmm_testing_kv_write_through_address_only:
// the kv_write handlers with a dest's identity reduced to its address, as before buffers
// had uids (a dest of a destroyed arena writes a newer arena placed at the same address).
// kv_write_address_only.h, kv_write_address_only_cpu.cc, kv_write_address_only_cuda.cc.
void AddAddressOnlyKvWriteCpuTargets(FfiRegistry& registry);
// jax_vmm_testing_kv_write_token_kernel, jax_vmm_testing_kv_write_through_token_kernel:
// the checked kv_write handlers with the token kernel instead of the tiled one (CUDA; the
// CPU has one writer). kv_write_token_kernel_cpu.cc, kv_write_token_kernel_cuda.cc.
void AddTokenKernelKvWriteCpuTargets(FfiRegistry& registry);

// jax_vmm_testing_decode_attention: decode attention with an operand `out_init` aliased
// to the output, and the attributes read_all_tokens (CPU: also touch every token up to
// T, as a kernel that ignored the lengths would) and skip_output (write nothing).
// attention_debug_cpu.cc, attention_debug_cuda.cc.
void AddDebugAttentionCpuTargets(FfiRegistry& registry);

// jax_vmm_testing_decode_attention_v2: the streaming decode attention with an operand
// `out_init` aliased to the output and the attribute skip_output (write nothing).
// stream_debug_cpu.cc, stream_debug_cuda.cc.
void AddDebugStreamCpuTargets(FfiRegistry& registry);

// jax_vmm_testing_kv_cache_write_no_limits, jax_vmm_testing_decode_attention_cache_no_limits,
// jax_vmm_testing_decode_attention_v2_cache_no_limits: the KVCache-layer kv_write and
// decode attention without the table of ensured tokens (writes past them land where a
// chunk happens to be backed; reads go up to T, uncounted). kv_cache_no_limits_cpu.cc,
// kv_cache_no_limits_cuda.cc.
void AddNoLimitsCacheCpuTargets(FfiRegistry& registry);

// jax_vmm_scratch_probe: y = x through a graph-safe scratch workspace (scratch_probe.h).
void AddProbeCpuTargets(FfiRegistry& registry);

// jax_vmm_testing_host_gate: y = x once the gate is open (SetHostGate); HostGateHeld
// counts the calls waiting at it. host_gate_cpu.cc.
void AddHostGateCpuTargets(FfiRegistry& registry);
void SetHostGate(bool open);
int HostGateHeld();

#ifdef JAX_VMM_HAVE_CUDA_KERNELS
void AddUncheckedKvWriteCudaTargets(FfiRegistry& registry);
void AddAddressOnlyKvWriteCudaTargets(FfiRegistry& registry);
void AddTokenKernelKvWriteCudaTargets(FfiRegistry& registry);
void AddDebugAttentionCudaTargets(FfiRegistry& registry);
void AddDebugStreamCudaTargets(FfiRegistry& registry);
void AddNoLimitsCacheCudaTargets(FfiRegistry& registry);
void AddProbeCudaTargets(FfiRegistry& registry);
#endif

}  // namespace jax_vmm::testing
