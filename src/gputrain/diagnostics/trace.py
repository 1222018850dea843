"""Figures from a torch.profiler run: the Chrome trace and the op table.

- `trace_summary(trace)`: kernel, copy, sync and busy figures per profiled step from a Chrome
  trace (a pure function of the JSON).
- `_top_ops(prof, ...)`: the ops taking the most self time per step (device time on a GPU, CPU
  time on the CPU).
"""

from __future__ import annotations

import json
import os
import statistics
from typing import Any

import torch


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


def trace_summary(trace: dict | str | os.PathLike) -> dict[str, Any]:
    """Kernel, copy and sync figures per profiled step from a torch.profiler Chrome trace.

    trace: the trace's JSON (a dict with "traceEvents") or its path. Steps are the ProfilerStep#N
    spans (CPU side); GPU events count when they start inside them. Returns steps, step_ms (mean
    profiled step), kernels_per_step, median_kernel_us,
    kernel_ms_per_step, memcpy_per_step, syncs_per_step (cuda*Synchronize and blocking cudaMemcpy
    calls), sync_ms_per_step, sync_wait_share and gpu_busy (the share of the steps' span with a kernel or
    copy running); GPU figures are None in a CPU-only trace.
    """
    if isinstance(trace, dict):
        data = trace
    else:
        with open(trace) as f:
            data = json.load(f)
    events = [e for e in data.get("traceEvents", []) if e.get("ph") == "X"]
    steps = [e for e in events if str(e.get("name", "")).startswith("ProfilerStep#")
             and not str(e.get("cat", "")).startswith("gpu_")]  # not the GPU-timeline copies
    if steps:
        t0 = min(float(e["ts"]) for e in steps)
        t1 = max(float(e["ts"]) + float(e.get("dur", 0)) for e in steps)
    else:
        t0 = min((float(e["ts"]) for e in events), default=0.0)
        t1 = max((float(e["ts"]) + float(e.get("dur", 0)) for e in events), default=0.0)
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
    durations = sorted(float(e.get("dur", 0)) for e in kernels)
    sync_ms = sum(float(e.get("dur", 0)) for e in syncs) / 1000.0
    busy = _union_ms([(float(e["ts"]), float(e["ts"]) + float(e.get("dur", 0))) for e in kernels + copies])
    return {
        "steps": len(steps),
        "step_ms": window_ms / n_steps if steps else None,
        "kernels_per_step": len(kernels) / n_steps if has_gpu else None,
        "median_kernel_us": statistics.median(durations) if durations else None,
        "kernel_ms_per_step": sum(durations) / 1000.0 / n_steps if has_gpu else None,
        "memcpy_per_step": len(copies) / n_steps if has_gpu else None,
        "syncs_per_step": len(syncs) / n_steps if has_gpu else None,
        "sync_ms_per_step": sync_ms / n_steps if has_gpu else None,
        "sync_wait_share": (sync_ms / window_ms) if has_gpu and window_ms > 0 else None,
        "gpu_busy": min(1.0, busy / window_ms) if has_gpu and window_ms > 0 else None,
    }


def _top_ops(prof, device: torch.device, limit: int, active: int) -> list[dict[str, Any]]:
    rows = []
    on_gpu = device.type == "cuda"
    for avg in prof.key_averages():
        if avg.key.startswith("ProfilerStep"):
            continue
        self_dev = getattr(avg, "self_device_time_total", 0.0) or 0.0
        rows.append({
            "name": avg.key,
            "calls_per_step": avg.count / active,
            "self_device_ms_per_step": self_dev / 1000.0 / active if on_gpu else None,
            "device_ms_per_step": (getattr(avg, "device_time_total", 0.0) or 0.0) / 1000.0 / active if on_gpu else None,
            "self_cpu_ms_per_step": avg.self_cpu_time_total / 1000.0 / active,
            "cpu_ms_per_step": avg.cpu_time_total / 1000.0 / active,
        })
    key = "self_device_ms_per_step" if on_gpu else "self_cpu_ms_per_step"
    rows = [r for r in rows if (r[key] or 0) > 0]
    rows.sort(key=lambda r: r[key], reverse=True)
    total = sum(r[key] for r in rows) or 1.0
    for r in rows:
        r["share"] = r[key] / total
    return rows[:limit]
