"""Where a run's time before its first optimizer step goes, measured with perf_counter marks.

The trainer marks the end of each setup part (device and precision, model moves and wrapping, the
compile cache's load, data preparation, optimizer and run directory, checkpoint load, the loop's
progress bar and stop signals; its outputs open after the first step); the first step is timed to its end with one device sync, and the seconds torch.compile
spent inside it (dynamo's own records, runtime/recompiles.py) are named apart from the rest of the
step. `import gputrain` is timed by gputrain/import_clock.py and shown beside the sum, not in it: it
happens once per process, before `fit`.
"""

from __future__ import annotations

import time
from typing import Any, Callable


class StartupClock:
    """Parts of the time from the trainer's construction to the end of the first optimizer step."""

    def __init__(self) -> None:
        self.t0 = self._last = time.perf_counter()
        self.parts: list[tuple[str, float]] = []  # (part, seconds), in order
        self.wall_s: float | None = None  # construction -> end of the first step (None: no step yet)
        self.ended_at: float | None = None  # the first step's end, Unix time (a benchmark's clock across processes)
        self.notes: list[str] = []

    def mark(self, name: str) -> None:
        """The time since the previous mark belongs to `name` (added to it when named twice)."""
        now = time.perf_counter()
        self.add(name, now - self._last)
        self._last = now

    def add(self, name: str, seconds: float) -> None:
        for i, (n, s) in enumerate(self.parts):
            if n == name:
                self.parts[i] = (n, s + seconds)
                return
        self.parts.append((name, seconds))

    def time_first_step(self, step: Callable[[], None], sync: Callable[[], None],
                        compile_seconds: Callable[[], float]) -> None:
        """Run the first optimizer step (`step`) and time it to its end (one sync), the compile
        seconds it held (`compile_seconds()`, torch.compile's total so far) named apart."""
        compiled_before = compile_seconds()
        step()
        sync()
        self._last, started = time.perf_counter(), self._last
        took = self._last - started
        compiling = min(took, max(0.0, compile_seconds() - compiled_before))
        if compiling > 0:  # an eager run has no such part
            self.add("compile (first step: dynamo and inductor)", compiling)
        self.add("first step (besides compiling)", took - compiling)
        self.wall_s, self.ended_at = self._last - self.t0, time.time()

    def report(self) -> dict[str, Any]:
        """{"wall_s", "parts": [{"name", "s"}], "import_s", "notes"} for the summary and the report."""
        from gputrain.import_clock import import_seconds

        return {"wall_s": self.wall_s, "ended_at": self.ended_at, "parts": [{"name": n, "s": s} for n, s in self.parts],
                "import_s": import_seconds(), "notes": list(self.notes)}

    def describe(self) -> str:
        parts = ", ".join(f"{n} {s:.2f} s" for n, s in sorted(self.parts, key=lambda p: -p[1]) if s >= 0.005)
        return f"{self.wall_s:.2f} s from fit ({parts})" if self.wall_s is not None else "no step yet"
