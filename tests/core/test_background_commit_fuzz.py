"""Random KV arena calls racing its background commits (commit ahead, prefetch), on the host
backend: after every call each sequence's ensured tokens lie in chunks backed in every
layer buffer, writes to ensured tokens land, reads in flight across releases are not
clamped, a zero-filling arena's newly backed chunks read zeros, and releasing everything
gives every byte back.

The background commits are slowed at random (0-5 ms before each core call), so releases,
shares, offloads, sleeps and shrinks overtake them at different points. The invariants
hold at every interleaving when the arena is right, so this test must never fail; as a
detector it is only probabilistic: with offload's wait for the background commit
removed it failed in 1 of 2 runs when it was written. The targeted tests in
test_commit_ahead.py, test_share_prefix.py and the sharded scenarios stage each known
race deterministically and fail without its fix.

The budget variant runs two such arenas in one MemoryBudget smaller than both at their
largest, so that commits, commits ahead (which then stop partway and give back what they
backed), wakes and restores run out of memory at random points: the budget never goes
over its cap, an ensure it refuses changes no ensured tokens, and whenever no background
commit runs the budget counts exactly what the two arenas hold.
"""

from __future__ import annotations

import random
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_vmm
from conftest import chunk_states, raw_bytes
from jax_vmm import testing

H, D, SEQS, CHUNKS = 2, 64, 3, 4
CHUNK = 32768
TPC = CHUNK // (H * D * 4)  # float32 tokens per chunk
MAX_TOKENS = CHUNKS * TPC
LOWERING = ("release", "keep", "reuse", "share", "offload", "sleep", "shrink")
OPS = ("ensure",) * 3 + ("ensure_all", "read", "write") * 2 + LOWERING + ("prefetch", "wait")


class _Fuzz:
    def __init__(self, seed: int, budget: jax_vmm.MemoryBudget | None = None):
        self.rng = random.Random(seed)  # the calls: the same sequence on every run
        self.delays = random.Random(seed + 1)  # drawn on the worker thread, at its own times
        self.kv = jax_vmm.kv_arena(
            num_layers=2, num_kv_heads=H, head_dim=D, max_tokens=MAX_TOKENS, max_seqs=SEQS,
            dtype=jnp.float32, device=jax.devices("cpu")[0], chunk_bytes=CHUNK,
            commit_ahead_tokens=TPC // 4, handle_bytes=CHUNK * self.rng.choice([1, 2, 4]),
            zero_fill=self.rng.random() < 0.5, budget=budget,
        )  # fmt: skip
        self.op = ""  # the call step() is making
        self._slow_background_commits()
        self.write = jax.jit(lambda c, t, s: c.replace(0, jax_vmm.kv_write(c[0], t, t, s)))
        self.read = jax.jit(lambda c, q, n: jax_vmm.decode_attention(q, c[0], n))
        self.token = jnp.ones((1, H, D), jnp.float32)
        self.query = jnp.ones((SEQS, H, D), jnp.float32)
        self.writes: list = []
        self.reads: list = []

    def _slow_background_commits(self) -> None:
        kv, delays = self.kv, self.delays
        core, commit = kv.arena._handle, kv._commit_ahead

        class Slow:
            def __getattr__(self, name):
                return getattr(core, name)

            def commit_ahead(self, ranges):
                time.sleep(delays.choice([0, 0, 0.001, 0.005]))
                return core.commit_ahead(ranges)

        def slowed(q, tokens, epoch):
            kv.arena._handle = Slow()
            try:
                return commit(q, tokens, epoch)
            finally:
                kv.arena._handle = core

        kv._commit_ahead = slowed

    def limits(self) -> list[int]:
        return self.kv._core_cache.limits()

    def step(self) -> str:
        kv, rng = self.kv, self.rng
        q, op = rng.randrange(SEQS), rng.choice(OPS)
        if op in LOWERING:  # a write dispatched before a release is dropped by design
            jax.block_until_ready(self.writes)
            self.writes.clear()
        away = kv.asleep or q in kv._offloaded
        n = rng.randrange(1, MAX_TOKENS + 1)
        self.op = op
        if op == "ensure" and not away:
            if kv.arena.zero_fill and rng.random() < 0.25:
                self.ensure_reads_zeros(n, q)
            else:
                kv.ensure(n, q)
        elif op == "ensure_all" and not (kv.asleep or kv._offloaded):
            kv.ensure_all([max(t, rng.randrange(MAX_TOKENS + 1)) for t in self.limits()])
        elif op == "read" and not kv.asleep:
            lengths = jnp.asarray(np.array(self.limits(), np.int32))
            self.reads = [*self.reads[-3:], self.read(kv.cache(), self.query, lengths)]
        elif op == "write" and not away and self.limits()[q] > kv._floors[q]:
            pos = rng.randrange(int(kv._floors[q]), self.limits()[q])
            slot = jnp.array([q * MAX_TOKENS + pos], jnp.int32)
            self.writes.append(self.write(kv.cache(), self.token, slot))
            op = f"write at {pos}"
        elif op == "release" and not kv.asleep:
            kv.release(q)
        elif op == "keep" and kv.arena.zero_fill:
            pass  # refused: kept bytes would not read zeros
        elif op in ("keep", "reuse") and not kv.asleep and not self.shares_memory(q):
            kv.release(q, **({"keep_tokens": n - 1 or 1} if op == "keep" else {"reuse": True}))
        elif op == "prefetch" and not away:
            kv.prefetch(n, q)
        elif op == "wait":
            kv.wait_prefetch(q, 5)
        elif op == "share" and not kv.asleep:
            src = (q + 1) % SEQS
            if self.limits()[src] >= n and not ({src, q} & set(kv._offloaded)):
                kv.release(q)
                kv.share_prefix(src, q, n)
        elif op == "offload" and not kv.asleep:
            if q in kv._offloaded:
                kv.restore(q).wait()
            elif self.limits()[q] and not self.shares_memory():
                kv.offload(q)
        elif op == "sleep" and not self.shares_memory():
            kv.wake() if kv.asleep else kv.sleep()
        elif op == "shrink" and not (kv.asleep or self.shares_memory() or kv._offloaded):
            kv.shrink(rng.randrange(0, MAX_TOKENS))
        return f"{op}({q}, n={n})"

    def shares_memory(self, q: int | None = None) -> bool:
        """Whether sequence q (None: any) maps memory another one maps too: the dst of a
        share in place, or a source one maps. A source whose sharers were all released
        does not count: its floor dropped at the last release (KVArena._lower_stale_floors)."""
        kv = self.kv
        shared = set(kv._shares) | {s for s in kv._memory_of.values() if s is not None}
        return bool(shared) if q is None else q in shared

    def ensure_reads_zeros(self, n: int, q: int) -> None:
        """ensure(n, q) with the background commits and writes settled around it: every
        chunk it backed anew reads zeros (a zero-filling arena's contract)."""
        kv = self.kv
        assert kv._ahead.wait_idle()
        jax.block_until_ready(self.writes)
        before = [chunk_states(b) for b in kv.buffers]
        kv.ensure(n, q)
        assert kv._ahead.wait_idle()
        kv.reclaim()  # raw_bytes reads the buffers behind the arena's back
        for b, was in zip(kv.buffers, before):
            raw = raw_bytes(b)
            for c, (old, now) in enumerate(zip(was, chunk_states(b))):
                assert old or not now or not raw[c * CHUNK : (c + 1) * CHUNK].any(), (
                    f"ensure({n}, {q}): chunk {c} of buffer {b.name}, backed anew, holds "
                    "nonzero bytes"
                )

    def check_backed(self, after: str) -> None:
        """Every ensured token's chunk is backed in every layer buffer."""
        kv, per_seq = self.kv, self.kv.seq_bytes // CHUNK
        for q, tokens in enumerate(self.limits()):
            need = -(-tokens // TPC)
            for b in kv.buffers:
                states = chunk_states(b)[q * per_seq : (q + 1) * per_seq]
                assert all(states[:need]), (
                    f"after {after}: sequence {q} has {tokens} tokens ensured, but buffer "
                    f"{b.name} has chunks {states} backed"
                )

    def release_resident(self) -> None:
        """Releases every sequence in memory (not the offloaded ones), its calls done."""
        jax.block_until_ready((self.writes, self.reads))
        for q in range(SEQS):
            if q not in self.kv._offloaded:
                self.kv.release(q)

    def finish(self) -> None:
        kv = self.kv
        if kv.asleep:
            kv.wake()
        # The resident sequences go first, so that a budget has room for each restore.
        self.release_resident()
        for q in list(kv._offloaded):
            kv.restore(q).wait()
            kv.release(q)
        kv.check()  # no write to ensured tokens dropped, no read clamped
        assert kv._ahead.wait_idle()
        kv.arena.reclaim()
        assert kv.arena.stats()["backed_bytes"] == 0
        kv.close()


@pytest.mark.parametrize("seed", range(8))
def test_random_calls_racing_background_commits_keep_the_invariants(seed):
    fuzz = _Fuzz(seed)
    for _ in range(400):
        fuzz.check_backed(fuzz.step())
    fuzz.finish()


class _BudgetFuzz:
    """Two arenas' random calls, interleaved, in one budget of 8-24 chunks (each arena
    spans 48: 4 layer buffers x 3 sequences x 4 chunks)."""

    def __init__(self, seed: int):
        rng = random.Random(seed)
        self.rng = rng
        self.budget = jax_vmm.MemoryBudget(CHUNK * rng.randrange(8, 25), jax.devices("cpu")[0])
        self.fuzz = [_Fuzz(1000 * seed + i, self.budget) for i in range(2)]
        self.refusals = 0

    def step(self) -> str:
        f = self.rng.choice(self.fuzz)
        before = f.limits()
        try:
            return f.step()
        except jax_vmm.OutOfMemoryError as e:
            self.refusals += 1
            assert "budget" in str(e), e
            if f.op in ("ensure", "ensure_all"):
                assert f.limits() == before, f"a refused {f.op} changed the ensured tokens"
            return f"{f.op} refused"

    def check(self, after: str, settle: bool) -> None:
        for f in self.fuzz:
            f.check_backed(after)
        used = self.budget.stats()["used_bytes"]
        assert used <= self.budget.bytes, f"after {after}: {used} bytes over the cap"
        if not settle:
            return
        for f in self.fuzz:
            assert f.kv._ahead.wait_idle()
        stats = self.budget.stats()
        held = [f.kv.arena.stats()["held_bytes"] for f in self.fuzz]
        assert stats["used_bytes"] == sum(held), (
            f"after {after}: the budget counts {stats['used_bytes']} bytes, the arenas hold {held}"
        )
        assert sorted(a["held_bytes"] for a in stats["arenas"]) == sorted(held)

    def finish(self) -> None:
        # Every awake arena's resident sequences first: then a wake or a restore of either
        # arena has the whole budget but what it brings back itself.
        for f in self.fuzz:
            if not f.kv.asleep:
                f.release_resident()
        for f in self.fuzz:
            f.finish()
        assert self.budget.stats()["used_bytes"] == 0


@pytest.mark.parametrize("seed", range(6))
def test_two_arenas_in_one_budget_racing_background_commits(seed):
    fuzz = _BudgetFuzz(seed)
    for i in range(400):
        op = fuzz.step()
        fuzz.check(op, settle=i % 20 == 19)
    fuzz.finish()
    assert fuzz.refusals > 0, "the budget never refused: the test did not exercise it"


def test_the_budget_fuzz_catches_a_budget_that_lets_commits_past_its_cap():
    """The control: with the budget's refusal bypassed (it still counts), the cap check
    above fails."""
    fuzz = _BudgetFuzz(0)
    try:
        with testing.budget_check_bypassed(), pytest.raises(AssertionError, match="over the cap"):
            for i in range(400):
                fuzz.check(fuzz.step(), settle=i % 20 == 19)
    finally:
        for f in fuzz.fuzz:
            f.kv.close()
