"""The host driver keeps the CUDA driver's contract: the same random core calls on a host
arena and on the real CUDA driver code over the fake driver (test_fake_cuda.py) give the
same outcome (return value or exception class), the same backed chunks and the same
bytes; and on each side the count of backed bytes equals the chunks it backs.

The calls are the core's own (commit, decommit, several ranges at once, unsorted and
overlapping, share_spans + copy_spans as share_prefix makes them, offload/restore,
sleep/wake, reclaim, writes), in any state, refused ones included, half the runs under a
memory budget smaller than the buffers (each side its own), within the KV layer's
rules for shares: shared chunks are not written nor released by part, and nothing sleeps
or moves while a share is in place. Where the contract leaves bytes open they are not
compared: a released chunk before the next reclaim, and with zero_fill=False a chunk not
written since it was backed.

Each random sequence runs in a child process: a memory error in the core aborts the
child, and the test reports it with the sequence's seed.
"""

from __future__ import annotations

import ctypes
import random
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pytest

import jax_vmm.testing
from jax_vmm.base.loader import core as _core

t = jax_vmm.testing.extension()
OK = t.fake_cuda_results()["CUDA_SUCCESS"]
C = t.fake_cuda_granularity()  # the chunk on both sides
SEQS, CHUNKS_PER_SEQ, BUFFERS = 4, 6, 2
SEQ = CHUNKS_PER_SEQ * C
BUF = SEQS * SEQ
CHUNKS = BUF // C
COPY_IN, AHEAD, KEEP = 0.5, 0.3, 0.7
VERBOSE = False  # outcomes with the exception message, and the whole log


class Side:
    """One arena of two buffers, on the host driver or on the fake CUDA driver."""

    def __init__(
        self, driver: str, handle_chunks: int, zero_fill: bool, budget_chunks: int | None = None
    ) -> None:
        reserve, handle = BUFFERS * BUF + 4 * C, handle_chunks * C
        if driver == "host":
            self.a = t.create_fault_injecting_arena("host", 0, reserve, C, handle, zero_fill)
        else:
            self.a = t.create_fake_cuda_arena(reserve, C, handle, zero_fill, False)
        self.budget = None  # the core's MemoryBudget, of its own on each side
        if budget_chunks is not None:
            kind = "host" if driver == "host" else "cuda"
            self.budget = _core.create_memory_budget(budget_chunks * C, kind, 0)
            _core.arena_join_budget(self.a, self.budget, driver)
        self.driver = driver
        self.ids = [self.a.allocate(BUF, f"b{i}")["id"] for i in range(BUFFERS)]
        self.tickets: dict = {}

    def address(self, b: int, offset: int) -> int:
        return self.a.base + self.a.buffer(self.ids[b])["offset"] + offset

    def read(self, b: int, chunks: list[int]) -> np.ndarray:
        """Buffer b's bytes, zeros but in `chunks`. Without a raw view out, the fake's
        reclaimer may be between an unmap and the zero mapping of a released chunk, so
        those are read only where the arena is settled (after reclaim())."""
        out = np.zeros(BUF, np.uint8)
        for c in chunks:
            lo = c * C
            if self.driver == "host":
                data = ctypes.string_at(self.address(b, lo), C)
            else:
                r, data = t.fake_cuda_read(self.address(b, lo), C)
                assert r == OK, f"buffer {b} chunk {c} is unreadable (CUresult {r})"
            out[lo : lo + C] = np.frombuffer(data, np.uint8)
        return out

    def write(self, b: int, offset: int, data: bytes) -> None:
        if self.driver == "host":
            ctypes.memmove(self.address(b, offset), data, len(data))
        else:
            assert t.fake_cuda_write(self.address(b, offset), data) == OK

    def backed(self, b: int) -> list[bool]:
        bid = self.ids[b]
        return [self.a.backed_prefix(bid, c * C, (c + 1) * C) == C for c in range(CHUNKS)]

    def backed_chunks(self) -> int:
        return sum(sum(self.backed(b)) for b in range(BUFFERS))


def outcome(call) -> tuple:
    try:
        return ("ok", call())
    except Exception as e:  # noqa: BLE001 - the class is the outcome compared
        return ("raised", type(e).__name__) + ((str(e)[:300],) if VERBOSE else ())


def share(x: Side, src: int, dst: int, chunks: int, part: int) -> int:
    """share_prefix's core calls: src's whole chunks mapped at dst, what the driver leaves
    out and the partial chunk copied. Returns the bytes mapped + copied (equal on both
    sides; how they split is the driver's choice)."""
    lo, shift = src * SEQ, (dst - src) * SEQ
    mapped, left_out = x.a.share_spans([(i, lo, i, lo + shift, chunks * C) for i in x.ids])
    end = lo + shift + chunks * C
    # dst's own memory for the rest of the prefix: what the driver left out and the part.
    x.a.commit_ranges([(i, lo + shift, end + part) for i in x.ids])
    copies = [(i, s - shift, i, s, e - s) for i, s, e in left_out]
    copies += [(i, lo + chunks * C, i, end, part) for i in x.ids] if part else []
    x.a.copy_spans(copies)
    return mapped + sum(c[-1] for c in copies)


def drawn_budget(seed: int) -> int | None:
    """The budget (in chunks) of run `seed`: half the runs draw from one smaller than the
    buffers. Drawn apart from the calls, so that a seed's calls stay the same."""
    r = random.Random(seed + 1)
    return r.randrange(12, 40) if r.random() < 0.5 else None


@dataclass
class Run:
    seed: int
    host_zero_fill: bool | None = None  # the control: a host that differs from the fake
    handle_chunks: int | None = None  # None: drawn
    rng: random.Random = field(init=False)
    sides: list[Side] = field(init=False)
    zero_fill: bool = field(init=False)

    def __post_init__(self) -> None:
        self.rng = random.Random(self.seed)
        handle_chunks = self.rng.choice([1, 1, 2, 3, 6])
        self.zero_fill = self.rng.random() < 0.7
        if self.host_zero_fill is not None:  # the control: chunks kept in allocations
            handle_chunks, self.zero_fill = self.handle_chunks or handle_chunks, True
        host_zf = self.zero_fill if self.host_zero_fill is None else self.host_zero_fill
        self.budget_chunks = drawn_budget(self.seed)
        self.sides = [
            Side("host", handle_chunks, host_zf, self.budget_chunks),
            Side("fake", handle_chunks, self.zero_fill, self.budget_chunks),
        ]
        self.asleep = False
        # Per sequence in a share: its first chunks that are shared. As in the KV layer,
        # they are read-only and released only with the whole sequence, and nothing
        # sleeps or is offloaded while a share is in place.
        self.shared: dict[int, int] = {}
        self.defined = [set() for _ in range(BUFFERS)]  # zero_fill=False: written since backed

    def on_both(self, call) -> list[tuple]:
        return [outcome(lambda x=x: call(x)) for x in self.sides]

    def undefine(self, b: int, start: int, stop: int) -> None:
        self.defined[b] -= set(range(start // C, -(-stop // C)))

    def in_a_share(self, start: int, stop: int) -> bool:
        """Whether byte range [start, stop) of a buffer reaches into shared chunks."""
        return any(start < q * SEQ + n * C and q * SEQ < stop for q, n in self.shared.items())

    def step(self) -> tuple[str, list[tuple]] | None:
        rng, host = self.rng, self.sides[0]
        op = rng.choice(
            ["commit", "commit", "decommit", "decommit", "write", "write", "share", "release",
             "reclaim", "sleep", "offload", "ranges"]
        )  # fmt: skip
        b, q = rng.randrange(BUFFERS), rng.randrange(SEQS)
        if op == "commit":
            s = q * SEQ + rng.randrange(CHUNKS_PER_SEQ) * C
            e = min((q + 1) * SEQ, s + rng.randrange(1, 4) * C - rng.choice([0, 0, 100]))
            if rng.random() < AHEAD:  # the background commit's call (a commit ahead)
                call = lambda x: x.a.commit_ahead([(x.ids[b], s, e)])  # noqa: E731
                return f"commit_ahead(b{b}, {s}, {e})", self.on_both(call)
            return f"commit(b{b}, {s}, {e})", self.on_both(lambda x: x.a.commit(x.ids[b], s, e))
        if op in ("decommit", "release"):
            if op == "release":
                s, e, bufs = q * SEQ, (q + 1) * SEQ, range(BUFFERS)
            else:
                s = q * SEQ + rng.randrange(CHUNKS_PER_SEQ) * C
                e, bufs = min((q + 1) * SEQ, s + rng.randrange(1, 3) * C), [b]
                if self.in_a_share(s, e):
                    return None
            wait = rng.random() < 0.5
            res = self.on_both(
                lambda x: x.a.decommit_ranges([(x.ids[i], s, e) for i in bufs], wait)
            )
            for i in bufs:
                self.undefine(i, s, e)
            if op == "release":
                self.shared.pop(q, None)
            return f"{op}(buffers {list(bufs)}, {s}, {e}, wait={wait})", res
        if op == "ranges":
            return self.several_ranges()
        if op == "reclaim":
            # Its bytes are what the fake's reclaimer had not given back yet: not compared.
            return "reclaim()", self.on_both(lambda x: [x.a.reclaim()] and None)
        if op == "write":
            free = [
                c
                for c, on in enumerate(host.backed(b))
                if on and not self.in_a_share(c * C, c * C + C)
            ]
            if self.asleep or not free:
                return None
            c = rng.choice(free)
            if rng.random() < COPY_IN:  # the core's copy: refused past the backed chunks
                n = rng.choice([C, 2 * C, C // 2])
                if c * C + n > BUF or self.in_a_share(c * C, c * C + n):
                    return None
                data = rng.randbytes(n)
                src = np.frombuffer(data, np.uint8)
                self.undefine(b, c * C, c * C + n)  # a refused copy may have written part
                call = lambda x: x.a.copy_in(x.ids[b], c * C, src.ctypes.data, n)  # noqa: E731
                return f"copy_in(b{b}, chunk {c}, {n} B)", self.on_both(call)
            data = rng.randbytes(C)
            self.defined[b].add(c)
            return f"write(b{b}, chunk {c})", self.on_both(lambda x: x.write(b, c * C, data))
        if op == "share":
            return self.share(q)
        if (op == "sleep" and not self.shared) or (self.asleep and rng.random() < 0.3):
            keep = rng.random() < KEEP
            res = self.on_both(lambda x: x.a.wake() if self.asleep else x.a.sleep(keep))
            call = "wake()" if self.asleep else f"sleep({keep})"
            if all(r[0] == "ok" for r in res):
                if not self.asleep and not keep:
                    self.defined = [set() for _ in range(BUFFERS)]  # zeros with zero_fill
                self.asleep = not self.asleep
            return call, res
        if op == "offload" and not self.asleep and not self.shared:
            key = (b, q)
            if key in host.tickets:
                return f"restore{key}", self.on_both(
                    lambda x: x.a.restore(x.tickets.pop(key), True)
                )
            s, e = q * SEQ, (q + 1) * SEQ

            def offload(x: Side):
                x.tickets[key] = x.a.offload([(x.ids[b], s, e)])
                return x.a.wait_transfer(x.tickets[key])[0]

            self.undefine(b, s, e)
            return f"offload{key}", self.on_both(offload)
        return None

    def several_ranges(self) -> tuple[str, list[tuple]] | None:
        rng = self.rng
        ranges = []
        for _ in range(rng.randrange(2, 4)):
            s = rng.randrange(CHUNKS) * C
            ranges.append((rng.randrange(BUFFERS), s, min(BUF, s + rng.randrange(1, 4) * C)))
        kind = rng.choice(["commit", "decommit", "offload"])
        if kind == "offload" and (self.asleep or self.sides[0].tickets or self.shared):
            return None
        if kind == "decommit" and any(self.in_a_share(s, e) for _, s, e in ranges):
            return None
        wait = rng.random() < 0.5

        def call(x: Side):
            rs = [(x.ids[b], s, e) for b, s, e in ranges]
            if kind == "commit":
                return x.a.commit_ranges(rs)
            if kind == "decommit":
                return x.a.decommit_ranges(rs, wait)
            ticket = x.a.offload(rs)
            state = x.a.wait_transfer(ticket)[0]
            x.a.restore(ticket, True)
            return state

        if kind != "commit":
            for b, s, e in ranges:
                self.undefine(b, s, e)
        return f"{kind}_ranges({ranges})", self.on_both(call)

    def share(self, src: int) -> tuple[str, list[tuple]] | None:
        rng = self.rng
        dst = (src + 1 + rng.randrange(SEQS - 1)) % SEQS
        chunks, part = rng.randrange(1, CHUNKS_PER_SEQ), rng.choice([0, C // 3])
        if self.asleep:
            return None
        need = (chunks + (1 if part else 0)) * C

        def prepare_and_share(x: Side):
            # As share_prefix finds them: src's prefix backed, dst holding nothing.
            x.a.decommit_ranges([(i, dst * SEQ, (dst + 1) * SEQ) for i in x.ids], True)
            x.a.commit_ranges([(i, src * SEQ, src * SEQ + need) for i in x.ids])
            return share(x, src, dst, chunks, part)

        for b in range(BUFFERS):
            self.undefine(b, dst * SEQ, (dst + 1) * SEQ)
        self.shared.pop(dst, None)
        self.shared[src] = max(self.shared.get(src, 0), chunks)
        self.shared[dst] = chunks
        call = f"share(seq {src} -> {dst}, {chunks} chunks + {part} B)"
        return call, self.on_both(prepare_and_share)

    def difference(self, op: str, results: list[tuple]) -> str | None:
        if results[0] != results[1]:
            return f"{op}: host {results[0]}, fake {results[1]}"
        if self.asleep:
            return None
        for x in self.sides:
            counted, backed = x.a.stats()["backed_bytes"] // C, x.backed_chunks()
            if counted != backed:
                return f"{op}: {x.driver} counts {counted} chunks backed, backs {backed}"
        if self.budget_chunks is not None:
            # What the budget counts includes memory the fake's reclaimer has not given back
            # yet: equal on both sides (and to what the arena holds) right after reclaim().
            used = [x.budget.stats()["used_bytes"] for x in self.sides]
            if max(used) > self.budget_chunks * C:
                return f"{op}: a budget of {self.budget_chunks} chunks counts {used} bytes"
            held = [x.a.stats()["held_bytes"] for x in self.sides]
            if op == "reclaim()" and (used[0] != used[1] or used != held):
                return f"{op}: budgets count {used} bytes, the arenas hold {held}"
        reclaimed = op == "reclaim()"
        for b in range(BUFFERS):
            host_backed, fake_backed = (x.backed(b) for x in self.sides)
            if host_backed != fake_backed:
                return f"{op}: buffer {b} backed chunks: host {host_backed}, fake {fake_backed}"
            # Open bytes are not compared: with zero_fill=False a chunk not written since
            # it was backed, and a released chunk but right after reclaim().
            shown = [
                c
                for c, on in enumerate(host_backed)
                if (on and (self.zero_fill or c in self.defined[b]))
                or (not on and self.zero_fill and reclaimed)
            ]
            got = [x.read(b, shown) for x in self.sides]
            if not np.array_equal(*got):
                bad = sorted({int(i) // C for i in np.nonzero(got[0] != got[1])[0]})
                return f"{op}: buffer {b} chunks {bad} hold different bytes"
        return None

    def run(self, steps: int) -> str | None:
        log: list[str] = []
        for _ in range(steps):
            made = self.step()
            if made is None:
                continue
            log.append(f"{made[0]} -> {made[1][0]}")
            if (diff := self.difference(*made)) is not None:
                shown = log if VERBOSE else log[-6:]
                return f"seed {self.seed}, call {len(log)}: {diff}\n  " + "\n  ".join(shown)
        for x in self.sides:
            x.a.close()
        return None


def in_child(code: str, timeout: float = 300) -> subprocess.CompletedProcess:
    """Runs `code` in a child Python with this module imported as `m`."""
    here = str(Path(__file__).parent)
    head = f"import sys; sys.path.insert(0, {here!r}); import test_host_matches_cuda as m; "
    return subprocess.run(
        [sys.executable, "-c", head + code], capture_output=True, text=True, timeout=timeout
    )


def run_in_child(seed: int, steps: int, budget_bypassed: bool = False, **control) -> str | None:
    """Run(seed, **control).run(steps) in a child process: its difference, or how the
    child died. budget_bypassed: with the core's budget check off (a control)."""
    bypass = "m.t.set_budget_check_bypassed(True); " if budget_bypassed else ""
    proc = in_child(f"{bypass}d = m.Run({seed}, **{control!r}).run({steps}); print(d or 'SAME')")
    if proc.returncode != 0:
        return f"seed {seed}: the child died (exit {proc.returncode}): {proc.stderr[-2000:]}"
    out = proc.stdout.strip()
    return None if out.endswith("SAME") else out


@pytest.mark.parametrize("seed", range(12))
def test_random_core_calls_agree_on_the_host_and_the_cuda_driver(seed):
    diff = run_in_child(seed, 300)
    assert diff is None, diff


def test_the_comparison_sees_a_host_that_keeps_old_bytes_where_cuda_gives_zeros():
    """Not vacuous: a host arena without zero_fill against a zero-filling fake, both with
    allocations of 3 chunks, differs (a chunk taken back from its allocation keeps its
    old bytes on the host)."""
    diffs = []
    for seed in range(12):
        diffs.append(run_in_child(seed, 300, host_zero_fill=False, handle_chunks=3))
        if diffs[-1] and "hold different bytes" in diffs[-1]:
            return
    pytest.fail(f"no seed showed the difference: {diffs}")


def test_the_comparison_sees_a_budget_that_lets_commits_past_its_cap():
    """Not vacuous for budgets: with the core's budget check off, a run under a budget
    counts more than its cap."""
    seeds = [s for s in range(40) if drawn_budget(s) is not None][:6]
    diffs = []
    for seed in seeds:
        diffs.append(run_in_child(seed, 300, budget_bypassed=True))
        if diffs[-1] and "a budget of" in diffs[-1]:
            return
    pytest.fail(f"no seed showed the difference: {diffs}")


@pytest.mark.parametrize(("driver", "raw_view"), [("host", False), ("fake", False), ("fake", True)])
def test_offload_of_an_allocation_with_a_released_chunk_inside_releases_it_once(driver, raw_view):
    """Two runs of one allocation (its middle chunk released) in one offload: the
    allocation was listed once per run and released twice where it is released at once
    (a heap corruption: the host driver aborted; CUDA with a raw view out, which releases
    at once too, hung)."""
    try:
        proc = in_child(f"m.offload_around_a_released_chunk({driver!r}, {raw_view})", timeout=60)
    except subprocess.TimeoutExpired:
        pytest.fail("the offload and restore did not finish within 60 s")
    assert proc.returncode == 0, f"exit {proc.returncode}: {proc.stderr[-2000:]}"
    assert proc.stdout.split() == ["restored", "2", "closed"], proc.stdout


def offload_around_a_released_chunk(driver: str, raw_view: bool) -> None:
    x = Side(driver, handle_chunks=3, zero_fill=True)
    b = x.ids[0]
    view = x.a.view(b, [BUF], 1, 8, 2, 0) if raw_view else None  # uint8 on kDLCUDA 0
    x.a.commit(b, 0, 3 * C)  # one allocation of three chunks
    x.write(0, 0, b"\x07" * C)
    x.a.decommit(b, C, 2 * C, True)  # its middle chunk released: two runs in it
    ticket = x.a.offload([(b, 0, 3 * C)])
    assert x.a.wait_transfer(ticket)[0] == 1
    x.a.restore(ticket, True)
    assert x.read(0, [0])[:C].tobytes() == b"\x07" * C
    print("restored", x.a.stats()["backed_bytes"] // C)
    del view
    x.a.close()
    print("closed")


@pytest.mark.parametrize("driver", ["host", "fake"])
def test_overlapping_and_unsorted_ranges_count_each_chunk_once(driver):
    x = Side(driver, handle_chunks=1, zero_fill=True)
    b = x.ids[0]
    x.a.commit(b, 0, 4 * C)
    # Chunk 1 twice: three chunks go, one stays, and the count says so.
    assert x.a.decommit_ranges([(b, 0, 2 * C), (b, C, 3 * C)], True) == 3 * C
    assert x.backed(0)[:4] == [False, False, False, True]
    assert x.a.stats()["backed_bytes"] == C
    x.a.commit(b, 0, 4 * C)
    x.write(0, 0, bytes(range(256)) * (4 * C // 256))
    ticket = x.a.offload([(b, 2 * C, 4 * C), (b, 0, 3 * C)])
    assert x.a.stats()["backed_bytes"] == 0
    x.a.restore(ticket, True)
    assert x.a.stats()["backed_bytes"] == 4 * C == x.backed_chunks() * C
    assert x.read(0, [0, 1, 2, 3])[: 4 * C].tobytes() == bytes(range(256)) * (4 * C // 256)
    x.a.close()


@pytest.mark.parametrize("driver", ["host", "fake"])
def test_two_spans_onto_one_destination_chunk_are_refused(driver):
    """share_spans with two spans over the same destination chunk mapped it twice: the
    count of backed bytes went wrong, and the release crashed the host driver."""
    proc = in_child(f"m.share_twice_onto_one_chunk({driver!r})", timeout=60)
    assert proc.returncode == 0, f"exit {proc.returncode}: {proc.stderr[-2000:]}"
    assert proc.stdout.split() == ["refused", "released", "closed"], proc.stdout


def share_twice_onto_one_chunk(driver: str) -> None:
    x = Side(driver, handle_chunks=1, zero_fill=True)
    b = x.ids[0]
    x.a.commit(b, 0, 4 * C)
    for spans in (
        [(b, 0, b, SEQ, 2 * C), (b, C, b, SEQ + C, 2 * C)],  # overlapping destinations
        [(b, 0, b, SEQ, 2 * C), (b, 2 * C, b, SEQ, 2 * C)],  # one destination, two sources
    ):
        with pytest.raises(ValueError, match="two spans map chunk"):
            x.a.share_spans(spans)
        assert x.a.stats()["backed_bytes"] == 4 * C == x.backed_chunks() * C
    print("refused")
    x.a.decommit_ranges([(b, 0, BUF)], True)
    assert x.a.stats()["backed_bytes"] == 0 == x.backed_chunks()
    print("released")
    x.a.close()
    print("closed")
