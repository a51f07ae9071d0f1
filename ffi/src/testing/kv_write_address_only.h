// The dest identity of the address-only kv_write variant (testing_targets.h): the uid
// attributes are replaced by the uid of whatever live buffer starts at the dest address
// now, which is what identity by address meant before buffers had uids.
#pragma once

#include <cstdint>

#include "jax_vmm/arena.h"
#include "ops/kv_write/kv_write_call.h"

namespace jax_vmm::testing {

inline uint64_t UidNowAt(uint64_t address) {
  BufferRef ref;
  if (address == 0 || !FindArenaBuffer(address, 1, &ref) || ref.buffer_base != address) return 0;
  return ref.buffer_uid;
}

inline kv::Dest AddressOnly(uint64_t dest_k, uint64_t dest_v) {
  return kv::Dest{dest_k, dest_v, UidNowAt(dest_k), UidNowAt(dest_v)};
}

}  // namespace jax_vmm::testing
