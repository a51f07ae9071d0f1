"""The attention-and-write stack of a decode step, on any cache and attention: what
bench/decode.py compares across memory backends.

One step = for every layer of the model's geometry: attention of the query over each
sequence's live tokens, then the write of one new token per sequence (kv_write on the
layer). The next layer's query is this layer's output, so layers run in order as in the
model; the projections and MLP (the same GEMMs for every backend) are left out, so the
step time is what the cache and the attention cost. Reads come before the write within
a layer (the query reads tokens [0, length) and the token goes to position length):
then every read of an arena layer follows the writes that produced it (a loop carry),
which is what lets cuDNN read the arena (`jax_vmm.ordered_views`). `steps` steps run in
one jitted `fori_loop` (the cache donated), so host dispatch does not count.

Variants (`VARIANTS`): a cache (prealloc = `jnp.zeros` array layers, vmm = a jax_vmm
arena) + an attention (cudnn = `jax.nn.dot_product_attention(implementation="cudnn")`,
kernel = `jax_vmm.decode_attention`, xla = the masked plain-XLA reference over all T).
"""

from __future__ import annotations

import functools
import gc
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

import jax_vmm
from jax_vmm.serving import model as M
from jax_vmm.serving.attention import cudnn_decode_attention, reference_decode_attention
from jax_vmm.serving.cache import PreallocatedCache, VmmCache

VARIANTS = ("prealloc+cudnn", "prealloc+kernel", "vmm+cudnn", "vmm+kernel", "prealloc+xla")
BASELINE = "prealloc+cudnn"
CUDNN_VARIANTS = tuple(v for v in VARIANTS if v.endswith("+cudnn"))


def _read(kind: str, q: jax.Array, layer: jax_vmm.KVLayer, views, lengths: jax.Array):
    if kind == "kernel":
        return jax_vmm.decode_attention(q, layer, lengths)
    if kind == "xla":
        return reference_decode_attention(q, layer.k, layer.v, lengths, tail_may_be_garbage=False)
    if layer.is_arena:  # cuDNN over the arena: the raw views, ordered after the writes
        k, v = jax_vmm.ordered_views(layer, *views)
    else:
        k, v = layer.k, layer.v
    return cudnn_decode_attention(q, k, v, lengths)


def stack_loop(cache, views, x, lengths, *, steps: int, kind: str, group: int, writes=True):
    """`steps` steps of the stack from `lengths` live tokens per sequence. x: (B, H_q, D)
    the first query. writes=False: the reads alone (what tools/gpu/profile_step.py takes
    from the whole step to find the write's share). Returns (cache, a checksum of the
    outputs (B,) fp32)."""
    batch, max_tokens = cache[0].shape[0], cache[0].shape[1]
    base = jnp.arange(batch, dtype=jnp.int32) * max_tokens

    def body(i, carry):
        cache, x, acc = carry
        live = lengths + i
        for l in range(len(cache)):
            out = _read(kind, x, cache[l], views[l] if views else None, live)
            if writes:
                new = out[:, ::group]  # (B, H_kv, D): one query head per KV head
                cache = cache.replace(l, jax_vmm.kv_write(cache[l], new, new, base + live))
            x = out
        return cache, x, acc + x[:, 0, 0].astype(jnp.float32)

    cache, _, acc = jax.lax.fori_loop(0, steps, body, (cache, x, jnp.zeros(batch, jnp.float32)))
    return cache, acc


def fill_sequence(cache, seq, length):
    """Writes tokens [0, length) of sequence `seq` in every layer with one smooth,
    nonzero pattern (K = V), so that every variant reads the same data and the checksums
    of their outputs can be compared. One sequence per call: the new tokens of a call
    are one row of the cache, however large the batch."""
    _, max_tokens, heads, dim = cache[0].shape
    pos = jnp.arange(max_tokens, dtype=jnp.int32)
    slots = jnp.where(pos < length, seq * max_tokens + pos, -1)
    phase = (slots.astype(jnp.float32) * 0.37)[:, None, None]
    new = jnp.sin(
        phase
        + 0.5 * jnp.arange(heads, dtype=jnp.float32)[None, :, None]
        + 0.05 * jnp.arange(dim, dtype=jnp.float32)[None, None, :]
    ).astype(cache[0].dtype)
    for l in range(len(cache)):
        cache = cache.replace(l, jax_vmm.kv_write(cache[l], new, new, slots))
    return cache


def if_it_fits(run: Callable[[], Any]) -> Any:
    """``run()``'s result, or "does not fit: ..." when it raised the arena's
    OutOfMemoryError or XLA's allocator ran out (RESOURCE_EXHAUSTED); any other failure
    raises. A grid sized for one card (an H200's 141 GB) then reports the points a smaller
    one cannot hold instead of ending the run."""
    try:
        return run()
    except (jax_vmm.OutOfMemoryError, jax.errors.JaxRuntimeError) as e:
        if not isinstance(e, jax_vmm.OutOfMemoryError) and "RESOURCE_EXHAUSTED" not in str(e):
            raise
        return "does not fit: " + str(e).splitlines()[0][:200]


class VariantRun:
    """One variant set up, compiled and warmed (two calls: compile, first command-buffer
    recording): :meth:`call` times one more jitted call of `steps` steps, :meth:`result`
    checks the cache and the outputs and reports, :meth:`close` frees the cache. Several
    may be alive at once, so that bench/decode.py can interleave their calls and the two
    sides of a ratio run under the same conditions. writes: see stack_loop."""

    def __init__(
        self,
        variant: str,
        cfg: M.ModelConfig,
        device: jax.Device,
        lengths: np.ndarray,
        *,
        context: int,
        steps: int,
        chunk_bytes: int | None = None,
        writes: bool = True,
        kv_layout: str = "per_layer",
    ):
        backend, kind = variant.split("+")
        if backend == "vmm" and kind == "cudnn" and kv_layout != "per_layer":
            raise ValueError(
                "vmm+cudnn reads the arena's layer views, which an interleaved arena has not; "
                "vmm+kernel reads it through the cache (cuDNN's route included)"
            )
        batch = len(lengths)
        self.variant, self.steps = variant, steps
        t0 = time.perf_counter()
        if backend == "prealloc":
            self.cache = PreallocatedCache(cfg, max_seqs=batch, max_tokens=context, device=device)
        else:
            # zero_fill: a masked read over the views (cuDNN, XLA) multiplies the tail past the
            # lengths by 0, and 0 x a NaN left in fresh memory is NaN. Its cost is in the setup
            # (every token is ensured before the timed calls).
            self.cache = VmmCache(
                cfg, max_seqs=batch, max_tokens=context, device=device, chunk_bytes=chunk_bytes,
                zero_fill=True, kv_layout=kv_layout,
            )  # fmt: skip
        try:
            cache = self.cache
            for seq, n in enumerate(lengths):  # every pass rewrites the same positions
                cache.ensure(seq, int(n) + steps)
            fill = jax.jit(fill_sequence, donate_argnums=(0,))
            for seq, n in enumerate(lengths):
                cache.update(fill(cache.cache(), jnp.int32(seq), jnp.int32(n)))
            self.live = jax.device_put(jnp.asarray(lengths, jnp.int32), device)
            self.views = ()
            if backend == "vmm" and kind == "cudnn":  # raw views: from now on commits drain
                self.views = tuple((cache.kv.k[l], cache.kv.v[l]) for l in range(cfg.num_layers))
            self.setup_s = time.perf_counter() - t0
            fn = jax.jit(
                functools.partial(
                    stack_loop,
                    steps=steps,
                    kind=kind,
                    group=cfg.num_q_heads // cfg.num_kv_heads,
                    writes=writes,
                ),
                donate_argnums=(0,),
            )
            self.x = jax.device_put(
                jax.random.normal(
                    jax.random.key(0), (batch, cfg.num_q_heads, cfg.head_dim), jnp.float32
                ).astype(cfg.jnp_dtype),
                device,
            )
            self.state = cache.cache()
            t0 = time.perf_counter()
            self.fn = fn.lower(self.state, self.views, self.x, self.live).compile()
            self.compile_s = time.perf_counter() - t0
            try:  # an in-place cache needs no temp buffer of its size (a copy would show here)
                self.temp = int(self.fn.memory_analysis().temp_size_in_bytes)
            except Exception:  # memory_analysis is best effort on some backends
                self.temp = -1
            self._run()
            self._run()  # a second warm-up: graph recording
        except BaseException:
            self.close()
            raise

    def _run(self) -> None:
        self.state, self.acc = self.fn(self.state, self.views, self.x, self.live)
        jax.block_until_ready(self.acc)

    def call(self) -> float:
        """Seconds per step of one more call."""
        t0 = time.perf_counter()
        self._run()
        return (time.perf_counter() - t0) / self.steps

    def result(self, times: list[float], around_call: Any = None) -> dict[str, Any]:
        """The report over `times` (from :meth:`call`); around_call: a context manager
        factory entered around one more call (a profiler trace), or None."""
        if around_call is not None:
            with around_call():
                self._run()
        self.cache.update(self.state)
        self.cache.check()
        if not np.all(np.isfinite(np.asarray(self.acc))):
            raise RuntimeError(f"{self.variant}: non-finite attention outputs")
        return {
            "variant": self.variant,
            "step_ms": 1e3 * min(times),
            "step_ms_median": 1e3 * float(np.median(times)),
            "setup_s": self.setup_s,
            "compile_s": self.compile_s,
            "temp_bytes": self.temp,
            "held_bytes": self.cache.backed_bytes(),
            "reserved_bytes": self.cache.reserved_bytes(),
            "checksum": float(np.asarray(self.acc, np.float64).sum()),
        }

    def close(self) -> None:
        self.cache.close()


def time_variant(
    variant: str,
    cfg: M.ModelConfig,
    device: jax.Device,
    lengths: np.ndarray,
    *,
    repeats: int,
    around_call: Any = None,
    **setup: Any,
) -> dict[str, Any]:
    """Per-step time of the stack (best of `repeats` calls of `steps` steps, after two
    warm-up calls), and the KV memory held: one :class:`VariantRun` on its own (setup:
    its context, steps, chunk_bytes, writes). around_call: see VariantRun.result."""
    run = VariantRun(variant, cfg, device, lengths, **setup)
    try:
        return run.result([run.call() for _ in range(repeats)], around_call)
    finally:
        run.close()


def time_pair(
    variants: tuple[str, str],
    cfg: M.ModelConfig,
    device: jax.Device,
    lengths: np.ndarray,
    *,
    repeats: int,
    **setup: Any,
) -> tuple[dict[str, Any], dict[str, Any], list[float]]:
    """Two variants alive at once (setup: VariantRun's context, steps, chunk_bytes), their
    calls interleaved for `repeats` rounds (the order alternating, so that neither always
    runs first): each one's report (as time_variant's) and the per-round ratios second /
    first."""
    first = VariantRun(variants[0], cfg, device, lengths, **setup)
    try:
        second = VariantRun(variants[1], cfg, device, lengths, **setup)
        try:
            times: tuple[list[float], list[float]] = ([], [])
            for r in range(repeats):
                order = (0, 1) if r % 2 == 0 else (1, 0)
                for i in order:
                    times[i].append((first, second)[i].call())
            ratios = [b / a for a, b in zip(*times)]
            return first.result(times[0]), second.result(times[1]), ratios
        finally:
            second.close()
    finally:
        first.close()


def time_all(
    variants: tuple[str, ...],
    cfg: M.ModelConfig,
    device: jax.Device,
    lengths: np.ndarray,
    *,
    skip: dict[str, str] | None = None,
    log: Callable[[str], Any] = print,
    **timing: Any,
) -> tuple[dict[str, dict], dict[str, str], dict[str, dict]]:
    """Every variant but those in `skip` (variant -> why) at one point (timing:
    time_variant's context, steps, repeats, chunk_bytes): (reports by variant, why each
    other one was skipped, paired ratios by attention). prealloc+X and vmm+X run as a pair
    (time_pair): timed apart, small points moved by up to 0.3 between runs (one suspect: a
    GPU's clocks, idle during the other side's setup and compile). A pair that does not
    fit together is timed apart; paired[X] holds the median and quartiles of the
    per-round ratios vmm / prealloc."""
    cases: dict[str, dict] = {}
    skipped: dict[str, str] = dict(skip or {})
    paired: dict[str, dict] = {}
    batch, context = len(lengths), timing["context"]

    def record(variant: str, got: dict | str) -> None:
        if isinstance(got, str):
            skipped[variant] = got
            log(f"     {variant} at B{batch} T{context}: {got}")
        else:
            cases[variant] = got

    def alone(variant: str) -> None:
        record(
            variant,
            if_it_fits(lambda: time_variant(variant, cfg, device, lengths, **timing)),
        )
        gc.collect()

    done: set[str] = set(skipped)
    for variant in variants:
        if variant in done:
            continue
        kind = variant.split("+")[1]
        pair = (f"prealloc+{kind}", f"vmm+{kind}")
        if not (set(pair) <= set(variants) and done.isdisjoint(pair)):
            done.add(variant)
            alone(variant)
            continue
        done.update(pair)
        got = if_it_fits(lambda: time_pair(pair, cfg, device, lengths, **timing))
        gc.collect()
        if isinstance(got, str):
            log(f"     {pair[0]} and {pair[1]} at B{batch} T{context} together: {got}; timed apart")
            for v in pair:
                alone(v)
            continue
        record(pair[0], got[0])
        record(pair[1], got[1])
        q1, median, q3 = np.percentile(got[2], [25, 50, 75])
        paired[kind] = {
            "median": float(median), "q1": float(q1), "q3": float(q3), "rounds": len(got[2]),
        }  # fmt: skip
    return cases, skipped, paired


def bytes_per_step(cfg: M.ModelConfig, lengths: np.ndarray, steps: int) -> int:
    """KV bytes a step must move at least: every live token read once (the mean over the
    steps' lengths) plus the new tokens written."""
    mean_live = float(np.sum(lengths)) + len(lengths) * (steps - 1) / 2
    return int((mean_live + len(lengths)) * cfg.kv_bytes_per_token)
