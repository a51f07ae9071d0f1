#include "ops/kv_cache/kv_cache.h"

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <string>
#include <utility>

#include "jax_vmm/errors.h"

namespace jax_vmm::kvcache {
namespace {

// Every live cache, for the handlers. Never destroyed: a cache may be released on an XLA
// thread after static destructors ran at exit.
struct Registry {
  std::mutex mu;
  std::vector<std::weak_ptr<KvCache>> caches;
  std::vector<const KvCache*> raw;  // same order: identifies an entry while it dies
};

Registry& GetRegistry() {
  static Registry* registry = new Registry;
  return *registry;
}

size_t LimitsBytes(int64_t max_seqs) {
  return (static_cast<size_t>(max_seqs) * sizeof(int32_t) + 7) / 8 * 8;
}

}  // namespace

std::vector<int64_t> Geometry::dims() const {
  if (per_sequence) return {max_seqs, max_tokens, kv_heads, head_dim};
  return {max_tokens, kv_heads, head_dim};
}

static bool SameGeometry(const Geometry& a, const Geometry& b) {
  return a.num_layers == b.num_layers && a.max_seqs == b.max_seqs && a.max_tokens == b.max_tokens &&
         a.kv_heads == b.kv_heads && a.head_dim == b.head_dim && a.per_sequence == b.per_sequence &&
         a.interleaved == b.interleaved && a.dtype == b.dtype && a.element_bytes == b.element_bytes;
}

// Throws unless a shard may join the caches registered under shared_uid (a live one
// exists, same geometry, no shard on this device ordinal yet). Caller holds the lock.
static void CheckJoin(const Registry& r, uint64_t shared_uid, const Geometry& g,
                      int device_ordinal) {
  std::string why = "no live KV cache has this uid";
  for (size_t i = 0; i < r.raw.size(); ++i) {
    const KvCache& c = *r.raw[i];
    if (c.uid() != shared_uid || r.caches[i].expired()) continue;
    why.clear();
    if (!SameGeometry(c.geometry(), g)) {
      why = "its geometry differs from the other shards'";
      break;
    }
    if (c.device_ordinal() == device_ordinal) {
      why = "device ordinal " + std::to_string(device_ordinal) + " has a shard already";
      break;
    }
  }
  if (!why.empty()) {
    throw InvalidArgument("KvCache: cannot add a shard to cache " + std::to_string(shared_uid) +
                          ": " + why);
  }
}

KvCache::KvCache(std::shared_ptr<Arena> arena, const Geometry& g, int device_ordinal, uint64_t uid)
    : arena_(std::move(arena)), uid_(uid), geometry_(g), device_ordinal_(device_ordinal) {}

std::shared_ptr<KvCache> KvCache::Create(std::shared_ptr<Arena> arena,
                                         const std::vector<int64_t>& k_ids,
                                         const std::vector<int64_t>& v_ids, const Geometry& g,
                                         int device_ordinal, uint64_t shared_uid) {
  if (arena == nullptr) throw InvalidArgument("KvCache: no arena");
  if (g.num_layers <= 0 || g.max_seqs <= 0 || g.max_tokens <= 0 || g.kv_heads <= 0 ||
      g.head_dim <= 0 || g.element_bytes == 0 || (!g.per_sequence && g.max_seqs != 1) ||
      g.max_tokens > INT32_MAX) {
    throw InvalidArgument("KvCache: invalid geometry");
  }
  if (k_ids.size() != static_cast<size_t>(g.num_layers) || v_ids.size() != k_ids.size()) {
    throw InvalidArgument("KvCache: need one K and one V buffer per layer, got " +
                          std::to_string(k_ids.size()) + " and " + std::to_string(v_ids.size()) +
                          " for " + std::to_string(g.num_layers) + " layers");
  }
  if (shared_uid != 0) {  // up front too: nothing is allocated for a refused shard
    Registry& r = GetRegistry();
    std::lock_guard<std::mutex> lock(r.mu);
    CheckJoin(r, shared_uid, g, device_ordinal);
  }
  if (g.interleaved && (std::any_of(k_ids.begin(), k_ids.end(),
                                     [&](int64_t id) { return id != k_ids[0]; }) ||
                         v_ids != k_ids)) {
    throw InvalidArgument("KvCache: an interleaved cache keeps every layer in one buffer");
  }
  std::shared_ptr<KvCache> cache(
      new KvCache(arena, g, device_ordinal, shared_uid != 0 ? shared_uid : NewUid()));
  for (size_t l = 0; l < k_ids.size(); ++l) {
    const BufferInfo k = arena->Buffer(k_ids[l]), v = arena->Buffer(v_ids[l]);
    if (k.nbytes < g.buffer_bytes() || v.nbytes < g.buffer_bytes()) {
      throw InvalidArgument("KvCache: layer " + std::to_string(l) + " buffers hold " +
                            std::to_string(k.nbytes) + " and " + std::to_string(v.nbytes) +
                            " bytes, the geometry needs " + std::to_string(g.buffer_bytes()));
    }
    const auto li = static_cast<int64_t>(l);
    cache->layers_.push_back(LayerBuffers{k.uid, v.uid, k.address + g.layer_offset(li, 0),
                                          v.address + g.layer_offset(li, 1)});
  }
  const size_t bytes = 3 * LimitsBytes(g.max_seqs) + sizeof(unsigned long long);
  Driver& driver = arena->driver();
  cache->metadata_ = driver.AllocMetadata(bytes);
  cache->limits_ = static_cast<int32_t*>(cache->metadata_);
  cache->read_clamps_ = reinterpret_cast<unsigned long long*>(
      static_cast<uint8_t*>(cache->metadata_) + LimitsBytes(g.max_seqs));
  cache->floors_ = reinterpret_cast<int32_t*>(static_cast<uint8_t*>(cache->metadata_) +
                                              LimitsBytes(g.max_seqs) + sizeof(unsigned long long));
  cache->read_limits_ = reinterpret_cast<int32_t*>(static_cast<uint8_t*>(cache->metadata_) +
                                                   2 * LimitsBytes(g.max_seqs) +
                                                   sizeof(unsigned long long));
  try {
    std::vector<uint8_t> zeros(bytes, 0);
    driver.CopyToMetadata(cache->metadata_, zeros.data(), bytes);
  } catch (...) {
    driver.FreeMetadata(cache->metadata_);
    cache->metadata_ = nullptr;
    throw;
  }
  cache->host_limits_.assign(static_cast<size_t>(g.max_seqs), 0);
  cache->host_floors_.assign(static_cast<size_t>(g.max_seqs), 0);
  Registry& r = GetRegistry();
  std::lock_guard<std::mutex> lock(r.mu);
  // Again under the lock that registers it (two shards racing for one device ordinal);
  // on a throw the lock goes first, then the destructor frees the table.
  if (shared_uid != 0) CheckJoin(r, shared_uid, g, device_ordinal);
  r.caches.push_back(cache);
  r.raw.push_back(cache.get());
  return cache;
}

KvCache::~KvCache() {
  {
    Registry& r = GetRegistry();
    std::lock_guard<std::mutex> lock(r.mu);
    for (size_t i = 0; i < r.raw.size(); ++i) {
      if (r.raw[i] == this) {
        r.raw.erase(r.raw.begin() + static_cast<std::ptrdiff_t>(i));
        r.caches.erase(r.caches.begin() + static_cast<std::ptrdiff_t>(i));
        break;
      }
    }
  }
  if (metadata_ == nullptr) return;
  if (pinned_) {
    // A graph may still hold the table's address: every sequence at 0 tokens, kept.
    try {
      std::lock_guard<std::mutex> lock(mu_);
      std::fill(host_limits_.begin(), host_limits_.end(), 0);
      WriteTableLocked();
    } catch (...) {
      // Destructors never throw; the driver reported the failure.
    }
    return;
  }
  arena_->driver().FreeMetadata(metadata_);
}

bool KvCache::Owns(uint64_t buffer_uid) const {
  return std::any_of(layers_.begin(), layers_.end(), [&](const LayerBuffers& l) {
    return l.k_uid == buffer_uid || l.v_uid == buffer_uid;
  });
}

void KvCache::WriteTableLocked() {
  const size_t bytes = host_limits_.size() * sizeof(int32_t);
  arena_->driver().CopyToMetadata(limits_, host_limits_.data(), bytes);
  arena_->driver().WriteTable(read_limits_, host_limits_.data(), bytes);
}

void KvCache::SetLimit(int64_t seq, int64_t tokens) {
  if (seq < 0 || seq >= geometry_.max_seqs) {
    throw InvalidArgument("KvCache.set_limit: seq " + std::to_string(seq) + " is outside [0, " +
                          std::to_string(geometry_.max_seqs) + ")");
  }
  if (tokens < 0 || tokens > geometry_.max_tokens) {
    throw InvalidArgument("KvCache.set_limit: tokens " + std::to_string(tokens) +
                          " is outside [0, " + std::to_string(geometry_.max_tokens) + "]");
  }
  std::lock_guard<std::mutex> lock(mu_);
  if (closed_) {
    throw ArenaClosed("KvCache.set_limit: the KV cache is closed; create a new KV arena");
  }
  host_limits_[static_cast<size_t>(seq)] = static_cast<int32_t>(tokens);
  const int32_t* entry = &host_limits_[static_cast<size_t>(seq)];
  arena_->driver().CopyToMetadata(limits_ + seq, entry, sizeof(int32_t));
  arena_->driver().WriteTable(read_limits_ + seq, entry, sizeof(int32_t));
}

void KvCache::SetFloor(int64_t seq, int64_t tokens) {
  if (seq < 0 || seq >= geometry_.max_seqs) {
    throw InvalidArgument("KvCache.set_floor: seq " + std::to_string(seq) + " is outside [0, " +
                          std::to_string(geometry_.max_seqs) + ")");
  }
  if (tokens < 0 || tokens > geometry_.max_tokens) {
    throw InvalidArgument("KvCache.set_floor: tokens " + std::to_string(tokens) +
                          " is outside [0, " + std::to_string(geometry_.max_tokens) + "]");
  }
  std::lock_guard<std::mutex> lock(mu_);
  if (closed_) {
    throw ArenaClosed("KvCache.set_floor: the KV cache is closed; create a new KV arena");
  }
  host_floors_[static_cast<size_t>(seq)] = static_cast<int32_t>(tokens);
  arena_->driver().CopyToMetadata(floors_ + seq, &host_floors_[static_cast<size_t>(seq)],
                                  sizeof(int32_t));
}

std::vector<int32_t> KvCache::Floors() const {
  std::lock_guard<std::mutex> lock(mu_);
  return host_floors_;
}

void KvCache::CheckTable(const char* op, const int64_t* tokens, size_t count) const {
  if (count != static_cast<size_t>(geometry_.max_seqs)) {
    throw InvalidArgument(std::string(op) + ": " + std::to_string(count) + " entries for " +
                          std::to_string(geometry_.max_seqs) + " sequences");
  }
  for (size_t i = 0; i < count; ++i) {
    if (tokens[i] < 0 || tokens[i] > geometry_.max_tokens) {
      throw InvalidArgument(std::string(op) + ": tokens " + std::to_string(tokens[i]) +
                            " is outside [0, " + std::to_string(geometry_.max_tokens) + "]");
    }
  }
}

void KvCache::SetLimits(const std::vector<int64_t>& tokens) {
  CheckTable("KvCache.set_limits", tokens.data(), tokens.size());
  std::lock_guard<std::mutex> lock(mu_);
  if (closed_) {
    throw ArenaClosed("KvCache.set_limits: the KV cache is closed; create a new KV arena");
  }
  for (size_t i = 0; i < tokens.size(); ++i) host_limits_[i] = static_cast<int32_t>(tokens[i]);
  WriteTableLocked();
}

bool KvCache::RaiseLimits(const int64_t* tokens, size_t count) {
  CheckTable("KvCache.raise_limits", tokens, count);
  std::lock_guard<std::mutex> lock(mu_);
  if (closed_) {
    throw ArenaClosed("KvCache.raise_limits: the KV cache is closed; create a new KV arena");
  }
  bool changed = false;
  for (size_t i = 0; i < count; ++i) {
    if (tokens[i] > host_limits_[i]) {
      host_limits_[i] = static_cast<int32_t>(tokens[i]);
      changed = true;
    }
  }
  if (changed) WriteTableLocked();
  return changed;
}

std::vector<int32_t> KvCache::Limits() const {
  std::lock_guard<std::mutex> lock(mu_);
  return host_limits_;
}

int32_t KvCache::BeginEpoch() {
  std::lock_guard<std::mutex> lock(mu_);
  kept_tables_[epoch_] = std::make_shared<const std::vector<int32_t>>(host_limits_);
  epoch_ = epoch_ == INT32_MAX ? 0 : epoch_ + 1;
  kept_tables_.erase(epoch_);  // wrapped around: never a table of the live epoch
  return epoch_;
}

void KvCache::ForgetEpochsBefore(int32_t epoch) {
  std::lock_guard<std::mutex> lock(mu_);
  kept_tables_.erase(kept_tables_.begin(), kept_tables_.lower_bound(epoch));
}

int32_t KvCache::epoch() const {
  std::lock_guard<std::mutex> lock(mu_);
  return epoch_;
}

std::shared_ptr<const std::vector<int32_t>> KvCache::ReadTableOf(int32_t epoch) const {
  std::lock_guard<std::mutex> lock(mu_);
  if (closed_ || epoch == epoch_) return nullptr;
  auto it = kept_tables_.find(epoch);
  return it == kept_tables_.end() ? nullptr : it->second;
}

uint64_t KvCache::ReadClamps() const {
  unsigned long long value = 0;
  arena_->driver().CopyFromMetadata(&value, read_clamps_, sizeof(value));
  return value;
}

void KvCache::ResetReadClamps() {
  const unsigned long long zero = 0;
  arena_->driver().CopyToMetadata(read_clamps_, &zero, sizeof(zero));
}

void KvCache::Close() {
  std::lock_guard<std::mutex> lock(mu_);
  if (closed_) return;
  closed_ = true;
  kept_tables_.clear();
  std::fill(host_limits_.begin(), host_limits_.end(), 0);
  WriteTableLocked();
}

bool KvCache::closed() const {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (closed_) return true;
  }
  return arena_->closed();
}

namespace {

// A strong reference to the first registered cache that `match` accepts, or null. The
// raw pointers are checked first: a cache whose destructor waits for the registry lock
// is still a valid object, and no strong reference is made (or dropped) to any other
// cache under the lock, so no destructor runs while it is held.
template <typename Match>
std::shared_ptr<KvCache> FindRegistered(const Match& match) {
  Registry& r = GetRegistry();
  std::lock_guard<std::mutex> lock(r.mu);
  for (size_t i = 0; i < r.raw.size(); ++i) {
    if (match(*r.raw[i])) return r.caches[i].lock();  // null when it is being destroyed
  }
  return nullptr;
}

}  // namespace

CacheLookup FindKvCache(uint64_t cache_uid, int device_ordinal, std::shared_ptr<KvCache>* out) {
  std::shared_ptr<KvCache> found = FindRegistered([&](const KvCache& cache) {
    return cache.uid() == cache_uid && cache.device_ordinal() == device_ordinal;
  });
  if (found == nullptr) {
    found = FindRegistered([&](const KvCache& cache) { return cache.uid() == cache_uid; });
  }
  if (found == nullptr) return CacheLookup::kGone;
  *out = found;
  if (found->closed()) return CacheLookup::kClosed;
  if (found->device_ordinal() != device_ordinal) return CacheLookup::kOtherDevice;
  return CacheLookup::kFound;
}

std::shared_ptr<KvCache> FindKvCacheOfBuffer(uint64_t buffer_uid) {
  // A closed cache is found too: its table is all zeros, so every write is dropped.
  return FindRegistered([&](const KvCache& cache) { return cache.Owns(buffer_uid); });
}

}  // namespace jax_vmm::kvcache
