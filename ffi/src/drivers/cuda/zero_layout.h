// Which read-only zero mappings cover the unbacked parts of one CUDA reservation, and how
// they change when real memory is mapped or unmapped.
//
// Every unbacked byte of a reservation maps a shared zero allocation read-only. cuMemMap
// maps an allocation only whole (a partial size or an offset is CUDA_ERROR_NOT_SUPPORTED),
// so every piece is `unit` x 2^k bytes, at most `max_piece`, aligned to its own size from
// the reservation base, and maps the zero allocation of exactly its size
// (zero_allocation.h). Mapping one piece per chunk would cost one cuMemMap per chunk at
// reserve time and one cuMemUnmap per chunk at every commit (both ~20 us); aligned pieces
// of up to `max_piece` bytes need one call per piece instead. A commit clears the zero
// pieces that overlap its range and maps the parts of them outside the range back (the
// "remainders", as aligned pieces: at most log2(max_piece / unit) on each side); an unmap
// restores zero over its range as aligned pieces (Tile).
//
// Pure bookkeeping (no driver calls), so that the CUDA driver's zero-mapping logic can be
// tested without a GPU (jax_vmm._core.testing.ZeroLayout). Thread-safety: none; the
// driver holds a mutex around every call.
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <vector>

namespace jax_vmm::cuda {

struct ZeroPiece {
  uintptr_t va = 0;
  size_t bytes = 0;
};

class ZeroLayout {
 public:
  // A layout of [base, base + bytes) with no piece yet (Tile gives the initial pieces).
  // `unit` and `max_piece` are powers of two, unit <= max_piece; addresses and sizes
  // handed in later are multiples of `unit`.
  ZeroLayout(uintptr_t base, size_t bytes, size_t max_piece, size_t unit);

  uintptr_t base() const { return base_; }
  size_t bytes() const { return bytes_; }
  size_t max_piece() const { return max_piece_; }
  size_t unit() const { return unit_; }
  bool contains(uintptr_t va) const { return va >= base_ && va < base_ + bytes_; }

  // The aligned pieces that cover [va, va + bytes), largest first where alignment allows,
  // so that a later large, aligned commit finds whole pieces.
  std::vector<ZeroPiece> Tile(uintptr_t va, size_t bytes) const;

  // What clearing [va, va + bytes) of zero mappings takes: every piece overlapping the
  // range is unmapped (in address order), and the parts of those pieces outside the
  // range are mapped back. Throws InvalidArgument when some byte of the range is not
  // zero-mapped (the caller's bookkeeping is wrong; nothing changed).
  struct Clear {
    std::vector<ZeroPiece> unmap;
    std::vector<ZeroPiece> remap;
    uintptr_t hull_va = 0;  // the union of `unmap`: contiguous, contains the range
    size_t hull_bytes = 0;
  };
  Clear PlanClear(uintptr_t va, size_t bytes) const;

  // Record pieces as mapped / unmapped. Add throws InvalidArgument on an overlap or a
  // piece that is not an aligned power-of-two piece.
  void Add(const std::vector<ZeroPiece>& pieces);
  void Remove(const std::vector<ZeroPiece>& pieces);

  std::vector<ZeroPiece> pieces() const;
  // Bytes of [va, va + bytes) covered by pieces.
  size_t Covered(uintptr_t va, size_t bytes) const;

 private:
  uintptr_t base_;
  size_t bytes_;
  size_t max_piece_;
  size_t unit_;
  // Appends the aligned pieces covering [va, va + bytes) to `out`.
  void AppendAligned(uintptr_t va, size_t bytes, std::vector<ZeroPiece>* out) const;
  bool IsAligned(const ZeroPiece& p) const;
  std::map<uintptr_t, size_t> pieces_;  // va -> bytes, disjoint
};

}  // namespace jax_vmm::cuda
