"""Figures from a torch.profiler run: the Chrome trace and the op tables.

Profile marks each training step with a `record_function(STEP_LABEL)` range; a profiled window
also holds the loop's other work (a log point's loss read and evaluation), which is not a step.
Per-step figures count the marked steps only, and the other work is given apart:

- `trace_summary(trace)`: kernel, copy, sync and busy figures from a Chrome trace (a pure function
  of the JSON): per training step, and the window's other work apart;
- `op_tables(prof, ...)`: the ops taking the most self time per training step (device time on a
  GPU, CPU time on the CPU), and the ops of the other work in the window.
A trace without step marks counts its ProfilerStep spans as steps, as before.
"""

from __future__ import annotations

import bisect
import json
import os
import statistics
from collections import defaultdict
from typing import Any

import torch

STEP_LABEL = "gputrain: training step"  # the record_function range around each training step


def _union_ms(intervals: list[tuple[float, float]]) -> float:
    total, end = 0.0, None
    for a, b in sorted(intervals):
        if end is None or a > end:
            total += b - a
            end = b
        elif b > end:
            total += b - end
            end = b
    return total / 1000.0


def _cpu_spans(events: list[dict[str, Any]], match) -> list[tuple[float, float]]:
    """(start, end) of the CPU-side events whose name `match`es (not their GPU-timeline copies), sorted."""
    return sorted((float(e["ts"]), float(e["ts"]) + float(e.get("dur", 0))) for e in events
                  if match(str(e.get("name", ""))) and not str(e.get("cat", "")).startswith("gpu_"))


def _within(t: float, spans: list[tuple[float, float]]) -> bool:
    i = bisect.bisect_right(spans, (t, float("inf"))) - 1
    return i >= 0 and spans[i][0] <= t <= spans[i][1]


def trace_summary(trace: dict | str | os.PathLike) -> dict[str, Any]:
    """Kernel, copy and sync figures per training step from a torch.profiler Chrome trace.

    trace: the trace's JSON (a dict with "traceEvents") or its path. The window is the ProfilerStep#N
    spans (CPU side). Steps are the STEP_LABEL ranges in it (a trace without them: the ProfilerStep
    spans); a kernel or copy belongs to a step when the runtime call that launched it (same
    "correlation") lies in one, a synchronizing call when it does itself. Returns steps, step_ms
    (mean training step, CPU side), kernels_per_step, median_kernel_us, kernel_ms_per_step,
    memcpy_per_step, syncs_per_step (cuda*Synchronize and blocking cudaMemcpy calls),
    sync_ms_per_step, sync_wait_share and gpu_busy (shares of the whole window), and other_work
    (the window's work outside the steps: ms, kernels, syncs; None without step marks); GPU
    figures are None in a CPU-only trace.
    """
    if isinstance(trace, dict):
        data = trace
    else:
        with open(trace) as f:
            data = json.load(f)
    events = [e for e in data.get("traceEvents", []) if e.get("ph") == "X"]
    windows = _cpu_spans(events, lambda name: name.startswith("ProfilerStep#"))
    if windows:
        t0, t1 = windows[0][0], max(end for _, end in windows)
    else:
        t0 = min((float(e["ts"]) for e in events), default=0.0)
        t1 = max((float(e["ts"]) + float(e.get("dur", 0)) for e in events), default=0.0)
    marked = [span for span in _cpu_spans(events, lambda name: name == STEP_LABEL) if t0 <= span[0] <= t1]
    steps = marked or windows
    n_steps = max(1, len(steps))

    def inside(e) -> bool:
        return t0 <= float(e["ts"]) <= t1

    cats = lambda e: str(e.get("cat", "")).lower()  # noqa: E731
    kernels = [e for e in events if cats(e) == "kernel" and inside(e)]
    copies = [e for e in events if cats(e) in ("gpu_memcpy", "gpu_memset") and inside(e)]
    runtime = [e for e in events if cats(e) in ("cuda_runtime", "cuda_driver") and inside(e)]
    syncs = [e for e in runtime if "Synchronize" in str(e.get("name", "")) or e.get("name") == "cudaMemcpy"]
    window_ms = (t1 - t0) / 1000.0
    has_gpu = bool(kernels or copies or runtime)
    busy = _union_ms([(float(e["ts"]), float(e["ts"]) + float(e.get("dur", 0))) for e in kernels + copies])
    sync_ms = sum(float(e.get("dur", 0)) for e in syncs) / 1000.0
    other = None
    if marked:  # the steps' own share of the window's GPU work; the rest is the other work's
        launched = {(e.get("args") or {}).get("correlation"): float(e["ts"]) for e in runtime}

        def in_step(e) -> bool:
            at = launched.get((e.get("args") or {}).get("correlation"), float(e["ts"]))
            return _within(at, marked)

        all_kernels, all_syncs = kernels, syncs
        kernels = [e for e in kernels if in_step(e)]
        copies = [e for e in copies if in_step(e)]
        syncs = [e for e in syncs if _within(float(e["ts"]), marked)]
        other = {"ms": window_ms - sum(b - a for a, b in marked) / 1000.0,
                 "kernels": len(all_kernels) - len(kernels) if has_gpu else None,
                 "syncs": len(all_syncs) - len(syncs) if has_gpu else None}
    durations = sorted(float(e.get("dur", 0)) for e in kernels)
    step_sync_ms = sum(float(e.get("dur", 0)) for e in syncs) / 1000.0
    return {
        "steps": len(steps),
        "step_ms": sum(b - a for a, b in steps) / 1000.0 / n_steps if marked else
        (window_ms / n_steps if steps else None),
        "kernels_per_step": len(kernels) / n_steps if has_gpu else None,
        "median_kernel_us": statistics.median(durations) if durations else None,
        "kernel_ms_per_step": sum(durations) / 1000.0 / n_steps if has_gpu else None,
        "memcpy_per_step": len(copies) / n_steps if has_gpu else None,
        "syncs_per_step": len(syncs) / n_steps if has_gpu else None,
        "sync_ms_per_step": step_sync_ms / n_steps if has_gpu else None,
        "sync_wait_share": (sync_ms / window_ms) if has_gpu and window_ms > 0 else None,
        "gpu_busy": min(1.0, busy / window_ms) if has_gpu and window_ms > 0 else None,
        "other_work": other,
    }


def _in_step(event: Any) -> bool:
    """Whether a profiler event ran inside a STEP_LABEL range (one of its CPU ancestors is one)."""
    parent = event.cpu_parent
    while parent is not None:
        if parent.name == STEP_LABEL:
            return True
        parent = parent.cpu_parent
    return False


def _op_rows(events: list[Any], per: int, on_gpu: bool, limit: int, unit: str = "_per_step") -> list[dict[str, Any]]:
    """The ops of `events` by name, their calls and times divided by `per` (keys "calls<unit>",
    "self_cpu_ms<unit>", ...), the top `limit` by self time, each with its share of the total."""
    sums: dict[str, list[float]] = defaultdict(lambda: [0, 0.0, 0.0, 0.0, 0.0])
    for e in events:
        row = sums[e.key]
        row[0] += 1
        row[1] += e.self_cpu_time_total
        row[2] += e.cpu_time_total
        row[3] += getattr(e, "self_device_time_total", 0.0) or 0.0
        row[4] += getattr(e, "device_time_total", 0.0) or 0.0
    rows = [{"name": name, f"calls{unit}": n / per,
             f"self_device_ms{unit}": self_dev / 1000.0 / per if on_gpu else None,
             f"device_ms{unit}": dev / 1000.0 / per if on_gpu else None,
             f"self_cpu_ms{unit}": self_cpu / 1000.0 / per, f"cpu_ms{unit}": cpu / 1000.0 / per}
            for name, (n, self_cpu, cpu, self_dev, dev) in sums.items()]
    key = f"self_device_ms{unit}" if on_gpu else f"self_cpu_ms{unit}"
    rows = [r for r in rows if (r[key] or 0) > 0]
    rows.sort(key=lambda r: r[key], reverse=True)
    total = sum(r[key] for r in rows) or 1.0
    for r in rows:
        r["share"] = r[key] / total
    return rows[:limit]


def op_tables(prof, device: torch.device, limit: int, active: int) -> dict[str, Any]:
    """The profiled window's ops (CPU-side events: on a GPU with the device time of the kernels they
    launched), split by the STEP_LABEL ranges: {"steps": training steps counted, "per_step": the top
    ops per training step, "other": the top ops of the window's other work (a log point's loss read,
    evaluation), totals over the window (keys "calls", "self_cpu_ms", ... without "_per_step")}.
    Without step marks every op counts as the steps', per profiled step (`active`)."""
    on_gpu = device.type == "cuda"
    events = [e for e in prof.events() if str(e.device_type).endswith("CPU") and not e.name.startswith("ProfilerStep")]
    steps = sum(1 for e in events if e.name == STEP_LABEL)
    if not steps:
        return {"steps": active, "per_step": _op_rows(events, active, on_gpu, limit), "other": []}
    inside = [e for e in events if e.name != STEP_LABEL and _in_step(e)]
    outside = [e for e in events if e.name != STEP_LABEL and not _in_step(e)]
    return {"steps": steps, "per_step": _op_rows(inside, steps, on_gpu, limit),
            "other": _op_rows(outside, 1, on_gpu, limit, unit="")}
