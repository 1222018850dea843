"""Watching a run's health at log points (never per step): non-finite steps and loss spikes.

At each log point and before every checkpoint write the trainer reads the loss with what tells of
non-finite steps since the last read: with on_nan="skip" the count the step keeps on the device,
with on_nan="stop" (nothing counted per step) whether the loss sum or the run's state (parameters,
gradients, optimizer state) went non-finite. `NonFiniteGuard` decides: stop with an error that
names the interval of steps and the last good checkpoint, or (on_nan="skip") report how many steps
were skipped. `SpikeDetector` compares each log point's loss (pooled over at least SPIKE_MIN_STEPS
steps) with the median of a rolling window.
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


# Steps a judged loss averages at least. One batch's loss scatters several times around its median once
# a model fits (a few hard samples make it): at log_every=1, 39 of 1,500 single-batch log points of an MLP
# (batch 16) were above 4x the median of the 10 before them, none of their means over 10 steps.
SPIKE_MIN_STEPS = 10


class SpikeDetector:
    """A loss above `ratio` x the median of the last `window` judged losses is a spike; `patience`
    spikes in a row trigger the action (warn or stop).

    The judged loss is a log point's, or the mean of consecutive log points (weighted by their steps)
    until it covers SPIKE_MIN_STEPS steps: log points closer than that (log_every=1) would judge one
    batch's noise. Log points of SPIKE_MIN_STEPS steps or more are judged one by one, as they come."""

    def __init__(self, ratio: float | None, window: int, patience: int, action: str):
        self.ratio, self.patience, self.action = ratio, patience, action
        self.history: deque[float] = deque(maxlen=window)
        self.min_points = max(3, window // 2)  # judged losses seen before a spike can be judged
        self.in_a_row = 0
        self.spikes: list[dict] = []
        self.last_step = 0  # the step of the last log point seen
        self.pool_from, self.pool_sum, self.pool_steps = 1, 0.0, 0  # log points not judged yet

    def update(self, step: int, loss: float) -> None:
        if self.ratio is None or not math.isfinite(loss):
            self.last_step = step
            return
        steps, self.last_step = max(1, step - self.last_step), step
        if not self.pool_steps:
            self.pool_from = step - steps + 1
        self.pool_sum += loss * steps
        self.pool_steps += steps
        if self.pool_steps < SPIKE_MIN_STEPS:
            return
        loss, first = self.pool_sum / self.pool_steps, self.pool_from
        self.pool_sum, self.pool_steps = 0.0, 0
        if len(self.history) >= self.min_points:
            median = statistics.median(self.history)
            if median > 0 and loss > self.ratio * median:
                self.in_a_row += 1
                self.spikes.append({"step": step, "loss": loss, "median": median})
                pooled = first < step - steps + 1  # several log points' mean
                at = f"steps {first}-{step} (their mean)" if pooled else f"step {step}"
                msg = (f"loss spike at {at}: {loss:.4g} is {loss / median:.1f}x the median {median:.4g} of "
                       f"the last {len(self.history)} {'such means' if pooled else 'log points'}")
                if self.in_a_row >= self.patience and self.action == "stop":
                    raise GputrainError(f"{msg}, {self.in_a_row} in a row: stopping (on_spike='stop'). Lower the "
                                        "learning rate or clip gradients (--max-grad-norm)")
                log.warning("%s", msg)
                return  # a spike does not enter the window
            self.in_a_row = 0
        self.history.append(loss)
