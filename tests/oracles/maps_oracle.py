"""An independent oracle for the host driver: what the Linux kernel says is mapped.

The host driver backs committed chunks with ``MAP_SHARED`` read-write mappings of a
memfd named ``jax_vmm`` and leaves every other byte of the reservation as a private,
anonymous, read-only mapping (which reads the kernel's zero page). This module reads
``/proc/self/maps`` and ``fstat`` of the memfd, never the arena's own bookkeeping, so a
test can compare what the arena *claims* with what the process really has.

Only the standard library is used, on purpose: the oracle must not share code (or bugs)
with the library under test.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Iterable, Sequence

MEMFD_PATH = "/memfd:jax_vmm"

# Kinds of byte ranges inside a reservation.
BACKED = "backed"  # memfd, shared, read-write: a committed chunk
ZERO = "zero"  # anonymous, private, read-only: unbacked, reads zeros
UNMAPPED = "unmapped"  # no mapping at all: a read would fault


@dataclasses.dataclass(frozen=True)
class Mapping:
    """One line of /proc/self/maps."""

    start: int
    end: int
    perms: str  # e.g. "rw-s"
    offset: int
    inode: int
    path: str

    @property
    def is_memfd(self) -> bool:
        return self.path.startswith(MEMFD_PATH)

    def kind(self) -> str:
        if self.is_memfd and self.perms == "rw-s":
            return BACKED
        if self.perms == "r--p" and self.inode == 0 and self.path == "":
            return ZERO
        # Anything else (a memfd mapped but not yet writable, a hole with no access, a
        # foreign mapping) is neither a finished commit nor a clean zero page.
        return f"other({self.perms} {self.path or 'anon'})"


@dataclasses.dataclass(frozen=True)
class Segment:
    """A maximal run of one kind, in bytes relative to the reservation base."""

    start: int
    end: int
    kind: str


def read_maps() -> list[Mapping]:
    out = []
    with open("/proc/self/maps") as f:
        for line in f:
            parts = line.split(maxsplit=5)
            lo, hi = (int(x, 16) for x in parts[0].split("-"))
            path = parts[5].strip() if len(parts) > 5 else ""
            out.append(Mapping(lo, hi, parts[1], int(parts[2], 16), int(parts[4]), path))
    return out


def layout(base: int, size: int, maps: Sequence[Mapping] | None = None) -> tuple[Segment, ...]:
    """Classify every byte of ``[base, base + size)``; adjacent runs of one kind are
    merged (the kernel merges or splits VMAs as it likes, so only kinds matter)."""
    maps = read_maps() if maps is None else maps
    segs: list[Segment] = []

    def add(lo: int, hi: int, kind: str) -> None:
        if lo >= hi:
            return
        if segs and segs[-1].kind == kind and segs[-1].end == lo:
            segs[-1] = Segment(segs[-1].start, hi, kind)
        else:
            segs.append(Segment(lo, hi, kind))

    pos = base
    for m in sorted(maps, key=lambda m: m.start):
        if m.end <= base or m.start >= base + size:
            continue
        lo, hi = max(m.start, base), min(m.end, base + size)
        add(pos - base, lo - base, UNMAPPED)
        add(lo - base, hi - base, m.kind())
        pos = hi
    add(pos - base, size, UNMAPPED)
    return tuple(segs)


def ranges_of(segs: Iterable[Segment], kind: str) -> list[tuple[int, int]]:
    return [(s.start, s.end) for s in segs if s.kind == kind]


def merge(ranges: Iterable[tuple[int, int]]) -> list[tuple[int, int]]:
    """Sort and coalesce [start, end) ranges."""
    out: list[tuple[int, int]] = []
    for lo, hi in sorted(r for r in ranges if r[0] < r[1]):
        if out and lo <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], hi))
        else:
            out.append((lo, hi))
    return out


def expected_layout(size: int, backed: Iterable[tuple[int, int]]) -> tuple[Segment, ...]:
    """The layout a reservation of ``size`` bytes should have when exactly ``backed``
    (relative ranges) is committed and everything else reads zeros."""
    segs: list[Segment] = []
    pos = 0
    for lo, hi in merge(backed):
        if lo > pos:
            segs.append(Segment(pos, lo, ZERO))
        segs.append(Segment(lo, hi, BACKED))
        pos = hi
    if pos < size:
        segs.append(Segment(pos, size, ZERO))
    return tuple(segs)


def jax_vmm_memfds() -> dict[int, int]:
    """{fd: inode} of every open jax_vmm memfd of this process."""
    out = {}
    for name in os.listdir("/proc/self/fd"):
        path = f"/proc/self/fd/{name}"
        try:
            if os.readlink(path).startswith(MEMFD_PATH):
                out[int(name)] = os.stat(path).st_ino
        except OSError:  # closed while we looked
            continue
    return out


def mappings_of_inode(inode: int) -> list[Mapping]:
    """Every mapping of one memfd anywhere in the process (not only in a reservation)."""
    return [m for m in read_maps() if m.is_memfd and m.inode == inode]


class MemfdProbe:
    """Watches one arena's memfd (found by diffing the open memfds around the arena's
    creation): physical bytes it holds, and whether it is still open."""

    def __init__(self, fd: int, inode: int):
        self.fd = fd
        self.inode = inode

    @classmethod
    def between(cls, before: dict[int, int], after: dict[int, int]) -> MemfdProbe:
        new = {fd: ino for fd, ino in after.items() if before.get(fd) != ino}
        if len(new) != 1:
            raise AssertionError(f"expected exactly one new jax_vmm memfd, found {new}")
        ((fd, ino),) = new.items()
        return cls(fd, ino)

    def is_open(self) -> bool:
        try:
            return (
                os.readlink(f"/proc/self/fd/{self.fd}").startswith(MEMFD_PATH)
                and os.stat(f"/proc/self/fd/{self.fd}").st_ino == self.inode
            )
        except OSError:
            return False

    def physical_bytes(self) -> int:
        """Bytes of memory the memfd really holds (allocated blocks, not its size)."""
        if not self.is_open():
            raise AssertionError(f"memfd fd={self.fd} inode={self.inode} is closed")
        return os.fstat(self.fd).st_blocks * 512


class HostOracle:
    """What the kernel says about one host arena's reservation and memory."""

    def __init__(self, base: int, size: int, probe: MemfdProbe):
        self.base = base
        self.size = size
        self.probe = probe

    def layout(self) -> tuple[Segment, ...]:
        return layout(self.base, self.size)

    def backed_ranges(self) -> list[tuple[int, int]]:
        return ranges_of(self.layout(), BACKED)

    def backed_bytes(self) -> int:
        return sum(hi - lo for lo, hi in self.backed_ranges())

    def snapshot(self) -> tuple:
        """Everything a failed call must leave unchanged: the layout of the reservation
        and the physical bytes held by the memfd."""
        return (self.layout(), self.probe.physical_bytes())

    def assert_backed_exactly(self, ranges: Iterable[tuple[int, int]]) -> None:
        """``ranges`` (relative to the base) are committed, read-write memfd mappings,
        every other byte is a zero mapping, and the memfd holds exactly that much."""
        ranges = merge(ranges)
        want = expected_layout(self.size, ranges)
        got = self.layout()
        assert got == want, f"reservation layout differs:\n got  {got}\n want {want}"
        phys = self.probe.physical_bytes()
        total = sum(hi - lo for lo, hi in ranges)
        assert phys == total, f"memfd holds {phys} bytes, committed ranges cover {total}"

    def assert_released(self) -> None:
        """Nothing is memfd-mapped in the reservation and the memfd holds no memory
        (after close(): the reservation itself is still there, reading zeros)."""
        self.assert_backed_exactly([])

    def assert_gone(self) -> None:
        """The arena object was destroyed: its memfd is closed, mapped nowhere, and its
        reservation is no longer one read-only zero mapping."""
        assert not self.probe.is_open(), "the arena's memfd is still open"
        assert not mappings_of_inode(self.probe.inode), "the arena's memfd is still mapped"
        assert layout(self.base, self.size) != (Segment(0, self.size, ZERO),), (
            "the reservation is still mapped"
        )
