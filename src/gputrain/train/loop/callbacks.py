"""Callbacks: your code at the trainer's log points, without slowing the hot loop.

A callback is an object with any of these methods (subclass `Callback` for the no-op defaults and
the types); the trainer calls each one that is there, in the order the callbacks were given:

    on_run_start(run)                        before the first step (of this process: also after a resume)
    on_evaluate(run, metrics) -> dict | None after an evaluation; may return values to add to the record
    on_log(run, record)                      at each log point, with every value already read (host floats)
    on_checkpoint_save(run) -> dict | None   the callback's own state, saved in the checkpoint
    on_checkpoint_load(run, state)           that state, given back on resume
    on_checkpoint(run, path)                 a checkpoint was committed to the run's store (every rank, the
                                             same path; only rank 0 may read it): report/ray_report.py
    on_exception(run, exc)                   training failed; the error propagates afterwards
    on_run_end(run, history)                 after the run's summary
    on_step(run)                             after every optimizer step: only when `every_step = True`
    step_update(module) -> fn | None         a device-only update the training step runs after its
                                             optimizer step (EMA's foreach lerp), inside the CUDA graph too

Hooks run where the loop already reads the device (log points, evaluations, checkpoints), so a run
with callbacks keeps one host read per `log_every` steps and the same CUDA-graph decision. A callback
that sets `every_step = True` is told in the run log what that costs: the step is no longer captured
in a CUDA graph (runtime/speed.py), and any device value it reads is a host sync per step.

`run` is a `RunControl`: the run's position and parts, plus what a callback may change: stop the run
(`request_stop`, which checkpoints and ends it cleanly; a resume then trains no further) and the
learning rate (`scale_lr`, `set_lr`, which move the schedule's base learning rates too).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Mapping, Sequence

import torch
from torch import nn

from gputrain.batch import OptimizerLike
from gputrain.errors import ConfigError
from gputrain.metric_direction import Direction, metric_direction
from gputrain import torch_compat

if TYPE_CHECKING:
    from gputrain.config import TrainConfig
    from gputrain.data.stream import BatchStream
    from gputrain.io.history import History
    from gputrain.runtime.distributed import DistInfo
    from gputrain.train.evaluation.evaluate import Evaluator
    from gputrain.train.loop.parts import DataFeeds, ModelParts, Optimizers
    from gputrain.train.optim.by_name import OptimizerSet
    from gputrain.train.loop.state import RunState

log = logging.getLogger("gputrain")

HOOKS = ("on_run_start", "on_evaluate", "on_log", "on_checkpoint_save", "on_checkpoint_load", "on_checkpoint",
         "on_exception", "on_run_end", "on_step", "step_update")


class Callback:
    """Base class with a no-op for every hook (see the module docstring). Override what you need.

    every_step: opt in to `on_step` after every optimizer step (no CUDA graph for the run).
    state_key: the name of this callback's state in checkpoints (default: the class name).
    """

    every_step: bool = False
    state_key: str | None = None

    def on_run_start(self, run: RunControl) -> None:
        pass

    def on_evaluate(self, run: RunControl, metrics: dict[str, float]) -> dict[str, float] | None:
        return None

    def on_log(self, run: RunControl, record: dict[str, Any]) -> None:
        pass

    def on_checkpoint_save(self, run: RunControl) -> dict[str, Any] | None:
        return None

    def on_checkpoint_load(self, run: RunControl, state: dict[str, Any]) -> None:
        pass

    def on_checkpoint(self, run: RunControl, path: Path) -> None:
        pass

    def on_exception(self, run: RunControl, exc: BaseException) -> None:
        pass

    def on_run_end(self, run: RunControl, history: History) -> None:
        pass

    def on_step(self, run: RunControl) -> None:
        pass

    def step_update(self, module: nn.Module) -> Callable[[], None] | None:
        return None


class RunControl:
    """What a callback sees of a run, and the few things it may change: read from the run's parts
    (train/loop/parts.py) as the builder made them."""

    def __init__(self, *, config: TrainConfig, dist: DistInfo, device: torch.device, state: RunState,
                 data: DataFeeds, model: ModelParts, optim: Optimizers, history: History, evaluator: Evaluator):
        self._config, self._dist, self._device, self._state = config, dist, device, state
        self._data, self._model, self._optim, self._history, self._evaluator = data, model, optim, history, evaluator

    # ---------------------------------------------------------------- where the run is (host values)

    @property
    def step(self) -> int:
        """Optimizer steps done."""
        return self._state.step

    @property
    def total_steps(self) -> int:
        return self._data.total_steps

    @property
    def epoch(self) -> float:
        """Epochs done, fractional (samples seen / training samples)."""
        return self._data.stream.epochs_done(self._state.samples_seen, self._dist.world_size)  # data of unknown length: passes done

    @property
    def config(self):
        return self._config

    @property
    def model(self) -> nn.Module:
        """The model being trained (unwrapped: not DDP, not compiled)."""
        return self._model.module

    @property
    def optimizer(self) -> torch.optim.Optimizer | OptimizerSet:
        """The run's optimizer; with a step of your own, its optimizers by name (`.optimizers`)."""
        return self._optim.optimizer

    @property
    def device(self) -> torch.device:
        return self._device

    @property
    def history(self) -> History:
        return self._history

    @property
    def is_main(self) -> bool:
        """Rank 0 (or the only process): where files and trackers are written."""
        return self._dist.is_main

    @property
    def has_eval_data(self) -> bool:
        return self._data.eval is not None

    @property
    def lr(self) -> float:
        """The first parameter group's learning rate in force (from the schedule: no device read for
        the built-in schedules)."""
        return float(self._optim.scheduler.get_last_lr()[0])

    @property
    def stop_reason(self) -> str:
        """Why a stop was requested ("" when none was)."""
        return self._state.stopped_by

    def metric_direction(self, key: str) -> Direction:
        """Which way record key `key` improves, by gputrain's one rule (gputrain/metric_direction.py):
        stated in TrainConfig.metric_modes, a torchmetrics metric's own higher_is_better, or the name."""
        return metric_direction(key, self._config.metric_modes, self._evaluator.metrics)

    # ---------------------------------------------------------------- what a callback may change

    def request_stop(self, reason: str) -> None:
        """End the run after this log point: it checkpoints (with a run directory), summarizes and returns.

        The reason goes into the run log, the summary and the checkpoint; resuming a run stopped this
        way trains no further.
        """
        st = self._state
        if not st.stopped_by:
            st.stopped_by = str(reason) or "a callback asked to stop"
            log.info("stop requested after step %d: %s", st.step, st.stopped_by)

    def scale_lr(self, factor: float) -> None:
        """Multiply the learning rate in force, and the schedule's base rates, by `factor`: the
        schedule (built-in or yours) goes on from the new rates. Saved in checkpoints."""
        if not factor > 0:
            raise ConfigError(f"scale_lr needs a positive factor, got {factor!r}")
        scale_schedule(self._optim.scheduler, self._optim.optimizer, float(factor))

    def set_lr(self, lr: float) -> None:
        """Make the learning rate in force `lr` (every group scaled by the same factor, the schedule's
        base rates too)."""
        if not lr > 0:
            raise ConfigError(f"set_lr needs a positive learning rate, got {lr!r}")
        now = self.lr
        if now > 0:
            self.scale_lr(lr / now)
        else:  # a schedule at zero (the end of a cosine): set the base rates instead
            scale_schedule(self._optim.scheduler, self._optim.optimizer, None, base=lr)

    def evaluate(self, model: nn.Module | None = None) -> dict[str, float]:
        """The run's evaluation (loss, accuracy, metrics) of `model` (default: the trained one) on the
        run's eval data: one host read. Collective under DDP: call it on every rank."""
        if self._data.eval is None:
            raise ConfigError("this run has no eval data: give eval_data to fit (or a workload with a test split)")
        return self._evaluator(model if model is not None else self._model.eval_model, self._data.eval)


def scale_schedule(scheduler: Any, optimizer: OptimizerLike, factor: float | None,
                   base: float | None = None) -> None:
    """Scale (or, with `base`, set) the base learning rates of `scheduler` and the rates in force."""
    from gputrain.train.optim.build import LRSchedule

    if isinstance(scheduler, LRSchedule):
        scheduler.scale(factor, base=base)
        return
    named = getattr(scheduler, "schedulers", None)  # a step of your own's, by optimizer (train/optim/by_name.py)
    if isinstance(named, dict) and hasattr(scheduler, "optimizers"):
        for name, each in named.items():
            scale_schedule(each, scheduler.optimizers.optimizers[name], factor, base=base)
        return
    bases = getattr(scheduler, "base_lrs", None)
    if isinstance(bases, list):
        scheduler.base_lrs = [base if base is not None else b * (factor or 1.0) for b in bases]
    for group in optimizer.param_groups:
        lr = group["lr"]
        new = base if base is not None else (lr * (factor or 1.0))
        if isinstance(lr, torch.Tensor):  # cuda-only: a capturable optimizer's device lr, written in place
            lr.fill_(new)
        else:
            group["lr"] = new
    torch_compat.set_last_lr(scheduler, [g["lr"] for g in optimizer.param_groups])  # what get_last_lr() reports


class CallbackList:
    """The run's callbacks, and the calls the loop makes into them."""

    def __init__(self, callbacks: Sequence[Any] | None):
        if callbacks is None:
            callbacks = []
        if isinstance(callbacks, (str, bytes)) or not isinstance(callbacks, Sequence):
            if any(callable(getattr(callbacks, h, None)) for h in HOOKS):
                callbacks = [callbacks]  # one callback given without a list
            else:
                raise ConfigError(f"callbacks must be a list of callback objects, got {type(callbacks).__name__}")
        for cb in callbacks:
            if isinstance(cb, type):
                raise ConfigError(f"callbacks takes instances: write {cb.__name__}(...), not {cb.__name__}")
            if not any(callable(getattr(cb, h, None)) for h in HOOKS):
                raise ConfigError(f"{type(cb).__name__} has none of the callback hooks ({', '.join(HOOKS)}); "
                                  "subclass gputrain.Callback")
        self.callbacks = list(callbacks)
        self.keys = _state_keys(self.callbacks)
        self.per_step = [k for k, cb in zip(self.keys, self.callbacks)
                         if getattr(cb, "every_step", False) and callable(getattr(cb, "on_step", None))]

    def __len__(self) -> int:
        return len(self.callbacks)

    def _each(self, hook: str):
        for key, cb in zip(self.keys, self.callbacks):
            fn = getattr(cb, hook, None)
            if callable(fn):
                yield key, fn

    def describe(self) -> str:
        """One line for the run log and the summary: which callbacks, and when they run."""
        if not self.callbacks:
            return "none"
        parts = [f"{k} ({'every step' if k in self.per_step else 'at log points'})" for k in self.keys]
        return ", ".join(parts)

    def cost(self) -> str | None:
        """What per-step hooks cost, or None when every callback runs at log points only."""
        if not self.per_step:
            return None
        return (f"{', '.join(self.per_step)} asked for a hook after every step: no CUDA graph for this run, and "
                "each device value a hook reads is a host sync per step (log-point hooks cost neither)")

    def step_updates(self, module: nn.Module) -> list[Callable[[], None]]:
        """The device updates callbacks give the training step (run after its optimizer step)."""
        updates = []
        for _, fn in self._each("step_update"):
            update = fn(module)
            if update is not None:
                updates.append(update)
        return updates

    def run_start(self, run: RunControl) -> None:
        for _, fn in self._each("on_run_start"):
            fn(run)

    def evaluate(self, run: RunControl, metrics: dict[str, float]) -> dict[str, float]:
        extra: dict[str, float] = {}
        for key, fn in self._each("on_evaluate"):
            more = fn(run, dict(metrics))
            if more is None:
                continue
            if not isinstance(more, Mapping):
                raise ConfigError(f"{key}.on_evaluate returned {type(more).__name__}: return a dict of values or None")
            extra.update(more)
        return extra

    def log(self, run: RunControl, record: dict[str, Any]) -> None:
        for _, fn in self._each("on_log"):
            fn(run, record)

    def checkpoint(self, run: RunControl, path: Path) -> None:
        for _, fn in self._each("on_checkpoint"):
            fn(run, path)

    def step(self, run: RunControl) -> None:
        for key, cb in zip(self.keys, self.callbacks):
            if key in self.per_step:
                cb.on_step(run)

    def exception(self, run: RunControl, exc: BaseException) -> None:
        for key, fn in self._each("on_exception"):
            try:
                fn(run, exc)
            except Exception as hook_exc:  # the first error is the one to report
                log.warning("%s.on_exception failed: %s: %s", key, type(hook_exc).__name__, hook_exc)

    def run_end(self, run: RunControl, history: History) -> None:
        for _, fn in self._each("on_run_end"):
            fn(run, history)

    def state_dict(self, run: RunControl) -> dict[str, Any]:
        """{state key: the callback's state} for the checkpoint (callbacks without state are left out)."""
        states = {}
        for key, fn in self._each("on_checkpoint_save"):
            state = fn(run)
            if state is not None:
                if not isinstance(state, dict):
                    raise ConfigError(f"{key}.on_checkpoint_save returned {type(state).__name__}: return a dict "
                                      "(of tensors and plain values) or None")
                states[key] = state
        return states

    def load_state_dict(self, run: RunControl, states: Mapping[str, Any]) -> None:
        for key, fn in self._each("on_checkpoint_load"):
            if key in states:
                fn(run, states[key])
        unused = sorted(set(states) - set(self.keys))
        if unused:
            log.info("the checkpoint holds the state of callbacks this run was not given: %s", ", ".join(unused))


def _state_keys(callbacks: list[Any]) -> list[str]:
    keys: list[str] = []
    for cb in callbacks:
        base = getattr(cb, "state_key", None) or type(cb).__name__
        key, n = base, 2
        while key in keys:
            key, n = f"{base}#{n}", n + 1
        keys.append(key)
    return keys
