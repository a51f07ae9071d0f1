"""Arena and Buffer: reserved virtual memory exposed to JAX as zero-copy arrays."""

from __future__ import annotations

import gc
import logging
import math
import threading
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from ..base.args import as_flag, as_index, as_int, as_shape, refuse_copy
from ..base.compute_streams import register_compute_stream
from ..base.devices import DeviceTarget, resolve_device
from ..base.errors import ArenaAsleepError, ArenaClosedError, ReservationFullError
from ..base.loader import core as _core
from . import host_reclaim
from .budget import MemoryBudget, check_budget
from .host_wait import in_flight, wait_for_host_work
from .stats import ArenaStats

log = logging.getLogger("jax_vmm")

# Every Arena not yet collected: a commit refused for memory counts them around the garbage
# collection it runs (Arena._commit).
_live_arenas: weakref.WeakSet[Arena] = weakref.WeakSet()


def _open_arenas() -> set[int]:
    """Identities of the arenas not yet collected nor closed (those that hold memory)."""
    return {id(a) for a in list(_live_arenas) if not a.closed}


# DLPack dtype codes (dlpack.h).
_DL_INT, _DL_UINT, _DL_FLOAT, _DL_BFLOAT, _DL_BOOL = 0, 1, 2, 4, 6
_DL_FLOAT8_E4M3FN = 10  # DLPack 1.1; jax 0.10.2 imports it zero-copy as float8_e4m3fn


def _dlpack_dtype(dtype: np.dtype) -> tuple[int, int]:
    if not dtype.isnative:
        raise TypeError(
            f"dtype {dtype.str} is not in this machine's byte order; arena memory holds "
            f"native values: use {dtype.newbyteorder('=').name}"
        )
    if dtype == jnp.bfloat16:
        return _DL_BFLOAT, 16
    if dtype == jnp.float8_e4m3fn:
        return _DL_FLOAT8_E4M3FN, 8
    kind = {"i": _DL_INT, "u": _DL_UINT, "f": _DL_FLOAT, "b": _DL_BOOL}.get(dtype.kind)
    if kind == _DL_FLOAT and dtype.itemsize < 2:
        kind = None  # other 8-bit floats (float8_e5m2, ...) have no plain DLPack float code
    if kind is None or dtype.itemsize not in (1, 2, 4, 8):
        raise TypeError(
            f"dtype {dtype} cannot back an arena buffer; use a float (float16, bfloat16, "
            "float32, float64, float8_e4m3fn), integer or bool dtype"
        )
    return kind, dtype.itemsize * 8


def _canonical(src: np.ndarray) -> np.ndarray:
    """``src`` in the dtype JAX gives it (with x64 off, int64 -> int32, float64 ->
    float32), so the buffer holds what its view reads and the view is zero-copy. Integers
    that do not fit are refused rather than wrapped."""
    if not src.dtype.isnative:  # the bytes go in as they are: native order first
        src = src.astype(src.dtype.newbyteorder("="))
    dtype = np.dtype(jax.dtypes.canonicalize_dtype(src.dtype))
    if dtype == src.dtype:
        return src
    if src.dtype.kind == "c":  # named as given: complex128 is refused, not "complex64"
        _dlpack_dtype(src.dtype)
    if np.issubdtype(dtype, np.inexact) and src.size:
        with np.errstate(over="ignore"):
            out = src.astype(dtype)
        if np.count_nonzero(np.isfinite(out)) != np.count_nonzero(np.isfinite(src)):
            raise ValueError(
                f"Arena.put: a {src.dtype} array with finite values beyond {dtype}'s range "
                f"(|x| > {np.finfo(dtype).max:.3g}) would become inf in {dtype}, the dtype "
                "JAX uses for it with x64 off; enable x64 (jax.config.update("
                "'jax_enable_x64', True)) or pass values that fit"
            )
        return out
    if np.issubdtype(dtype, np.integer) and src.size:
        info = np.iinfo(dtype)
        if src.min() < info.min or src.max() > info.max:
            raise ValueError(
                f"Arena.put: a {src.dtype} array with values in [{src.min()}, {src.max()}] "
                f"does not fit {dtype}, the dtype JAX uses for it with x64 off; enable "
                "x64 (jax.config.update('jax_enable_x64', True)) or pass values that fit"
            )
    return src.astype(dtype)


def _create_core_arena(
    driver: str,
    ordinal: int,
    reserve_bytes: int,
    chunk_bytes: int,
    handle_bytes: int,
    zero_fill: bool,
) -> Any:
    return _core.create_arena(driver, ordinal, reserve_bytes, chunk_bytes, handle_bytes, zero_fill)


#: Makes the C++ arena behind every :class:`Arena` (and so every ``kv_arena``):
#: ``(driver, ordinal, reserve_bytes, chunk_bytes, handle_bytes, zero_fill) -> core
#: arena``. The one seam for test hooks: ``jax_vmm.testing.fault_injection()`` replaces it
#: for the duration of its with-block; nothing else should.
_core_arena_factory = _create_core_arena


def _lease_view(
    handle: Any,
    buffer_id: int,
    shape: list[int],
    code: int,
    bits: int,
    device_type: int,
    ordinal: int,
) -> Any:
    return handle.view(buffer_id, shape, code, bits, device_type, ordinal)


#: Makes the DLPack capsule behind every view: ``(core arena, buffer id, shape, dtype
#: code, bits, DLPack device type, ordinal) -> capsule``. The capsule's deleter releases a
#: view lease and needs no GIL. The seam for ``jax_vmm.testing.legacy_views()``, which
#: swaps in views without a lease (GIL-taking deleter) for its with-block; nothing else.
_core_view_factory = _lease_view


class _DLPackCapsule:
    """Presents a DLPack capsule from the core through the ``__dlpack__`` protocol that
    ``jax.dlpack.from_dlpack`` expects. Single use, like the capsule."""

    def __init__(self, capsule: Any, device_type: int, device_id: int):
        self._capsule = capsule
        self._device = (device_type, device_id)

    def __dlpack__(
        self, stream: Any = None, max_version: Any = None, dl_device: Any = None, copy: Any = None
    ) -> Any:
        # Arena memory is written only by host code that has already synchronised, so
        # no stream ordering is needed for the consumer.
        capsule, self._capsule = self._capsule, None
        if capsule is None:
            raise RuntimeError("this DLPack capsule was already consumed")
        return capsule

    def __dlpack_device__(self) -> tuple[int, int]:
        return self._device


class Buffer:
    """A buffer at a fixed address inside an :class:`Arena`.

    Nothing is backed until :meth:`commit`; unbacked bytes read as zeros. :attr:`array`
    returns a fresh zero-copy ``jax.Array`` view each time it is read (a donated view is
    consumed by JAX, so do not cache one across donating calls). Views keep the arena's
    address range alive. Thread-safe: the arena serialises commits.
    """

    def __init__(self, arena: Arena, info: dict, shape: tuple[int, ...], dtype: np.dtype):
        self._arena = arena
        self._id: int = info["id"]
        self._uid: int = info["uid"]
        self._freed = False
        self.name: str = info["name"]
        self.offset: int = info["offset"]
        self.address: int = info["address"]
        self.nbytes: int = info["nbytes"]
        self.shape = shape
        self.dtype = dtype

    @property
    def id(self) -> int:
        """Index of the buffer in its arena (never reused within the arena)."""
        return self._id

    @property
    def uid(self) -> int:
        """Process-unique identity: no other buffer or arena of this process has it, ever
        (addresses, by contrast, are reused)."""
        return self._uid

    @property
    def arena(self) -> Arena:
        return self._arena

    @property
    def freed(self) -> bool:
        return self._freed

    @property
    def backed_bytes(self) -> int:
        self._check_live("Buffer.backed_bytes")
        return self._arena._handle.buffer(self._id)["backed_bytes"]

    def live_views(self) -> int:
        """Views of this buffer alive now (JAX releases a view when the array is deleted
        and no computation uses it any more, on any thread)."""
        self._check_live("Buffer.live_views")
        return self._arena._handle.buffer_live_views(self._id)

    @property
    def array(self) -> jax.Array:
        return self.view(self.shape, self.dtype, _op="Buffer.array")

    def view(
        self, shape: Sequence[int] | None = None, dtype: Any = None, *, _op: str = "Buffer.view"
    ) -> jax.Array:
        """A zero-copy ``jax.Array`` over this buffer's memory with another shape/dtype
        (it must fit in :attr:`nbytes`)."""
        self._arena._check_open(_op)
        self._check_live(_op)
        shape = self.shape if shape is None else as_shape(shape)
        dtype = self.dtype if dtype is None else np.dtype(jnp.dtype(dtype))
        code, bits = _dlpack_dtype(dtype)
        if np.dtype(jax.dtypes.canonicalize_dtype(dtype)) != dtype:
            raise TypeError(
                f"Buffer.view: a {dtype} view needs jax_enable_x64 (without it JAX would "
                f"convert the buffer to {jax.dtypes.canonicalize_dtype(dtype)}: a copy, "
                "not a view of the arena); enable x64, or pass a 32-bit dtype= to view "
                "the same bytes"
            )
        t = self._arena._target
        if not self._arena._handle.views_exported:
            # The first view gives back every deferred release at once (from then on a
            # reader may touch any byte): on the CPU the work that may read them first.
            self._arena._wait_for_host_work()
        capsule = _core_view_factory(
            self._arena._handle,
            self._id,
            list(shape),
            code,
            bits,
            t.dlpack_device_type,
            t.dlpack_device_id,
        )
        return jax.dlpack.from_dlpack(
            _DLPackCapsule(capsule, t.dlpack_device_type, t.dlpack_device_id), copy=False
        )

    def commit(self, start: int = 0, stop: int | None = None) -> int:
        """Back bytes ``[start, stop)`` with physical memory (rounded out to whole chunks).
        Idempotent. Returns the bytes newly backed. Raises ``MemoryError``
        (:class:`~jax_vmm.errors.OutOfMemoryError`) leaving the buffer unchanged. Waits for
        the device only once the arena has handed out a raw view (a reader could run over
        the pages being mapped) or to zero-fill released memory it takes back."""
        self._check_live("Buffer.commit")
        start, stop = self._range(start, stop)
        return self._arena._commit(lambda: self._arena._handle.commit(self._id, start, stop))

    def decommit(self, start: int = 0, stop: int | None = None, *, wait: bool = False) -> int:
        """Give back the physical memory of the chunks that lie fully inside
        ``[start, stop)`` (plus the buffer's last partial chunk when ``stop`` is the end).
        Returns the bytes no longer backed.

        Never waits for the device: kernels launched after the call skip those chunks, and
        the memory goes back to the driver once the device has finished the work launched
        before it (``wait=True``: before returning; or call :meth:`Arena.reclaim`). Until
        then a raw view of the range may still read the old bytes; afterwards it reads
        zeros. Once the arena has handed out a raw view (``.array``, ``.view``, ``kv.k[l]``)
        the call waits for the device itself and gives the memory back at once: JAX may
        keep arrays over arena memory past the view (see ``docs/design.md``)."""
        self._check_live("Buffer.decommit")
        start, stop = self._range(start, stop)
        wait = as_flag(wait, "wait")
        self._arena._generation += 1
        self._arena._wait_for_host_work()
        return self._arena._handle.decommit(self._id, start, stop, wait)

    def backed_prefix(self, start: int, stop: int) -> int:
        """Bytes backed contiguously from ``start`` (stops at ``stop`` or the first hole)."""
        self._check_live("Buffer.backed_prefix")
        start, stop = self._range(start, stop)
        return self._arena._handle.backed_prefix(self._id, start, stop)

    def free(self) -> None:
        """Decommit the buffer and return its address range to the arena. Views made
        before stay valid and read zeros; the range is placed again only once the last of
        them is gone. Later calls on this Buffer raise ``ValueError``."""
        self._arena._check_open("Buffer.free")
        self._check_live("Buffer.free")
        self._arena._generation += 1
        self._arena._wait_for_host_work()
        self._arena._handle.free(self._id)
        self._freed = True
        self._arena._forget(self)

    def _check_live(self, op: str) -> None:
        if self._freed:
            raise ValueError(
                f"{op}: buffer '{self.name}' was freed (Buffer.free()); allocate a new buffer"
            )

    def __reduce_ex__(self, protocol: Any) -> Any:
        raise TypeError(
            "jax_vmm.Buffer cannot be pickled or copied: it is memory of its "
            "arena. Share the object itself, or copy data out with "
            "np.asarray(buf.array)"
        )

    def _range(self, start: int, stop: int | None) -> tuple[int, int]:
        start = as_index(start, "start")
        stop = self.nbytes if stop is None else as_index(stop, "stop")
        if start > stop or stop > self.nbytes:
            raise ValueError(
                f"Buffer '{self.name}': byte range [{start}, {stop}) is outside "
                f"[0, {self.nbytes}); "
                "expected 0 <= start <= stop <= nbytes"
            )
        return start, stop

    def __repr__(self) -> str:
        return (
            f"Buffer(name={self.name!r}, shape={self.shape}, dtype={self.dtype}, "
            f"address=0x{self.address:x}, nbytes={self.nbytes}{', freed' if self._freed else ''})"
        )


class Arena:
    """One reserved virtual address range on a device; buffers are placed in it and
    backed page by page.

    ``Arena(reserve_bytes, device=None, chunk_bytes=None, *, handle_bytes=None,
    zero_fill=True)``: ``device`` is a ``jax.Device`` (default ``jax.devices()[0]``); CUDA
    GPUs use driver VMM, the CPU a host mmap/memfd backend. ``chunk_bytes`` is the unit of
    commits and releases (default: the device granularity on CUDA, 64 KiB on the host).
    ``handle_bytes`` (a multiple of ``chunk_bytes``; default ``chunk_bytes``) is the largest
    physical allocation one commit makes: a commit of a long run takes few, large
    allocations (fewer driver calls), but a release frees an allocation's memory only
    once every chunk of it is released. ``zero_fill``: newly backed memory reads zeros
    (else whatever the memory held: cheaper, for data that is written before it is read).
    ``budget``: a :class:`~jax_vmm.MemoryBudget` of the same device that caps the
    physical memory of this arena together with the budget's other arenas
    (``docs/sharing.md``). ``name``: how the budget's stats and errors call this arena
    (``"weights"`` reads there as ``arena 7 (weights)``; default just ``arena 7``).

    ``close()`` releases all physical memory at once; views that are still alive then
    read zeros (the address range stays reserved until the last view is gone). Also a
    context manager. ``sleep()`` / ``wake()`` give all physical memory back and take it
    again at the same addresses, contents kept on the host (``docs/sleep.md``).
    Thread-safe.
    """

    def __init__(
        self,
        reserve_bytes: int,
        device: jax.Device | None = None,
        chunk_bytes: int | None = None,
        *,
        handle_bytes: int | None = None,
        zero_fill: bool = True,
        budget: MemoryBudget | None = None,
        name: str | None = None,
        _kind: str = "arena",
    ):
        # _kind (jax_vmm.kv only): what the budget's stats and errors call this arena
        # before its uid ("KV arena 42").
        reserve_bytes = as_int(reserve_bytes, "reserve_bytes")
        if reserve_bytes <= 0:
            raise ValueError(
                "reserve_bytes must be > 0 (the size of the virtual range to "
                f"reserve), got {reserve_bytes}"
            )
        if reserve_bytes >= 1 << 64:
            raise ValueError(
                f"reserve_bytes={reserve_bytes} is too large: it must be below 2^64 "
                "(and fit the process's virtual address space); reserve less"
            )
        chunk = 0 if chunk_bytes is None else as_int(chunk_bytes, "chunk_bytes")
        if chunk_bytes is not None and not 0 < chunk < 1 << 64:
            raise ValueError(
                f"chunk_bytes must be > 0 and below 2^64 (or None for the default), got {chunk}"
            )
        handle = 0 if handle_bytes is None else as_int(handle_bytes, "handle_bytes")
        if handle_bytes is not None and not 0 < handle < 1 << 64:
            raise ValueError(
                f"handle_bytes must be > 0 and below 2^64 (or None for one allocation per "
                f"chunk), got {handle}"
            )
        zero_fill = as_flag(zero_fill, "zero_fill")
        budget = check_budget(budget, "Arena")
        if name is not None and not isinstance(name, str):
            raise TypeError(f"Arena: name must be a str or None, got {type(name).__name__}")
        self.name: str | None = name
        self._budget = budget
        self._target: DeviceTarget = resolve_device(device)
        self._handle = _core_arena_factory(
            self._target.driver, self._target.ordinal, reserve_bytes, chunk, handle, zero_fill
        )
        try:
            # How the budget's stats and errors (and _with_parked_note) name this arena.
            self._budget_label = f"{_kind} {self._handle.uid}" + (f" ({name})" if name else "")
            if budget is not None:
                budget._join(self._handle, self._target, self._budget_label)
            # before the arena's first device wait (it waits for that stream)
            register_compute_stream(self._target)
        except BaseException:
            self._handle.close()
            raise
        self._lock = threading.Lock()
        self._buffers: list[Buffer] = []
        self._free_at_wake: list[Buffer] = []  # guarded by _lock (_free_failed_put)
        _live_arenas.add(self)
        # Bumped by every call that may unback memory behind a KV arena's bookkeeping
        # (Buffer.decommit/free, close, sleep, wake): KVArena.ensure trusts its own record
        # of backed tokens only while this is unchanged.
        self._generation = 0
        # Called with True before the arena sleeps and False once it is awake again (a
        # KV arena's table of ensured tokens): weak, the arena does not keep them alive.
        self._sleep_hooks: list[weakref.WeakMethod] = []
        log.debug(
            "reserved %d bytes on %s at 0x%x",
            self._handle.reserved_bytes,
            self._target.device,
            self._handle.base,
        )

    # -- placement -----------------------------------------------------------------
    def allocate(
        self, shape: Sequence[int] | int, dtype: Any = jnp.float32, name: str | None = None
    ) -> Buffer:
        """Place a buffer of ``shape`` and ``dtype``; nothing is backed yet."""
        self._check_open("Arena.allocate")
        shape = as_shape(shape)
        if dtype is None:  # JAX's default float (float32 with x64 off), as jnp.zeros
            dtype = jax.dtypes.canonicalize_dtype(jnp.float64)
        try:
            np_dtype = np.dtype(jnp.dtype(dtype))
        except TypeError:
            raise TypeError(f"dtype {dtype!r} is not a JAX dtype") from None
        _dlpack_dtype(np_dtype)
        if name is not None and not isinstance(name, str):
            raise TypeError(f"name must be a str or None, got {type(name).__name__}")
        nbytes = math.prod(shape) * np_dtype.itemsize
        if nbytes > self._handle.reserved_bytes:
            raise ReservationFullError(
                f"Arena.allocate({name!r}): shape {shape} of {np_dtype} needs {nbytes} bytes, more "
                f"than the whole {self._handle.reserved_bytes} bytes reservation; create the arena "
                "with a larger reserve_bytes"
            )
        try:
            info = self._handle.allocate(nbytes, name or "")
        except ReservationFullError as e:
            held = int(self._handle.stats().get("held_range_bytes", 0))
            if not held:
                raise
            raise ReservationFullError(
                f"{e} ({held} bytes of the reservation are held by freed buffers whose "
                "views are still alive: a freed range is placed again once its last view "
                "is gone; drop those views first)"
            ) from None
        buf = Buffer(self, info, shape, np_dtype)
        with self._lock:
            self._buffers.append(buf)
        return buf

    # -- properties ------------------------------------------------------------------
    @property
    def uid(self) -> int:
        """Process-unique identity: no other arena or buffer of this process has it, ever
        (a new arena may reuse a destroyed one's addresses, never its uid)."""
        return self._handle.uid

    @property
    def device(self) -> jax.Device:
        return self._target.device

    @property
    def base(self) -> int:
        return self._handle.base

    @property
    def reserved_bytes(self) -> int:
        return self._handle.reserved_bytes

    @property
    def backed_bytes(self) -> int:
        return self._handle.stats()["backed_bytes"]

    @property
    def granularity(self) -> int:
        return self._handle.granularity

    @property
    def chunk_bytes(self) -> int:
        return self._handle.chunk_bytes

    @property
    def handle_bytes(self) -> int:
        return self._handle.handle_bytes

    @property
    def zero_fill(self) -> bool:
        return self._handle.zero_fill

    @property
    def asleep(self) -> bool:
        return self._handle.asleep

    @property
    def driver(self) -> str:
        return self._handle.driver_kind

    @property
    def closed(self) -> bool:
        return self._handle.closed

    @property
    def buffers(self) -> list[Buffer]:
        with self._lock:
            return list(self._buffers)

    def stats(self) -> ArenaStats:
        """A plain dict: reserved/backed/peak bytes; ``held_bytes`` (physical memory held:
        backed + ``parked_bytes`` (released chunks inside allocations still in use) +
        ``retired_bytes`` (released, waiting for the device)); commit and decommit counts
        and cumulative seconds, ``commit_drains`` (device waits before new memory was
        mapped, by a commit, wake or restore, because raw views were handed out
        (``views_exported``) or a zero-filling arena revived chunks; a commit that then
        failed and rolled back still counts its wait), ``live_views`` and the
        address space of freed buffers they hold back (``held_range_bytes``);
        ``unbacked_reads_zero`` (false while the arena defers its zero mapping: before
        its first view a raw read of an unbacked byte faults); sleep and transfer state;
        driver kind, granularity, chunk and handle size, and more."""
        stats: ArenaStats = dict(self._handle.stats())  # type: ignore[assignment]
        return stats

    # -- memory ----------------------------------------------------------------------
    def reclaim(self) -> int:
        """Wait for the device, then give every released allocation back to the driver
        (releases otherwise do it in the background). Returns the bytes given back."""
        self._wait_for_host_work()
        return self._handle.reclaim()

    def put(self, x: Any, *, name: str | None = None) -> jax.Array:
        """Copy an array (a ``jax.Array`` on one device, or anything ``numpy.asarray``
        takes) into a new buffer of this arena and return a zero-copy view of it. The
        buffer (``arena.buffers[-1]``) sleeps and wakes with the arena, so a program can
        give its weights' memory back too."""
        self._check_open("Arena.put")
        if self._handle.asleep:
            raise ArenaAsleepError(
                "Arena.put: the arena is asleep (sleep() gave its memory back); call wake() first"
            )
        src = x
        if isinstance(x, jax.Array):
            if len(x.devices()) != 1 or not x.is_fully_addressable:
                raise ValueError(
                    "Arena.put: the array must live on one device; got one on "
                    f"{sorted(str(d) for d in x.devices())}"
                )
            if next(iter(x.devices())) != self.device:
                src = jax.device_put(x, self.device)
            src.block_until_ready()
        else:
            src = _canonical(np.asarray(x))  # (ascontiguousarray would make 0-d 1-d)
            if not src.flags.c_contiguous:
                src = np.ascontiguousarray(src)
        shape, dtype = tuple(src.shape), np.dtype(src.dtype)
        if not shape or math.prod(shape) == 0:
            raise ValueError(
                f"Arena.put: needs an array with at least one dimension and one "
                f"element; got shape {shape}"
            )
        try:
            buf = self.allocate(shape, dtype, name=name)
        except ReservationFullError as e:
            raise ReservationFullError(f"Arena.put: {e}") from None
        try:
            buf.commit()
            pointer = src.unsafe_buffer_pointer() if isinstance(src, jax.Array) else src.ctypes.data
            self._handle.copy_in(buf.id, 0, int(pointer), buf.nbytes)
        except BaseException:
            self._free_failed_put(buf)
            raise
        return buf.array

    def _free_failed_put(self, buf: Buffer) -> None:
        """Free the buffer of a put that failed. Another thread may have put the arena to
        sleep since the put began (its copy then failed), and an asleep arena refuses a
        free: the buffer is then freed by the next successful wake()."""
        try:
            buf.free()
        except ArenaAsleepError:
            with self._lock:
                self._free_at_wake.append(buf)

    def free_host_cache(self) -> None:
        """Free the page-locked host memory kept for the next sleep (or offload)."""
        self._handle.free_host_cache()

    def live_views(self) -> int:
        """Views of this arena's buffers alive now (freed buffers' included). A view is
        released when JAX deletes its array and no computation uses it any more."""
        return self._handle.live_views()

    def _forget(self, buf: Buffer) -> None:
        with self._lock:
            self._buffers.remove(buf)

    # -- lifetime --------------------------------------------------------------------
    def sleep(self, keep: str = "host") -> None:
        """Wait for device work on the arena, copy every backed chunk to page-locked host
        memory (``keep="host"``) or drop it (``keep="discard"``), and give all physical
        memory back (the driver's free-memory count shows it on return). Addresses stay:
        views and compiled programs stay valid; while asleep writes through jax_vmm ops
        are dropped (and counted), reads see zeros, commits and releases raise
        :class:`~jax_vmm.errors.ArenaAsleepError`. See ``docs/sleep.md``."""
        if keep not in ("host", "discard"):
            raise ValueError(f"Arena.sleep: keep must be 'host' or 'discard', got {keep!r}")
        self._check_open("Arena.sleep")
        self._generation += 1
        self._wait_for_host_work()  # work in flight reads over the old table (CPU)
        self._run_sleep_hooks(True)
        try:
            self._handle.sleep(keep == "host")
        except BaseException:
            if not self._handle.asleep:
                self._run_sleep_hooks(False)
            raise

    def wake(self) -> None:
        """Back exactly the chunks that were backed before :meth:`sleep`, at the same
        addresses, and copy their contents back (``keep="discard"``: zeros with
        ``zero_fill``, else undefined). All or nothing: on failure the arena stays asleep
        with its contents kept, and a later ``wake()`` can succeed."""
        self._check_open("Arena.wake")
        self._generation += 1
        self._commit(self._handle.wake)
        self._run_sleep_hooks(False)
        with self._lock:
            pending, self._free_at_wake = self._free_at_wake, []
        for buf in pending:  # failed puts' buffers (_free_failed_put)
            buf.free()

    def close(self) -> None:
        """Release all physical memory. Later calls on the arena raise
        :class:`~jax_vmm.errors.ArenaClosedError`; live views read zeros. Idempotent."""
        self._generation += 1
        if not self._handle.closed:
            self._wait_for_host_work()
        self._handle.close()

    def __enter__(self) -> Arena:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _on_sleep(self, hook: Callable[[bool], None]) -> None:
        """Register a bound method to call with True before :meth:`sleep` and with False
        after :meth:`wake` (or a sleep that failed)."""
        self._sleep_hooks.append(weakref.WeakMethod(hook))  # type: ignore[arg-type]

    def _run_sleep_hooks(self, asleep: bool) -> None:
        for ref in list(self._sleep_hooks):
            hook = ref()
            if hook is not None:
                hook(asleep)

    def _wait_for_host_work(self) -> None:
        """Before memory is unmapped, copied out or punched, and before a KV arena's
        table of ensured tokens is lowered (work in flight must still see the tokens it
        was dispatched for): on the CPU, wait for the XLA:CPU work that may still use them
        (``host_wait.py``; a GPU arena's core waits for the compute stream itself)."""
        wait_for_host_work(self._target.device)

    def _commit(self, commit: Callable[[], int]) -> int:
        """Run a core call that commits (a commit, ``wake``, ``restore``). On the CPU,
        memory released while XLA:CPU work that may read it was in flight goes back on the
        host reclaim thread once that work is done, never from inside a commit
        (``host_reclaim.py``): a commit that ran out of memory (or budget) with such
        releases pending waits for them and tries once more, as a GPU commit waits for the
        device. A zero-filling arena waits before the commit: it may take such memory back
        and zero it. A commit refused for memory also tries once more after a garbage
        collection that found something: an arena nobody references any more holds its
        memory (and its place in a budget) until then, as it and its buffers refer to each
        other; a collection that took no open arena frees nothing, so it does not retry."""
        host = self._target.device.platform == "cpu"
        if host and self.zero_fill and host_reclaim.pending():
            host_reclaim.drain()
        try:
            return commit()
        except MemoryError as e:
            holding = _open_arenas()
            gc.collect()
            collected = bool(holding - _open_arenas())  # one went, and its memory with it
            reclaim = host and host_reclaim.pending()
            if not (collected or reclaim):
                raise self._with_parked_note(e) from None
        if reclaim:
            host_reclaim.drain()
        try:
            return commit()
        except MemoryError as e:
            raise self._with_parked_note(e) from None

    def _with_parked_note(self, e: MemoryError) -> MemoryError:
        """A budget refusal that names what its arenas hold parked (released chunks inside
        allocations that still back others: handle_bytes), which no reclaim gives back."""
        if self._budget is None or "memory budget" not in str(e):
            return e
        members = [a for a in list(_live_arenas) if a._budget is self._budget and not a.closed]
        parked = [(a._budget_label, int(a._handle.stats()["parked_bytes"])) for a in members]
        where = ", ".join(f"{label}: {n} bytes" for label, n in parked if n)
        if not where:
            return e
        out = type(e)(
            f"{e} Of what they hold, these bytes are parked: released chunks inside "
            f"allocations that still back other chunks ({where}); they go back once the rest "
            "of their allocation is released (release the sequence without keep_tokens, or "
            "use a smaller handle_bytes)."
        )
        out.__dict__.update(getattr(e, "__dict__", {}))
        return out

    def _host_work_to_outlive(self) -> list[jax.Array] | None:
        """For a release that does not wait (a KV arena's ``release`` / ``shrink``): the
        XLA:CPU work in flight that the memory it gives back must outlive, as arrays
        (``host_wait.in_flight``). Empty when the release may unmap at once (another
        platform, whose core defers itself, or nothing in flight); None when the caller
        must wait first (:meth:`_wait_for_host_work`): raw views were handed out, so the
        core unmaps inline."""
        if self._target.device.platform != "cpu":
            return []
        if self._handle.views_exported:
            return None
        return in_flight(self._target.device)

    def _reclaim_after(self, work: list[jax.Array], then: Callable[[], None]) -> None:
        """Give back what the releases since the last call retired
        (``decommit_ranges(defer_unmap=True)``) once ``work`` has finished, then call
        ``then``; on the host reclaim thread (``host_reclaim.py``)."""
        sync = self._handle.begin_host_wait()
        ref = weakref.ref(self)  # a job still queued at exit keeps nothing alive

        def reclaim() -> None:
            arena = ref()
            if arena is not None:
                arena._handle.reclaim_retired_before(sync)
            then()

        host_reclaim.after(work, reclaim)

    def _check_open(self, op: str) -> None:
        if self._handle.closed:
            raise ArenaClosedError(f"{op}: the arena is closed; create a new arena")

    def __reduce_ex__(self, protocol: Any) -> Any:
        raise refuse_copy("Arena", self._target.device, "np.asarray(buf.array)")

    def __repr__(self) -> str:
        s = self._handle.stats()
        return (
            f"Arena(driver={s['driver']}, device={self._target.device}, "
            f"reserved={s['reserved_bytes']}, "
            f"backed={s['backed_bytes']}, closed={s['closed']})"
        )
