"""A run's parts, made once by the builder (train/loop/build.py) and run by the loop (trainer.py).

    RunParts
      config, dist, device   TrainConfig; the process group and this process's device
      precision, speed       the numeric precision (one contract) and the speed switches, decided once
      model: ModelParts      the plain module, the model as trained (wrapped, compiled), as evaluated
      data: DataFeeds        the loaders, the stream of batches, how many steps, when to evaluate
      optim: Optimizers      the optimizer (or a step of your own's named set) and the schedule
      step: StepParts        the loss rule, the step (built-in or yours), its graph, the gated call
      carried, callbacks     what steps carry to the next one; your hooks at log points
      evaluator, guards      evaluation; the non-finite and spike watch
      checkpoints            the checkpoint manager, built with the states it saves
      state, history         where the run is (saved), what it logged
      startup, warnings      the time before the first step by part; what the summary warns of

Each part is typed; what reads the run takes the parts it reads.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

import torch
from torch import nn

if TYPE_CHECKING:
    from gputrain.checkpoint.manager import CheckpointManager
    from gputrain.config import TrainConfig
    from gputrain.data.placement import Placement
    from gputrain.data.stream import BatchStream
    from gputrain.io.history import History
    from gputrain.runtime.distributed import DistInfo
    from gputrain.runtime.precision import RunPrecision
    from gputrain.runtime.speed import SpeedSwitches
    from gputrain.train.evaluation.evaluate import Evaluator
    from gputrain.train.evaluation.points import EvalPoints
    from gputrain.train.loop.callbacks import CallbackList, RunControl
    from gputrain.train.loop.compiling import RunCompile
    from gputrain.train.loop.guards import NonFiniteGuard, SpikeDetector
    from gputrain.train.loop.startup_costs import StartupClock
    from gputrain.train.loop.state import RunState
    from gputrain.train.modes import UserModes
    from gputrain.train.optim.by_name import OptimizerSet
    from gputrain.train.optim.intervals import SchedulerSteps
    from gputrain.train.step.carried_state import CarriedState
    from gputrain.train.step.graphs import GraphedStep
    from gputrain.train.step.layout import MemoryFormats
    from gputrain.train.step.loss import LossRule
    from gputrain.train.step.own_step import OwnStep
    from gputrain.train.step.train_step import TrainStep


@dataclass
class ModelParts:
    """module: the plain module (moved to the device); model: as trained (DDP/FSDP-wrapped, compiled);
    eval_model: what evaluation calls (uncompiled: no_grad and eval shapes would recompile); modes and
    formats: the user's train/eval modes and memory layouts, given back at the end; recomputed: the
    modules whose activations backward recomputes; compile: what a compiled run keeps of its compile."""

    module: nn.Module
    model: nn.Module
    eval_model: nn.Module
    modes: UserModes
    formats: MemoryFormats
    recomputed: list[str] = field(default_factory=list)
    compile: RunCompile | None = None


@dataclass
class DataFeeds:
    """train / eval: the loaders (eval None without eval data); stream: the training batches in order,
    resumable; total_steps: the run's optimizer steps; batches_per_epoch: None for an iterable without a
    length; batch_size: the data's own per process (a user DataLoader's), None for an iterable's own."""

    train: Any
    eval: Any
    placement: Placement
    stream: BatchStream
    total_steps: int
    batches_per_epoch: int | None
    eval_points: EvalPoints
    batch_size: int | None


@dataclass
class Optimizers:
    """The optimizer (a step of your own's: its named set), the schedule, how each was decided, and
    when the schedule steps (`steps`: after every optimizer step, or after each epoch)."""

    optimizer: torch.optim.Optimizer | OptimizerSet
    scheduler: Any
    optimizer_desc: str
    schedule_desc: str
    steps: SchedulerSteps

    def all(self) -> list[torch.optim.Optimizer]:
        """Every optimizer of the run: one, or a step of your own's by name."""
        if isinstance(self.optimizer, torch.optim.Optimizer):
            return [self.optimizer]
        return list(self.optimizer.optimizers.values())


@dataclass
class StepParts:
    """loss: how a batch becomes a loss; body: the step (built-in or your own); graphed: its CUDA-graph
    wrapper (None: eager); run: what the loop calls, the first step's gate over the graphed or eager step."""

    loss: LossRule
    body: TrainStep | OwnStep
    graphed: GraphedStep | None
    run: Callable[[list], Any]
    own: bool = False  # a step of your own (step_fn)


@dataclass
class Guards:
    nonfinite: NonFiniteGuard
    spikes: SpikeDetector


@dataclass
class RunParts:
    """Everything a run is made of (see the module docstring)."""

    config: TrainConfig
    dist: DistInfo
    device: torch.device
    precision: RunPrecision
    speed: SpeedSwitches
    model: ModelParts
    data: DataFeeds
    optim: Optimizers
    step: StepParts
    carried: CarriedState
    callbacks: CallbackList
    control: RunControl
    evaluator: Evaluator
    guards: Guards
    checkpoints: CheckpointManager
    state: RunState
    history: History
    startup: StartupClock
    task: str | None
    run_dir: Path | None
    warnings: list[str] = field(default_factory=list)

    @property
    def is_main(self) -> bool:
        return self.dist.is_main
