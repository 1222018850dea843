"""The host's memory allocator seen from the training loop: the steps' page faults, and what to do
when they take a noticeable share of a step.

Each log point records `step_page_faults`: the process's minor page faults during the training
steps since the previous log point, counted from the end of that log point's own work (the loss
read, the evaluation, tracker writes, callbacks, a checkpoint), so evaluations and saves are left out.
The summary gives them per step (`faults_per_step`).

Where do many come from? glibc's malloc gives freed memory back to the OS once the free space at
the top of its heap passes a trim threshold, which it raises only as far as the largest block it
has freed from mmap; a step that allocates and frees a few MB at once (activations of
variable-length batches) then faults its memory in again every step. Fixed thresholds
(`GLIBC_TUNABLES` below) or another allocator (jemalloc, tcmalloc) keep it. On 2 CPU cores,
`benchmarks/data_input.py`'s hf-rows case took ~1,000-1,500 faults a step and fit ran 1.08x as fast
with the setting; elsewhere it helped 1.03-2.0x. gputrain does not change the allocator of the
process it runs in.

The advice (`allocator_advice`) is given only from a measurement that can carry it and where it can
matter for this run: the faults were counted over at least MEASURE_FROM_STEPS steps after the run's
first log interval (which holds the first allocations of its state, and is left out; a one-step toy
fit measures nothing), and those faults a step times the cost of one fault, measured on this machine
at the run's end (`fault_seconds`), are at least `ADVISE_FROM_SHARE` of the run's time a step, on
glibc without the setting. Its words are this run's figures. Where it goes: report.html (the summary's
"advice"); the terminal too only where faulting was measured at TERMINAL_FROM_SHARE of a step or more
(`AllocatorAdvice.in_terminal`). Below that (on runs of public models faulting takes a few percent of
a step) nothing measured that acting on it pays, so it is not printed.
"""

from __future__ import annotations

import contextlib
import os
import platform
import statistics
import time
from dataclasses import dataclass
from typing import Any, Iterator, Sequence

# The share of a step that faulting must take (faults a step x measured seconds a fault / seconds a
# step) before the summary advises the setting.
ADVISE_FROM_SHARE = 0.03
# Fewer faults a step than this are not worth measuring a fault's cost for (a few MB a run).
MEASURE_FROM = 16
# Steps whose faults were counted (the first log interval left out) before their mean is a measurement.
MEASURE_FROM_STEPS = 20
# The share of a step that faulting must take before the advice is printed in the terminal as well:
# where faulting itself is a quarter of every step, fewer faults show in samples/s (at most 1.33x).
TERMINAL_FROM_SHARE = 0.25
# Fixed malloc thresholds: blocks up to 64 MiB from the heap, up to 256 MiB of free heap kept.
TUNABLES = "glibc.malloc.mmap_threshold=67108864:glibc.malloc.trim_threshold=268435456"


def minor_faults() -> int | None:
    """This process's minor page faults so far (getrusage); None where there is no getrusage."""
    try:
        import resource
    except ImportError:  # Windows
        return None
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_minflt)


class StepFaults:
    """The training loop's count of its steps' own minor page faults: `take()` at a log point gives
    those since the last `restart()` (the end of the previous log point's work), less any work run
    under `excluded()` (a checkpoint save between log points). Host calls (getrusage) at log points
    and saves only, never per step. Counts are None where there is no getrusage."""

    def __init__(self):
        self.mark = minor_faults()

    def take(self) -> int | None:
        now = minor_faults()
        return None if now is None or self.mark is None else now - self.mark

    def restart(self) -> None:
        self.mark = minor_faults()

    @contextlib.contextmanager
    def excluded(self) -> Iterator[None]:
        before = minor_faults()
        try:
            yield
        finally:
            after = minor_faults()
            if self.mark is not None and before is not None and after is not None:
                self.mark += after - before


def _intervals(records: Sequence[dict[str, Any]], start_step: int) -> tuple[list[tuple[int, int]], bool]:
    """(steps, faults) of each log interval after `start_step` that counted faults, the first left
    out when there are more; and whether it was left out."""
    intervals, previous = [], start_step
    for r in records:
        if r["step"] <= start_step:
            continue
        if r.get("step_page_faults") is not None and r["step"] > previous:
            intervals.append((r["step"] - previous, r["step_page_faults"]))
        previous = r["step"]
    return (intervals[1:], True) if len(intervals) > 1 else (intervals, False)


def faults_per_step(records: Sequence[dict[str, Any]], start_step: int = 0) -> float | None:
    """The training steps' own minor page faults a step: each log point's `step_page_faults` over
    the steps since the log point before it, for the log points after `start_step` (this process's:
    a resumed run's history also holds another process's), the first interval left out when there
    are more (it holds the first allocations of the run's state). None when nothing was counted."""
    intervals, _ = _intervals(records, start_step)
    steps = sum(n for n, _ in intervals)
    return sum(f for _, f in intervals) / steps if steps else None


def steps_measured(records: Sequence[dict[str, Any]], start_step: int = 0) -> int:
    """How many steps `faults_per_step` measured apart from the run's first allocations: the steps of
    the intervals after the first; 0 when there was one interval only (its count holds them)."""
    intervals, left_out = _intervals(records, start_step)
    return sum(n for n, _ in intervals) if left_out else 0


def fault_seconds(pages: int = 2048, repeats: int = 3) -> float | None:
    """Seconds one minor page fault takes on this machine, measured now: the time to touch `pages`
    fresh anonymous pages (each one faulted in) less the time to touch them again, over the faults
    counted; the median of `repeats`. None where it cannot be measured (no getrusage or mmap)."""
    import mmap

    page = mmap.PAGESIZE
    results = []
    for _ in range(repeats):
        before = minor_faults()
        if before is None:
            return None
        m = mmap.mmap(-1, pages * page)
        try:
            t0 = time.perf_counter()
            for i in range(0, pages * page, page):
                m[i] = 1
            t1 = time.perf_counter()
            faulted = (minor_faults() or 0) - before
            for i in range(0, pages * page, page):
                m[i] = 2
            t2 = time.perf_counter()
        finally:
            m.close()
        if faulted >= pages // 2:
            results.append(max(0.0, (t1 - t0) - (t2 - t1)) / faulted)
    return statistics.median(results) if results else None


def allocator_set() -> bool:
    """True when this process is not on glibc's malloc with its default thresholds: another libc,
    GLIBC_TUNABLES with malloc settings, or a preloaded allocator."""
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return True
    return "malloc" in os.environ.get("GLIBC_TUNABLES", "") or any(
        name in os.environ.get("LD_PRELOAD", "") for name in ("jemalloc", "tcmalloc", "mimalloc"))


@dataclass(frozen=True)
class AllocatorAdvice:
    """The allocator advice of a run: its words, and faulting's measured share of a step."""

    text: str
    share: float  # faults a step x measured seconds a fault / seconds a step

    @property
    def in_terminal(self) -> bool:
        """Printed in the terminal too (not only in report.html): faulting took TERMINAL_FROM_SHARE
        of a step or more."""
        return self.share >= TERMINAL_FROM_SHARE


def allocator_advice(per_step: float | None, step_seconds: float | None, steps: int,
                     seconds_a_fault: float | None = None) -> AllocatorAdvice | None:
    """The advice for report.html (and the terminal where `in_terminal`), or None: when the training
    steps' faults (`per_step`, counted over `steps` steps after the first log interval: at least
    MEASURE_FROM_STEPS) at `seconds_a_fault` (None: measured now by `fault_seconds`) take at least
    ADVISE_FROM_SHARE of `step_seconds` (the run's time a step), on glibc's malloc with its default
    thresholds."""
    if per_step is None or step_seconds is None or step_seconds <= 0 or per_step < MEASURE_FROM:
        return None
    if steps < MEASURE_FROM_STEPS or allocator_set():
        return None
    if seconds_a_fault is None:
        seconds_a_fault = fault_seconds()
        if seconds_a_fault is None:
            return None
    faulting = per_step * seconds_a_fault
    share = faulting / step_seconds
    if share < ADVISE_FROM_SHARE:
        return None
    mib = per_step * os.sysconf("SC_PAGE_SIZE") / 2**20
    return AllocatorAdvice(
        f"the training steps took {per_step:,.0f} minor page faults each (evaluations, checkpoints and tracker "
        f"writes left out; {steps} steps counted): ~{mib:.1f} MiB of host memory mapped afresh every step. A fault "
        f"took {seconds_a_fault * 1e6:.2f} us on this machine (measured at the run's end), so faulting took about "
        f"{faulting * 1e3:.2f} ms of each {step_seconds * 1e3:.2f} ms step ({share:.0%}). This process runs on "
        "glibc's malloc with its default thresholds, which can give a step's freed memory back to the OS (when "
        "a step frees a few MB at once) and fault it in again on the next; to see whether that is the cause, "
        f"start Python with GLIBC_TUNABLES={TUNABLES} (or preload jemalloc or tcmalloc) and compare samples/s",
        share)
