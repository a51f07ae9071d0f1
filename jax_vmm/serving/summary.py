"""The decode demo's summary: one dict of what a run served and the memory it held (written
as summary.json), and its printed form."""

from __future__ import annotations

import dataclasses

import jax

from . import engine as E
from . import model as M
from .cache import capacity_bytes
from .report import fmt_bytes


def write_name(cache) -> str:
    if cache.name == "prealloc":
        return "kv_write on array layers (donated scatter)"
    return "kv_write on arena layers (in place)"


#: The cache statistics summarize() reports that add up over the cache's life.
RUN_COUNTERS = (
    "commit_calls",
    "commit_seconds",
    "commits_ahead",
    "decommit_calls",
    "decommit_seconds",
)


def counters_since(stats: dict, before: dict) -> dict:
    """``stats`` with its RUN_COUNTERS counted from ``before`` (an earlier cache.stats()):
    one run's counts when the cache served another run first (decode.py --warmup)."""
    return dict(
        stats, **{k: stats[k] - before[k] for k in RUN_COUNTERS if k in stats and k in before}
    )


def summarize(
    report: E.RunReport,
    stats: dict,
    cache,
    cfg: M.ModelConfig,
    serving: dict,
    device: jax.Device,
    attention: str,
) -> dict:
    capacity = capacity_bytes(cfg, serving["batch"], serving["max_tokens"], cache.kv_dtype)
    # Physical memory: the trace's (a shared chunk counted once). The arena's own peak
    # also sees commits between trace points, but counts a shared chunk at every address
    # that maps it, so it serves only a run that shared nothing.
    peak_backed = max((r.backed_bytes for r in report.trace), default=0)
    if not stats.get("chunks_shared", 0):
        peak_backed = max(peak_backed, int(stats.get("peak_backed_bytes", 0)))
    return {
        "backend": cache.name,
        "kv_dtype": cache.kv_dtype,
        "kv_layout": getattr(getattr(cache, "kv", None), "layout", None),
        "writes": write_name(cache),
        "attention": attention,
        "device": device.platform,
        "model": dataclasses.asdict(cfg),
        "serving": serving,
        "generated_tokens": report.generated_tokens,
        "seconds": report.seconds,
        "tokens_per_second": report.generated_tokens / max(report.seconds, 1e-9),
        "compile_seconds": report.compile_seconds,
        "decode_steps": report.decode_steps,
        "decode_blocks": report.blocks,
        "block": report.block,
        "prefills": report.prefills,
        "host_memory_seconds": report.ensure_seconds,
        "host_memory_share": report.ensure_seconds / max(report.seconds, 1e-9),
        "host_memory_calls": {
            k: {"calls": c, "seconds": t, "longest_seconds": m}
            for k, (c, t, m) in sorted(report.host_calls.items())
        },
        "memory_wait_seconds": report.memory_wait_seconds,
        "memory_wait_idle_seconds": report.memory_wait_idle_seconds,
        "capacity_bytes": capacity,
        "reserved_bytes": cache.reserved_bytes(),
        "peak_backed_bytes": peak_backed,
        "final_backed_bytes": report.trace[-1].backed_bytes if report.trace else 0,
        "peak_live_bytes": max((r.live_bytes for r in report.trace), default=0),
        "commit_calls": int(stats.get("commit_calls", 0)),
        "commit_seconds": float(stats.get("commit_seconds", 0.0)),
        "commits_ahead": int(stats.get("commits_ahead", 0)),
        "decommit_calls": int(stats.get("decommit_calls", 0)),
        "decommit_seconds": float(stats.get("decommit_seconds", 0.0)),
        "returned_cache_bytes": int(stats.get("returned_cache_bytes", 0)),
        "trace": [dataclasses.asdict(r) for r in report.trace],
    }


def print_summary(s: dict) -> None:
    cap = s["capacity_bytes"]
    print(
        f"\n{s['generated_tokens']} tokens in {s['seconds']:.2f} s = "
        f"{s['tokens_per_second']:.0f} tokens/s ({s['decode_steps']} decode steps in "
        f"{s['decode_blocks']} blocks of {s['block']}, {s['prefills']} prefills; compile "
        f"{s['compile_seconds']:.1f} s, not counted)"
    )
    print(
        f"host time in ensure/release: {1e3 * s['host_memory_seconds']:.1f} ms of "
        f"{s['seconds']:.2f} s ({100 * s['host_memory_share']:.2f}% of the serving time)"
    )
    if s["host_memory_calls"]:
        print(
            "  by call: "
            + ", ".join(
                f"{k} {v['calls']} x {1e6 * v['seconds'] / v['calls']:.0f} us "
                f"(longest {1e3 * v['longest_seconds']:.2f} ms)"
                for k, v in s["host_memory_calls"].items()
            )
        )
    if s["backend"] == "jax_vmm":
        print(
            f"waited for prompts' memory (committed in the background): "
            f"{1e3 * s['memory_wait_seconds']:.1f} ms, of which "
            f"{1e3 * s['memory_wait_idle_seconds']:.1f} ms with nothing queued on the device "
            f"({100 * s['memory_wait_idle_seconds'] / max(s['seconds'], 1e-9):.2f}%)"
        )
    print(
        f"KV memory: reserved {fmt_bytes(s['reserved_bytes'])} | backed peak "
        f"{fmt_bytes(s['peak_backed_bytes'])} ({100 * s['peak_backed_bytes'] / cap:.0f}% of "
        f"a preallocated cache: {fmt_bytes(cap)}) | live tokens peak "
        f"{fmt_bytes(s['peak_live_bytes'])} | backed at end "
        f"{fmt_bytes(s['final_backed_bytes'])}"
    )
    if "shared_prefix" in s:
        p = s["shared_prefix"]
        print(
            f"shared prefix of {p['tokens']} tokens: backed peak "
            f"{fmt_bytes(p['peak_backed_bytes'])} = {p['memory_ratio']:.3f}x the peak of the "
            "tokens cached, the prefix once "
            f"({fmt_bytes(p['peak_held_bytes'])}); unshared peak "
            f"{fmt_bytes(p['unshared_peak_backed_bytes'])}; {p['chunks_shared']} chunks shared"
        )
    if "warmup_tokens_equal" in s:
        print(
            "the warm-up run generated the same tokens as the timed run: "
            f"{'yes' if s['warmup_tokens_equal'] else 'NO'}"
        )
    if s["backend"] == "jax_vmm":
        print(
            f"commits: {s['commit_calls']} calls ({s['commits_ahead']} ahead of need, off the "
            f"decode thread), {1e3 * s['commit_seconds']:.1f} ms | "
            f"decommits: {s['decommit_calls']} calls, "
            f"{1e3 * s['decommit_seconds']:.1f} ms"
        )
        print(
            f"each step returned a cache of {s['returned_cache_bytes']} bytes (the arena is "
            "the state: nothing of it is copied)"
        )
    if "sleep" in s:
        z = s["sleep"]
        print(
            f"sleep/wake (KV arena + weights) every {z['every_blocks']} blocks, sequences in "
            f"flight: {z['cycles']} cycles, sleep {z['sleep_ms_median']:.1f} ms / wake "
            f"{z['wake_ms_median']:.1f} ms (median), held while asleep "
            f"{fmt_bytes(z['asleep_backed_bytes'])}; generation unchanged: "
            f"{'yes' if z['generation_unchanged'] else 'NO'}"
        )
    if "budget" in s:
        z = s["budget"]
        print(
            f"a reference engine took {z['reference_turns']} turns at those pauses; both in "
            f"one budget of {fmt_bytes(z['budget_bytes'])} (peak "
            f"{fmt_bytes(z['peak_bytes'])}; the engines' peaks sum to "
            f"{fmt_bytes(z['sum_of_engine_peaks_bytes'])}); reference unchanged: "
            f"{'yes' if z['reference_unchanged'] else 'NO'}"
        )
