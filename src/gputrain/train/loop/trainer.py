"""The trainer: named setup parts, then a small loop around one `TrainStep`.

Setup, decided once and in this order: process group and device; precision (one `RunPrecision`);
the model (speed switches decided before the optimizer, channels_last, cudnn.benchmark, recompute
(blocks that compute their activations again in backward), DDP/FSDP wrapping, compile); the data (placement by the memory rule);
the optimizer and schedule (capturable when graphs will be used); the step (`TrainStep`, wrapped
in a `GraphedStep` when graphs are on); the checkpoint's named parts (checkpoint/parts.py).
The loop (`_iterate`, also what `run_steps` runs for profile) pulls one optimizer step's
micro-batches from the stream, runs the step, and reads the device-side loss only every
`log_every` steps (the one host sync of the hot loop); evaluation and checkpoints happen there.
Its phases are marked on `self.clock`, a no-op unless profile lends one (`timed_phases`).
"""

from __future__ import annotations

import contextlib
import functools
import logging
import sys
import time
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence, cast

import torch
from torch import nn

from gputrain.batch import move, move_optimizer_state
from gputrain.checkpoint import save_resume as checkpointing
from gputrain.checkpoint.parts import run_checkpoint
from gputrain.config import TrainConfig
from gputrain.data import BatchStream, BatchTransform, TensorBatches, make_loader
from gputrain.data.deferred import materialize, num_samples
from gputrain.data.sources import batch_size_used
from gputrain.data.stream import DataExhausted, known_length, plan_steps
from gputrain.data.splits import unpack_splits
from gputrain.errors import GputrainError
from gputrain.io.history import History
from gputrain.runtime import distributed
from gputrain.runtime.devices import seed_run, synchronizer, take_peak_memory
from gputrain.runtime.host_memory import StepFaults
from gputrain.runtime.precision import RunPrecision, resolve_precision
from gputrain.runtime.recompiles import RecompileWatcher
from gputrain.runtime.speed import SpeedSwitches, decide_speed, scheduler_blocker
from gputrain.runtime.timing import NO_CLOCK, PhaseClock
from gputrain.train.evaluation.evaluate import Evaluator, infer_task
from gputrain.train.evaluation.points import EvalPoints
from gputrain.train.step.graphs import GraphedStep
from gputrain.train.loop.guards import NonFiniteGuard, SpikeDetector
from gputrain.train.loop import run_summary
from gputrain.train.loop.loop_pass import LoopPass
from gputrain.train.step.layout import MemoryFormats, gate_step, run_optimizers
from gputrain.train.step.precision_gate import gate_precision
from gputrain.train.step.loss import LossRule
from gputrain.train.modes import UserModes
from gputrain.train.loop.callbacks import CallbackList, RunControl
from gputrain.train.step.carried_state import CarriedState
from gputrain.train.optim.build import make_optimizer, make_scheduler, make_user_scheduler
from gputrain.train.optim.by_name import OptimizerSet, SchedulerSet
from gputrain.train.step.recompute import recompute_for_run
from gputrain.train.step.own_step import OwnStep, own_optimizers
from gputrain.train.loop.signals import agree_to_stop
from gputrain.train.loop.state import RunState
from gputrain.train.loop.startup_costs import StartupClock
from gputrain.train.loop.compiling import after_first_step, compile_counts, compile_for_run, compile_seconds
from gputrain.train.step.train_step import TrainStep, skips_nonfinite

log = logging.getLogger("gputrain")

SIGNAL_SYNC_EVERY = 10  # steps between the ranks' agreement on a stop signal (several processes)


class Trainer:
    """One training run. `fit` is the usual entry point; this class holds the run's parts and state.

    Batches are turned into a loss by `LossRule` (train/step/loss.py): `compute_loss(model, batch)`, a
    pair with `loss_fn`, or the model's own loss. `metrics` and `num_items` as in `fit`.
    """

    def __init__(self, model: nn.Module, train_data, *, loss_fn: Callable | None = None,
                 compute_loss: Callable | None = None, optimizer=None, config: TrainConfig | None = None,
                 eval_data=None, task: str | None = None, transform: BatchTransform | None = None,
                 metrics: Mapping[str, Any] | None = None, num_items: Callable | None = None,
                 callbacks: Sequence[Any] | None = None, scheduler=None, collate_fn: Callable | None = None,
                 step_fn: Callable | None = None, state: Any = None):
        self.startup = StartupClock()  # the time before the first step, by part (train/loop/startup_costs.py)
        self.config = config = config or TrainConfig()
        config.validate()
        model = distributed.unwrap_data_parallel(model)
        self.dist, self.device = distributed.init_distributed(config.device)
        self.is_main = self.dist.is_main
        seed_run(config.seed + self.dist.rank, self.device)
        self.loss = LossRule(loss_fn, compute_loss, step_fn=step_fn)
        self.own_step = step_fn  # a step of your own (train/step/own_step.py): named optimizers, no DDP wrapper
        self.task = task or (infer_task(loss_fn) if compute_loss is None else None)
        self.warnings: list[str] = []
        self.callbacks = CallbackList(callbacks)  # hooks at log points (train/loop/callbacks.py)
        self.control = RunControl(self)
        self._setup_precision()
        self.startup.mark("device and precision")
        self._setup_model(model, optimizer)
        self.startup.mark("model moves, wrapping and compile setup")
        self._setup_data(train_data, eval_data, transform, collate_fn)
        self.startup.mark("data preparation")
        self._setup_optimizer(optimizer, scheduler)
        self.carried = CarriedState(state, self.device)  # what steps carry to the next (train/step/carried_state.py)
        self.speed.refuse_graphs(self.carried.graph_blocker())  # state=: Python that a graph would run once
        self._setup_step(num_items)
        self.step_fn = gate_precision(self, gate_step(self))  # layout, automatic autocast: decided on the 1st batch
        self.evaluator = Evaluator(self.loss, self.precision, self.device, self.dist, self.task, metrics)
        self.state = RunState()
        self.stream = BatchStream(self.train_loader)
        self.history = History(records=[], config=config.to_dict(), summary={})
        self.run_dir = Path(config.run_dir) if config.run_dir else None
        self.store = self._setup_checkpoints()
        self.checkpoint = run_checkpoint(self)  # the checkpoint's named parts
        self.clock: PhaseClock = NO_CLOCK  # the loop's phase marks: a timing clock only while profiled
        self._bare_loop: LoopPass | None = None  # run_steps' loop (no outputs, progress bar or signals)
        self.startup.mark("optimizer, step and run directory")
        if config.resume:
            checkpointing.resume(self)
            self.startup.mark("checkpoint load")

    # ------------------------------------------------------------ setup parts

    def _setup_precision(self) -> None:
        self.precision = RunPrecision(resolve_precision(self.config.precision, self.device), self.device).apply()

    def _setup_model(self, model: nn.Module, optimizer) -> None:
        cfg, device = self.config, self.device
        self.modes = UserModes(model).said(self.is_main)  # kept while training, given back by close()
        self.speed: SpeedSwitches = decide_speed(cfg, model, device, world_size=self.dist.world_size,
                                                 use_scaler=self.precision.precision.use_scaler, optimizer=optimizer,
                                                 step_hooks=self.callbacks.per_step, own_step=self.own_step,
                                                 probe_layout=True)
        self.memory_formats = MemoryFormats(model)  # the user's layouts: given back by close() (train/step/layout.py)
        self.module = move(model, device)
        if self.speed.channels_last:
            self.module = self.module.to(memory_format=torch.channels_last)
        self.speed.apply(device)  # cudnn.benchmark, given back by close()
        # the modules whose activations are recomputed in backward (train/step/recompute.py)
        self.recomputed: list[str] = recompute_for_run(self.module, cfg.recompute) if cfg.recompute else []
        # A step of your own is not DDP-wrapped: it averages its gradients per optimizer (train/step/own_step.py).
        self.model = distributed.wrap_model(self.module, self.dist, device, shard=cfg.shard) \
            if self.own_step is None or cfg.shard else self.module
        self.eval_model = self.model  # evaluation runs uncompiled: no_grad and eval shapes would recompile
        self.recompiles: RecompileWatcher | None = None
        if cfg.compile:  # whole or regional, the compile cache first (train/loop/compiling.py)
            self.startup.mark("model moves, wrapping and compile setup")
            compile_for_run(self)

    def _setup_data(self, train_data, eval_data, transform: BatchTransform | None,
                    collate_fn: Callable | None = None) -> None:
        cfg = self.config
        # Data given as a workload's DataSplits carries its own normalization and augmentation.
        transform, train_data, eval_data = unpack_splits(train_data, eval_data, transform)
        transform.channels_last = self.speed.channels_last
        load = functools.partial(make_loader, device=self.device, seed=cfg.seed, rank=self.dist.rank,
                                 world_size=self.dist.world_size, on_device=cfg.data_on_device,
                                 memory_fraction=cfg.device_memory_fraction, num_workers=cfg.num_workers,
                                 collate_fn=collate_fn, rebuild_loader=cfg.rebuild_loader)
        self.train_loader, self.placement = load(train_data, cfg.batch_size, train=True, transform=transform)
        self.eval_loader = None
        if eval_data is not None:
            self.eval_loader, _ = load(eval_data, max(cfg.batch_size, 256), train=False,
                                       transform=transform.for_eval())
        # Steps, or epochs x batches per epoch (data/stream.py: a clear error when the length is unknown).
        self.total_steps = plan_steps(self.train_loader, steps=cfg.steps, epochs=cfg.epochs, accumulate=cfg.accumulate)
        self.batches_per_epoch = known_length(self.train_loader)  # None: an iterable without a length
        self.eval_points = EvalPoints(cfg.eval_every, self.batches_per_epoch, cfg.accumulate, self.total_steps,
                                      cfg.log_every, has_eval=self.eval_loader is not None)  # train/evaluation/points.py
        # The batch size the data really give (a user DataLoader's own), for the log and the summary.
        self.batch_size, why = batch_size_used(self.train_loader, cfg.batch_size,
                                               TrainConfig.__dataclass_fields__["batch_size"].default)
        if why and self.is_main:
            log.warning("%s", why)
            self.warnings.append(why)

    def _setup_optimizer(self, optimizer, scheduler: Callable[[Any], Any] | None = None) -> None:
        cfg = self.config
        built_in = (lambda opt: make_scheduler(opt, cfg.schedule, self.total_steps, cfg.warmup_steps),
                    f"{cfg.schedule}" + (f" after {cfg.warmup_steps} warm-up steps" if cfg.warmup_steps else "")
                    + " (built-in)")
        if self.own_step is not None:  # optimizers and schedulers by name
            self.optimizer, self.scheduler, self.optimizer_desc, self.schedule_desc = own_optimizers(
                optimizer, scheduler, self.module, cfg, self.device, self.speed.cuda_graphs, built_in)
        else:
            self.optimizer, self.optimizer_desc = make_optimizer(
                optimizer, self.model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay, device=self.device,
                fused=cfg.fused_optimizer, capturable=self.speed.cuda_graphs, decay_groups=cfg.weight_decay_groups)
            self.scheduler, self.schedule_desc = make_user_scheduler(self.optimizer, scheduler) \
                if scheduler is not None else (built_in[0](self.optimizer), built_in[1])
        move_optimizer_state(self.optimizer, self.device)
        self.speed.refuse_graphs(scheduler_blocker(self.scheduler))  # one that writes Python numbers each step

    def _setup_step(self, num_items: Callable | None) -> None:
        cfg = self.config
        skip = skips_nonfinite(cfg.on_nan, self.precision.precision.use_scaler, self.optimizer, self.optimizer_desc)
        self.train_step = TrainStep(self.model, self.loss, self.optimizer, self.precision, device=self.device,
                                    max_grad_norm=cfg.max_grad_norm, num_items=num_items, dist=self.dist,
                                    oom_recovery=cfg.oom_recovery, params=list(self.module.parameters()),
                                    skip_nonfinite=skip, after_step=self.callbacks.step_updates(self.module)) \
            if self.own_step is None else OwnStep(
                self.own_step, self.model, self.module, cast(OptimizerSet, self.optimizer), cast(SchedulerSet, self.scheduler),
                self.precision, device=self.device, max_grad_norm=cfg.max_grad_norm, dist=self.dist,
                oom_recovery=cfg.oom_recovery, after_step=self.callbacks.step_updates(self.module),
                index=lambda: self.state.step, state=self.carried)
        self.nonfinite = NonFiniteGuard(cfg.on_nan)
        self.spikes = SpikeDetector(cfg.spike_ratio, cfg.spike_window, cfg.spike_patience, cfg.on_spike)
        self.last_checkpoint: str | None = None
        self.handed_over: str | None = None  # the last checkpoint told to the callbacks (checkpoint/save_resume.py)
        self.graphed = GraphedStep(self.train_step, self.device) if self.speed.cuda_graphs else None
        if self.graphed is not None and cfg.accumulate == 1 and isinstance(self.train_loader, TensorBatches):
            # Resident batches are assembled inside the step's graph (data/deferred.py).
            self.train_loader.defer = True
        self.step_fn: Callable = self.graphed if self.graphed is not None else self.train_step
        if cfg.cuda_graphs is True and not self.speed.cuda_graphs:
            log.warning("CUDA graphs requested but not used: %s", self.speed.reasons["cuda_graphs"])

    def _setup_checkpoints(self):
        """Preflight the run directory (created, writable, room for the checkpoints) and open its store;
        choose the checkpoint format (one file, or every rank its part with DCP, checkpoint/sharded_save.py)."""
        from gputrain.checkpoint.sharded_save import DcpCheckpointer

        self.checkpointer = DcpCheckpointer(self.dist, self.device, self.config.checkpoint_format,
                                            self.config.async_checkpoint)
        if self.run_dir is None:
            return None
        from gputrain.io.preflight import estimate_checkpoint_bytes

        cfg = self.config
        mode = self.control.metric_direction(cfg.best_metric).mode if cfg.best_metric and cfg.best_mode == "auto" \
            else cfg.best_mode  # "auto": gputrain/metric_direction.py's rule, with the run's metrics
        store = checkpointing.open_run_store(self.run_dir, cfg, mode, is_main=self.is_main,
                                             checkpoint_bytes=estimate_checkpoint_bytes(self.module, self.optimizer))
        distributed.barrier(self.dist)
        return store

    # ------------------------------------------------------------ the loop

    def next_step_batches(self) -> list:
        """The micro-batches of the next optimizer step (advances the data stream and samples_seen)."""
        # Shapes are host metadata: no sync.
        if self.config.accumulate == 1:
            batch = self.stream.next()[2]
            self.state.samples_seen += num_samples(batch) * self.dist.world_size
            return [batch]
        micro = []
        for _ in range(self.config.accumulate):
            micro.append(self.stream.next()[2])
            self.state.samples_seen += num_samples(micro[-1]) * self.dist.world_size
        return micro

    def train_one_step(self) -> None:
        """One optimizer step exactly as the loop runs it (also what autotune and bench time).

        A step interrupted before its optimizer update (Ctrl-C, an error in user code) gives its
        batches back, so that a checkpoint written then resumes with exactly that step.
        """
        st, stream = self.state, self.stream
        epoch, batch_in_epoch, samples_seen = stream.epoch, stream.batch_in_epoch, st.samples_seen
        try:
            batches = self.next_step_batches()
            self.clock.mark("data")
            self.step_fn(batches)
        except BaseException:
            stream.rewind(epoch, batch_in_epoch)
            st.samples_seen = samples_seen
            self.optimizer.zero_grad(set_to_none=True)
            raise
        self.scheduler.step()
        st.step += 1
        st.steps_since_log += 1

    def run(self) -> History:
        cfg, st = self.config, self.state
        run_summary.announce(self)
        self.callbacks.run_start(self.control)
        if st.stopped_by:
            log.info("this run was stopped after step %d (%s): nothing more to train; train further in a new run",
                     st.step, st.stopped_by)
        loop = LoopPass.open(self.run_dir, cfg, main=self.is_main, total_steps=self.total_steps,
                             description=f"{self.device} {self.precision.name}", callbacks=self.callbacks,
                             world=self.dist.world_size, state=st)
        self.modes.train(self.model)  # train mode, eval mode kept where the user set it (train/modes.py)
        sync = synchronizer(self.device)
        self.startup.mark("announce, outputs and loggers")
        self.startup.watch_first_step(self, sync, lambda: compile_seconds(self), lambda: after_first_step(self))
        stop = min(self.total_steps, cfg.stop_at_step) if cfg.stop_at_step else self.total_steps
        finished = False
        try:
            with loop.progress, loop.signals:
                while st.step < stop and not st.stopped_by:
                    self._iterate(loop, stop)
            finished = True
        except DataExhausted as exc:  # a one-shot iterable ran out: the run ends here, saved and summarized
            log.warning("%s", exc)
            self.warnings.append(str(exc))
        except KeyboardInterrupt:
            if self.run_dir:
                log.warning("interrupted at step %d: saving a checkpoint to resume from", st.step)
                self.save_checkpoint()
                checkpointing.wait_for_saves(self)
            raise
        except GputrainError:
            raise
        except Exception as exc:
            checkpointing.checkpoint_after_error(self, exc)
            raise
        finally:
            error = None if finished else sys.exc_info()[1]  # the error leaving the loop
            if error is not None:
                self.callbacks.exception(self.control, error)
            loop.outputs.close(error=error)
        sync()
        elapsed = time.perf_counter() - loop.t_start
        if self.run_dir:
            self.save_checkpoint()
            checkpointing.wait_for_saves(self)  # an asynchronous save is committed before the run ends
        run_summary.summarize(self, elapsed, loop.peak, stopped=st.step < self.total_steps, start_step=loop.start_step)
        self.callbacks.run_end(self.control, self.history)
        loop.outputs.finish(self.history)
        return self.history

    def _iterate(self, loop: LoopPass, stop: int, most: int | None = None) -> None:
        """The loop's steps up to the next log point, checkpoint or `stop` (at most `most` steps).

        Every step: the step, per-step hooks, [the log point (and evaluation) every log_every steps,
        a checkpoint every checkpoint_every], the stop-signal check, the "logging" mark. The bracketed
        events fall on the stretch's last step only, so the steps before it run in a tight loop.
        """
        cfg, st = self.config, self.state
        every, ckpt_every = cfg.log_every, cfg.checkpoint_every
        ends = min(stop, self.total_steps, (st.step // every + 1) * every, st.step + (most or stop),
                   self.eval_points.next_after(st.step))  # an evaluation is a log point too
        if ckpt_every:
            ends = min(ends, (st.step // ckpt_every + 1) * ckpt_every)
        clock, step_once, on_step, control = self.clock, self.train_one_step, loop.on_step, self.control
        signals, one_process = loop.signals, loop.world == 1
        while True:
            clock.start()
            step_once()
            if on_step is not None:
                on_step(control)  # may request a stop (st.stopped_by): the stretch ends after this step
            if st.step >= ends or st.stopped_by:
                break
            if not one_process or signals.requested is not None:  # one process: a flag read, no call
                self._check_signals(loop)
            clock.mark("logging")
        # The run's last step is a log point; an early stop is not (the loss since the last log
        # point goes into the checkpoint, so a resumed history matches).
        if st.step % every == 0 or st.step == self.total_steps or self._eval_due():
            record = self._log_point(loop.t_log, loop.samples_at_log, loop.faults)
            loop.peak = max(loop.peak, record.get("peak_memory_bytes") or 0)
            loop.t_log, loop.samples_at_log = time.perf_counter(), st.samples_seen
            record["wall_time_s"] = loop.t_log - loop.t_start
            self.history.add(record)
            loop.outputs.append(record)
            loop.progress.update(st.step, epoch=record["epoch"], loss=record["loss"],
                                 samples_per_s=record["samples_per_s"], memory_bytes=record.get("peak_memory_bytes"))
            self.callbacks.log(self.control, record)  # may request a stop: the loop ends here
            loop.t_log = time.perf_counter()  # evaluation and logging stay out of samples/s
            loop.faults.restart()  # evaluation, trackers, callbacks: not the steps' page faults
        if ckpt_every and st.step % ckpt_every == 0 and st.step < stop and self.run_dir:
            with loop.faults.excluded():  # nor a checkpoint's
                self.save_checkpoint()
        self._check_signals(loop)
        clock.mark("logging")

    def _check_signals(self, loop: LoopPass) -> None:
        """A signal is only recorded by its handler; the step it came in has finished. One process
        checks every step (a flag read); several agree every SIGNAL_SYNC_EVERY steps (a small gloo
        all-reduce, no GPU sync), as the signal may reach one rank only."""
        signals = loop.signals
        if ((loop.world == 1 and signals.requested is not None)
                or (loop.world > 1 and self.state.step % SIGNAL_SYNC_EVERY == 0
                    and agree_to_stop(signals.requested is not None, self.dist))):
            checkpointing.stop_for_signal(self, signals, functools.partial(agree_to_stop, dist_info=self.dist))

    def run_steps(self, n: int) -> None:
        """n iterations of the training loop's own body (`_iterate`: the step, log points with the
        loss read and evaluation, checkpoints) outside `run`, without output files, progress bar
        or signal handlers: what `gputrain profile` times."""
        if self._bare_loop is None:
            self._bare_loop = LoopPass.bare(self.config, self.total_steps, self.callbacks, self.dist.world_size,
                                            self.state)
        if not self.model.training:  # train() walks every module: not once per call
            self.modes.train(self.model)
        done = self.state.step
        while self.state.step < done + n:
            self._iterate(self._bare_loop, self.total_steps, most=done + n - self.state.step)

    @contextlib.contextmanager
    def timed_phases(self, clock: PhaseClock):
        """While active, the loop and its step mark their phases on `clock`, and the step runs eagerly
        (a CUDA graph cannot be split into phases; deferred batches are assembled in the "data" phase)."""
        step_fn, self.step_fn = self.step_fn, self._eager_step
        self.clock = self.train_step.clock = clock
        try:
            yield clock
        finally:
            self.step_fn, self.clock, self.train_step.clock = step_fn, NO_CLOCK, NO_CLOCK

    def _eager_step(self, micro_batches: list) -> None:
        self.train_step([materialize(b) for b in micro_batches])

    @contextlib.contextmanager
    def steps_inside(self, context: Callable[[], contextlib.AbstractContextManager]):
        """While active, the loop runs each step (`train_one_step`) inside `context()`: profile's
        labelled range per step, so that a trace tells the steps from the loop's other work."""
        step = self.train_one_step

        def inside() -> None:
            with context():
                step()

        self.train_one_step = inside  # _iterate reads it once per stretch
        try:
            yield
        finally:
            del self.train_one_step  # the class's method again

    def step_flops(self) -> int:
        """FLOPs of one forward + backward of the next batch (profile's MFU); the weights stay as they are."""
        return self.train_step.count_flops(materialize(self.next_step_batches()[0]))

    def collect_step_totals(self) -> None:
        """Read the step's device accumulators into the run state: the loss summed since the last
        read and the non-finite steps (one host sync; collective with several processes). With
        on_nan="stop" a non-finite step raises here, so no checkpoint ever holds a non-finite state.
        Log points and checkpoints call it; `state_dict()` does not read the device."""
        st = self.state
        loss_total, bad = self.train_step.read_totals()
        st.nonfinite_steps += bad
        self.nonfinite.check(bad, st.step, self.last_checkpoint)  # on_nan="stop": raises here
        st.loss_since_log += loss_total
        self.train_step.fold_read(st)  # a step of your own's named losses

    def _log_point(self, t_log: float, samples_at_log: int, faults: StepFaults | None = None) -> dict[str, Any]:
        """Read the device-side loss (one sync), evaluate, and build the record. `faults`: the loop's
        count of its steps' page faults (runtime/host_memory.py)."""
        st = self.state
        self.collect_step_totals()
        loss = st.loss_since_log / st.steps_since_log
        self.spikes.update(st.step, loss)
        extra = self.train_step.log_values(st, st.steps_since_log)
        st.loss_since_log, st.steps_since_log = 0.0, 0
        now = time.perf_counter()
        record: dict[str, Any] = {
            "step": st.step,
            "epoch": self.stream.epochs_done(st.samples_seen, self.dist.world_size),
            "loss": loss,
            "lr": self.scheduler.get_last_lr()[0],  # host value: no device read
            "samples_per_s": (st.samples_seen - samples_at_log) / max(1e-9, now - t_log),
            "peak_memory_bytes": take_peak_memory(self.device),
            "step_page_faults": faults.take() if faults is not None else None,  # the steps' own since the last
            **extra,
        }
        record.update(compile_counts(self))  # recompilations and graph breaks, under compile
        if self.eval_loader is not None and self._eval_due():
            metrics = self.evaluate()
            record.update(metrics)
            record.update(self.callbacks.evaluate(self.control, metrics))  # e.g. the EMA weights' metrics
        return record

    def close(self) -> None:
        """Give back the process-wide settings the run changed (cudnn.benchmark, TF32); stop watching compiles."""
        self.speed.restore()
        self.precision.restore()
        self.modes.restore()  # every module in the mode the user gave it
        self.memory_formats.restore(run_optimizers(self.optimizer))  # and its parameters in the layout it gave them
        self.checkpointer.close()  # a save still in flight (an error left the loop) completes first
        if self.recompiles is not None:
            self.recompiles.stop()

    def _eval_due(self) -> bool:  # at epoch ends unless eval_every says otherwise (train/evaluation/points.py)
        return self.eval_points.due(self.state.step)

    def evaluate(self) -> dict[str, float]:
        """Loss, the built-in accuracy and the run's metrics over the whole eval set; one host read."""
        return self.evaluator(self.eval_model, self.eval_loader)

    # ------------------------------------------------------------ checkpoints (gputrain/checkpoint/)

    def state_dict(self) -> dict[str, Any]:
        """The checkpoint's contents from the named parts (checkpoint/parts.py), as they stand:
        no device accumulator is read (`collect_step_totals` first for the loss of the steps since
        the last log point, as `save_checkpoint` does). Its tensors are the live ones (as
        `Module.state_dict` gives them): save or copy it before training on. Collective with
        several processes."""
        return self.checkpoint.state_dict()

    def save_checkpoint(self, path: Path | None = None) -> Path | None:
        return checkpointing.save_checkpoint(self, path)

    # ------------------------------------------------------------ reporting (train/loop/run_summary.py)

    def graph_status(self) -> str:
        return run_summary.graph_status(self.graphed, self.speed)
