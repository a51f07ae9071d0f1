// See host_map_budget.h.
#include "drivers/host_map_budget.h"

#include <fcntl.h>
#include <unistd.h>

#include <fstream>
#include <mutex>
#include <string>

#include "jax_vmm/errors.h"

namespace jax_vmm::host {
namespace {

// Left for everything else: what one large commit of a JAX process's other libraries
// might map, and the splits of releases in flight.
constexpr size_t kMargin = 4096;

size_t MaxMapCount() {
  std::ifstream f("/proc/sys/vm/max_map_count");
  size_t n = 0;
  return (f >> n) ? n : 65530;  // the kernel's default
}

// Mappings of this process now: the lines of /proc/self/maps.
size_t CountMappings() {
  const int fd = open("/proc/self/maps", O_RDONLY | O_CLOEXEC);
  if (fd < 0) return 0;
  size_t lines = 0;
  char buf[1 << 16];
  for (ssize_t n; (n = read(fd, buf, sizeof(buf))) > 0;) {
    for (ssize_t i = 0; i < n; ++i) lines += buf[i] == '\n';
  }
  close(fd);
  return lines;
}

struct Budget {
  std::mutex mu;
  MapLimitSource source = &MaxMapCount;
  size_t limit = 0;    // 0 until first use
  size_t counted = 0;  // mappings at the last count
  size_t added = 0;    // at most this many made since (each reservation counts in full)
};

Budget& GetBudget() {
  static Budget b;
  return b;
}

}  // namespace

void ReserveMappings(size_t more, size_t bytes) {
  Budget& b = GetBudget();
  std::lock_guard<std::mutex> lock(b.mu);
  const bool first = b.limit == 0;
  if (first) b.limit = b.source();
  if (first || b.counted + b.added + more + kMargin > b.limit) {  // no estimate, or it says maybe
    b.counted = CountMappings();
    b.added = 0;
  }
  if (b.counted + more + kMargin > b.limit) {
    throw OutOfMemory(
        "host driver: committing " + std::to_string(bytes) + " bytes needs up to " +
            std::to_string(more) + " more memory mappings; the process has " +
            std::to_string(b.counted) + " of vm.max_map_count=" + std::to_string(b.limit) +
            " (a host arena can need one per committed chunk, and " + std::to_string(kMargin) +
            " stay for the rest of the process). Use a larger chunk_bytes (e.g. 2 MiB), commit "
            "less, or raise the limit (sysctl vm.max_map_count)",
        bytes, 0);
  }
  b.added += more;
}

void SetMapLimitSource(MapLimitSource source) {
  Budget& b = GetBudget();
  std::lock_guard<std::mutex> lock(b.mu);
  b.source = source != nullptr ? source : &MaxMapCount;
  b.limit = 0;  // re-read (and re-count) on next use
}

}  // namespace jax_vmm::host
