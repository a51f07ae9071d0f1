"""What the benchmarks in bench/ share: timing, the copy-bandwidth floor, size and list
arguments, device choice, looped kv_writes, relative errors, text tables, JSON and plot
output.

The scripts run as ``python bench/NAME.py``, so this folder is first on ``sys.path`` and
they import this module as ``_common``.
"""

from __future__ import annotations

import contextlib
import json
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

KiB, MiB, GiB = 1 << 10, 1 << 20, 1 << 30

# -- arguments ------------------------------------------------------------------------


def parse_size(text: str) -> int:
    """Bytes from '2M', '64MiB', '1.5G', '4096' (K/M/G are powers of 1024)."""
    text = text.strip().upper().removesuffix("B").removesuffix("I")
    mult = {"K": KiB, "M": MiB, "G": GiB}.get(text[-1:], 1)
    return int(float(text.rstrip("KMG")) * mult)


def fmt_size(n: int) -> str:
    """The largest binary unit that divides n exactly: '2 MiB', '64 GiB', '1000 B'."""
    for unit, m in (("GiB", GiB), ("MiB", MiB), ("KiB", KiB)):
        if n >= m and n % m == 0:
            return f"{n // m} {unit}"
    return f"{n} B"


def parse_list(convert: Callable[[str], Any]) -> Callable[[str], list]:
    """An argparse ``type`` for comma-separated values, each passed through `convert`
    (argparse applies it to string defaults too)."""

    def parse(text: str) -> list:
        return [convert(x) for x in text.split(",") if x.strip()]

    return parse


def pick_device(kind: str) -> jax.Device:
    """'cpu'; 'gpu' (exits with a message when JAX has none); 'auto': a GPU if JAX has
    one, else the CPU."""
    if kind == "cpu":
        return jax.devices("cpu")[0]
    gpus = [d for d in jax.devices() if d.platform in ("gpu", "cuda")]
    if kind == "gpu" and not gpus:
        sys.exit("no JAX GPU device (use --device cpu)")
    return gpus[0] if gpus else jax.devices("cpu")[0]


# -- timing ---------------------------------------------------------------------------


#: HBM bandwidth (TB/s) of the physical floor by device kind; others get the H200's.
HBM_TBPS = {"H100": 3.35, "H200": 4.8}


def hbm_tbps(device: jax.Device) -> float:
    """The floor's bandwidth for ``device``: hbm_tbps_of_kind of its device kind."""
    return hbm_tbps_of_kind(getattr(device, "device_kind", ""))


def hbm_tbps_of_kind(kind: str) -> float:
    """The entry in HBM_TBPS of a device named ``kind`` (an "NVIDIA H100 80GB HBM3" is an
    H100), else the H200's 4.8 TB/s."""
    return next((tbps for name, tbps in HBM_TBPS.items() if name in kind), 4.8)


def median_time(fn: Callable[[], Any], repeats: int, runs: int = 1, warmups: int = 2) -> float:
    """Median over `repeats` samples of (wall time of `runs` back-to-back calls, waited
    for) / runs, after `warmups` calls (compile, first command-buffer recording). `fn`
    may return JAX arrays (waited for) or None."""
    for _ in range(warmups):
        jax.block_until_ready(fn())
    samples = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        out = None
        for _ in range(runs):
            out = fn()
        jax.block_until_ready(out)
        samples.append((time.perf_counter() - t0) / runs)
    return statistics.median(samples)


def copy_bandwidth(device: jax.Device, nbytes: int, runs: int = 10, repeats: int = 5) -> float:
    """Bytes read + written per second by a device-to-device copy of `nbytes`: the best of
    an XLA elementwise copy and (GPU, when cupy is there) a runtime memcpy."""
    x = jax.device_put(jnp.arange(nbytes // 4, dtype=jnp.float32), device)
    # x + 1: one read and one write per element, as a plain copy, and not elided.
    f = jax.jit(lambda a: a + jnp.float32(1))
    best = 2 * nbytes / median_time(lambda: f(x), repeats, runs)
    if device.platform != "cpu":
        with contextlib.suppress(ImportError):
            best = max(best, 2 * nbytes / _cupy_memcpy_time(device, nbytes, runs, repeats))
    return best


def _cupy_memcpy_time(device: jax.Device, nbytes: int, runs: int, repeats: int) -> float:
    import cupy

    rt = cupy.cuda.runtime
    with cupy.cuda.Device(device.id):
        a = cupy.empty(nbytes, cupy.uint8)
        b = cupy.empty(nbytes, cupy.uint8)
        a.fill(1)
        for _ in range(2):
            b[...] = a
        rt.deviceSynchronize()
        samples = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            for _ in range(runs):
                rt.memcpyAsync(b.data.ptr, a.data.ptr, nbytes, rt.memcpyDeviceToDevice, 0)
            rt.deviceSynchronize()
            samples.append((time.perf_counter() - t0) / runs)
        return statistics.median(samples)


# -- kv_write loops -------------------------------------------------------------------


def ring_slots(start: Any, i: Any, n: int, num_slots: int) -> jax.Array:
    """The int32 slots of write `i` of `n` consecutive tokens from slot `start`, wrapping
    around a cache of `num_slots` slots: repeated runs keep writing fresh slots."""
    return ((start + i * n + jnp.arange(n, dtype=jnp.int32)) % num_slots).astype(jnp.int32)


def looped_writes(
    update: Callable[[Any, Any, jax.Array], tuple[Any, Any]], n: int, loop: int, num_slots: int
) -> Callable[[Any, Any, Any], tuple[Any, Any, Any]]:
    """``g(k, v, start) -> (k, v, start + loop * n)``: `loop` calls of
    ``update(k, v, slots)`` in one ``fori_loop``, each on the next `n` ring slots. Jit it
    donating all three, so that the device time per write is amortised over the loop."""

    def g(k: Any, v: Any, start: Any) -> tuple[Any, Any, Any]:
        def body(i: Any, kv: tuple[Any, Any]) -> tuple[Any, Any]:
            return update(*kv, ring_slots(start, i, n, num_slots))

        k, v = jax.lax.fori_loop(0, loop, body, (k, v))
        return k, v, start + loop * n

    return g


# -- accuracy -------------------------------------------------------------------------


def rel_err(got: Any, ref: Any) -> float:
    """||got - ref|| / ||ref|| in float64; NaN when `got` is not finite."""
    got, ref = np.asarray(got, np.float64), np.asarray(ref, np.float64)
    if not np.isfinite(got).all():
        return float("nan")
    return float(np.linalg.norm(got - ref) / max(np.linalg.norm(ref), 1e-30))


# -- text output ----------------------------------------------------------------------


def ratio(a: float | None, b: float | None) -> float | None:
    """a / b, or None when either is missing (or b is 0)."""
    return None if a is None or not b else a / b


def fmt(value: Any, template: str, missing: str = "n/a") -> str:
    """template.format(value), or `missing` for None."""
    return missing if value is None else template.format(value)


class Table:
    """A fixed-width text table. Each column is (header, width) or (header, width, align)
    with align '>' (default) or '<'; cells are preformatted strings padded to the width,
    so the header line and the rows cannot drift apart."""

    def __init__(self, *columns: tuple):
        self.columns = [(c[0], c[1], c[2] if len(c) > 2 else ">") for c in columns]

    def header(self) -> str:
        return self.row(*(name for name, _, _ in self.columns))

    def rule(self) -> str:
        return "-" * len(self.header())

    def row(self, *cells: object) -> str:
        if len(cells) != len(self.columns):
            raise ValueError(f"Table.row: {len(cells)} cells for {len(self.columns)} columns")
        return " ".join(f"{c!s:{a}{w}}" for c, (_, w, a) in zip(cells, self.columns))


# -- files ----------------------------------------------------------------------------


def write_json(path: str | Path, obj: Any) -> None:
    """Writes `obj` as JSON (values JSON cannot hold become strings), making the folder."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(obj, indent=1, default=str))


def command_line(script: str, argv: list[str] | None) -> str:
    """How to repeat this run: 'python bench/NAME.py ARGS...' (argv None: this process's)."""
    args = sys.argv[1:] if argv is None else argv
    return " ".join(["python", f"bench/{Path(script).name}", *args])


@contextlib.contextmanager
def two_panel_figure(path: Path, title: str) -> Iterator[tuple[Any, Any]]:
    """Two side-by-side axes for the caller to draw on; on exit the figure gets `title`
    and is saved to `path` (a file only: no display needed)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5), dpi=120)
    try:
        yield axes
        fig.suptitle(title, fontsize=11)
        fig.tight_layout()
        fig.savefig(path)
    finally:
        plt.close(fig)
