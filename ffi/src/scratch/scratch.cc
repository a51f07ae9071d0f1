// Graph-safe scratch workspaces (see jax_vmm/scratch.h for the contract).
//
// One table of workspaces keyed by (device, stream, generation). A workspace starts
// empty; its first growth picks the strategy:
//   grow-in-place: a Driver reservation; chunks are created and mapped at the tail, one
//                  set-access per growth, so the address never changes;
//   retire:        one plain block; a larger one replaces it and the old block is kept.
// Nothing is ever freed except under the test-only debug switch, because a captured
// graph may hold any pointer we ever handed out.
#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "common/format.h"
#include "common/math.h"
#include "jax_vmm/driver.h"
#include "jax_vmm/scratch.h"
#include "scratch/scratch_internal.h"

namespace jax_vmm::scratch {
namespace {

constexpr size_t kDefaultReserveBytes = size_t{1} << 30;

std::string DeviceName(int device) {
  return device == kHostDevice ? std::string("host") : "cuda:" + std::to_string(device);
}

// ---------------------------------------------------------------- host platform
bool HostIsCapturing(void*, std::string*) { return false; }

void* HostAlloc(int, size_t bytes, std::string* error) {
  void* p = std::aligned_alloc(256, RoundUp(bytes, 256));
  if (p == nullptr) *error = "aligned_alloc of " + std::to_string(bytes) + " bytes failed";
  return p;
}

void HostFree(int, void* p) { std::free(p); }

std::unique_ptr<Driver> HostMakeDriver(int, std::string* error) {
  try {
    return MakeHostDriver(0);
  } catch (const std::exception& e) {
    *error = e.what();
    return nullptr;
  }
}

const internal::DevicePlatform& HostPlatform() {
  static const internal::DevicePlatform p = [] {
    internal::DevicePlatform h;
    h.name = "host";
    h.is_capturing = HostIsCapturing;
    h.alloc = HostAlloc;
    h.free = HostFree;
    h.make_driver = HostMakeDriver;
    h.alloc_granularity = 4096;
    return h;
  }();
  return p;
}

internal::DevicePlatform& CudaPlatformSlot() {
  static internal::DevicePlatform p;  // name empty until scratch_cuda.cc registers
  return p;
}

const internal::DevicePlatform* PlatformFor(int device, std::string* error) {
  if (device == kHostDevice) return &HostPlatform();
  const internal::DevicePlatform& cuda = CudaPlatformSlot();
  if (cuda.alloc == nullptr) {
    *error = "jax_vmm scratch: device " + DeviceName(device) +
             " needs CUDA, but this jax_vmm build has no CUDA kernels (rebuild with "
             "JAX_VMM_CUDA=ON and nvcc on PATH)";
    return nullptr;
  }
  if (device < 0) {
    *error = "jax_vmm scratch: invalid device ordinal " + std::to_string(device);
    return nullptr;
  }
  return &cuda;
}

size_t ReserveBytesFromEnv() {
  if (const char* env = std::getenv("JAX_VMM_SCRATCH_RESERVE_BYTES")) {
    char* end = nullptr;
    unsigned long long v = std::strtoull(env, &end, 10);
    if (end != env && *end == '\0' && v > 0) return static_cast<size_t>(v);
  }
  return kDefaultReserveBytes;
}

// ---------------------------------------------------------------- workspace
// One workspace. Not thread-safe by itself: the table mutex guards every call.
//
// Memory comes from a Driver (VMM: host mmap/memfd or CUDA) whenever the device has
// one; retire mode then uses one exactly-sized range per block. Without VMM, retire
// mode falls back to plain allocations (cudaMalloc).
class Workspace {
 public:
  Workspace(int device, uintptr_t stream, int64_t generation,
            const internal::DevicePlatform& platform)
      : platform_(platform) {
    stats_.device = device;
    stats_.stream = stream;
    stats_.generation = generation;
  }

  void* ptr() const { return reinterpret_cast<void*>(stats_.address); }
  size_t capacity() const { return stats_.capacity; }
  WorkspaceStats& stats() { return stats_; }
  const WorkspaceStats& stats() const { return stats_; }

  // Makes at least `bytes` usable. Never called under stream capture.
  std::string GrowTo(size_t bytes, ScratchMode requested, size_t reserve_bytes,
                     bool free_on_growth) {
    if (bytes == 0) bytes = 1;
    if (bytes <= stats_.capacity) return "";
    if (stats_.mode == ScratchMode::kDefault) {
      std::string err = ChooseMode(requested);
      if (!err.empty()) return err;
    }
    std::string err = driver_ != nullptr ? GrowRange(bytes, reserve_bytes, free_on_growth)
                                         : GrowPlain(bytes, free_on_growth);
    if (err.empty()) stats_.growth_events += 1;
    return err;
  }

 private:
  // A virtual range with chunks mapped from its start.
  struct Range {
    uintptr_t va = 0;
    size_t reserved = 0;
    std::vector<PhysicalHandle> handles;  // chunk i is mapped at va + i * chunk
  };

  std::string ChooseMode(ScratchMode requested) {
    std::string why;
    driver_ = platform_.make_driver(stats_.device, &why);
    if (requested == ScratchMode::kGrowInPlace && driver_ == nullptr) {
      return "jax_vmm scratch: grow-in-place mode was selected but device " +
             DeviceName(stats_.device) + " cannot provide virtual memory (" + why +
             "); select the 'retire' mode (jax_vmm.scratch.set_scratch_mode('retire')) or "
             "'default', which falls back to it";
    }
    if (requested == ScratchMode::kRetire || driver_ == nullptr) {
      stats_.mode = ScratchMode::kRetire;
      if (requested == ScratchMode::kDefault) stats_.fallback_reason = why;
    } else {
      stats_.mode = ScratchMode::kGrowInPlace;
    }
    stats_.vmm = driver_ != nullptr;
    return "";
  }

  // Maps chunks [range.handles.size(), want_chunks) of `range`; all-or-nothing.
  std::string MapChunks(Range& range, size_t want_chunks) {
    const size_t chunk = driver_->chunk_bytes();
    const size_t first = range.handles.size();
    std::vector<PhysicalHandle> fresh;
    size_t mapped = 0;
    try {
      for (size_t i = first; i < want_chunks; ++i) {
        fresh.push_back(driver_->Create());
        driver_->Map(range.va + i * chunk, fresh.back());
        ++mapped;
      }
      driver_->SetAccess(range.va + first * chunk, (want_chunks - first) * chunk);
    } catch (const std::exception& e) {
      for (size_t i = 0; i < fresh.size(); ++i) {
        if (i < mapped) driver_->Unmap(range.va + (first + i) * chunk);
        driver_->Release(fresh[i]);
      }
      return std::string("jax_vmm scratch: growing the workspace on ") + DeviceName(stats_.device) +
             " to " + std::to_string(want_chunks * chunk) + " bytes failed: " + e.what();
    }
    range.handles.insert(range.handles.end(), fresh.begin(), fresh.end());
    return "";
  }

  // Gives the physical memory back. The virtual range stays reserved (reading zeros,
  // writes fault), so a graph that still points here faults instead of silently writing
  // into whatever would reuse the addresses.
  void ReleaseChunks(Range& range) noexcept {
    const size_t chunk = driver_->chunk_bytes();
    for (size_t i = 0; i < range.handles.size(); ++i) {
      driver_->Unmap(range.va + i * chunk);
      driver_->Release(range.handles[i]);
    }
    range.handles.clear();
  }

  std::string NewRange(size_t reserve, size_t want_chunks, Range* out) {
    try {
      out->va = driver_->Reserve(reserve);
      out->reserved = reserve;
    } catch (const std::exception& e) {
      return "jax_vmm scratch: reserving " + std::to_string(reserve) +
             " bytes of virtual address space on " + DeviceName(stats_.device) +
             " failed: " + e.what();
    }
    std::string err = MapChunks(*out, want_chunks);
    if (!err.empty()) {
      driver_->Unreserve(out->va, out->reserved);
      *out = Range{};
    }
    return err;
  }

  // Grow in place (map at the tail), or move to a new range: always in retire mode,
  // in grow mode when the reservation is outgrown, and under the debug switch.
  std::string GrowRange(size_t bytes, size_t reserve_bytes, bool free_on_growth) {
    const size_t chunk = driver_->chunk_bytes();
    const size_t need = RoundUp(bytes, chunk);
    const bool grow = stats_.mode == ScratchMode::kGrowInPlace;
    if (grow && !free_on_growth && current_.va != 0 && need <= current_.reserved) {
      std::string err = MapChunks(current_, need / chunk);
      if (!err.empty()) return err;
    } else {
      size_t reserve = need;  // retire mode and the debug switch: exactly what is needed
      if (grow && !free_on_growth) {
        reserve = RoundUp(std::max<size_t>({reserve_bytes, need, current_.reserved * 2}), chunk);
      }
      Range next;
      std::string err = NewRange(reserve, need / chunk, &next);
      if (!err.empty()) return err;
      if (current_.va != 0) {
        const size_t old_bytes = current_.handles.size() * chunk;
        if (free_on_growth) {
          ReleaseChunks(current_);  // the seed's bug: graphs may still point here
          stats_.freed_blocks += 1;
        } else {
          stats_.retired_blocks += 1;  // kept mapped for the life of the process
          stats_.retired_bytes += old_bytes;
        }
        dead_.push_back(current_);
      }
      current_ = next;
    }
    stats_.address = current_.va;
    stats_.capacity = current_.handles.size() * chunk;
    stats_.reserved_bytes = current_.reserved;
    stats_.backed_bytes = stats_.capacity + stats_.retired_bytes;
    return "";
  }

  // Retire mode without VMM: plain device allocations.
  std::string GrowPlain(size_t bytes, bool free_on_growth) {
    const size_t need = RoundUp(bytes, platform_.alloc_granularity);
    std::string err;
    void* block = platform_.alloc(stats_.device, need, &err);
    if (block == nullptr) {
      return "jax_vmm scratch: allocating a " + std::to_string(need) + "-byte workspace block on " +
             DeviceName(stats_.device) + " failed: " + err;
    }
    if (stats_.address != 0) {
      if (free_on_growth) {
        platform_.free(stats_.device, ptr());  // the seed's bug
        stats_.freed_blocks += 1;
      } else {
        stats_.retired_blocks += 1;  // kept for the life of the process
        stats_.retired_bytes += stats_.capacity;
      }
    }
    stats_.address = reinterpret_cast<uintptr_t>(block);
    stats_.capacity = need;
    stats_.reserved_bytes = need;
    stats_.backed_bytes = stats_.capacity + stats_.retired_bytes;
    return "";
  }

  const internal::DevicePlatform& platform_;
  WorkspaceStats stats_;
  std::unique_ptr<Driver> driver_;  // null: no VMM on this device (plain retire blocks)
  Range current_;
  std::vector<Range> dead_;  // retired (still mapped) or freed (debug; VA kept) ranges
};

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
  bool free_on_growth = false;
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
                             const internal::DevicePlatform& platform) {
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
                       const internal::DevicePlatform& platform, void** ptr) {
  const uintptr_t key = reinterpret_cast<uintptr_t>(stream);
  Workspace& ws = GetOrCreateLocked(t, device, key, platform);
  std::string err = ws.GrowTo(bytes, t.mode, t.reserve_bytes, t.free_on_growth);
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
  t.reserve_bytes = bytes == 0 ? kDefaultReserveBytes : bytes;
}

size_t GetReserveBytes() {
  Table& t = GetTable();
  std::lock_guard<std::mutex> lock(t.mu);
  return t.reserve_bytes;
}

std::string Reserve(int device, void* stream, size_t bytes) {
  std::string err;
  const internal::DevicePlatform* platform = PlatformFor(device, &err);
  if (platform == nullptr) return err;
  if (stream != nullptr) {
    const bool capturing = platform->is_capturing(stream, &err);
    if (!err.empty()) return err;
    if (capturing) {
      return "jax_vmm scratch: Reserve(" + std::to_string(bytes) + " bytes) on " +
             DeviceName(device) + " was called while stream " +
             Hex(reinterpret_cast<uintptr_t>(stream)) +
             " is capturing a CUDA graph; reserve before capture (kInitialize stage or "
             "jax_vmm.scratch.reserve())";
    }
  }
  Table& t = GetTable();
  std::lock_guard<std::mutex> lock(t.mu);
  return GrowLocked(t, device, stream, bytes, *platform, nullptr);
}

std::string Get(int device, void* stream, size_t bytes, void** ptr) {
  std::string err;
  const internal::DevicePlatform* platform = PlatformFor(device, &err);
  if (platform == nullptr) return err;
  const bool capturing = stream != nullptr && platform->is_capturing(stream, &err);
  if (!err.empty()) return err;
  return GetWithCaptureState(device, stream, bytes, capturing, ptr);
}

std::string GetWithCaptureState(int device, void* stream, size_t bytes, bool capturing,
                                void** ptr) {
  std::string err;
  const internal::DevicePlatform* platform = PlatformFor(device, &err);
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
         "memory that could move). Reserve before capture: jax_vmm.scratch.reserve(" +
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

void SetDebugFreeOnGrowth(bool enabled) {
  Table& t = GetTable();
  std::lock_guard<std::mutex> lock(t.mu);
  t.free_on_growth = enabled;
}

bool DebugFreeOnGrowth() {
  Table& t = GetTable();
  std::lock_guard<std::mutex> lock(t.mu);
  return t.free_on_growth;
}

namespace internal {
void RegisterCudaPlatform(const DevicePlatform& platform) { CudaPlatformSlot() = platform; }
}  // namespace internal

}  // namespace jax_vmm::scratch
