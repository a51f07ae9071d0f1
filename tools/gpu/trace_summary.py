"""Device time of a JAX profiler trace, per kernel and per part of a decode step.

`summarize(trace, steps=, layers=)` reads the Chrome-trace JSON that
``jax.profiler.trace(..., create_perfetto_trace=True)`` writes (``*.trace.json.gz``): the
device's stream lines ("/device:GPU:N" processes, "Stream ..." threads; XLA's derived
lines "XLA Ops", "XLA Modules", "Steps" would count each kernel twice and are left
out). Each kernel's name is put in a part of the step (`PARTS`, by regular expression;
the first that matches), and everything is given per decode step and per layer:

    busy     the kernels' summed durations
    span     first kernel start to last kernel end on the device
    gaps     span - busy: the device idle between kernels (launch gaps inside the
             command buffer, host work between calls)

`by_module(trace)` splits the same kernels by the XLA program they ran in (the derived
"XLA Modules" line: one event per execution of a jitted program), for a trace of a whole
serving run: prefill against decode blocks, each program's kernel time and its span.

Pure Python on a parsed trace: tests run it on the CPU with a made-up trace.
"""

from __future__ import annotations

import gzip
import json
import re
from collections import defaultdict
from pathlib import Path
from typing import Any

#: (part, pattern): a kernel's part is the first whose pattern matches its name (case
#: ignored). Names are what CUPTI reports: demangled CUDA kernels, XLA's fusion names,
#: cuDNN's engine kernels, memset/memcpy activities.
PARTS: tuple[tuple[str, str], ...] = (
    ("kv_write (arena)", r"kvkernel|kvbulkkernel|kv_?write"),
    ("table read (clamp lengths)", r"clamplengths"),
    ("jax_vmm attention", r"splitkernel|streamkernel|combinekernel"),
    ("cuDNN zero rows (jax_vmm)", r"zerorowskernel"),
    ("cuDNN attention", r"cudnn|fmha|flash|sdpa|sm\d+_xmma|generated_"),
    ("XLA write (DUS/scatter)", r"dynamic_update_slice|dynamic-update-slice|scatter"),
    ("memset/memcpy", r"memset|memcpy"),
    ("other XLA fusions", r"fusion|loop_|input_|wrapped_|convert|copy|slice|reduce"),
)
OTHER = "other"
_DERIVED_LINES = re.compile(r"xla ops|xla modules|steps|framework|launch stats|source", re.I)
_MODULE_LINE = re.compile(r"xla modules", re.I)
_EXECUTION_ID = re.compile(r"\(\d+\)$")


def load(path: str | Path) -> dict:
    """A trace file (.json or .json.gz) as a dict."""
    path = Path(path)
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt") as f:
        return json.load(f)


def part_of(name: str) -> str:
    for part, pattern in PARTS:
        if re.search(pattern, name, re.I):
            return part
    return OTHER


def _lines(trace: dict) -> tuple[set, dict[tuple[Any, Any], str]]:
    """The device processes' pids, and every (pid, tid)'s line name."""
    events = trace.get("traceEvents", [])
    procs: dict[Any, str] = {}
    threads: dict[tuple[Any, Any], str] = {}
    for e in events:
        if e.get("ph") != "M":
            continue
        if e.get("name") == "process_name":
            procs[e.get("pid")] = str(e.get("args", {}).get("name", ""))
        elif e.get("name") == "thread_name":
            threads[(e.get("pid"), e.get("tid"))] = str(e.get("args", {}).get("name", ""))
    return {pid for pid, name in procs.items() if name.startswith("/device:")}, threads


def device_events(trace: dict) -> list[dict]:
    """The complete ('X') events of the device stream lines, earliest first."""
    events = trace.get("traceEvents", [])
    device_pids, threads = _lines(trace)

    def on_stream(e: dict) -> bool:
        if e.get("ph") != "X" or e.get("pid") not in device_pids:
            return False
        line = threads.get((e.get("pid"), e.get("tid")), "")
        return not _DERIVED_LINES.search(line)

    return sorted((e for e in events if on_stream(e)), key=lambda e: float(e["ts"]))


def summarize(trace: dict, *, steps: int, layers: int) -> dict:
    """Per kernel name and per part: count, device us per step and per layer; and the
    busy/span/gap totals per step and per layer (see the module docstring). `steps`:
    decode steps the traced calls ran in all."""
    events = device_events(trace)
    if not events:
        return {"events": 0, "kernels": [], "parts": [], "busy_us": 0.0, "span_us": 0.0}
    by_name: dict[str, list[float]] = defaultdict(list)
    for e in events:
        by_name[str(e.get("name", ""))].append(float(e.get("dur", 0.0)))
    busy = sum(sum(d) for d in by_name.values())
    start = float(events[0]["ts"])
    end = max(float(e["ts"]) + float(e.get("dur", 0.0)) for e in events)
    kernels = [
        {
            "name": name,
            "part": part_of(name),
            "per_step": len(d) / steps,
            "us_per_step": sum(d) / steps,
            "us_each": sum(d) / len(d),
        }
        for name, d in by_name.items()
    ]
    kernels.sort(key=lambda k: -k["us_per_step"])
    parts: dict[str, dict] = {}
    for k in kernels:
        p = parts.setdefault(k["part"], {"part": k["part"], "per_step": 0.0, "us_per_step": 0.0})
        p["per_step"] += k["per_step"]
        p["us_per_step"] += k["us_per_step"]
    for p in parts.values():
        p["us_per_layer"] = p["us_per_step"] / layers
    return {
        "events": len(events),
        "kernels": kernels,
        "parts": sorted(parts.values(), key=lambda p: -p["us_per_step"]),
        "busy_us": busy / steps,
        "span_us": (end - start) / steps,
        "gap_us": (end - start - busy) / steps,
        "busy_us_per_layer": busy / steps / layers,
        "gap_us_per_layer": (end - start - busy) / steps / layers,
    }


def trace_file(log_dir: str | Path) -> Path | None:
    """The newest ``*.trace.json.gz`` under a jax.profiler log dir, or None."""
    found = sorted(Path(log_dir).glob("plugins/profile/*/*.trace.json.gz"))
    return found[-1] if found else None


def module_events(trace: dict) -> list[dict]:
    """The device's "XLA Modules" events (one per program execution), earliest first."""
    device_pids, threads = _lines(trace)
    return sorted(
        (
            e
            for e in trace.get("traceEvents", [])
            if e.get("ph") == "X"
            and e.get("pid") in device_pids
            and _MODULE_LINE.search(threads.get((e.get("pid"), e.get("tid")), ""))
        ),
        key=lambda e: float(e["ts"]),
    )


def by_module(trace: dict) -> dict:
    """Per program (module name without its execution id): executions, span (the module
    events' summed durations), kernel time inside them per part, and their gaps (ms);
    plus how many kernels fall in no module. Whole-trace totals are `summarize`'s."""
    kernels = device_events(trace)
    out: dict[str, dict] = {}
    inside = j = 0
    # Kernels inside a module's interval belong to it (modules on one device do not overlap).
    for m in module_events(trace):
        name = _EXECUTION_ID.sub("", str(m.get("name", ""))).strip()
        row = out.setdefault(name, {"executions": 0, "span_ms": 0.0, "busy_ms": 0.0, "parts": {}})
        start, dur = float(m["ts"]), float(m.get("dur", 0.0))
        row["executions"] += 1
        row["span_ms"] += dur / 1e3
        while j < len(kernels) and float(kernels[j]["ts"]) < start:
            j += 1
        while j < len(kernels) and float(kernels[j]["ts"]) < start + dur:
            k, ms = kernels[j], float(kernels[j].get("dur", 0.0)) / 1e3
            row["busy_ms"] += ms
            part = part_of(str(k.get("name", "")))
            row["parts"][part] = row["parts"].get(part, 0.0) + ms
            inside += 1
            j += 1
    for row in out.values():
        row["gap_ms"] = row["span_ms"] - row["busy_ms"]
    return {
        "modules": dict(sorted(out.items(), key=lambda kv: -kv[1]["span_ms"])),
        "kernels_outside_modules": len(kernels) - inside,
    }


def idle_gaps(trace: dict, *, min_us: float = 10.0, top: int = 12) -> dict:
    """The device's idle gaps of at least `min_us` between consecutive kernels (by end time
    so far, so that overlapping kernels leave no gap), grouped by the kernels on either
    side: where in a run the device waited. Totals in ms."""
    events = device_events(trace)
    groups: dict[tuple[str, str], list[float]] = defaultdict(list)
    end, before = None, ""
    for e in events:
        ts, dur = float(e["ts"]), float(e.get("dur", 0.0))
        if end is not None and ts - end >= min_us:
            groups[(before, str(e.get("name", "")))].append(ts - end)
        if end is None or ts + dur >= end:
            end, before = ts + dur, str(e.get("name", ""))
    rows = [
        {"before": b, "after": a, "count": len(d), "ms": sum(d) / 1e3, "longest_us": max(d)}
        for (b, a), d in groups.items()
    ]
    rows.sort(key=lambda r: -r["ms"])
    return {
        "min_us": min_us,
        "count": sum(r["count"] for r in rows),
        "ms": sum(r["ms"] for r in rows),
        "top": rows[:top],
    }
