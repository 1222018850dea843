"""What one pass of the training loop holds besides the trainer (train/loop/trainer.py): its output files,
progress bar and stop signals, the log interval's clock and samples, the peak memory seen at log
points. `Trainer.run` opens a pass (`LoopPass.open`: the progress bar and stop signals) and its outputs
once the run goes ahead (`open_outputs`, after the first step: a run refused there writes no file);
`Trainer.run_steps`, what `gputrain profile` times, a bare one (`LoopPass.bare`: no files, bar or
signal handlers).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import TYPE_CHECKING

from gputrain.runtime.host_memory import StepFaults
from gputrain.train.loop.signals import StopSignals

if TYPE_CHECKING:
    from gputrain.config import TrainConfig
    from gputrain.report.progress import TrainProgress
    from gputrain.report.run_outputs import RunOutputs
    from gputrain.train.loop.callbacks import CallbackList
    from gputrain.train.loop.state import RunState


class LoopPass:
    """One pass of the loop: `outputs`, `progress`, `signals`, the opt-in per-step hooks (`on_step`),
    the processes (`world`), and the figures kept between log points."""

    def __init__(self, outputs: RunOutputs, progress: TrainProgress, signals: StopSignals, callbacks: CallbackList,
                 world: int, state: RunState):
        self.outputs, self.progress, self.signals = outputs, progress, signals
        self.on_step = callbacks.step if callbacks.per_step else None  # opt-in per-step hooks
        self.world = world
        self.t_start = self.t_log = time.perf_counter()
        self.samples_at_log = state.samples_seen
        self.start_step = state.step  # a resumed run's history also holds the stopped run's records
        self.faults = StepFaults()  # the steps' own page faults, counted from here (Trainer._log_point)
        self.peak = 0
        self.opened = False  # open_outputs was called: the run went ahead

    def open_outputs(self, run_dir: Path | None, config: TrainConfig, *, main: bool) -> None:
        """The run's outputs (metrics files, TensorBoard, MLflow, W&B; written by the main process),
        opened once the run goes ahead."""
        from gputrain.report.run_outputs import RunOutputs

        self.outputs = RunOutputs(run_dir, config, enabled=main, start_step=self.start_step)
        self.opened = True

    @classmethod
    def open(cls, config: TrainConfig, *, main: bool, total_steps: int, description: str,
             callbacks: CallbackList, world: int, state: RunState) -> LoopPass:
        """A pass with the progress bar (on the main process), catching the configured stop signals;
        no outputs until `open_outputs`."""
        import signal

        from gputrain.report.progress import TrainProgress
        from gputrain.report.run_outputs import RunOutputs

        return cls(RunOutputs(None, config, enabled=False),
                   TrainProgress(enabled=bool(config.progress and main), total_steps=total_steps,
                                 description=description),
                   StopSignals(tuple(getattr(signal, name) for name in config.stop_signals)), callbacks, world, state)

    @classmethod
    def bare(cls, config: TrainConfig, total_steps: int, callbacks: CallbackList, world: int,
             state: RunState) -> LoopPass:
        """A pass without output files, progress bar or signal handlers."""
        from gputrain.report.progress import TrainProgress
        from gputrain.report.run_outputs import RunOutputs

        return cls(RunOutputs(None, config, enabled=False), TrainProgress(enabled=False, total_steps=total_steps),
                   StopSignals(()), callbacks, world, state)
