"""Watching a run's health at log points (never per step): non-finite steps and loss spikes.

At each log point and before every checkpoint write the trainer reads the loss with what tells of
non-finite steps since the last read: with on_nan="skip" the count the step keeps on the device,
with on_nan="stop" (nothing counted per step) whether the loss sum or the run's state (parameters,
gradients, optimizer state) went non-finite. `NonFiniteGuard` decides: stop with an error that
names the interval of steps and the last good checkpoint, or (on_nan="skip") report how many steps
were skipped. `SpikeDetector` compares each log point's loss with the median of a rolling window.
"""

from __future__ import annotations

import logging
import math
import statistics
from collections import deque

from gputrain.errors import GputrainError

log = logging.getLogger("gputrain")


class NonFiniteError(GputrainError):
    """Training produced a non-finite loss or gradient and on_nan="stop"."""


class NonFiniteGuard:
    def __init__(self, on_nan: str):
        self.on_nan = on_nan
        self.last_clean_step = 0  # the last log point / checkpoint at which every step was finite
        self.skipped = 0

    def check(self, bad_steps: int, step: int, last_checkpoint: str | None) -> None:
        """Called with the non-finite steps since the last check, at `step`; raises or records.
        (on_nan="stop": 0, or 1 for one or more: the steps are not counted one by one.)"""
        if bad_steps == 0:
            self.last_clean_step = step
            return
        where = f"between steps {self.last_clean_step + 1} and {step}"
        if self.on_nan == "skip":
            self.skipped += bad_steps
            log.warning("%d step(s) %s had a non-finite loss or gradient and were skipped (%d so far)",
                        bad_steps, where, self.skipped)
            self.last_clean_step = step
            return
        resume = (f"; the last good checkpoint is {last_checkpoint}" if last_checkpoint
                  else "; no checkpoint was written from this run")
        raise NonFiniteError(
            f"the loss or gradient became non-finite (NaN/inf) {where}{resume}. "
            "Lower the learning rate (--lr), clip gradients (--max-grad-norm), check the data for NaN/inf, "
            "or skip such steps with --on-nan skip")


class SpikeDetector:
    """A log point's loss above `ratio` x the median of the last `window` ones is a spike;
    `patience` spikes in a row trigger the action (warn or stop)."""

    def __init__(self, ratio: float | None, window: int, patience: int, action: str):
        self.ratio, self.patience, self.action = ratio, patience, action
        self.history: deque[float] = deque(maxlen=window)
        self.min_points = max(3, window // 2)  # log points seen before a spike can be judged
        self.in_a_row = 0
        self.spikes: list[dict] = []

    def update(self, step: int, loss: float) -> None:
        if self.ratio is None or not math.isfinite(loss):
            return
        if len(self.history) >= self.min_points:
            median = statistics.median(self.history)
            if median > 0 and loss > self.ratio * median:
                self.in_a_row += 1
                self.spikes.append({"step": step, "loss": loss, "median": median})
                msg = (f"loss spike at step {step}: {loss:.4g} is {loss / median:.1f}x the median {median:.4g} of "
                       f"the last {len(self.history)} log points")
                if self.in_a_row >= self.patience and self.action == "stop":
                    raise GputrainError(f"{msg}, {self.in_a_row} in a row: stopping (on_spike='stop'). Lower the "
                                        "learning rate or clip gradients (--max-grad-norm)")
                log.warning("%s", msg)
                return  # a spike does not enter the window
            self.in_a_row = 0
        self.history.append(loss)
