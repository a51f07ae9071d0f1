"""Formatting and the memory plot shared by the example and the benchmarks."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path


def fmt_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def matplotlib_missing() -> str | None:
    """None when plots can be drawn; else one line saying why not and how to fix it."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return (
            "plot skipped: matplotlib is not installed; get it with `pip install "
            "matplotlib` (or `pip install '.[example]'`), or pass --no-plot"
        )
    return None


def plot_memory(trace: Sequence, capacity_bytes: int, path: Path, *, title: str) -> None:
    """Backed KV memory and live-token bytes per engine call, against the constant
    footprint of a preallocated cache of the same capacity. `trace`: StepRecords."""
    import matplotlib

    matplotlib.use("Agg")  # files only, no display needed
    import matplotlib.pyplot as plt

    mib = 1024.0**2
    steps = list(range(len(trace)))
    fig, ax = plt.subplots(figsize=(8, 4.5), dpi=120)
    ax.axhline(
        capacity_bytes / mib, color="tab:red", ls="--", label="preallocated cache (plain JAX)"
    )
    ax.step(
        steps,
        [r.backed_bytes / mib for r in trace],
        where="post",
        color="tab:blue",
        label="backed KV memory",
    )
    ax.plot(
        steps, [r.live_bytes / mib for r in trace], color="tab:green", lw=1, label="live tokens"
    )
    ax.set_xlabel("engine call (prefills and decode blocks)")
    ax.set_ylabel("MiB")
    ax.set_ylim(bottom=0)
    ax.set_title(title, fontsize=10)
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.16), ncol=3, fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)
