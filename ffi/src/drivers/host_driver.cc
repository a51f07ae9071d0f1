// Host driver: POSIX virtual memory as a real VMM backend for JAX's cpu platform.
//
//   reserve   mmap(PROT_READ, MAP_PRIVATE|MAP_ANONYMOUS|MAP_NORESERVE): reads as zeros
//             (the kernel's shared zero page), costs no memory.
//   physical  one memfd per driver; an allocation is a file range allocated with
//             fallocate() (so a commit really takes the memory, or fails with
//             ENOSPC/ENOMEM now rather than SIGBUS later) and freed with
//             FALLOC_FL_PUNCH_HOLE. Ranges are recycled first-fit from a coalesced free
//             list, so the file does not grow without bound.
//   map       mmap(MAP_SHARED|MAP_FIXED) of a piece's file range, read-only until
//   set_access mprotect(PROT_READ|PROT_WRITE) over the whole run.
//   unmap     mmap the zero reservation mapping back over the run: MAP_FIXED replaces
//             the mapping atomically, so a concurrent reader sees old bytes or zeros and
//             never a hole (it does not fault; it does read the wrong bytes).
//   wait      Synchronize is a no-op: XLA:CPU work has no stream to wait on. The Python
//             layer waits for it (jax_vmm/memory/host_wait.py) before every call that
//             unmaps, copies out or lowers a KV table, and unmapping runs inline here
//             (UnmapNeedsQuiescence false), so nothing is unmapped after that wait.
//   host mem  page-aligned anonymous mappings; copies are memcpy.
// One memfd (not one per allocation) keeps the file-descriptor count constant.
#include <fcntl.h>
#include <linux/falloc.h>
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <map>
#include <mutex>
#include <string>

#include "common/free_ranges.h"
#include "common/math.h"
#include "drivers/host_map_budget.h"
#include "jax_vmm/driver.h"
#include "jax_vmm/errors.h"

namespace jax_vmm {
namespace {

std::string Errno(const char* call) {
  return std::string(call) + " failed: " + std::strerror(errno);
}

MemInfo ReadMemInfo() {
  MemInfo info;
  std::ifstream in("/proc/meminfo");
  std::string line;
  while (std::getline(in, line)) {
    unsigned long long kib = 0;
    if (std::sscanf(line.c_str(), "MemTotal: %llu kB", &kib) == 1) info.total_bytes = kib * 1024;
    if (std::sscanf(line.c_str(), "MemAvailable: %llu kB", &kib) == 1) info.free_bytes = kib * 1024;
  }
  return info;
}

[[noreturn]] void ThrowHostOutOfMemory(const std::string& what, size_t bytes) {
  const size_t free_bytes = ReadMemInfo().free_bytes;
  throw OutOfMemory("host driver: out of memory " + what + " of " + std::to_string(bytes) +
                        " bytes (" + std::to_string(free_bytes) + " bytes available)",
                    bytes, free_bytes);
}

// A memfd commit past the machine's memory is answered by the kernel's OOM killer (the
// process dies), not by fallocate's ENOMEM: so a commit larger than MemAvailable, less a
// reserve of 1/64 of the memory, is refused before anything is created. /proc/meminfo is
// read once per kUncheckedBytes the process commits, so small commits stay cheap.
constexpr size_t kUncheckedBytes = size_t{16} << 20;
std::atomic<size_t> g_unchecked_bytes{0};
std::atomic<size_t> g_available_override{0};  // testing::SetHostAvailableBytes
std::atomic<bool> g_poison_fresh{false};       // testing::SetHostFreshMemoryPoisoned

void CheckHostRoomFor(size_t bytes) {
  const size_t forced = g_available_override.load();
  if (forced == 0 && g_unchecked_bytes.fetch_add(bytes) + bytes < kUncheckedBytes) return;
  g_unchecked_bytes.store(0);
  const MemInfo info = forced ? MemInfo{forced, forced} : ReadMemInfo();
  if (info.free_bytes == 0) return;  // /proc/meminfo unreadable: nothing to go by
  const size_t reserve = forced ? 0 : info.total_bytes / 64;
  if (bytes > info.free_bytes || info.free_bytes - bytes < reserve) {
    throw OutOfMemory("host driver: out of memory committing " + std::to_string(bytes) +
                          " bytes: the machine has " + std::to_string(info.free_bytes) +
                          " bytes available and keeps " + std::to_string(reserve) +
                          " (1/64 of its memory) in reserve, since a memfd commit past it "
                          "is answered by the kernel's OOM killer, not by an error",
                      bytes, info.free_bytes);
  }
}

// Thread-safety: Create/Release share the file's bookkeeping under `mu_`; every other
// method is a stateless system call on a range the caller (the arena) owns.
class HostDriver final : public Driver {
 public:
  explicit HostDriver(size_t chunk_bytes) {
    page_ = static_cast<size_t>(sysconf(_SC_PAGESIZE));
    chunk_ = chunk_bytes == 0 ? std::max<size_t>(64 * 1024, page_) : chunk_bytes;
    if (chunk_ % page_ != 0) {
      throw InvalidArgument("chunk_bytes=" + std::to_string(chunk_bytes) +
                            " must be a multiple of the host page size " + std::to_string(page_));
    }
    fd_ = memfd_create("jax_vmm", MFD_CLOEXEC);
    if (fd_ < 0) throw DriverError(Errno("memfd_create"));
  }
  ~HostDriver() override {
    if (fd_ >= 0) close(fd_);
  }

  const char* kind() const override { return "host"; }
  int device_ordinal() const override { return 0; }
  size_t granularity() const override { return page_; }
  size_t chunk_bytes() const override { return chunk_; }
  MemInfo mem_info() const override { return ReadMemInfo(); }
  // New and punched blocks read 0, unless a test poisons them as a GPU's may hold anything.
  bool FreshMemoryIsZero() const override { return !g_poison_fresh.load(); }
  bool UnmapNeedsQuiescence() const override { return false; }

  uintptr_t Reserve(size_t bytes) override {
    // Over-reserve by one chunk so the range can start chunk-aligned.
    const size_t padded = bytes + chunk_;
    void* p = mmap(nullptr, padded, PROT_READ, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (p == MAP_FAILED) {
      throw DriverError(Errno("mmap(reserve)") + " for " + std::to_string(bytes) + " bytes");
    }
    const uintptr_t raw = reinterpret_cast<uintptr_t>(p);
    const uintptr_t base = RoundUp(raw, chunk_);
    if (base > raw) munmap(p, base - raw);
    const uintptr_t end = base + bytes;
    if (raw + padded > end) munmap(reinterpret_cast<void*>(end), raw + padded - end);
    return base;
  }

  void Unreserve(uintptr_t va, size_t bytes) noexcept override {
    munmap(reinterpret_cast<void*>(va), bytes);
  }

  void CheckRoomFor(size_t bytes) override { CheckHostRoomFor(bytes); }

  PhysicalHandle Create(size_t bytes) override {
    if (bytes == 0 || bytes % chunk_ != 0) {
      throw InvalidArgument("host driver: allocation of " + std::to_string(bytes) +
                            " bytes; expected a positive multiple of " + std::to_string(chunk_));
    }
    const off_t offset = TakeFileRange(bytes);
    if (fallocate(fd_, 0, offset, static_cast<off_t>(bytes)) != 0) {
      const int err = errno;
      // fallocate may have allocated part of the range before failing: give it back.
      fallocate(fd_, FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE, offset, static_cast<off_t>(bytes));
      GiveFileRange(offset, bytes);
      if (err == ENOSPC || err == ENOMEM) ThrowHostOutOfMemory("committing memory", bytes);
      errno = err;
      throw DriverError(Errno("fallocate(memfd)"));
    }
    if (g_poison_fresh.load()) {
      try {
        Poison(offset, bytes);
      } catch (...) {
        fallocate(fd_, FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE, offset,
                  static_cast<off_t>(bytes));
        GiveFileRange(offset, bytes);
        throw;
      }
    }
    std::lock_guard<std::mutex> lock(mu_);
    sizes_[offset] = bytes;
    return static_cast<PhysicalHandle>(offset);
  }

  void Release(PhysicalHandle handle) noexcept override {
    const off_t offset = static_cast<off_t>(handle);
    size_t bytes = 0;
    {
      std::lock_guard<std::mutex> lock(mu_);
      auto it = sizes_.find(offset);
      if (it == sizes_.end()) {
        std::fprintf(stderr, "jax_vmm: host driver asked to release unknown allocation %lld\n",
                     static_cast<long long>(offset));
        return;
      }
      bytes = it->second;
      sizes_.erase(it);
    }
    // Punching the hole frees the pages now; the range is recycled for a later allocation.
    fallocate(fd_, FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE, offset, static_cast<off_t>(bytes));
    GiveFileRange(offset, bytes);
  }

  void MapRun(uintptr_t va, const MapPiece* pieces, size_t count) override {
    size_t bytes = 0;
    for (size_t i = 0; i < count; ++i) bytes += pieces[i].bytes;
    host::ReserveMappings(2 * count, bytes);  // each piece may split the zero mapping in two
    size_t done = 0;
    for (size_t i = 0; i < count; ++i) {
      void* p = mmap(reinterpret_cast<void*>(va + done), pieces[i].bytes, PROT_READ,
                     MAP_SHARED | MAP_FIXED, fd_,
                     static_cast<off_t>(pieces[i].handle + pieces[i].offset));
      if (p == MAP_FAILED) {
        const std::string msg = Errno("mmap(map piece)");
        RestoreZero(va, done + pieces[i].bytes);
        throw DriverError(msg);
      }
      done += pieces[i].bytes;
    }
  }

  void UnmapRun(uintptr_t va, const size_t* piece_bytes, size_t count) noexcept override {
    if (count == 0) return;  // as the CUDA driver: mmap refuses a zero length
    size_t bytes = 0;
    for (size_t i = 0; i < count; ++i) bytes += piece_bytes[i];
    RestoreZero(va, bytes);
  }

  void SetAccess(uintptr_t va, size_t bytes) override {
    host::ReserveMappings(2, bytes);
    if (mprotect(reinterpret_cast<void*>(va), bytes, PROT_READ | PROT_WRITE) != 0) {
      throw DriverError(Errno("mprotect(set_access)"));
    }
  }

  void ZeroFill(uintptr_t va, size_t bytes) override {
    std::memset(reinterpret_cast<void*>(va), 0, bytes);
  }

  void* AllocMetadata(size_t bytes) override {
    void* p = std::aligned_alloc(64, RoundUp(bytes, 64));
    if (p == nullptr) throw OutOfMemory("host driver: metadata allocation failed", bytes, 0);
    std::memset(p, 0, bytes);
    return p;
  }
  void FreeMetadata(void* ptr) noexcept override { std::free(ptr); }
  void CopyToMetadata(void* dst, const void* src, size_t bytes) override {
    std::memcpy(dst, src, bytes);
  }
  void CopyFromMetadata(void* dst, const void* src, size_t bytes) override {
    std::memcpy(dst, src, bytes);
  }
  void Synchronize() override {}

  void* AllocHost(size_t bytes) override {
    void* p = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (p == MAP_FAILED) ThrowHostOutOfMemory("allocating host memory", bytes);
    return p;
  }
  void FreeHost(void* ptr, size_t bytes) noexcept override {
    if (ptr != nullptr) munmap(ptr, bytes);
  }
  void CopyToHost(const CopyRegion* regions, size_t count) override { Copy(regions, count); }
  void CopyToDevice(const CopyRegion* regions, size_t count) override { Copy(regions, count); }

 private:
  static void Copy(const CopyRegion* regions, size_t count) {
    for (size_t i = 0; i < count; ++i)
      std::memcpy(regions[i].dst, regions[i].src, regions[i].bytes);
  }

  off_t TakeFileRange(size_t bytes) {
    std::lock_guard<std::mutex> lock(mu_);
    const uint64_t recycled = TakeFirstFit(ranges_, bytes);
    if (recycled != kNoFreeRange) return static_cast<off_t>(recycled);
    const off_t offset = file_end_;
    if (ftruncate(fd_, file_end_ + static_cast<off_t>(bytes)) != 0) {
      throw DriverError(Errno("ftruncate(memfd)"));
    }
    file_end_ += static_cast<off_t>(bytes);
    return offset;
  }
  void GiveFileRange(off_t offset, size_t bytes) {
    std::lock_guard<std::mutex> lock(mu_);
    GiveRange(ranges_, static_cast<uint64_t>(offset), bytes);
  }
  // 0xFF bytes: NaN in every float type a cache holds (float8_e4m3fn included).
  void Poison(off_t offset, size_t bytes) {
    void* p = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd_, offset);
    if (p == MAP_FAILED) throw DriverError(Errno("mmap(poison)"));
    std::memset(p, 0xFF, bytes);
    munmap(p, bytes);
  }
  static void RestoreZero(uintptr_t va, size_t bytes) noexcept {
    // Cannot fail for a range inside our own reservation short of address-space
    // exhaustion; if it ever did, the range would fault, so report loudly.
    void* p = mmap(reinterpret_cast<void*>(va), bytes, PROT_READ,
                   MAP_PRIVATE | MAP_ANONYMOUS | MAP_FIXED | MAP_NORESERVE, -1, 0);
    if (p == MAP_FAILED) {
      std::fprintf(stderr, "jax_vmm: host driver could not restore the zero mapping at %p: %s\n",
                   reinterpret_cast<void*>(va), std::strerror(errno));
    }
  }

  size_t page_ = 4096;
  size_t chunk_ = 0;
  int fd_ = -1;
  std::mutex mu_;
  off_t file_end_ = 0;
  FreeRangeMap ranges_;            // recycled file ranges
  std::map<off_t, size_t> sizes_;  // live allocations: offset -> bytes
};

}  // namespace

std::unique_ptr<Driver> MakeHostDriver(size_t chunk_bytes) {
  return std::make_unique<HostDriver>(chunk_bytes);
}

namespace testing {
void SetHostAvailableBytes(size_t bytes) { g_available_override.store(bytes); }
void SetHostFreshMemoryPoisoned(bool poisoned) { g_poison_fresh.store(poisoned); }
}  // namespace testing

}  // namespace jax_vmm
