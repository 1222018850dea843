"""The trainer: named setup parts, then a small loop around one `TrainStep`.

Setup, decided once and in this order: process group and device; precision (one `RunPrecision`);
the model (speed switches decided before the optimizer, channels_last, cudnn.benchmark, activation
checkpointing, DDP/FSDP wrapping, compile); the data (placement by the memory rule); the optimizer
and schedule (capturable when graphs will be used); the step (`TrainStep`, wrapped in a
`GraphedStep` when graphs are on). The loop pulls one optimizer step's micro-batches from the
stream, runs the step, and reads the device-side loss only every `log_every` steps (the one host
sync of the hot loop, the practice seed 003 arrives at); evaluation and checkpoints happen there.
The run's position lives in one `RunState` that checkpoints save and load.
"""

from __future__ import annotations

import functools
import logging
import math
import sys
import time
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence, cast

import torch
from torch import nn

from gputrain.batch import move, move_optimizer_state
from gputrain.config import TrainConfig
from gputrain.data import BatchStream, BatchTransform, TensorBatches, make_loader
from gputrain.data.checks import first_step_note
from gputrain.data.deferred import num_samples
from gputrain.data.sources import batch_size_used
from gputrain.data.stream import DataExhausted, known_length, plan_steps
from gputrain.errors import ConfigError, GputrainError, StopRequested
from gputrain.io.history import History
from gputrain.runtime import distributed
from gputrain.runtime.precision import RunPrecision, resolve_precision
from gputrain.runtime.speed import SpeedSwitches, decide_speed
from gputrain.train.evaluate import Evaluator, infer_task
from gputrain.train.graphs import GraphedStep
from gputrain.train.guards import NonFiniteGuard, SpikeDetector
from gputrain.train import checkpointing, run_summary
from gputrain.train.loss import LossRule
from gputrain.train.callbacks import CallbackList, RunControl
from gputrain.train.optim import make_optimizer, make_scheduler, make_user_scheduler
from gputrain.train.state import RunState
from gputrain.train.step import TrainStep

log = logging.getLogger("gputrain")

SIGNAL_SYNC_EVERY = 10  # steps between the ranks' agreement on a stop signal (several processes)


class Trainer:
    """One training run. `fit` is the usual entry point; this class holds the run's parts and state.

    Batches are turned into a loss by `LossRule` (train/loss.py): `compute_loss(model, batch)`, a
    pair with `loss_fn`, or the model's own loss. `metrics` and `num_items` as in `fit`.
    """

    def __init__(self, model: nn.Module, train_data, *, loss_fn: Callable | None = None,
                 compute_loss: Callable | None = None, optimizer=None, config: TrainConfig | None = None,
                 eval_data=None, task: str | None = None, transform: BatchTransform | None = None,
                 metrics: Mapping[str, Any] | None = None, num_items: Callable | None = None,
                 callbacks: Sequence[Any] | None = None, scheduler: Callable[[Any], Any] | None = None,
                 collate_fn: Callable | None = None):
        self.config = config = config or TrainConfig()
        config.validate()
        model = distributed.unwrap_data_parallel(model)
        self.dist, self.device = distributed.init_distributed(config.device)
        self.is_main = self.dist.is_main
        torch.manual_seed(config.seed + self.dist.rank)
        self.loss = LossRule(loss_fn, compute_loss)
        self.task = task or (infer_task(loss_fn) if compute_loss is None else None)
        self.warnings: list[str] = []
        self.callbacks = CallbackList(callbacks)  # hooks at log points (train/callbacks.py)
        self.control = RunControl(self)
        self._setup_precision()
        self._setup_model(model, optimizer)
        self._setup_data(train_data, eval_data, transform, collate_fn)
        self._setup_optimizer(optimizer, scheduler)
        self._setup_step(num_items)
        self.evaluator = Evaluator(self.loss, self.precision, self.device, self.dist, self.task, metrics)
        self.state = RunState()
        self.stream = BatchStream(self.train_loader)
        self.history = History(records=[], config=config.to_dict(), summary={})
        self.run_dir = Path(config.run_dir) if config.run_dir else None
        self.store = self._setup_checkpoints()
        if config.resume:
            self._resume()

    # ------------------------------------------------------------ setup parts

    def _setup_precision(self) -> None:
        self.precision = RunPrecision(resolve_precision(self.config.precision, self.device), self.device).apply()

    def _setup_model(self, model: nn.Module, optimizer) -> None:
        cfg, device = self.config, self.device
        self.speed: SpeedSwitches = decide_speed(cfg, model, device, world_size=self.dist.world_size,
                                                 use_scaler=self.precision.precision.use_scaler, optimizer=optimizer,
                                                 step_hooks=self.callbacks.per_step)
        self.module = move(model, device)
        if self.speed.channels_last:
            self.module = self.module.to(memory_format=torch.channels_last)
        self.speed.apply(device)  # cudnn.benchmark, given back by close()
        self.checkpointed: list[str] = []
        if cfg.recompute:
            from gputrain.train.activation_checkpointing import apply_activation_checkpointing

            targets = None if cfg.recompute is True else list(cfg.recompute)
            self.checkpointed = apply_activation_checkpointing(self.module, targets)
        self.model = distributed.wrap_model(self.module, self.dist, device, shard=cfg.shard)
        self.eval_model = self.model  # evaluation runs uncompiled: no_grad and eval shapes would recompile
        self.recompiles = None
        if cfg.compile:
            from gputrain.runtime.recompiles import RecompileWatcher

            # Compiling a Module gives an OptimizedModule (a Module); torch's stub only says "a callable".
            # mode None: torch's default.
            self.model = cast(nn.Module, torch.compile(self.model, mode=cfg.compile_mode or None))
            self.recompiles = RecompileWatcher().start()

    def _setup_data(self, train_data, eval_data, transform: BatchTransform | None,
                    collate_fn: Callable | None = None) -> None:
        cfg = self.config
        # Data given as a workload's DataSplits carries its own normalization and augmentation.
        transform, train_data, eval_data = _unpack_splits(train_data, eval_data, transform)
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
        # The batch size the data really give (a user DataLoader's own), for the log and the summary.
        self.batch_size, why = batch_size_used(self.train_loader, cfg.batch_size,
                                               TrainConfig.__dataclass_fields__["batch_size"].default)
        if why and self.is_main:
            log.warning("%s", why)
            self.warnings.append(why)

    def _setup_optimizer(self, optimizer, scheduler: Callable[[Any], Any] | None = None) -> None:
        cfg = self.config
        self.optimizer, self.optimizer_desc = make_optimizer(
            optimizer, self.model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay, device=self.device,
            fused=cfg.fused_optimizer, capturable=self.speed.cuda_graphs)
        move_optimizer_state(self.optimizer, self.device)
        self.scheduler, self.schedule_desc = make_user_scheduler(self.optimizer, scheduler) if scheduler is not None \
            else (make_scheduler(self.optimizer, cfg.schedule, self.total_steps, cfg.warmup_steps),
                  f"{cfg.schedule}" + (f" after {cfg.warmup_steps} warm-up steps" if cfg.warmup_steps else "")
                  + " (built-in)")

    def _setup_step(self, num_items: Callable | None) -> None:
        cfg = self.config
        skip = cfg.on_nan == "skip"
        if skip and not self.precision.precision.use_scaler and not all(
                g.get("fused", False) for g in self.optimizer.param_groups):
            raise ConfigError(
                f"on_nan='skip' decides on the device whether a step is applied, which needs a fused optimizer "
                f"(it reads a found_inf flag in its kernel); {self.optimizer_desc} is not fused: use the default "
                "optimizer (fused AdamW), create yours with fused=True, or use on_nan='stop'")
        self.train_step = TrainStep(self.model, self.loss, self.optimizer, self.precision, device=self.device,
                                    max_grad_norm=cfg.max_grad_norm, num_items=num_items, dist=self.dist,
                                    oom_recovery=cfg.oom_recovery, params=list(self.module.parameters()),
                                    skip_nonfinite=skip, after_step=self.callbacks.step_updates(self.module))
        self.nonfinite = NonFiniteGuard(cfg.on_nan)
        self.spikes = SpikeDetector(cfg.spike_ratio, cfg.spike_window, cfg.spike_patience, cfg.on_spike)
        self.last_checkpoint: str | None = None
        self.graphed = GraphedStep(self.train_step, self.device) if self.speed.cuda_graphs else None
        if self.graphed is not None and cfg.accumulate == 1 and isinstance(self.train_loader, TensorBatches):
            # Resident batches are assembled inside the step's graph (data/deferred.py).
            self.train_loader.defer = True
        self.step_fn: Callable = self.graphed if self.graphed is not None else self.train_step
        if cfg.cuda_graphs is True and not self.speed.cuda_graphs:
            log.warning("CUDA graphs requested but not used: %s", self.speed.reasons["cuda_graphs"])

    def _setup_checkpoints(self):
        """Preflight the run directory (created, writable, room for the checkpoints) and open its store;
        choose the checkpoint format (one file, or every rank its part with DCP, train/dcp_checkpointing.py)."""
        from gputrain.train.dcp_checkpointing import DcpCheckpointer

        self.checkpointer = DcpCheckpointer(self.dist, self.device, self.config.checkpoint_format,
                                            self.config.async_checkpoint)
        if self.run_dir is None:
            return None
        from gputrain.io.checkpoint_store import CheckpointStore
        from gputrain.io.preflight import estimate_checkpoint_bytes, preflight_run_dir

        cfg = self.config
        if self.is_main:
            preflight_run_dir(self.run_dir, estimate_checkpoint_bytes(self.module, self.optimizer), cfg.keep_last)
        distributed.barrier(self.dist)
        return CheckpointStore(self.run_dir, keep_last=cfg.keep_last, best_metric=cfg.best_metric,
                               best_mode=cfg.best_mode)

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
        """One optimizer step exactly as the loop runs it (also what profile, memory and bench time).

        A step interrupted before its optimizer update (Ctrl-C, an error in user code) gives its
        batches back, so that a checkpoint written then resumes with exactly that step.
        """
        st, stream = self.state, self.stream
        position = (stream.epoch, stream.batch_in_epoch, st.samples_seen)
        try:
            self.step_fn(self.next_step_batches())
        except BaseException:
            stream.rewind(position[0], position[1])
            st.samples_seen = position[2]
            self.optimizer.zero_grad(set_to_none=True)
            raise
        self.scheduler.step()
        self.state.step += 1
        self.state.steps_since_log += 1

    def run(self) -> History:
        cfg, st = self.config, self.state
        self._announce()
        control = self.control
        self.callbacks.run_start(control)
        on_step = self.callbacks.step if self.callbacks.per_step else None  # opt-in per-step hooks
        if st.stopped_by:
            log.info("this run was stopped after step %d (%s): nothing more to train; train further in a new run",
                     st.step, st.stopped_by)
        from gputrain.report.progress import TrainProgress
        from gputrain.report.run_outputs import RunOutputs

        outputs = RunOutputs(self.run_dir, cfg, enabled=self.is_main, start_step=st.step)
        progress = TrainProgress(enabled=bool(cfg.progress and self.is_main), total_steps=self.total_steps,
                                 description=f"{self.device} {self.precision.name}")
        self.model.train()
        sync = _synchronizer(self.device)
        t_start = t_log = time.perf_counter()
        samples_at_log = st.samples_seen
        peak = 0
        stop = min(self.total_steps, cfg.stop_at_step) if cfg.stop_at_step else self.total_steps
        import signal as _signal

        from gputrain.train.signals import StopSignals, agree_to_stop

        signals = StopSignals(tuple(getattr(_signal, name) for name in cfg.stop_signals))
        world = self.dist.world_size
        finished = False
        try:
            with progress, signals:
                while st.step < stop and not st.stopped_by:
                    self.train_one_step()
                    if on_step is not None:
                        on_step(control)
                    # The run's last step is a log point; an early stop is not (the loss since the
                    # last log point goes into the checkpoint, so a resumed history matches).
                    if st.step % cfg.log_every == 0 or st.step == self.total_steps:
                        record = self._log_point(t_log, samples_at_log)
                        peak = max(peak, record.get("peak_memory_bytes") or 0)
                        t_log, samples_at_log = time.perf_counter(), st.samples_seen
                        record["wall_time_s"] = t_log - t_start
                        self.history.add(record)
                        outputs.append(record)
                        progress.update(st.step, epoch=record["epoch"], loss=record["loss"],
                                        samples_per_s=record["samples_per_s"],
                                        memory_bytes=record.get("peak_memory_bytes"))
                        self.callbacks.log(control, record)  # may request a stop: the loop ends here
                        t_log = time.perf_counter()  # evaluation and logging stay out of samples/s
                    if cfg.checkpoint_every and st.step % cfg.checkpoint_every == 0 and st.step < stop:
                        self.save_checkpoint()
                    # A signal is only recorded by its handler; the step it came in has finished. One
                    # process checks every step (a flag read); several agree every SIGNAL_SYNC_EVERY
                    # steps (a small gloo all-reduce, no GPU sync), as the signal may reach one rank only.
                    if ((world == 1 and signals.requested is not None)
                            or (world > 1 and st.step % SIGNAL_SYNC_EVERY == 0
                                and agree_to_stop(signals.requested is not None, self.dist))):
                        self._stop_for_signal(signals)
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
            self._checkpoint_after_error(exc)
            raise
        finally:
            error = None if finished else sys.exc_info()[1]  # the error leaving the loop
            if error is not None:
                self.callbacks.exception(control, error)
            outputs.close(error=error)
        sync()
        elapsed = time.perf_counter() - t_start
        if self.run_dir:
            self.save_checkpoint()
            checkpointing.wait_for_saves(self)  # an asynchronous save is committed before the run ends
        self._summarize(elapsed, peak, stopped=st.step < self.total_steps)
        self.callbacks.run_end(control, self.history)
        outputs.finish(self.history)
        return self.history

    def _stop_for_signal(self, signals) -> None:
        """Checkpoint (every rank takes part; rank 0 writes) and raise StopRequested."""
        st = self.state
        name = signals.name or "a stop signal (on another rank)"
        code = signals.exit_code or 143
        path = self.save_checkpoint() if self.run_dir else None
        if path is not None:
            checkpointing.wait_for_saves(self)  # committed before the process leaves
            from gputrain.runtime.slurm import requeue_after_stop

            # Slurm's SIGUSR1 before the time limit: rank 0 puts a requeuable job back in the queue
            requeue_after_stop(signals.requested, self.dist)
        resume = (f"resume with: gputrain fit ... --resume {self.run_dir} (from Python: the same fit(...) with "
                  f"TrainConfig(..., run_dir={str(self.run_dir)!r}, resume=True))" if path
                  else "nothing was saved (no run directory): set run_dir to make runs resumable")
        log.warning("%s: stopped after step %d%s", name, st.step, f", checkpoint {path}" if path else "")
        raise StopRequested(f"stopped by {name} after step {st.step} of {self.total_steps}; {resume}",
                            exit_code=code, step=st.step, checkpoint=str(path) if path else None)

    def _checkpoint_after_error(self, exc: BaseException) -> None:
        """An error in user code (model, loss, data) after the first step: checkpoint the last
        finished step when its state is finite, and add a line saying where and how to resume."""
        st = self.state
        where = _user_frame(exc)
        saved = None
        # Several processes: the other ranks are inside a collective of their own step, so a
        # checkpoint (itself collective) cannot be written; the periodic ones remain.
        if self.run_dir and st.step > 0 and self.dist.world_size == 1:
            try:
                saved = self.save_checkpoint()
            except Exception as save_exc:  # a non-finite state, a full disk: the error stays the first one
                log.warning("no checkpoint after the error: %s", save_exc)
        how = (f"a checkpoint of step {st.step} is at {saved}: fix the cause and resume with --resume {self.run_dir}"
               if saved else "no checkpoint was written after the error"
               + (f" (resume from the last periodic one with --resume {self.run_dir})" if self.last_checkpoint else ""))
        exc.add_note(f"gputrain: training failed in step {st.step + 1} at {where}; {how}")
        if st.step == 0 and self.stream.load_error is not exc and self.stream.last_batch is not None:
            exc.add_note(first_step_note(self.stream.last_batch, self.module))  # data/checks.py

    def _read_step_totals(self) -> tuple[float, int]:
        """The loss summed since the last read (all ranks' mean) and the non-finite steps: one sync.

        on_nan="skip" counts the non-finite steps on the device. on_nan="stop" counts nothing per
        step (train/step.py): a non-finite loss shows in the loss sum, a non-finite gradient in the
        state probe read with it; either gives 1, for "one or more steps since the last read".
        """
        totals = distributed.all_reduce_mean(self.train_step.take_totals(), self.dist)
        loss_total, bad, probe = totals.tolist()
        if self.train_step.count_nonfinite:
            return loss_total, int(round(bad))
        if math.isfinite(loss_total) and (math.isfinite(probe) or self._state_is_finite()):
            return loss_total, 0
        return loss_total, 1

    def _state_is_finite(self) -> bool:
        """Whether every rank's state is finite although the probe's norm was not (it overflows past
        ~1e19): the exact check, on this rare path only; collective, as every rank read the same probe."""
        bad = torch.tensor(0.0 if self.train_step.state_is_finite() else 1.0, device=self.device)
        return distributed.all_reduce_mean(bad, self.dist).item() == 0.0

    def _log_point(self, t_log: float, samples_at_log: int) -> dict[str, Any]:
        """Read the device-side loss (one sync), evaluate, and build the record."""
        st = self.state
        loss_total, bad = self._read_step_totals()
        st.nonfinite_steps += bad
        self.nonfinite.check(bad, st.step, self.last_checkpoint)  # on_nan="stop": raises here
        loss = (loss_total + st.loss_since_log) / st.steps_since_log
        self.spikes.update(st.step, loss)
        st.loss_since_log, st.steps_since_log = 0.0, 0
        st.splits = self.train_step.splits
        now = time.perf_counter()
        record: dict[str, Any] = {
            "step": st.step,
            "epoch": self.stream.epochs_done(st.samples_seen, self.dist.world_size),
            "loss": loss,
            "lr": self.scheduler.get_last_lr()[0],  # host value: no device read
            "samples_per_s": (st.samples_seen - samples_at_log) / max(1e-9, now - t_log),
            "peak_memory_bytes": _peak_memory(self.device),
        }
        if self.recompiles is not None:
            self.recompiles.poll()
            record["recompilations"] = self.recompiles.recompilations
            record["graph_breaks"] = self.recompiles.graph_breaks
        if self.eval_loader is not None and self._eval_due():
            metrics = self.evaluate()
            record.update(metrics)
            record.update(self.callbacks.evaluate(self.control, metrics))  # e.g. the EMA weights' metrics
        return record

    def close(self) -> None:
        """Give back the process-wide settings the run changed (cudnn.benchmark, TF32); stop watching compiles."""
        self.speed.restore()
        self.precision.restore()
        self.checkpointer.close()  # a save still in flight (an error left the loop) completes first
        if self.recompiles is not None:
            self.recompiles.stop()

    def _eval_due(self) -> bool:
        every = self.config.eval_every
        return every is None or self.state.step % every == 0 or self.state.step >= self.total_steps

    def evaluate(self) -> dict[str, float]:
        """Loss, the built-in accuracy and the run's metrics over the whole eval set; one host read."""
        return self.evaluator(self.eval_model, self.eval_loader)

    # ------------------------------------------------------------ checkpoints (train/checkpointing.py)

    def state_dict(self) -> dict[str, Any]:
        return checkpointing.state_dict(self)

    def save_checkpoint(self, path: Path | None = None) -> Path | None:
        return checkpointing.save_checkpoint(self, path)

    def _resume(self) -> None:
        checkpointing.resume(self)

    # ------------------------------------------------------------ reporting (train/run_summary.py)

    def decisions(self) -> list[dict[str, str]]:
        return run_summary.decisions(self)

    def graph_status(self) -> str:
        return run_summary.graph_status(self)

    def _announce(self) -> None:
        run_summary.announce(self)

    def _summarize(self, elapsed: float, peak: int, stopped: bool) -> None:
        run_summary.summarize(self, elapsed, peak, stopped)


def _unpack_splits(train_data, eval_data, transform: BatchTransform | None):
    from gputrain.data.splits import DataSplits

    if isinstance(train_data, DataSplits):
        splits = train_data
        transform = transform or BatchTransform(splits.mean, splits.std, splits.augment,
                                                key=getattr(splits, "transform_key", None))
        if eval_data is None:
            eval_data = splits.test
        train_data = splits.train
    return transform or BatchTransform(), train_data, eval_data


def _user_frame(exc: BaseException) -> str:
    """file:line of the innermost frame outside torch and gputrain's training core (the user's code)."""
    import traceback

    frames = traceback.extract_tb(exc.__traceback__)
    for fr in reversed(frames):
        f = fr.filename.replace("\\", "/")
        if "/torch/" not in f and "/gputrain/train/" not in f and "/gputrain/data/" not in f:
            return f"{fr.filename}:{fr.lineno} ({fr.name})"
    return f"{frames[-1].filename}:{frames[-1].lineno}" if frames else "an unknown place"


def _peak_memory(device: torch.device) -> int | None:
    if device.type == "cuda":
        peak = torch.cuda.max_memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        return int(peak)
    if device.type == "mps":
        return int(torch.mps.driver_allocated_memory())
    return None


def _synchronizer(device: torch.device):
    from gputrain.runtime.devices import synchronizer

    return synchronizer(device)
