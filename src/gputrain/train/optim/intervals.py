"""When the run's scheduler steps: after every optimizer step, or after each epoch.

`TrainConfig(scheduler_interval="epoch")` (`--scheduler-interval epoch`; Lightning's
`"interval": "epoch"`) steps your scheduler (`fit(scheduler=...)`) once an epoch, after the step that
finishes the epoch and its evaluation, as the tutorials' loops do (`for epoch ...: train(); test();
scheduler.step()`): pytorch/examples' mnist_rnn keeps its `StepLR(step_size=1)` as written.
`ReduceLROnPlateau` steps on the evaluation metric `scheduler_monitor` names (default `eval_loss`),
its newest value at the epoch's end (`scheduler.step(metric)`); it steps once an epoch only.

An epoch ends at the optimizer step whose micro-batches include the epoch's last batch: with
`batches` per epoch and `accumulate` micro-batches a step, after step k when
floor(k * accumulate / batches) > floor((k - 1) * accumulate / batches). That is a function of the
step count, so a resumed run steps its scheduler where the uninterrupted one did.
"""

from __future__ import annotations

import math
from typing import Any, Callable, Sequence

import torch

from gputrain.errors import ConfigError

INTERVALS = ("step", "epoch")


def is_plateau(scheduler: Any) -> bool:
    """A scheduler that steps on a metric (torch's ReduceLROnPlateau)."""
    return isinstance(scheduler, torch.optim.lr_scheduler.ReduceLROnPlateau)


class SchedulerSteps:
    """The run's scheduler, stepped at its interval (see the module docstring).

    per_step: what the loop calls after every optimizer step (the scheduler's step, or nothing);
    `epoch_end_after(step)`: the next step that ends an epoch (None: not stepped by epoch);
    `after(step, records)`: at a stretch's end, step the scheduler when `step` ended an epoch.
    """

    def __init__(self, scheduler: Any, *, interval: str, monitor: str, batches_per_epoch: int | None,
                 accumulate: int, yours: bool, own_step: bool):
        self.scheduler, self.interval, self.monitor = scheduler, interval, monitor
        self.batches, self.accumulate = batches_per_epoch, accumulate
        plateau = is_plateau(scheduler)
        if interval == "epoch":
            if own_step:
                raise ConfigError("scheduler_interval='epoch' steps the scheduler given to fit(scheduler=...); a "
                                  "step_fn steps its schedulers with step.step(name), after every optimizer step")
            if not yours:
                raise ConfigError("scheduler_interval='epoch' steps your scheduler (fit(scheduler=...)) after each "
                                  "epoch; the built-in schedule (schedule=, --schedule) is per optimizer step: give "
                                  "your own scheduler, or leave scheduler_interval at 'step'")
            if batches_per_epoch is None:
                raise ConfigError("scheduler_interval='epoch' needs data with a length (an epoch is unknown for an "
                                  "iterable without one): step the scheduler per step, or give a sized source")
        elif plateau:
            raise ConfigError("ReduceLROnPlateau steps on a metric once an epoch: set scheduler_interval='epoch' "
                              "(--scheduler-interval epoch), with scheduler_monitor naming the metric (default "
                              "eval_loss)")
        self.per_step: Callable[[], Any] = scheduler.step if interval == "step" else (lambda: None)
        self._plateau = plateau

    def describe(self, what: str) -> str:
        """The schedule's description with its interval (`what`: make_user_scheduler's)."""
        if self.interval == "step":
            return what
        on = f" on {self.monitor}" if self._plateau else ""
        return what.replace("stepped after every optimizer step", f"stepped after each epoch{on}")

    def _epochs_after(self, step: int) -> int:
        assert self.batches is not None
        return step * self.accumulate // self.batches

    def epoch_end_after(self, step: int) -> int | None:
        """The first step after `step` that ends an epoch; None when not stepped by epoch."""
        if self.interval != "epoch" or self.batches is None:
            return None
        return math.ceil((self._epochs_after(step) + 1) * self.batches / self.accumulate)

    def after(self, step: int, records: Sequence[dict[str, Any]]) -> None:
        """Step the scheduler once for each epoch that step `step` ended (ReduceLROnPlateau with the
        monitored metric's newest value)."""
        if self.interval != "epoch" or step == 0:
            return
        for _ in range(self._epochs_after(step) - self._epochs_after(step - 1)):
            if not self._plateau:
                self.scheduler.step()
                continue
            value = next((r[self.monitor] for r in reversed(records) if self.monitor in r), None)
            if value is None:
                seen = sorted({k for r in records for k in r if k.startswith("eval_")})
                raise ConfigError(f"ReduceLROnPlateau steps on {self.monitor!r}, which no log point has reported by "
                                  f"the end of epoch {self._epochs_after(step)}: evaluate at least once an epoch "
                                  "(eval data; eval_every), or name a metric the run reports with scheduler_monitor"
                                  + (f" ({', '.join(seen)})" if seen else ""))
            self.scheduler.step(value)
