"""The host's memory allocator seen from the training loop: page faults a step, and what to do
about many.

glibc's malloc gives freed memory back to the OS once the free space at the top of its heap passes
a trim threshold, which it raises only as far as the largest block it has freed from mmap. A step
that allocates and frees more than that at once (activations of variable-length batches, a few MB)
has its memory returned and faulted back in on every step. Measured on 2 CPU cores with
`benchmarks/data_input.py`'s hf-rows case (a token model on padded rows of 16-64 tokens): ~1,000-1,500
minor page faults a step in fit and in the hand loop alike; with the thresholds fixed
(`GLIBC_TUNABLES` below) the faults went to ~0 and fit ran 1.08x as fast, the hand loop 1.12x
(`--allocator-ab`, medians of 4 alternating rounds; the streaming case 1.06x / 1.07x). gputrain
does not change the allocator of the process it runs in: the summary gives the figure and, past
`ADVISE_FROM` faults a step on glibc, the setting.
"""

from __future__ import annotations

import os
import platform
from typing import Any, Sequence

# Past this many minor faults a step (1 MiB of 4 KiB pages), the summary says what to set.
ADVISE_FROM = 256
# Fixed malloc thresholds: blocks up to 64 MiB from the heap, up to 256 MiB of free heap kept.
TUNABLES = "glibc.malloc.mmap_threshold=67108864:glibc.malloc.trim_threshold=268435456"


def minor_faults() -> int | None:
    """This process's minor page faults so far (getrusage); None where there is no getrusage."""
    try:
        import resource
    except ImportError:  # Windows
        return None
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_minflt)


def faults_per_step(records: Sequence[dict[str, Any]]) -> float | None:
    """Minor page faults a step between the log points' counts (`host_page_faults`), the first
    interval left out when there are more (it holds the first allocations of the run's state).
    None without two log points that counted."""
    points = [(r["step"], r["host_page_faults"]) for r in records if r.get("host_page_faults") is not None]
    if len(points) > 2:
        points = points[1:]
    if len(points) < 2 or points[-1][0] <= points[0][0]:
        return None
    return (points[-1][1] - points[0][1]) / (points[-1][0] - points[0][0])


def allocator_advice(per_step: float | None) -> str | None:
    """One line for the summary's warnings when the steps fault in memory every step on glibc, and
    the allocator was not set already (GLIBC_TUNABLES with malloc settings, a preloaded allocator)."""
    if per_step is None or per_step < ADVISE_FROM:
        return None
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return None
    if "malloc" in os.environ.get("GLIBC_TUNABLES", "") or any(
            name in os.environ.get("LD_PRELOAD", "") for name in ("jemalloc", "tcmalloc", "mimalloc")):
        return None
    return (f"{per_step:,.0f} page faults a step (~{per_step * os.sysconf('SC_PAGE_SIZE') / 2**20:.1f} MiB of host memory given back to "
            "the OS and taken again every step): glibc's malloc trims its heap after steps of this size. Start "
            f"Python with GLIBC_TUNABLES={TUNABLES} (or preload jemalloc or tcmalloc); a variable-length text "
            "model trained 1.08x as fast on the CPU that way (gputrain's benchmarks/data_input.py)")
