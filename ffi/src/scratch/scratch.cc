// Graph-safe scratch workspaces (see jax_vmm/scratch.h for the contract): the table of
// workspaces keyed by (device, stream, generation), capture resolution and the public API.
// One workspace is scratch/workspace.h; the device platforms are host_platform.cc and
// cuda_platform.cc. Nothing is ever freed under the default growth policy, because a
// captured graph may hold any pointer we ever handed out.
#include <algorithm>
#include <cstdlib>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <tuple>
#include <vector>

#include "common/format.h"
#include "jax_vmm/scratch.h"
#include "scratch/device_platform.h"
#include "scratch/growth_policy.h"
#include "scratch/simulated_capture.h"
#include "scratch/workspace.h"

namespace jax_vmm::scratch {
namespace {

using internal::DeviceName;
using internal::DevicePlatform;
using internal::GrowthPolicy;
using internal::PlatformFor;
using internal::Workspace;

constexpr size_t kDefaultReserveBytes = size_t{1} << 30;

size_t ReserveBytesFromEnv() {
  if (const char* env = std::getenv("JAX_VMM_SCRATCH_RESERVE_BYTES")) {
    char* end = nullptr;
    unsigned long long v = std::strtoull(env, &end, 10);
    if (end != env && *end == '\0' && v > 0) return static_cast<size_t>(v);
  }
  return kDefaultReserveBytes;
}

// Graph-safe scratch itself: grow in place where the mode allows, retire every outgrown
// block (never free it).
class RetireOutgrown final : public GrowthPolicy {
 public:
  bool GrowsInPlace() const override { return true; }
  bool Retire(const internal::OutgrownBlock&) const override { return true; }
};

const GrowthPolicy& DefaultPolicy() {
  static const RetireOutgrown policy;
  return policy;
}

// ---------------------------------------------------------------- table
struct Key {
  int device;
  uintptr_t stream;
  int64_t generation;
  bool operator<(const Key& o) const {
    return std::tie(device, stream, generation) < std::tie(o.device, o.stream, o.generation);
  }
};

struct Table {
  std::mutex mu;
  ScratchMode mode = ScratchMode::kDefault;
  int64_t generation = 0;
  size_t reserve_bytes = ReserveBytesFromEnv();
  const GrowthPolicy* policy = nullptr;  // nullptr: DefaultPolicy()
  // Workspaces are never destroyed (graphs may point into them): the table is leaked.
  std::map<Key, std::unique_ptr<Workspace>> workspaces;
};

Table& GetTable() {
  static Table* table = new Table();  // intentionally leaked, see above
  return *table;
}

// The stream this thread last reserved or used outside capture, per device. XLA runs a
// handler's kInitialize and then records the command buffer on the same thread.
struct Binding {
  uintptr_t stream = 0;
  int64_t generation = -1;
};
thread_local std::map<int, Binding> t_bound;

Workspace& GetOrCreateLocked(Table& t, int device, uintptr_t stream,
                             const DevicePlatform& platform) {
  Key key{device, stream, t.generation};
  auto it = t.workspaces.find(key);
  if (it == t.workspaces.end()) {
    it = t.workspaces
             .emplace(key, std::make_unique<Workspace>(device, stream, t.generation, platform))
             .first;
  }
  return *it->second;
}

Workspace* FindLocked(Table& t, int device, uintptr_t stream) {
  auto it = t.workspaces.find(Key{device, stream, t.generation});
  return it == t.workspaces.end() ? nullptr : it->second.get();
}

std::string GrowLocked(Table& t, int device, void* stream, size_t bytes,
                       const DevicePlatform& platform, void** ptr) {
  const uintptr_t key = reinterpret_cast<uintptr_t>(stream);
  Workspace& ws = GetOrCreateLocked(t, device, key, platform);
  std::string err =
      ws.GrowTo(bytes, t.mode, t.reserve_bytes, t.policy != nullptr ? *t.policy : DefaultPolicy());
  if (!err.empty()) return err;
  t_bound[device] = Binding{key, t.generation};
  if (ptr != nullptr) *ptr = ws.ptr();
  return "";
}

}  // namespace

const char* ModeName(ScratchMode mode) {
  switch (mode) {
    case ScratchMode::kDefault:
      return "default";
    case ScratchMode::kGrowInPlace:
      return "grow";
    case ScratchMode::kRetire:
      return "retire";
  }
  return "unknown";
}

void SetMode(ScratchMode mode) {
  Table& t = GetTable();
  std::lock_guard<std::mutex> lock(t.mu);
  if (mode == t.mode) return;
  t.mode = mode;
  t.generation += 1;  // current workspaces are retired (kept alive), new ones use `mode`
}

ScratchMode GetMode() {
  Table& t = GetTable();
  std::lock_guard<std::mutex> lock(t.mu);
  return t.mode;
}

void SetReserveBytes(size_t bytes) {
  Table& t = GetTable();
  std::lock_guard<std::mutex> lock(t.mu);
  t.reserve_bytes = bytes == 0 ? ReserveBytesFromEnv() : bytes;
}

size_t GetReserveBytes() {
  Table& t = GetTable();
  std::lock_guard<std::mutex> lock(t.mu);
  return t.reserve_bytes;
}

std::string Reserve(int device, void* stream, size_t bytes) {
  std::string err;
  const DevicePlatform* platform = PlatformFor(device, &err);
  if (platform == nullptr) return err;
  if (stream != nullptr) {
    const bool capturing = platform->is_capturing(stream, &err);
    if (!err.empty()) return err;
    if (capturing) {
      return "jax_vmm scratch: Reserve(" + std::to_string(bytes) + " bytes) on " +
             DeviceName(device) + " was called while stream " +
             Hex(reinterpret_cast<uintptr_t>(stream)) +
             " is capturing a CUDA graph; reserve before capture (kInitialize stage or "
             "jax_vmm.ops.scratch.reserve())";
    }
  }
  Table& t = GetTable();
  std::lock_guard<std::mutex> lock(t.mu);
  return GrowLocked(t, device, stream, bytes, *platform, nullptr);
}

std::string Get(int device, void* stream, size_t bytes, void** ptr) {
  std::string err;
  const DevicePlatform* platform = PlatformFor(device, &err);
  if (platform == nullptr) return err;
  const bool capturing = stream != nullptr && platform->is_capturing(stream, &err);
  if (!err.empty()) return err;
  return GetWithCaptureState(device, stream, bytes, capturing, ptr);
}

std::string GetWithCaptureState(int device, void* stream, size_t bytes, bool capturing,
                                void** ptr) {
  std::string err;
  const DevicePlatform* platform = PlatformFor(device, &err);
  if (platform == nullptr) return err;
  Table& t = GetTable();
  std::lock_guard<std::mutex> lock(t.mu);
  if (!capturing) return GrowLocked(t, device, stream, bytes, *platform, ptr);

  // Under capture: never allocate. Resolve to a workspace that already has the bytes.
  const uintptr_t key = reinterpret_cast<uintptr_t>(stream);
  std::vector<Workspace*> candidates = {FindLocked(t, device, key)};
  auto bound = t_bound.find(device);
  if (bound != t_bound.end() && bound->second.generation == t.generation) {
    candidates.push_back(FindLocked(t, device, bound->second.stream));
  }
  candidates.push_back(FindLocked(t, device, 0));
  size_t largest = 0;
  for (Workspace* ws : candidates) {
    if (ws == nullptr) continue;
    if (ws->capacity() >= bytes) {
      *ptr = ws->ptr();
      return "";
    }
    largest = std::max(largest, ws->capacity());
  }
  // Count the refusal on this stream's (possibly empty) workspace; creating the entry
  // allocates nothing.
  GetOrCreateLocked(t, device, key, *platform).stats().capture_refusals += 1;
  return "jax_vmm scratch: a workspace of " + std::to_string(bytes) + " bytes is needed on " +
         DeviceName(device) + " while stream " + Hex(key) +
         " is capturing a CUDA graph, but the largest workspace usable there holds " +
         std::to_string(largest) +
         " bytes. Growing under capture is refused (the graph would keep a pointer to "
         "memory that could move). Reserve before capture: jax_vmm.ops.scratch.reserve(" +
         std::to_string(bytes) +
         ", device=...) from Python, or scratch::Reserve() at "
         "the handler's kInitialize stage.";
}

std::vector<WorkspaceStats> Stats() {
  Table& t = GetTable();
  std::lock_guard<std::mutex> lock(t.mu);
  std::vector<WorkspaceStats> out;
  out.reserve(t.workspaces.size());
  for (const auto& [key, ws] : t.workspaces) {
    WorkspaceStats s = ws->stats();
    s.current = key.generation == t.generation;
    out.push_back(s);
  }
  return out;
}

namespace internal {

void SetGrowthPolicy(const GrowthPolicy* policy) {
  Table& t = GetTable();
  std::lock_guard<std::mutex> lock(t.mu);
  t.policy = policy;
}

const GrowthPolicy* InstalledGrowthPolicy() {
  Table& t = GetTable();
  std::lock_guard<std::mutex> lock(t.mu);
  return t.policy;
}

}  // namespace internal

}  // namespace jax_vmm::scratch
