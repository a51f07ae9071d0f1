// Shared memory: Arena::ShareSpans maps the physical memory under one span of chunks at a
// second span (kv.share_prefix: a prompt prefix mapped into another sequence without a
// copy), Arena::CopySpans copies what could not be shared (contract in jax_vmm/arena.h).
//
// Each second address is a Mapping of its own (an alias) holding a reference to the
// allocation (Arena::Physical), so releasing any one address unmaps only that address and
// the memory goes back to the driver with the last one. Both mappings are marked shared:
// a released chunk of either is never taken back by a later commit (PlanChunk), since the
// other address still holds its bytes; a new sequence gets new memory there. Once every
// other mapping of the allocation is reclaimed, the one left is unmarked
// (Arena::UnshareIfLast): a share undone after a failure leaves its source as it was.
//
// Allocations and chunks: a commit makes allocations of up to handle_bytes, so one
// allocation can back several chunks, and cuMemMap maps an allocation only whole. An
// allocation lying wholly inside the span is mapped whole at the second address; the
// chunks of one that also backs chunks outside it are left to the caller, which commits
// and copies them (the KV arena commits a prefix's whole chunks as their own allocation,
// so that they are shared: jax_vmm/kv/sharing.py). The host driver could map a memfd
// range by part, but does as CUDA does: what is shared, and so what sleeps, moves and is
// released by part, is the same on every driver.
#include <algorithm>
#include <map>
#include <memory>
#include <string>
#include <unordered_map>
#include <vector>

#include "common/math.h"
#include "core/arena_internal.h"
#include "jax_vmm/arena.h"
#include "jax_vmm/errors.h"

namespace jax_vmm {

namespace {

std::string SpanText(const std::string& name, size_t start, size_t stop) {
  return "'" + name + "' bytes [" + std::to_string(start) + ", " + std::to_string(stop) + ")";
}

}  // namespace

size_t Arena::ShareSpans(const std::vector<SpanPair>& spans, std::vector<Range>* not_shared) {
  ThrowIfForked("share");
  std::unique_lock<std::mutex> lock(mu_);
  ThrowIfClosed("share");
  ThrowIfAsleep("share");
  // Validate everything before the first driver call.
  struct Planned {
    size_t src_first, dst_first, count;  // arena chunks
    int64_t dst_buffer;
    std::string dst_name;
  };
  std::vector<Planned> planned;
  for (const SpanPair& sp : spans) {
    const Placement& src = PlacementOrThrow(sp.src_buffer, "Arena.share");
    const Placement& dst = PlacementOrThrow(sp.dst_buffer, "Arena.share");
    CheckRange(src.info, sp.src_start, sp.src_start + sp.bytes, "Arena.share");
    CheckRange(dst.info, sp.dst_start, sp.dst_start + sp.bytes, "Arena.share");
    if (sp.src_start % chunk_bytes_ || sp.dst_start % chunk_bytes_ || sp.bytes % chunk_bytes_) {
      throw InvalidArgument(
          "Arena.share: " + SpanText(src.info.name, sp.src_start, sp.src_start + sp.bytes) +
          " -> " + SpanText(dst.info.name, sp.dst_start, sp.dst_start + sp.bytes) +
          " is not whole chunks of " + std::to_string(chunk_bytes_) + " bytes");
    }
    if (sp.bytes == 0) continue;
    const size_t n = sp.bytes / chunk_bytes_;
    const size_t s0 = ArenaChunk(src, sp.src_start / chunk_bytes_);
    const size_t d0 = ArenaChunk(dst, sp.dst_start / chunk_bytes_);
    if (s0 < d0 + n && d0 < s0 + n) {
      throw InvalidArgument("Arena.share: the source and destination spans overlap");
    }
    for (size_t i = 0; i < n; ++i) {
      if (!host_page_table_[s0 + i]) {
        throw InvalidArgument(
            "Arena.share: " + SpanText(src.info.name, sp.src_start, sp.src_start + sp.bytes) +
            " is not all backed (chunk " + std::to_string(i) + "); commit it first");
      }
    }
    planned.push_back({s0, d0, n, sp.dst_buffer, dst.info.name});
  }
  // Each destination chunk gets one mapping (a source chunk is backed and a destination
  // one must hold nothing, so a span's destination cannot be another's source either).
  std::vector<const Planned*> by_dst;
  for (const Planned& p : planned) by_dst.push_back(&p);
  std::sort(by_dst.begin(), by_dst.end(),
            [](const Planned* a, const Planned* b) { return a->dst_first < b->dst_first; });
  for (size_t i = 1; i < by_dst.size(); ++i) {
    const Planned& p = *by_dst[i];
    if (p.dst_first < by_dst[i - 1]->dst_first + by_dst[i - 1]->count) {
      const size_t chunk = p.dst_first - ArenaChunk(buffers_.at(p.dst_buffer), 0);
      throw InvalidArgument("Arena.share: two spans map chunk " + std::to_string(chunk) +
                            " of '" + p.dst_name + "'; give each destination chunk one span");
    }
  }
  // The destination must hold nothing; memory released there and waiting for the device
  // is given back first (a mapping is about to replace it).
  for (int pass = 0; pass < 2; ++pass) {
    bool retired_there = false;
    for (const Planned& p : planned) {
      for (size_t a = p.dst_first; a < p.dst_first + p.count; ++a) {
        const Mapping* m = chunk_mapping_[a];
        if (m == nullptr) continue;
        if (host_page_table_[a] || m->live > 0 || m->pins > 0 || pass == 1) {
          throw InvalidArgument("Arena.share: destination '" + p.dst_name + "' chunk " +
                                std::to_string(a - p.dst_first) +
                                " of the span holds memory (backed, parked or in transfer); "
                                "release it first");
        }
        retired_there = true;
      }
    }
    if (!retired_there) break;
    ReclaimAllLocked(lock);
  }
  // Pieces: per source mapping met along each span, mapped whole or by part.
  Pending pending;
  struct Run {
    size_t dst_first, count;
    size_t begin, end;  // pending.mappings[begin, end)
  };
  std::vector<Run> runs;
  std::vector<Mapping*> sources;
  for (const Planned& p : planned) {
    size_t i = 0;
    bool extends = false;
    while (i < p.count) {
      Mapping* m = chunk_mapping_[p.src_first + i];
      size_t j = i + 1;
      while (j < p.count && chunk_mapping_[p.src_first + j] == m) ++j;
      const size_t first = p.src_first + i, count = j - i;
      const bool whole = first == m->first_chunk && count == m->num_chunks;
      if (!whole) {
        // The allocation also backs chunks outside the span: the caller copies.
        const Placement& dst = buffers_.at(p.dst_buffer);
        const size_t off = (p.dst_first + i - ArenaChunk(dst, 0)) * chunk_bytes_;
        not_shared->push_back({dst.info.id, off, off + count * chunk_bytes_});
        extends = false;
        i = j;
        continue;
      }
      const size_t d = p.dst_first + i;
      pending.mappings.push_back(std::make_unique<Mapping>(
          driver_.get(), d, count, chunk_bytes_, ChunkAddress(d), m->physical,
          m->offset + (first - m->first_chunk) * chunk_bytes_));
      sources.push_back(m);
      if (extends) {
        runs.back().count += count;
        runs.back().end = pending.mappings.size();
      } else {
        runs.push_back({d, count, pending.mappings.size() - 1, pending.mappings.size()});
      }
      extends = true;
      i = j;
    }
  }
  if (pending.mappings.empty()) return 0;
  // The work dispatched before may still write the source (a prefill of the prefix):
  // it lands before a second address can see the memory, and before the caller makes the
  // source read-only. It also drains raw readers of the zeros about to be swapped.
  driver_->Synchronize();
  std::vector<ChunkRun> published;
  for (const Run& r : runs) published.push_back({r.dst_first, r.count});
  try {
    for (const Run& r : runs) {
      std::vector<MapPiece> pieces;
      for (size_t k = r.begin; k < r.end; ++k) {
        const Mapping& m = *pending.mappings[k];
        pieces.push_back({m.handle, m.offset, m.bytes});
      }
      const uintptr_t va = ChunkAddress(r.dst_first);
      driver_->MapRun(va, pieces.data(), pieces.size());  // all-or-nothing
      for (size_t k = r.begin; k < r.end; ++k) pending.mappings[k]->mapped = true;
      driver_->SetAccess(va, r.count * chunk_bytes_);
    }
    for (const Run& r : runs) std::fill_n(host_page_table_.begin() + r.dst_first, r.count, 1);
    PublishPageTable(published);
  } catch (...) {
    for (const Run& r : runs) std::fill_n(host_page_table_.begin() + r.dst_first, r.count, 0);
    try {
      PublishPageTable(published);
    } catch (...) {
      // The table copy only fails when the device is already broken.
    }
    pending.mappings.clear();  // the aliases unmap; the allocations stay with their sources
    ++stats_.failed_commits;
    throw;
  }
  size_t shared = 0;
  for (Mapping* m : sources) m->shared = true;
  for (auto& m : pending.mappings) {
    std::fill_n(chunk_mapping_.begin() + m->first_chunk, m->num_chunks, m.get());
    m->live = m->num_chunks;
    AccountBacked(m->first_chunk, m->num_chunks, +1);
    shared += m->bytes;
    stats_.chunks_shared += static_cast<int64_t>(m->num_chunks);
    const size_t key = m->first_chunk;
    mappings_.emplace(key, std::move(m));
  }
  pending.mappings.clear();
  stats_.set_access_calls += static_cast<int64_t>(runs.size());
  return shared;
}

size_t Arena::SharedBytes(const std::vector<Range>& ranges) const {
  std::lock_guard<std::mutex> lock(mu_);
  ThrowIfClosed("shared_bytes");
  size_t chunks = 0;
  for (const Range& r : ranges) {
    const Placement& p = PlacementOrThrow(r.buffer_id, "Arena.shared_bytes");
    CheckRange(p.info, r.start, r.stop, "Arena.shared_bytes");
    for (size_t c = r.start / chunk_bytes_; c < CeilDiv(r.stop, chunk_bytes_); ++c) {
      const Mapping* m = chunk_mapping_[ArenaChunk(p, c)];
      if (m != nullptr && m->shared) ++chunks;
    }
  }
  return chunks * chunk_bytes_;
}

void Arena::CopySpans(const std::vector<SpanPair>& spans) {
  ThrowIfForked("copy");
  std::lock_guard<std::mutex> lock(mu_);
  ThrowIfClosed("copy");
  ThrowIfAsleep("copy");
  std::vector<CopyRegion> regions;
  for (const SpanPair& sp : spans) {
    const Placement& src = PlacementOrThrow(sp.src_buffer, "Arena.copy");
    const Placement& dst = PlacementOrThrow(sp.dst_buffer, "Arena.copy");
    CheckRange(src.info, sp.src_start, sp.src_start + sp.bytes, "Arena.copy");
    CheckRange(dst.info, sp.dst_start, sp.dst_start + sp.bytes, "Arena.copy");
    if (sp.bytes == 0) continue;
    for (const bool to : {false, true}) {
      const Placement* p = to ? &dst : &src;
      const size_t start = to ? sp.dst_start : sp.src_start;
      for (size_t c = start / chunk_bytes_; c < CeilDiv(start + sp.bytes, chunk_bytes_); ++c) {
        const size_t a = ArenaChunk(*p, c);
        if (!host_page_table_[a]) {
          throw InvalidArgument("Arena.copy: " + SpanText(p->info.name, start, start + sp.bytes) +
                                " is not all backed; commit it first");
        }
        if (to && chunk_mapping_[a]->shared) {
          throw InvalidArgument("Arena.copy: " + SpanText(p->info.name, start, start + sp.bytes) +
                                " lies in shared memory (read-only for every sharer)");
        }
      }
    }
    regions.push_back({reinterpret_cast<void*>(dst.info.address + sp.dst_start),
                       reinterpret_cast<const void*>(src.info.address + sp.src_start), sp.bytes});
  }
  if (regions.empty()) return;
  driver_->Synchronize();  // the work that wrote the source is done
  driver_->CopyToDevice(regions.data(), regions.size());
}

size_t Arena::ZeroRanges(const std::vector<Range>& ranges) {
  ThrowIfForked("zero");
  std::lock_guard<std::mutex> lock(mu_);
  ThrowIfClosed("zero");
  ThrowIfAsleep("zero");
  std::vector<std::pair<uintptr_t, size_t>> pieces;  // (address, bytes), in order
  for (const Range& r : ranges) {
    const Placement& p = PlacementOrThrow(r.buffer_id, "Arena.zero");
    CheckRange(p.info, r.start, r.stop, "Arena.zero");
    for (size_t c = r.start / chunk_bytes_; c < CeilDiv(r.stop, chunk_bytes_); ++c) {
      const size_t a = ArenaChunk(p, c);
      if (!host_page_table_[a] || chunk_mapping_[a]->shared) continue;
      const size_t lo = std::max(r.start, c * chunk_bytes_);
      const size_t hi = std::min(r.stop, (c + 1) * chunk_bytes_);
      const uintptr_t va = p.info.address + lo;
      if (!pieces.empty() && pieces.back().first + pieces.back().second == va) {
        pieces.back().second += hi - lo;
      } else {
        pieces.emplace_back(va, hi - lo);
      }
    }
  }
  if (pieces.empty()) return 0;
  driver_->Synchronize();  // work dispatched before may still write these bytes
  size_t zeroed = 0;
  for (const auto& [va, bytes] : pieces) {
    driver_->ZeroFill(va, bytes);
    zeroed += bytes;
  }
  return zeroed;
}

void Arena::ThrowIfShared(const std::vector<ChunkRun>& runs, const char* op) const {
  for (const ChunkRun& run : runs) {
    for (size_t a = run.first; a < run.first + run.count; ++a) {
      const Mapping* m = chunk_mapping_[a];
      if (m != nullptr && m->shared && host_page_table_[a]) {
        throw InvalidArgument(std::string(op) +
                              ": the arena holds memory mapped at several addresses "
                              "(kv.share_prefix); release the sequences that share it first");
      }
    }
  }
}

}  // namespace jax_vmm
