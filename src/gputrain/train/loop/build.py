"""The builder: a run's parts made once, in order, into one `RunParts` (train/loop/parts.py).

Parse, build, train (torchtitan's `train.py`): `fit` hands what the user gave to `build_run`, and
the loop (train/loop/trainer.py) runs over the parts it returns. In this order, each decided once:

1. the process group and the device, the run's seed;
2. precision: one `RunPrecision` (autocast, loss scaling, TF32);
3. the model: speed switches decided before the optimizer (channels_last, cudnn.benchmark, graphs,
   compile), moved, recomputed blocks, DDP/FSDP wrapping, compile (the cache first);
4. the data: placement by the memory rule, the loaders, the steps, when to evaluate;
5. the optimizer(s) and schedule (capturable when graphs will be used);
6. the step: the built-in or yours, its CUDA-graph wrapper, the first step's deciders (layout,
   automatic autocast) behind one gate (train/step/first_step.py);
7. evaluation, the guards, the callbacks' view of the run (`RunControl`);
8. checkpoints: the run directory checked before anything is written, the store, the manager
   built with the states it saves; a resume loads them.
"""

from __future__ import annotations

import functools
import logging
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

import torch
from torch import nn

from gputrain.batch import move, move_optimizer_state
from gputrain.checkpoint.frozen import FrozenBase
from gputrain.checkpoint.manager import CheckpointManager, ResumeRules, open_run_store
from gputrain.checkpoint.parts import DataPart, HistoryPart, ModelPart, OptimizerPart, RngPart, RunCheckpoint, \
    Stateful, global_batch
from gputrain.checkpoint.sharded_save import DcpCheckpointer
from gputrain.config import TrainConfig
from gputrain.data import BatchStream, BatchTransform, TensorBatches, make_loader
from gputrain.data.sources import batch_size_used
from gputrain.data.splits import unpack_splits
from gputrain.data.stream import known_length, plan_steps
from gputrain.errors import ConfigError
from gputrain.io.history import History
from gputrain.runtime import distributed
from gputrain.runtime.devices import seed_run
from gputrain.runtime.precision import RunPrecision, resolve_precision
from gputrain.runtime.speed import SpeedSwitches, decide_speed, scheduler_blocker
from gputrain.train.evaluation.evaluate import Evaluator, infer_task
from gputrain.train.evaluation.points import EvalPoints
from gputrain.train.loop.callbacks import CallbackList, RunControl
from gputrain.train.loop.compiling import compile_for_run
from gputrain.train.loop.guards import NonFiniteGuard, SpikeDetector
from gputrain.train.loop.parts import DataFeeds, Guards, ModelParts, Optimizers, RunParts, StepParts
from gputrain.train.loop.startup_costs import StartupClock
from gputrain.train.loop.state import RunState
from gputrain.train.modes import UserModes
from gputrain.train.optim.build import make_optimizer, make_scheduler, make_user_scheduler
from gputrain.train.optim.by_name import OptimizerSet, SchedulerSet
from gputrain.batch import needs_closure
from gputrain.train.optim.intervals import SchedulerSteps, is_plateau
from gputrain.train.step.autocast_decider import AutocastDecider
from gputrain.train.step.carried_state import CarriedState
from gputrain.train.step.first_step import Decider, FirstPass, FirstStepGate
from gputrain.train.step.graphs import GraphedStep
from gputrain.train.step.layout import LayoutDecider, MemoryFormats
from gputrain.train.step.loss import LossRule
from gputrain.train.step.nonfinite import skips_nonfinite
from gputrain.train.step.own_step import OwnStep, own_optimizers
from gputrain.train.step.recompute import recompute_for_run
from gputrain.train.step.train_step import TrainStep

log = logging.getLogger("gputrain")


def build_run(model: nn.Module, train_data: Any, *, loss_fn: Callable | None = None,
              compute_loss: Callable | None = None, optimizer: Any = None, config: TrainConfig | None = None,
              eval_data: Any = None, task: str | None = None, transform: BatchTransform | None = None,
              metrics: Mapping[str, Any] | None = None, num_items: Callable | None = None,
              callbacks: Sequence[Any] | None = None, scheduler: Any = None, collate_fn: Callable | None = None,
              step_fn: Callable | None = None, state: Any = None) -> RunParts:
    """The run's parts, as `fit` describes its arguments (see the module docstring for the order)."""
    startup = StartupClock()  # the time before the first step, by part (train/loop/startup_costs.py)
    config = config or TrainConfig()
    config.validate()
    model = distributed.unwrap_data_parallel(model)
    dist, device = distributed.init_distributed(config.device)
    seed_run(config.seed + dist.rank, device)
    loss = LossRule(loss_fn, compute_loss, step_fn=step_fn)
    task = task or (infer_task(loss_fn) if compute_loss is None else None)
    warnings: list[str] = []
    hooks = CallbackList(callbacks)  # hooks at log points (train/loop/callbacks.py)
    precision = RunPrecision(resolve_precision(config.precision, device), device).apply()
    startup.mark("device and precision")
    speed = decide_speed(config, model, device, world_size=dist.world_size, use_scaler=precision.scaled,
                         optimizer=optimizer, step_hooks=hooks.per_step, own_step=step_fn, probe_layout=True)
    models = _model(config, model, device, dist, speed, own_step=step_fn is not None, startup=startup)
    startup.mark("model moves, wrapping and compile setup")
    data = _data(config, train_data, eval_data, transform, collate_fn, device, dist, speed, warnings)
    startup.mark("data preparation")
    optim = _optimizers(config, optimizer, scheduler, models, device, speed, data, step_fn)
    carried = CarriedState(state, device)  # what steps carry to the next (train/step/carried_state.py)
    speed.refuse_graphs(carried.graph_blocker())  # state=: Python that a graph would run once
    run_state = RunState()
    step = _step(config, models, optim, loss, precision, speed, device, dist, data, hooks, carried, run_state,
                 num_items=num_items, step_fn=step_fn)
    evaluator = Evaluator(loss, precision, device, dist, task, metrics)
    history = History(records=[], config=config.to_dict(), summary={})
    control = RunControl(config=config, dist=dist, device=device, state=run_state, data=data, model=models,
                         optim=optim, history=history, evaluator=evaluator)
    run_dir = Path(config.run_dir) if config.run_dir else None
    checkpoints = _checkpoints(config, models, optim, precision, dist, device, data, run_state, step, history,
                               hooks, control, carried, run_dir)
    startup.mark("optimizer, step and run directory")
    parts = RunParts(config=config, dist=dist, device=device, precision=precision, speed=speed, model=models,
                     data=data, optim=optim, step=step, carried=carried, callbacks=hooks, control=control,
                     evaluator=evaluator, guards=Guards(NonFiniteGuard(config.on_nan),
                                                        SpikeDetector(config.spike_ratio, config.spike_window,
                                                                      config.spike_patience, config.on_spike)),
                     checkpoints=checkpoints, state=run_state, history=history, startup=startup, task=task,
                     run_dir=run_dir, warnings=warnings)
    if config.resume:
        resume(parts)
        startup.mark("checkpoint load")
    return parts


def _model(config: TrainConfig, model: nn.Module, device: torch.device, dist: distributed.DistInfo,
           speed: SpeedSwitches, *, own_step: bool, startup: StartupClock) -> ModelParts:
    """The model moved, laid out, recomputed, wrapped and compiled, with what is given back at the end."""
    modes = UserModes(model).said(dist.is_main)  # kept while training, given back at the end
    formats = MemoryFormats(model)  # the user's layouts: given back at the end (train/step/layout.py)
    module = move(model, device)
    if speed.channels_last:
        module = module.to(memory_format=torch.channels_last)  # pyright: ignore[reportCallIssue]  # Module.to takes it
    speed.apply(device)  # cudnn.benchmark, given back at the end
    # the modules whose activations are recomputed in backward (train/step/recompute.py)
    recomputed = recompute_for_run(module, config.recompute) if config.recompute else []
    # A step of your own is not DDP-wrapped: it averages its gradients per optimizer (train/step/own_step.py).
    wrapped = distributed.wrap_model(module, dist, device, shard=config.shard) \
        if not own_step or config.shard else module
    parts = ModelParts(module=module, model=wrapped, eval_model=wrapped, modes=modes, formats=formats,
                       recomputed=recomputed)
    if config.compile:  # whole or regional, the compile cache first (train/loop/compiling.py)
        startup.mark("model moves, wrapping and compile setup")
        parts.model, parts.compile = compile_for_run(config, module, wrapped, device, speed, startup)
    return parts


def _data(config: TrainConfig, train_data: Any, eval_data: Any, transform: BatchTransform | None,
          collate_fn: Callable | None, device: torch.device, dist: distributed.DistInfo, speed: SpeedSwitches,
          warnings: list[str]) -> DataFeeds:
    """The loaders (placement by the memory rule), the run's steps and when it evaluates."""
    # Data given as a workload's DataSplits carries its own normalization and augmentation.
    transform, train_data, eval_data = unpack_splits(train_data, eval_data, transform)
    transform.channels_last = speed.channels_last
    load = functools.partial(make_loader, device=device, seed=config.seed, rank=dist.rank,
                             world_size=dist.world_size, on_device=config.data_on_device,
                             memory_fraction=config.device_memory_fraction, num_workers=config.num_workers,
                             collate_fn=collate_fn, rebuild_loader=config.rebuild_loader)
    train, placement = load(train_data, config.batch_size, train=True, transform=transform)
    evaluated = None
    if eval_data is not None:
        evaluated, _ = load(eval_data, max(config.batch_size, 256), train=False, transform=transform.for_eval())
    # Steps, or epochs x batches per epoch (data/stream.py: a clear error when the length is unknown).
    total_steps = plan_steps(train, steps=config.steps, epochs=config.epochs, accumulate=config.accumulate)
    per_epoch = known_length(train)  # None: an iterable without a length
    points = EvalPoints(config.eval_every, per_epoch, config.accumulate, total_steps, config.log_every,
                        has_eval=evaluated is not None)  # train/evaluation/points.py
    # The batch size the data really give (a user DataLoader's own), for the log and the summary.
    batch_size, why = batch_size_used(train, config.batch_size, TrainConfig.__dataclass_fields__["batch_size"].default)
    if why and dist.is_main:
        log.warning("%s", why)
        warnings.append(why)
    return DataFeeds(train=train, eval=evaluated, placement=placement, stream=BatchStream(train),
                     total_steps=total_steps, batches_per_epoch=per_epoch, eval_points=points, batch_size=batch_size)


def _optimizers(config: TrainConfig, optimizer: Any, scheduler: Any, models: ModelParts, device: torch.device,
                speed: SpeedSwitches, data: DataFeeds, step_fn: Callable | None) -> Optimizers:
    """The optimizer(s) and the schedule (capturable when graphs will be used), on the run's device,
    and when the schedule steps (train/optim/intervals.py)."""
    def built_in(opt: torch.optim.Optimizer) -> Any:
        return make_scheduler(opt, config.schedule, data.total_steps, config.warmup_steps)

    built_in_desc = f"{config.schedule}" + (f" after {config.warmup_steps} warm-up steps"
                                            if config.warmup_steps else "") + " (built-in)"
    def steps(made: Any) -> SchedulerSteps:
        steps = SchedulerSteps(made, interval=config.scheduler_interval, monitor=config.scheduler_monitor,
                               batches_per_epoch=data.batches_per_epoch, accumulate=config.accumulate,
                               yours=scheduler is not None, own_step=step_fn is not None)
        if is_plateau(made) and config.scheduler_monitor.startswith("eval_"):
            if data.eval is None:
                raise ConfigError(f"ReduceLROnPlateau steps on {config.scheduler_monitor}, but this run has no eval "
                                  "data: give eval_data (or a workload with a test split), or set scheduler_monitor to "
                                  "a training value such as 'loss'")
            data.eval_points.each_epoch(f"ReduceLROnPlateau steps on {config.scheduler_monitor} at each epoch's end")
        return steps

    if step_fn is not None:  # optimizers and schedulers by name
        named, schedulers, optimizer_desc, schedule_desc = own_optimizers(
            optimizer, scheduler, models.module, config, device, speed.cuda_graphs, (built_in, built_in_desc))
        optim = Optimizers(named, schedulers, optimizer_desc, schedule_desc, steps(schedulers))
    else:
        one, optimizer_desc = make_optimizer(
            optimizer, models.model.parameters(), lr=config.lr, weight_decay=config.weight_decay, device=device,
            fused=config.fused_optimizer, capturable=speed.cuda_graphs, decay_groups=config.weight_decay_groups)
        made, schedule_desc = make_user_scheduler(one, scheduler) if scheduler is not None \
            else (built_in(one), built_in_desc)
        interval = steps(made)
        optim = Optimizers(one, made, optimizer_desc, interval.describe(schedule_desc), interval)
    move_optimizer_state(optim.optimizer, device)  # the named set's: each optimizer's
    speed.refuse_graphs(scheduler_blocker(optim.scheduler))  # one that writes Python numbers each step
    return optim


def _step(config: TrainConfig, models: ModelParts, optim: Optimizers, loss: LossRule, precision: RunPrecision,
          speed: SpeedSwitches, device: torch.device, dist: distributed.DistInfo, data: DataFeeds,
          hooks: CallbackList, carried: CarriedState, run_state: RunState, *, num_items: Callable | None,
          step_fn: Callable | None) -> StepParts:
    """The step (built-in or yours), its CUDA-graph wrapper, and the first step's gate over them."""
    after = hooks.step_updates(models.module)
    body: TrainStep | OwnStep
    if step_fn is None:
        assert isinstance(optim.optimizer, torch.optim.Optimizer)
        _check_closure(optim.optimizer, precision)
        skip = skips_nonfinite(config.on_nan, precision.skips_nonfinite, optim.optimizer, optim.optimizer_desc)
        body = TrainStep(models.model, loss, optim.optimizer, precision, device=device,
                         max_grad_norm=config.max_grad_norm, num_items=num_items, dist=dist,
                         oom_recovery=config.oom_recovery, params=list(models.module.parameters()),
                         skip_nonfinite=skip, after_step=after)
        speed.refuse_graphs(body.capture_blocker())  # a closure optimizer reads the host while it steps
    else:
        assert isinstance(optim.optimizer, OptimizerSet) and isinstance(optim.scheduler, SchedulerSet)
        body = OwnStep(step_fn, models.model, models.module, optim.optimizer, optim.scheduler, precision,
                       device=device, max_grad_norm=config.max_grad_norm, dist=dist, oom_recovery=config.oom_recovery,
                       num_items=num_items, after_step=after, index=lambda: run_state.step, state=carried)
    graphed = GraphedStep(body, device) if speed.cuda_graphs else None
    if graphed is not None and config.accumulate == 1 and isinstance(data.train, TensorBatches):
        data.train.defer = True  # resident batches are assembled inside the step's graph (data/deferred.py)
    if config.cuda_graphs is True and not speed.cuda_graphs:
        log.warning("CUDA graphs requested but not used: %s", speed.reasons["cuda_graphs"])
    inner: Callable[[list], Any] = graphed if graphed is not None else body
    first_pass = FirstPass(loss, step_fn, (optim.optimizer.optimizers, optim.scheduler.schedulers)
                           if isinstance(optim.optimizer, OptimizerSet) and isinstance(optim.scheduler, SchedulerSet)
                           else ({}, {}))
    deciders: list[Decider] = []
    if speed.layout_probe is not None or speed.channels_last:  # NHWC may run: decided on the first batch, or on
        deciders.append(LayoutDecider(module=models.module, speed=speed, first_pass=first_pass, precision=precision,
                                      device=device, total_steps=data.total_steps, optimizers=optim.all(),
                                      formats=models.formats, loaders=(data.train, data.eval)))
    if (config.precision or "auto").strip().lower() == "auto" and precision.precision.autocast_dtype is not None:
        own = body if isinstance(body, OwnStep) else None
        deciders.append(AutocastDecider(precision=precision, module=models.module, first_pass=first_pass,
                                        flag=body.flag if isinstance(body, TrainStep) else None,
                                        stepped=(lambda: own.context.steps > 0) if own is not None else None))
    run = FirstStepGate(inner, deciders, module=models.module, device=device, clear=body.zero_grad,
                        graphs=graphed.graphs if graphed is not None else None) if deciders else inner
    return StepParts(loss=loss, body=body, graphed=graphed, run=run, own=step_fn is not None)


def _check_closure(optimizer: torch.optim.Optimizer, precision: RunPrecision) -> None:
    """A closure optimizer (LBFGS) steps through the built-in step's closure; GradScaler takes none."""
    if needs_closure(optimizer) and precision.scaled:
        raise ConfigError(f"{type(optimizer).__name__}.step(closure) cannot run through fp16's loss scaler "
                          "(torch's GradScaler takes no closure): use precision='bf16' or 'fp32'")


def _checkpoints(config: TrainConfig, models: ModelParts, optim: Optimizers, precision: RunPrecision,
                 dist: distributed.DistInfo, device: torch.device, data: DataFeeds, run_state: RunState,
                 step: StepParts, history: History, hooks: CallbackList, control: RunControl,
                 carried: CarriedState, run_dir: Path | None) -> CheckpointManager:
    """The run directory checked and its store opened (before anything is written), and the manager
    built with the states a checkpoint holds (checkpoint/parts.py's, in load order)."""
    writer = DcpCheckpointer(dist, device, config.checkpoint_format, config.async_checkpoint)
    store = None
    if run_dir is not None:
        from gputrain.io.preflight import estimate_checkpoint_bytes

        # "auto": gputrain/metric_direction.py's rule, with the run's metrics
        mode = control.metric_direction(config.best_metric).mode if config.best_metric and config.best_mode == "auto" \
            else config.best_mode
        store = open_run_store(run_dir, config, mode, is_main=dist.is_main,
                               checkpoint_bytes=estimate_checkpoint_bytes(models.module, optim.optimizer))
        distributed.barrier(dist)
    frozen = FrozenBase.decide(models.module, full_checkpoints=config.full_checkpoints, sharded=writer.uses_dcp,
                               fsdp=config.shard and dist.enabled)  # what the checkpoints hold of a frozen base
    states: dict[str, Stateful] = {
        "model": ModelPart(models.model, models.module, dist, frozen),
        "optimizer": OptimizerPart(models.model, optim.optimizer, dist, device),
        "scaler": precision,
        "scheduler": optim.scheduler,
        "rng": RngPart(device),
        "run": RunPart(run_state, data.stream, step.body),
        "data": DataPart(data.stream),
        "history": HistoryPart(history),
        "callbacks": CallbacksPart(hooks, control),
        "carried": carried,
    }
    header = lambda: {"global_batch": global_batch(config, data.batch_size, dist.world_size),  # noqa: E731
                      "world_size": dist.world_size, "config": config.to_dict(),
                      **({"frozen": frozen.header()} if frozen.trainable_only else {})}
    return CheckpointManager(RunCheckpoint(states, dist, header), store=store, writer=writer, records=history,
                             is_main=dist.is_main, step=lambda: run_state.step,
                             on_commit=functools.partial(hooks.checkpoint, control))


def resume(parts: RunParts) -> None:
    """Load the checkpoint `config.resume` names into the parts; say when it leaves nothing to train."""
    rules = ResumeRules(parts.config, parts.model.module, parts.data.batch_size,
                        default_optimizer=parts.optim.optimizer_desc.startswith("AdamW ("))
    path = parts.checkpoints.resume(rules)
    total = parts.data.total_steps
    if path is not None and parts.state.step >= total:
        done = (f"the checkpoint {path} is at step {parts.state.step}, which already reaches this run's "
                f"{total} steps: there is nothing to train (give more steps= or epochs= to train on)")
        log.warning("%s", done)
        parts.warnings.append(done)


class RunPart:
    """The run state (train/loop/state.py's RunState), with the position of the stream (`epoch`,
    `batch_in_epoch`) and the step's OOM `splits`, which live on those objects while the run goes on."""

    def __init__(self, state: RunState, stream: BatchStream, step: TrainStep | OwnStep):
        self.state, self.stream, self.step = state, stream, step

    def state_dict(self) -> dict[str, Any]:
        return {**self.state.state_dict(), "epoch": self.stream.epoch, "batch_in_epoch": self.stream.batch_in_epoch,
                "splits": self.step.micro.splits}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.state.load_state_dict(state)
        self.step.micro.splits = int(state.get("splits", 1))


class CallbacksPart:
    """Each callback's own state, under its `state_key` (train/loop/callbacks.py)."""

    def __init__(self, callbacks: CallbackList, control: RunControl):
        self.callbacks, self.control = callbacks, control

    def state_dict(self) -> dict[str, Any]:
        return self.callbacks.state_dict(self.control)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.callbacks.load_state_dict(self.control, state)
