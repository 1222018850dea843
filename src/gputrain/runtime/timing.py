"""Timing a callable on a device, by the project's measuring protocol: warm up, then time with CUDA
events on a CUDA device (the host clock plus a synchronize elsewhere, bound once per device), repeat,
and report the median with min, max and n (docs/how-to/measure.md). The benchmarks, `gputrain doctor`
and the profile's step figures all time with these.
"""

from __future__ import annotations

import math
import statistics
import time
from typing import Any, Callable, Protocol

import torch

from gputrain.runtime.devices import synchronizer


class PhaseClock(Protocol):
    """What the training loop marks while it runs: `start()` opens a step, `mark(phase)` closes the
    span since the last mark and books it to `phase` ("data", "forward", "backward", "optimizer",
    "logging"). The trainer and its step hold `NO_CLOCK`; `gputrain profile` lends a timing one."""

    def start(self) -> None: ...

    def mark(self, phase: str) -> None: ...


class _NoClock:
    """The default phase clock: marks cost one no-op call each, and the step body needs no branch."""

    __slots__ = ()

    def start(self) -> None:
        pass

    def mark(self, phase: str) -> None:
        pass


NO_CLOCK: PhaseClock = _NoClock()


def clock(device: torch.device) -> Callable[[Callable[[], Any], int], float]:
    """`elapsed(fn, inner) -> seconds` for `inner` back-to-back calls of fn, bound once per device.

    CUDA: two CUDA events around the calls (device time, no host sleep in the figure). Elsewhere:
    the host's perf_counter with a synchronize before each reading (a no-op on the CPU).
    """
    if device.type == "cuda":
        def elapsed_cuda(fn, inner: int) -> float:
            with torch.cuda.device(device):  # events go on this device's current stream
                start = torch.cuda.Event(enable_timing=True)
                end = torch.cuda.Event(enable_timing=True)
                start.record()
                for _ in range(inner):
                    fn()
                end.record()
                end.synchronize()
            return start.elapsed_time(end) / 1e3  # elapsed_time is in ms

        return elapsed_cuda

    sync = synchronizer(device)

    def elapsed_host(fn, inner: int) -> float:
        sync()
        t0 = time.perf_counter()
        for _ in range(inner):
            fn()
        sync()
        return time.perf_counter() - t0

    return elapsed_host


def summarize(samples: list[float]) -> dict[str, Any]:
    """median, min, max, n (and spread = (max - min) / median) of a list of seconds."""
    med = statistics.median(samples)
    return {
        "median_s": med,
        "min_s": min(samples),
        "max_s": max(samples),
        "n": len(samples),
        "spread": (max(samples) - min(samples)) / med if med > 0 else None,
    }


def measure(fn: Callable[[], Any], device: torch.device, *, warmup: int = 3, repeats: int = 10,
            min_sample_s: float = 2e-3, max_inner: int = 1000, budget_s: float | None = None) -> dict[str, Any]:
    """Time one call of fn on `device`: warm-up calls, then `repeats` samples of `inner` calls each.

    `inner` is chosen so one sample lasts at least min_sample_s (short calls are then not swamped by
    the clock's own cost); `budget_s` caps the total by lowering repeats (never below 3) and ends
    the warm-up early (after at least one call) once it has taken a quarter of the budget.
    Returns summarize() of the per-call seconds, plus "inner" (calls per sample).
    """
    elapsed = clock(device)
    sync = synchronizer(device)
    t0 = time.perf_counter()
    for i in range(max(warmup, 0)):
        fn()
        if budget_s is not None and i + 1 < warmup:
            sync()
            if time.perf_counter() - t0 > budget_s / 4:
                break
    once = max(elapsed(fn, 1), 1e-9)
    inner = int(min(max_inner, max(1, math.ceil(min_sample_s / once))))
    if budget_s is not None:
        repeats = max(3, min(repeats, int(budget_s / (once * inner))))
    samples = [elapsed(fn, inner) / inner for _ in range(repeats)]
    return {**summarize(samples), "inner": inner}


