"""EarlyStopping: end a run when an evaluated metric stops improving (a callback at log points).

It reads the metric from the log point's record, where the evaluation already put it: no host read
of its own. After `patience` evaluations in a row without an improvement larger than `min_delta`, it
asks the run to stop; the run checkpoints and ends cleanly, and a resume of it trains no further.
Its count and best value are saved in checkpoints, so a resumed run goes on counting where it was.
"""

from __future__ import annotations

import math
from typing import Any

from gputrain.errors import ConfigError
from gputrain.metric_direction import Direction, metric_direction
from gputrain.train.loop.callbacks import Callback, RunControl


class EarlyStopping(Callback):
    """Stop when `metric` has not improved for `patience` evaluations.

    metric: a record key, e.g. "eval_loss", "eval_accuracy" (any `eval_<name>` of your metrics).
    patience: evaluations without improvement before the stop (>= 1).
    min_delta: the smallest change that counts as an improvement (in the metric's units, >= 0).
    mode: "min", "max", or "auto": gputrain's one rule (gputrain/metric_direction.py), as the summary
        and the best checkpoint use it: TrainConfig.metric_modes, a torchmetrics metric's own
        higher_is_better, else lower for a name that says loss, error, MSE, perplexity..., else higher.
    """

    def __init__(self, metric: str = "eval_loss", patience: int = 3, min_delta: float = 0.0, mode: str = "auto"):
        if not isinstance(metric, str) or not metric:
            raise ConfigError(f"EarlyStopping needs a metric name such as 'eval_loss', got {metric!r}")
        if not isinstance(patience, int) or isinstance(patience, bool) or patience < 1:
            raise ConfigError(f"EarlyStopping patience must be a positive integer, got {patience!r}")
        if not (isinstance(min_delta, (int, float)) and min_delta >= 0):
            raise ConfigError(f"EarlyStopping min_delta must be >= 0, got {min_delta!r}")
        if mode not in ("min", "max", "auto"):
            raise ConfigError(f"EarlyStopping mode must be 'min', 'max' or 'auto', got {mode!r}")
        self.auto = mode == "auto"  # decided again at the run's start, where the run's metrics are known
        self.direction = metric_direction(metric) if self.auto else Direction(mode, "stated")
        self.metric, self.patience, self.min_delta = metric, patience, float(min_delta)
        self.best: float | None = None
        self.best_step = 0
        self.bad_evaluations = 0  # evaluations in a row without an improvement

    @property
    def mode(self) -> str:
        """"min" or "max": the direction in force."""
        return self.direction.mode

    def on_run_start(self, run: RunControl) -> None:
        if self.metric.startswith("eval_") and not run.has_eval_data:
            raise ConfigError(f"EarlyStopping watches {self.metric!r}, but this run has no eval data: give "
                              "eval_data to fit (or a workload with a test split), or watch another metric")
        if self.auto:
            self.direction = run.metric_direction(self.metric)

    def improved(self, value: float) -> bool:
        if self.best is None:
            return math.isfinite(value)
        if self.mode == "min":
            return value < self.best - self.min_delta
        return value > self.best + self.min_delta

    def on_log(self, run: RunControl, record: dict[str, Any]) -> None:
        value = record.get(self.metric)
        if not isinstance(value, (int, float)) or isinstance(value, bool):
            return  # not evaluated at this log point
        value = float(value)
        if self.improved(value):
            self.best, self.best_step, self.bad_evaluations = value, run.step, 0
            return
        self.bad_evaluations += 1
        if self.bad_evaluations >= self.patience:
            best = f"{self.best:.4g} at step {self.best_step}" if self.best is not None else "none finite"
            run.request_stop(f"EarlyStopping: {self.metric} did not improve by more than {self.min_delta:g} in "
                             f"{self.patience} evaluation(s) (best {best}; {self.direction.why()})")

    def on_run_end(self, run: RunControl, history) -> None:
        if history.records and not any(self.metric in r for r in history.records):
            import logging

            logging.getLogger("gputrain").warning(
                "EarlyStopping: no log point had %r (the record keys were: %s)", self.metric,
                ", ".join(sorted({k for r in history.records for k in r})) or "none")

    def on_checkpoint_save(self, run: RunControl) -> dict[str, Any]:
        return {"metric": self.metric, "best": self.best, "best_step": self.best_step,
                "bad_evaluations": self.bad_evaluations}

    def on_checkpoint_load(self, run: RunControl, state: dict[str, Any]) -> None:
        if state.get("metric", self.metric) != self.metric:
            return  # another metric now: start counting afresh
        best = state.get("best")
        self.best = float(best) if best is not None else None
        self.best_step = int(state.get("best_step", 0))
        self.bad_evaluations = int(state.get("bad_evaluations", 0))
