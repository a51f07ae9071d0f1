"""Test hooks of jax_vmm: switches that remove one protection each, so that a test can
show its checks would catch the failure they guard against, or force one production path
that tests would not reach otherwise.

Nothing here is for production use, and the production ``jax_vmm`` namespace exposes
none of it. The hooks live in the C++ testing layer (``ffi/src/testing/``, the extension module
``jax_vmm._core_testing``, built unless CMake's ``JAX_VMM_TESTING`` is OFF); this module is
the only package code that imports it.

* :func:`fault_injection`: arenas created inside the with-block get a fault-injecting
  driver; :class:`FaultInjection` arms faults per arena (the nth ``create``, ``map``,
  ``set_access``, ``zero_fill``, ``host_alloc``, ``copy_to_host`` or ``copy_to_device``
  driver call fails with :class:`InjectedFault` or an out-of-memory) and can break
  release/unmap so that a rollback leaks observably.
* Device-wait switches of :class:`FaultInjection`: ``skip_device_waits`` removes the
  commit drain and the deferred release (memory is unmapped under running kernels: the
  failure the deferral prevents); ``defer_reclaim`` and ``hold_device`` make the host
  driver take the deferred path with a device that stays busy until released.
* :func:`uncounted_view`: a view that does not count as a raw view of its arena, standing
  in for memory that jax_vmm's own ops reach by identity.
* :func:`unchecked_kv_writes`: ``jax_vmm.kv_write`` / ``kv_write_through`` call variants
  without the slot range and page checks; :func:`token_kernel_kv_writes`: the same calls
  with the (checked) token kernel that production keeps for huge tokens.
* :func:`decode_attention`: decode attention (split-K or streaming kernel) with an
  aliased ``out_init`` output buffer, ``skip_output`` and (split-K, CPU)
  ``read_all_tokens``; :func:`stream_partition`: the streaming kernel's work partition;
  :func:`fast_div`: the kv_write kernel's index division, run on the host.
* :func:`address_only_dests`: a ``KVDest`` identified by its addresses alone (no uid
  check in the handlers, no check of eager views against the dest), as before buffers
  had uids.
* :func:`identity_stripped`: an arena layer of a ``KVCache`` flattens to its arena views
  (an array layer) instead of its static identity: the naive cache pytree, whose arrays
  XLA copies, so the arena is not written inside ``jit``.
* :func:`host_device_waits_skipped`: a CPU arena gives memory back without waiting for
  the XLA:CPU computations in flight (the host driver's no-op device wait), and a KV
  release lowers the table under them (no read epoch).
* :func:`read_epochs_kept`: an arena layer keeps its token's read epoch across a release,
  so a later step reads the table kept for an earlier one; :func:`host_reclaims_paused`
  holds the host reclaim thread (released memory and kept tables stay);
  :func:`wait_for_host_reclaims` waits for it; :func:`host_gate_closed` with
  :func:`through_host_gate` holds a CPU step in flight until the test lets it go.
* :func:`untiled_reads`: ``ensure`` backs only the asked tokens' chunks, not up to the
  end of the key/value tile cuDNN reads them in.
* :func:`shared_writes_allowed`: ``kv.share_prefix`` leaves the shared tokens writable
  (no floor in the device table), so a write into one sharer lands in the other's tokens.
* :func:`limits_ignored`: the KVCache-layer kv_write and decode attention without the
  table of ensured tokens (writes past them land where a chunk is backed; reads are not
  clamped or counted).
* :func:`tokens_unnoted`: the cache pytree does not note the tokens of returned caches,
  so ``kv.check()`` does not wait for a cache step in flight on JAX's fast path.
* :func:`context_wide_device_waits`: an arena's device waits wait for the whole CUDA
  context (cuCtxSynchronize) instead of XLA's compute stream, which breaks a command-buffer
  capture that XLA runs meanwhile on another thread.
* :func:`legacy_views`: views without a view lease, whose DLPack deleter takes the GIL
  (a plain nanobind ndarray owning a reference to the arena), as before leases.
* :func:`scratch_probe` (with :func:`scratch_probe_stats`, :func:`address_of`): a custom
  call that copies its input through a graph-safe scratch workspace;
  :func:`scratch_get` serves a workspace with a simulated capture state;
  :func:`free_scratch_on_growth` re-creates the bug graph-safe scratch prevents.

Thread-safety: the switches are process-wide. Use them from one test at a time.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from typing import Any, Literal
from unittest import mock

import jax
import jax.numpy as jnp
import numpy as np

from .base import compute_streams as _compute_streams
from .base import ffi as _ffi
from .base import record_stages as _record_stages
from .base.args import as_shape
from .base.devices import resolve_device
from .cache import pytree as _cache
from .cache import read_epochs as _read_epochs
from .cache import registry as _registry
from .kv import KVArena
from .kv import backing as _backing
from .kv import base as _kv_base
from .kv import sharded as _sharded
from .kv import sharing as _sharing
from .memory import arena as _arena
from .memory import host_reclaim as _host_reclaim
from .memory import host_wait as _host_wait
from .ops import array_writes as _ops
from .ops import layer_ops as _cache_ops
from .ops import vmap_reads as _vmap_reads
from .ops.attention_call import prepare as _prepare_attention
from .ops.general_attention import checked_options
from .ops.scratch import reserve as _scratch_reserve

try:
    from . import _core_testing as _testing
except ImportError as exc:  # pragma: no cover - only in a build with JAX_VMM_TESTING=OFF
    raise ImportError(
        "jax_vmm.testing needs the extension jax_vmm._core_testing, which this build of "
        f"jax_vmm lacks ({exc}); rebuild with the CMake option -DJAX_VMM_TESTING=ON"
    ) from exc


def extension() -> Any:
    """The extension module ``jax_vmm._core_testing`` (the C++ testing layer)."""
    return _testing


_ffi.add_source(_testing.registrations)

__all__ = [
    "extension",
    "InjectedFault",
    "FaultInjection",
    "fault_injection",
    "host_map_limit",
    "budget_check_bypassed",
    "host_memory_available",
    "uncounted_view",
    "unchecked_kv_writes",
    "token_kernel_kv_writes",
    "address_only_dests",
    "identity_stripped",
    "limits_ignored",
    "shared_writes_allowed",
    "loop_views_unbarriered",
    "vmapped_reads_allowed",
    "host_device_waits_skipped",
    "commits_take_releases_unwaited",
    "legacy_views",
    "decode_attention",
    "stream_partition",
    "scratch_probe",
    "scratch_probe_stats",
    "address_of",
    "scratch_get",
    "free_scratch_on_growth",
]

#: A driver call failed because a test armed a fault (:meth:`FaultInjection.arm`).
#: A ``RuntimeError``.
InjectedFault = _testing.InjectedFault


# -- fault injection ------------------------------------------------------------------


def _core_arena(arena: Any) -> Any:
    """The C++ arena of a jax_vmm.Arena or jax_vmm.KVArena."""
    if isinstance(arena, KVArena):
        arena = arena.arena
    if not isinstance(arena, _arena.Arena):
        raise TypeError(f"expected a jax_vmm.Arena or KVArena, got {type(arena).__name__}")
    return arena._handle


class FaultInjection:
    """Arms faults in the drivers of arenas created inside :func:`fault_injection`.

    Every method takes a ``jax_vmm.Arena`` or ``KVArena`` and raises ``ValueError`` for an
    arena created outside the with-block. The handle stays usable after the block ends
    (the arenas keep their fault-injecting driver).
    """

    def arm(self, arena: Any, op: str, nth: int = 1, out_of_memory: bool = False) -> None:
        """Make the ``nth`` (1-based) future driver call of ``op`` fail: with
        :class:`InjectedFault`, or with an out-of-memory (``jax_vmm.OutOfMemoryError``) when
        ``out_of_memory``. ``nth <= 0`` disarms ``op``. Ops: ``"create"`` (one physical
        allocation), ``"map"`` (one piece of a run: a commit maps a run of allocations at
        once), ``"set_access"``, ``"zero_fill"``, ``"host_alloc"`` (host staging memory of
        a sleep or offload), ``"copy_to_host"`` / ``"copy_to_device"`` (one copied region:
        sleep and offload copy out, wake and restore copy in)."""
        _testing.arm_fault(_core_arena(arena), op, int(nth), bool(out_of_memory))

    def disarm(self, arena: Any) -> None:
        """Disarm every op, repair release (undo :meth:`break_release`) and lift every
        device-wait switch and hold."""
        _testing.disarm_faults(_core_arena(arena))

    def break_release(self, arena: Any, broken: bool = True) -> None:
        """While broken, the driver's release and unmap calls do nothing: a failed commit
        (or a decommit) keeps its physical memory, as a rollback that forgot its chunks
        would. The memory stays held until the arena is destroyed."""
        _testing.break_release(_core_arena(arena), bool(broken))

    def injected(self, arena: Any) -> int:
        """Faults thrown into this arena's driver so far."""
        return int(_testing.injected_faults(_core_arena(arena)))

    def skip_device_waits(self, arena: Any, skip: bool = True) -> None:
        """While set, the driver's device waits return at once and unmapping claims to need
        none: a commit never drains and a release unmaps at once, under any kernel still
        running -- the protection removed, for tests that must see the fault it prevents."""
        _testing.skip_device_waits(_core_arena(arena), bool(skip))

    def defer_reclaim(self, arena: Any, defer: bool = True) -> None:
        """While set, unmapping claims to need a device wait, so the host driver defers
        releases to the reclaimer thread as the CUDA driver does."""
        _testing.defer_reclaim(_core_arena(arena), bool(defer))

    def unorder_table_writes(self, arena: Any, unordered: bool = True) -> None:
        """While set, a change to a table the kernels read (ensured tokens, page table,
        floors) lands at once instead of in dispatch order: a step dispatched before a
        release but still queued reads the lowered table -- the protection removed."""
        _testing.unorder_table_writes(_core_arena(arena), bool(unordered))

    @contextlib.contextmanager
    def hold_device(self, arena: Any) -> Iterator[None]:
        """Inside the with-block the arena's device waits block (a device still busy with
        earlier work), and the host reclaim thread, which unmaps a CPU arena's released
        memory once the XLA:CPU work that may read it is done, serves nothing; leaving it
        lets both go on."""
        _testing.hold_device(_core_arena(arena), True)
        try:
            with host_reclaims_paused():
                yield
        finally:
            _testing.hold_device(_core_arena(arena), False)

    def device_syncs(self, arena: Any) -> int:
        """Device waits (driver Synchronize calls) made for this arena so far."""
        return int(_testing.device_syncs(_core_arena(arena)))


@contextlib.contextmanager
def fault_injection() -> Iterator[FaultInjection]:
    """Arenas created inside the with-block (``jax_vmm.Arena``, ``jax_vmm.kv_arena``, on
    any device) get a fault-injecting driver; yields the :class:`FaultInjection` that arms
    them. Nests; restores the previous factory on exit. Not for concurrent use with
    threads that create arenas outside the block."""
    previous = _arena._core_arena_factory
    _arena._core_arena_factory = _testing.create_fault_injecting_arena
    try:
        yield FaultInjection()
    finally:
        _arena._core_arena_factory = previous


@contextlib.contextmanager
def host_map_limit(limit: int) -> Iterator[None]:
    """Inside the with-block host arenas check their memory mappings against ``limit``
    instead of the process limit ``vm.max_map_count`` (which a test cannot lower): the
    point where a commit is refused comes within reach of a small arena."""
    if isinstance(limit, bool) or not isinstance(limit, int) or limit <= 0:
        raise ValueError(f"host_map_limit: limit must be an int > 0, got {limit!r}")
    _testing.set_host_map_limit(limit)
    try:
        yield
    finally:
        _testing.set_host_map_limit(0)


@contextlib.contextmanager
def budget_check_bypassed() -> Iterator[None]:
    """Inside the with-block no :class:`~jax_vmm.MemoryBudget` refuses a commit (each
    still counts what its arenas hold): tests show with it that they would catch arenas
    going past their budget. Process-wide; not for concurrent use."""
    _testing.set_budget_check_bypassed(True)
    try:
        yield
    finally:
        _testing.set_budget_check_bypassed(False)


@contextlib.contextmanager
def host_memory_available(num_bytes: int) -> Iterator[None]:
    """Inside the with-block the host driver takes ``num_bytes`` as the memory the machine
    has available (instead of /proc/meminfo's) and checks every commit against it: tests
    show its refusal of a commit past the machine's memory (which the kernel's OOM killer
    would answer by killing the process) without filling the machine. Process-wide; not
    for concurrent use."""
    if num_bytes < 1:
        raise ValueError(f"num_bytes must be >= 1, got {num_bytes}")
    _testing.set_host_available_bytes(num_bytes)
    try:
        yield
    finally:
        _testing.set_host_available_bytes(0)


@contextlib.contextmanager
def fresh_memory_poisoned() -> Iterator[None]:
    """Inside the with-block the host driver fills the memory it commits with 0xFF bytes
    (NaN in every float type a cache holds) instead of zeros: a GPU's fresh memory
    (``cuMemCreate``) may hold anything, so a CPU test that passes only because unwritten
    host memory reads zeros fails here as it would on a GPU. Arenas with
    ``zero_fill=True`` still read zeros. Process-wide; not for concurrent use. With
    ``JAX_VMM_TEST_POISON_FRESH=1`` a process that imports this module runs whole under
    it (the test suite and the children its tests start)."""
    global _fresh_memory_poisoned
    before, _fresh_memory_poisoned = _fresh_memory_poisoned, True
    _testing.set_host_fresh_memory_poisoned(True)
    try:
        yield
    finally:
        _fresh_memory_poisoned = before
        _testing.set_host_fresh_memory_poisoned(before)


#: Whether fresh_memory_poisoned() is in force (the core's switch has no getter).
_fresh_memory_poisoned = os.environ.get("JAX_VMM_TEST_POISON_FRESH") == "1"
if _fresh_memory_poisoned:  # a whole test run so (tests/conftest.py imports this module)
    _testing.set_host_fresh_memory_poisoned(True)


# -- views that do not count ----------------------------------------------------------


def uncounted_view(buf: Any, shape: Any = None, dtype: Any = None) -> jax.Array:
    """A zero-copy view of a buffer (like ``buf.view``) that does not count as a raw view
    of its arena (a view without a lease, as :func:`legacy_views` makes): the arena does
    not switch to waiting commits and releases. It stands in for the arena memory
    jax_vmm's own ops reach by identity (they never read an unbacked chunk); reading it
    with XLA ops over unbacked chunks may fault."""
    arena = buf.arena
    arena._check_open("testing.uncounted_view")
    shape = buf.shape if shape is None else as_shape(shape)
    np_dtype = buf.dtype if dtype is None else jnp.dtype(dtype)
    code, bits = _arena._dlpack_dtype(np_dtype)
    t = arena._target
    capsule = _testing.legacy_view(
        arena._handle, buf.id, list(shape), code, bits, t.dlpack_device_type, t.dlpack_device_id
    )
    return jax.dlpack.from_dlpack(
        _arena._DLPackCapsule(capsule, t.dlpack_device_type, t.dlpack_device_id), copy=False
    )


# -- kv_write without its checks ------------------------------------------------------


@contextlib.contextmanager
def _kv_write_targets(targets: Any) -> Iterator[None]:
    """``jax_vmm.kv_write`` / ``kv_write_through`` call `targets` inside the with-block."""
    previous = _ops._targets
    _ops._targets = targets
    try:
        yield
    finally:
        _ops._targets = previous


def unchecked_kv_writes() -> contextlib.AbstractContextManager[None]:
    """Inside the with-block ``jax_vmm.kv_write`` / ``kv_write_through`` call variants that
    skip the slot range and page checks and write wherever a slot points: out-of-range
    slots corrupt neighbouring memory and unbacked pages fault. Applies to calls traced
    inside the block (a function jitted before keeps its checked call)."""
    return _kv_write_targets(
        _ops._Targets(
            write="jax_vmm_testing_kv_write_unchecked",
            through="jax_vmm_testing_kv_write_through_unchecked",
        )
    )


def token_kernel_kv_writes() -> contextlib.AbstractContextManager[None]:
    """Inside the with-block ``jax_vmm.kv_write`` / ``kv_write_through`` run, on a GPU, the
    token kernel (one thread group per token) instead of the tiled kernel: the checked
    fallback that production picks only for tokens too large for the tiled kernel, so that
    tests reach it and benchmarks compare the two. On the CPU (one writer) nothing changes.
    Applies to calls traced inside the block."""
    return _kv_write_targets(
        _ops._Targets(
            write="jax_vmm_testing_kv_write_token_kernel",
            through="jax_vmm_testing_kv_write_through_token_kernel",
        )
    )


@contextlib.contextmanager
def address_only_dests() -> Iterator[None]:
    """Inside the with-block a ``KVDest`` is identified by its addresses alone: the
    kv_write call variants traced there take the uid of whatever live buffer starts at
    the dest address when they run (so a step traced with the dest of a destroyed arena
    writes a newer arena placed at the same address), and eager calls no longer check
    their views against the dest. Applies to calls traced inside the block."""
    previous = _ops._targets, _ops._verify_views
    _ops._targets = _ops._Targets(
        write="jax_vmm_testing_kv_write_address_only",
        through="jax_vmm_testing_kv_write_through_address_only",
    )
    _ops._verify_views = lambda *args: None
    try:
        yield
    finally:
        _ops._targets, _ops._verify_views = previous


# -- the KV cache pytree without its protections ----------------------------------------


def _flatten_with_views(layer: Any) -> tuple[tuple, Any]:
    scales = (layer.k_scale, layer.v_scale) if layer.fp8 else ()
    return (layer.k, layer.v, *scales), _cache._ViewsId(layer.fp8)


@contextlib.contextmanager
def identity_stripped() -> Iterator[None]:
    """Inside the with-block an arena layer of a ``KVCache`` flattens to its arena views
    (``kv.k[l]``, ``kv.v[l]``) as leaves and unflattens as an array layer: a cache pytree
    that carries the big arrays, without the static identity. Inside ``jit`` XLA then
    hands the writes its own copy (always on the CPU, on a GPU unless donated), so the
    arena is not written: what the identity exists to prevent."""
    previous = _cache._arena_flatten
    _cache._arena_flatten = _flatten_with_views
    try:
        yield
    finally:
        _cache._arena_flatten = previous


@contextlib.contextmanager
def tokens_unnoted() -> Iterator[None]:
    """Inside the with-block the cache pytree does not note the tokens of the caches it
    rebuilds (a jitted step's returned cache): ``kv.check()`` then waits only for its
    arguments and for computations with a JAX effect, not for a cache step still in
    flight on JAX's fast path. What the noting exists to prevent."""
    previous = _registry.note_token
    _registry.note_token = lambda lid, token: None
    try:
        yield
    finally:
        _registry.note_token = previous


@contextlib.contextmanager
def live_results_unwaited() -> Iterator[None]:
    """Inside the with-block ``kv.check()`` does not wait for the computations on the
    arena's devices whose results are alive (``kv/base.py`` ``wait_for_live_results``):
    a step that writes a layer, reads it and returns only what it read is then checked
    before it has run. What that wait exists to prevent."""
    previous = _kv_base.wait_for_live_results
    _kv_base.wait_for_live_results = lambda devices: None
    try:
        yield
    finally:
        _kv_base.wait_for_live_results = previous


@contextlib.contextmanager
def limits_ignored() -> Iterator[None]:
    """Inside the with-block ``jax_vmm.kv_write(layer, ...)`` and
    ``jax_vmm.decode_attention(q, layer, lengths)`` / ``jax_vmm.attention`` on arena layers
    (jax_vmm's kernels, the fp8 copy and the cuDNN route's lengths clamp) call variants
    without the table of ensured tokens: a write past a sequence's ensured tokens lands wherever
    its chunk happens to be backed (and is not counted), a read is clamped only to T (and
    not counted). Applies to calls traced inside the block."""
    previous = _cache_ops._targets
    _cache_ops._targets = _cache_ops._Targets(
        write="jax_vmm_testing_kv_cache_write_no_limits",
        attention="jax_vmm_testing_decode_attention_cache_no_limits",
        attention_stream="jax_vmm_testing_decode_attention_v2_cache_no_limits",
        copy_tokens="jax_vmm_testing_kv_cache_copy_tokens_no_limits",
        read_lengths="jax_vmm_testing_kv_cache_read_lengths_no_limits",
    )
    try:
        yield
    finally:
        _cache_ops._targets = previous


@contextlib.contextmanager
def untiled_reads() -> Iterator[None]:
    """Inside the with-block ``ensure`` backs only the chunks of the tokens it is asked
    for, not up to the end of the tile a reader rounds them to (``READ_TILE_TOKENS``,
    jax_vmm/kv/backing.py): on a CUDA arena without a view, cuDNN's last key/value tile can
    then cross into an unmapped chunk and fault."""
    previous = _backing.READ_TILE_TOKENS
    _backing.READ_TILE_TOKENS = 1
    try:
        yield
    finally:
        _backing.READ_TILE_TOKENS = previous


@contextlib.contextmanager
def shared_writes_allowed() -> Iterator[None]:
    """Inside the with-block ``kv.share_prefix`` publishes no floor of writable tokens
    (the device table keeps 0): kv_write into a shared prefix is not dropped but lands in
    the memory every sharer reads. Floors published before the block stay."""
    previous = _sharing._publish_floor
    _sharing._publish_floor = lambda core_cache, seq, tokens: None
    try:
        yield
    finally:
        _sharing._publish_floor = previous


@contextlib.contextmanager
def loop_views_unbarriered() -> Iterator[None]:
    """Inside the with-block (while tracing) ``ordered_views`` returns the views as they
    came, without the barrier that ties them to the layer's token: in a loop body XLA
    then hoists reads of them out of the loop, before every iteration's write."""
    previous = _cache_ops._loop_variant_views
    _cache_ops._loop_variant_views = lambda k, v, token: (k, v)
    try:
        yield
    finally:
        _cache_ops._loop_variant_views = previous


@contextlib.contextmanager
def vmapped_reads_allowed() -> Iterator[None]:
    """Inside the with-block a cache read of a layer that a kv_write batched by the same
    vmap produced, and a batched write of a layer a loop body read, are not refused
    (ops/vmap_reads.py): they run, and the reads see every element's writes."""
    with (
        mock.patch.object(_vmap_reads, "refuse_read", lambda *args: None),
        mock.patch.object(_vmap_reads, "refuse_loop_write", lambda *args: None),
    ):
        yield


@contextlib.contextmanager
def host_device_waits_skipped() -> Iterator[None]:
    """Inside the with-block a CPU arena does not wait for the XLA:CPU work in flight
    before it unmaps, copies out or punches memory (``release``, ``close``, ``sleep``,
    ``offload``, ...): the host driver's device wait as a no-op, so a computation
    dispatched before the call reads released memory (zeros, or partial sums)."""
    previous = _host_wait.skip
    _host_wait.skip = True
    try:
        yield
    finally:
        _host_wait.skip = previous


@contextlib.contextmanager
def read_epochs_kept() -> Iterator[None]:
    """Inside the with-block an arena layer keeps the read epoch of its token when it
    crosses a jit boundary after a release (``jax_vmm/cache/read_epochs.py``; the
    protection removed): a step dispatched after the release but fed the cache an earlier
    step returned reads the table kept for that earlier step, and its reads of the
    released sequence are neither clamped nor counted."""
    previous = _read_epochs.renewing
    _read_epochs.renewing = False
    try:
        yield
    finally:
        _read_epochs.renewing = previous


@contextlib.contextmanager
def host_gate_closed() -> Iterator[None]:
    """Inside the with-block :func:`through_host_gate` holds every CPU step that reaches
    it (on an XLA:CPU thread, its dispatch returned) until the block ends, or a guard of
    60 s passes: a test knows such a step is in flight across the calls it makes."""
    _testing.set_host_gate(False)
    try:
        yield
    finally:
        _testing.set_host_gate(True)


def through_host_gate(x: jax.Array) -> jax.Array:
    """``y = x`` on the CPU (inside ``jit``), once the host gate is open
    (:func:`host_gate_closed`). XLA:CPU runs a step inline on the dispatching thread when
    it costs under ~1000 flops: give the step more than that to keep it asynchronous."""
    _ffi.register()
    return jax.ffi.ffi_call("jax_vmm_testing_host_gate", jax.ShapeDtypeStruct(x.shape, x.dtype))(x)


def host_gate_held() -> int:
    """Steps waiting at the host gate now."""
    return int(_testing.host_gate_held())


@contextlib.contextmanager
def host_reclaims_paused() -> Iterator[None]:
    """Inside the with-block the host reclaim thread serves no deferred release: released
    memory stays mapped and the tables kept for earlier read epochs stay, whatever has
    finished (a test can then tell which table a step read)."""
    _host_reclaim.serving.clear()
    try:
        yield
    finally:
        _host_reclaim.serving.set()


@contextlib.contextmanager
def commits_take_releases_unwaited() -> Iterator[None]:
    """The protection removed: inside the with-block a commit on the CPU first takes back
    every deferred release at once (the core's reclaim, not waiting for the XLA:CPU work
    in flight that may still read it), as an out-of-memory or full-budget commit would
    without ``Arena._commit``'s wait."""
    original = _arena.Arena._commit

    def unwaited(self: Any, commit: Any) -> int:
        self._handle.reclaim()
        return commit()

    _arena.Arena._commit = unwaited
    try:
        yield
    finally:
        _arena.Arena._commit = original


def wait_for_host_reclaims(timeout: float = 60.0) -> bool:
    """Wait until the host reclaim thread (``jax_vmm/memory/host_reclaim.py``) has served
    every deferred release queued so far (their work finished and their memory went).
    False if ``timeout`` seconds passed first."""
    return _host_reclaim.drain(timeout)


@contextlib.contextmanager
def sharded_rollback_skipped() -> Iterator[None]:
    """Inside the with-block a sharded KV arena does not roll back the shards whose
    commit succeeded when another device's failed (the protection removed): their memory
    and ensured tokens stay, which the rollback tests must catch."""
    previous = _sharded._roll_back_shard
    _sharded._roll_back_shard = lambda shard, point: None
    try:
        yield
    finally:
        _sharded._roll_back_shard = previous


# -- context-wide device waits --------------------------------------------------------


@contextlib.contextmanager
def context_wide_device_waits(device: jax.Device) -> Iterator[None]:
    """Inside the with-block the CUDA driver knows no compute stream of ``device`` (a GPU),
    so every device wait of its arenas is a cuCtxSynchronize: one that runs while another
    thread captures a CUDA graph fails and invalidates that capture."""
    ordinal = resolve_device(device).ordinal
    streams = _testing.forget_compute_streams(ordinal)
    try:
        yield
    finally:
        _testing.register_compute_streams(ordinal, streams)


def keep_compute_streams_past_their_clients() -> None:
    """From now on, registered compute streams stay known after their JAX client goes
    (and at exit): the bug the finalizers of ``jax_vmm/base/compute_streams.py`` prevent, a
    later device wait on a destroyed stream. For a test's child process; not undone."""
    for f in _compute_streams._finalizers:
        f.detach()


# -- views without leases -------------------------------------------------------------


@contextlib.contextmanager
def legacy_views() -> Iterator[None]:
    """Views made inside the with-block (``buf.array``, ``kv.k[l]``) have no view lease:
    they keep the arena alive through a Python reference that their DLPack deleter drops
    with the GIL taken (on whatever thread XLA releases them, also during interpreter
    exit), and ``free()`` does not see them (their range may be placed again under
    them)."""
    previous = _arena._core_view_factory
    _arena._core_view_factory = _testing.legacy_view
    try:
        yield
    finally:
        _arena._core_view_factory = previous


# -- decode attention with its protections removable ---------------------------------


def decode_attention(
    q: Any,
    k: Any,
    v: Any,
    lengths: Any,
    *,
    out_init: Any = None,
    read_all_tokens: bool = False,
    skip_output: bool = False,
    scale: float | None = None,
    chunk: int = 0,
    splits: int = 0,
    impl: str = "auto",
    k_scale: Any = None,
    v_scale: Any = None,
    ctas: int = 0,
    stages: int = 0,
    min_tiles: int = 0,
    **options: Any,
) -> jax.Array:
    """``jax_vmm.decode_attention`` (graph-safe scratch workspace) through the testing
    targets, with the same validation, kernel choice and plan as the private
    ``jax_vmm.ops.attention.decode_attention_tuned`` (the split-K kernel, or the streaming one for
    fp8 caches and impl "stream*", with their plan knobs).

    out_init: an array of q's shape and dtype that becomes the output buffer before the
      kernel runs (aliased; default zeros), e.g. NaN, to show that every element is
      written.
    skip_output: write nothing to the output (out_init comes back unchanged).
    read_all_tokens: (the split-K CPU handler only) also touch every token up to T, as a
      kernel that ignored the lengths would.
    options: q_lengths / window / softcap of the general attention (q ``(B, S, H_q, D)``),
      validated as ``jax_vmm`` attention does (jax_vmm/ops/general_attention.py).
    """
    if options:
        q, options = checked_options(q, k, options)
    call = _prepare_attention(
        q,
        k,
        v,
        lengths,
        scale=scale,
        chunk=chunk,
        splits=splits,
        impl=impl,
        workspace="scratch",
        k_scale=k_scale,
        v_scale=v_scale,
        ctas=ctas,
        stages=stages,
        min_tiles=min_tiles,
        **options,
    )
    if call is None:
        return jnp.zeros(jnp.shape(q), jnp.asarray(q).dtype)
    if read_all_tokens and (call.device.platform != "cpu" or call.stream):
        raise ValueError("read_all_tokens is implemented by the split-K CPU handler only")
    q = call.operands[0]
    out_init = jnp.zeros(q.shape, q.dtype) if out_init is None else jnp.asarray(out_init)
    if out_init.shape != q.shape or out_init.dtype != q.dtype:
        raise ValueError(
            f"out_init must match q: {q.shape} {q.dtype}, got {out_init.shape} {out_init.dtype}"
        )
    attrs = dict(call.attrs, skip_output=bool(skip_output))
    if call.stream:
        target = "jax_vmm_testing_decode_attention_v2"
    else:
        target = "jax_vmm_testing_decode_attention"
        attrs["read_all_tokens"] = bool(read_all_tokens)
    ffi = jax.ffi.ffi_call(
        target,
        call.out_type,
        vmap_method="sequential",
        input_output_aliases={len(call.operands): 0},
    )
    return ffi(*call.operands, out_init, *call.tail, **attrs)


def stream_partition(
    lengths: Any,
    max_tokens: int,
    unit_groups: int,
    ctas: int,
    min_tiles: int,
    tile_tokens: int = 16,
) -> list[list[tuple[int, ...]]]:
    """The streaming attention kernel's partition as the kernel computes it
    (ffi/src/ops/attention/stream_plan.h): per working CTA, its pieces as tuples (b, hg,
    first_tile, tiles, slot or -1 for a whole unit, first_owner, last_owner), for tiles of
    ``tile_tokens`` tokens (the plan's ``tile_tokens``: 16, or 32 for K/V rows of at most
    128 bytes)."""
    parts = _testing.attention_stream_partition(
        [int(n) for n in lengths],
        int(max_tokens),
        int(unit_groups),
        int(ctas),
        int(min_tiles),
        int(tile_tokens),
    )
    return [list(pieces) for pieces in parts]


def fast_div(divisor: int, dividends: Any) -> np.ndarray:
    """``FastDivmod(divisor).Div(n)`` (ffi/src/common/fast_divmod.h, the tiled kv_write
    kernel's token-of-a-vector division) for each n in ``dividends``, computed on the host
    with the device's arithmetic. divisor in [1, 2^31), each n in [0, 2^31)."""
    n = np.ascontiguousarray(dividends, np.uint32)
    return np.asarray(_testing.fast_div(int(divisor), n), np.uint32)


# -- scratch --------------------------------------------------------------------------


def scratch_probe(
    x: jax.Array,
    workspace_bytes: int | None = None,
    *,
    reserve_at: Literal["initialize", "trace"] = "initialize",
    device: jax.Device | None = None,
) -> tuple[jax.Array, jax.Array]:
    """``y = x`` copied through a scratch workspace of ``workspace_bytes`` (default
    ``x.nbytes``). Returns ``(y, address)``: ``address`` is the int32 ``(lo, hi)`` pair of
    the workspace pointer the call used (see :func:`address_of`).

    ``reserve_at`` says where the workspace is sized before any capture: "initialize"
    (the CUDA handler's kInitialize stage reserves it on its stream) or "trace" (this
    function calls ``jax_vmm.ops.scratch.reserve`` for ``device`` now, at trace time)."""
    nbytes = int(x.size) * jnp.dtype(x.dtype).itemsize
    ws = nbytes if workspace_bytes is None else int(workspace_bytes)
    if ws < nbytes:
        raise ValueError(f"workspace_bytes={ws} is smaller than the input ({nbytes} bytes)")
    if reserve_at not in ("initialize", "trace"):
        raise ValueError(f"reserve_at must be 'initialize' or 'trace', got {reserve_at!r}")
    _ffi.register()
    if reserve_at == "trace":
        _scratch_reserve(ws, device)
    y, addr = jax.ffi.ffi_call(
        "jax_vmm_scratch_probe",
        (jax.ShapeDtypeStruct(x.shape, x.dtype), jax.ShapeDtypeStruct((2,), jnp.int32)),
    )(x, workspace_bytes=ws, reserve_at_initialize=reserve_at == "initialize")
    return y, addr


def scratch_probe_stats() -> dict:
    """Host invocations of the probe: ``calls``, ``captured_calls`` (made while a CUDA
    graph was captured) and ``initialize_calls`` (CUDA kInitialize stage)."""
    return dict(_testing.scratch_probe_stats())


def address_of(addr: jax.Array) -> int:
    """The pointer from a :func:`scratch_probe` ``address`` result."""
    lo, hi = (int(a) & 0xFFFFFFFF for a in jax.device_get(addr))
    return (hi << 32) | lo


def scratch_get(device: int, stream: int, nbytes: int, capturing: bool) -> int:
    """The address of a workspace of at least ``nbytes`` for (``device``, ``stream``), as
    a custom call's Get() would serve it, with ``capturing`` standing for the stream's
    capture state (device -1 is the host). Raises ``RuntimeError`` where Get() refuses."""
    return int(_testing.scratch_get(int(device), int(stream), int(nbytes), bool(capturing)))


@contextlib.contextmanager
def free_scratch_on_growth() -> Iterator[None]:
    """Inside the with-block every scratch growth moves the workspace and frees the
    outgrown block at once, in both modes: the bug graph-safe scratch exists to prevent
    (a graph captured before the growth then replays into freed memory). A freed VMM
    block keeps its virtual range reserved, reading zeros, so a stale writer faults."""
    previous = bool(_testing.scratch_free_on_growth())
    _testing.scratch_set_free_on_growth(True)
    try:
        yield
    finally:
        _testing.scratch_set_free_on_growth(previous)


def record_stages_off() -> contextlib.AbstractContextManager[Any]:
    """Inside the with-block calls traced lower to the plain targets on a GPU instead of
    their recorded variants (base/record_stages.py), which XLA then traces into its
    command buffers. Takes effect for functions traced inside the block."""
    return mock.patch.object(_record_stages, "_use_recorded", False)
