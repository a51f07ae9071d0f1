"""The seed-style baseline: the simplest VMM KV cache (sglang's KvVmmArena, the code
jax_vmm grew from), rebuilt here over cuda-python so it runs in the same process as the
arena it is compared with. Imported as ``_seed`` by bench/commit.py and bench/growth.py.

Per buffer: one reserved virtual range; creation backs its first granule (the seed's
"page 0"); every extension of a buffer is one ``cuMemCreate`` of the extension's size +
one ``cuMemMap`` + one ``cuMemSetAccess``. No zero mapping (an unbacked read faults), no
page table, no release of anything but whole extensions from the end. That is the least
any VMM cache can do per extension, so it is the time to beat.
"""

from __future__ import annotations

from _raw import RawCuda


def round_up(n: int, unit: int) -> int:
    return -(-n // unit) * unit


class SeedKV:
    """`buffers` VMM buffers of `reserve_bytes` each, grown by one handle per extension.
    one_reservation: the buffers lie back to back in one reserved range, as an arena's
    do (the seed reserves one range per buffer), so that a difference between the two
    layouts is the driver's, not the library's."""

    def __init__(
        self,
        raw: RawCuda,
        buffers: int,
        reserve_bytes: int,
        granule: int = 2 << 20,
        one_reservation: bool = False,
    ):
        self.raw, self.cu, self.granule = raw, raw.cu, granule
        self.reserve_bytes = round_up(reserve_bytes, granule)
        self.vas: list[int] = []
        self.reservations: list[tuple[int, int]] = []  # (va, bytes) to free
        self.exts: list[list[tuple[int, int, object]]] = []  # per buffer: (offset, bytes, handle)
        try:
            if one_reservation:
                total = buffers * self.reserve_bytes
                base = raw.reserve(total, max(granule, 256 << 20))  # the arena's alignment
                self.reservations.append((base, total))
                self.vas = [base + b * self.reserve_bytes for b in range(buffers)]
            else:
                for _ in range(buffers):
                    self.vas.append(raw.reserve(self.reserve_bytes, granule))
                    self.reservations.append((self.vas[-1], self.reserve_bytes))
            self.exts = [[] for _ in range(buffers)]
            self.grow_to(granule)  # page 0 of every buffer
        except BaseException:
            self.close()
            raise

    def backed(self, b: int) -> int:
        ext = self.exts[b]
        return ext[-1][0] + ext[-1][1] if ext else 0

    def grow_to(self, nbytes: int) -> None:
        """Every buffer backed to at least nbytes (rounded up to the granule)."""
        cu, ok, raw = self.cu, self.raw._ok, self.raw
        want = min(round_up(nbytes, self.granule), self.reserve_bytes)
        for b, va in enumerate(self.vas):
            have = self.backed(b)
            if want <= have:
                continue
            n = want - have
            h = ok(cu.cuMemCreate(n, raw.prop, 0))
            ok(cu.cuMemMap(va + have, n, 0, h, 0))
            self.exts[b].append((have, n, h))
            ok(cu.cuMemSetAccess(va + have, n, raw.rw, 1))

    def shrink_to(self, nbytes: int) -> None:
        """Gives back whole extensions from the end until no more than nbytes stay (never
        page 0)."""
        cu, ok = self.cu, self.raw._ok
        keep = max(nbytes, self.granule)
        for b, va in enumerate(self.vas):
            ext = self.exts[b]
            while ext and ext[-1][0] >= keep:
                off, n, h = ext.pop()
                ok(cu.cuMemUnmap(va + off, n))
                ok(cu.cuMemRelease(h))

    def close(self) -> None:
        cu = self.cu
        for va, ext in zip(self.vas, self.exts):
            for off, n, h in reversed(ext):
                cu.cuMemUnmap(va + off, n)
                cu.cuMemRelease(h)
        for va, n in self.reservations:
            cu.cuMemAddressFree(va, n)
        self.vas, self.exts, self.reservations = [], [], []


class OneAllocation:
    """One reserved range backed by one handle at once: what torch_memory_saver does for a
    tensor (cuMemCreate + cuMemMap + cuMemSetAccess of the whole size)."""

    def __init__(self, raw: RawCuda, nbytes: int, granule: int = 2 << 20):
        cu, ok = raw.cu, raw._ok
        self.raw, self.n = raw, round_up(nbytes, granule)
        self.va = raw.reserve(self.n, granule)
        self.h = ok(cu.cuMemCreate(self.n, raw.prop, 0))
        ok(cu.cuMemMap(self.va, self.n, 0, self.h, 0))
        ok(cu.cuMemSetAccess(self.va, self.n, raw.rw, 1))

    def close(self) -> None:
        cu = self.raw.cu
        cu.cuMemUnmap(self.va, self.n)
        cu.cuMemRelease(self.h)
        cu.cuMemAddressFree(self.va, self.n)
