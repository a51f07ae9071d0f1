// Host driver: POSIX virtual memory as a real VMM backend for JAX's cpu platform.
//
//   reserve   mmap(PROT_READ, MAP_PRIVATE|MAP_ANONYMOUS|MAP_NORESERVE): reads as zeros
//             (the kernel's shared zero page), costs no memory.
//   physical  one memfd per driver; a chunk is a file range allocated with fallocate()
//             (so a commit really takes the memory, or fails with ENOSPC/ENOMEM now
//             rather than SIGBUS later) and freed with FALLOC_FL_PUNCH_HOLE.
//   map       mmap(MAP_SHARED|MAP_FIXED) of the chunk's file range, read-only until
//   set_access mprotect(PROT_READ|PROT_WRITE) over the whole run.
//   unmap     mmap the zero reservation mapping back over the chunk.
// One memfd (not one per chunk) keeps the file-descriptor count constant.
#include <fcntl.h>
#include <linux/falloc.h>
#include <sys/mman.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <mutex>
#include <string>
#include <vector>

#include "common/math.h"
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

// Thread-safety: Create/Release share the chunk free list under `mu_`; every other
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

  PhysicalHandle Create() override {
    off_t offset;
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (!free_offsets_.empty()) {
        offset = free_offsets_.back();
        free_offsets_.pop_back();
      } else {
        offset = file_end_;
        file_end_ += static_cast<off_t>(chunk_);
        if (ftruncate(fd_, file_end_) != 0) {
          file_end_ -= static_cast<off_t>(chunk_);
          throw DriverError(Errno("ftruncate(memfd)"));
        }
      }
    }
    if (fallocate(fd_, 0, offset, static_cast<off_t>(chunk_)) != 0) {
      const int err = errno;
      ReturnOffset(offset);
      if (err == ENOSPC || err == ENOMEM) {
        const size_t free_bytes = ReadMemInfo().free_bytes;
        throw OutOfMemory("host driver: out of memory committing a chunk of " +
                              std::to_string(chunk_) + " bytes (" + std::to_string(free_bytes) +
                              " bytes available)",
                          chunk_, free_bytes);
      }
      errno = err;
      throw DriverError(Errno("fallocate(memfd)"));
    }
    return static_cast<PhysicalHandle>(offset);
  }

  void Release(PhysicalHandle handle) noexcept override {
    const off_t offset = static_cast<off_t>(handle);
    // Punching the hole frees the pages now; the offset is recycled for a later chunk.
    fallocate(fd_, FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE, offset, static_cast<off_t>(chunk_));
    ReturnOffset(offset);
  }

  void Map(uintptr_t va, PhysicalHandle handle) override {
    void* p = mmap(reinterpret_cast<void*>(va), chunk_, PROT_READ, MAP_SHARED | MAP_FIXED, fd_,
                   static_cast<off_t>(handle));
    if (p == MAP_FAILED) {
      const std::string msg = Errno("mmap(map chunk)");
      RestoreZero(va, chunk_);
      throw DriverError(msg);
    }
  }

  void Unmap(uintptr_t va) noexcept override { RestoreZero(va, chunk_); }

  void SetAccess(uintptr_t va, size_t bytes) override {
    if (mprotect(reinterpret_cast<void*>(va), bytes, PROT_READ | PROT_WRITE) != 0) {
      throw DriverError(Errno("mprotect(set_access)"));
    }
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

 private:
  void ReturnOffset(off_t offset) {
    std::lock_guard<std::mutex> lock(mu_);
    free_offsets_.push_back(offset);
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
  std::vector<off_t> free_offsets_;
};

}  // namespace

std::unique_ptr<Driver> MakeHostDriver(size_t chunk_bytes) {
  return std::make_unique<HostDriver>(chunk_bytes);
}

}  // namespace jax_vmm
