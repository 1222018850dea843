"""The trainer: `fit(model, data, loss_fn=...)` with the right defaults, and nothing slow in the loop.

What happens, in order:
1. decide once: process group and device, precision, data placement, speed switches, graphs;
2. loop over optimizer steps; each step runs `accumulate` micro-batches (the loss divided so the
   update equals one big batch) and skips gradient sync on all but the last under DDP/FSDP;
3. the loss stays on the device and is read only every `log_every` steps (the one host sync of the
   hot loop, the practice seed 003 arrives at); evaluation and metrics happen at those points;
4. checkpoints are written atomically and hold everything an exact resume needs.
"""

from __future__ import annotations

import logging
import math
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch
from torch import nn

from gputrain.runtime import distributed
from gputrain.config import TrainConfig
from gputrain.train.graphs import GraphedTrainStep, graph_blockers
from gputrain.data.loading import BatchStream, BatchTransform, make_loader, split_batch
from gputrain.errors import CheckpointError, GputrainError
from gputrain.io.history import History
from gputrain.batch import move, move_optimizer_state
from gputrain.train.optim import make_optimizer, make_scheduler
from gputrain.runtime.precision import Precision, apply_matmul_settings, autocast, make_scaler, resolve_precision

log = logging.getLogger("gputrain")

CHECKPOINT_NAME = "checkpoint.pt"


def infer_task(loss_fn: Callable) -> str:
    """classification / binary / regression, from the loss (decides which metrics make sense)."""
    if isinstance(loss_fn, (nn.CrossEntropyLoss, nn.NLLLoss)):
        return "classification"
    if isinstance(loss_fn, (nn.BCEWithLogitsLoss, nn.BCELoss)):
        return "binary"
    name = getattr(loss_fn, "__name__", "")
    if name in ("cross_entropy", "nll_loss"):
        return "classification"
    if name.startswith("binary_cross_entropy"):
        return "binary"
    return "regression"


def has_conv(model: nn.Module) -> bool:
    return any(isinstance(m, (nn.Conv2d, nn.Conv3d)) for m in model.modules())


@dataclass
class SpeedSwitches:
    """The speed decisions of a run, each with its reason (printed in the run log)."""

    channels_last: bool
    cudnn_benchmark: bool
    cuda_graphs: bool
    compile: bool
    reasons: dict[str, str]


def decide_speed(config: TrainConfig, model: nn.Module, device: torch.device) -> SpeedSwitches:
    cuda = device.type == "cuda"
    conv = has_conv(model)
    reasons: dict[str, str] = {}

    def pick(name: str, value, auto_value: bool, auto_reason: str) -> bool:
        if value == "auto":
            reasons[name] = auto_reason
            return auto_value
        reasons[name] = "requested"
        return bool(value)

    # NHWC suits both cuDNN's tensor-core kernels and oneDNN on the CPU: on 2 CPU cores the
    # digits CNN step went from 9.6-10.2 ms to 7.8-8.2 ms.
    nhwc = conv and device.type in ("cuda", "cpu")
    channels_last = pick("channels_last", config.channels_last, nhwc,
                         f"2D convolutions run faster in NHWC on {device.type}" if nhwc
                         else "no 2D convolutions" if not conv else f"not measured on {device.type}")
    benchmark = pick("cudnn_benchmark", config.cudnn_benchmark, cuda and conv,
                     "fixed input shapes: cuDNN picks the fastest algorithm once" if cuda and conv else "not a CUDA conv net")
    graphs = pick("cuda_graphs", config.cuda_graphs, cuda,
                  "CUDA: one graph launch per step instead of one launch per kernel" if cuda else "not CUDA")
    if config.compile:
        reasons["compile"] = f"requested (mode {config.compile_mode or 'default'})"
    return SpeedSwitches(channels_last, benchmark, graphs, bool(config.compile), reasons)


class Trainer:
    """One training run. `fit` is the usual entry point; this class holds the run's state."""

    def __init__(self, model: nn.Module, train_data, *, loss_fn: Callable, optimizer=None,
                 config: TrainConfig | None = None, eval_data=None, task: str | None = None,
                 transform: BatchTransform | None = None):
        self.config = config = config or TrainConfig()
        config.validate()
        if isinstance(model, nn.DataParallel):
            warnings.warn(
                "the model is wrapped in nn.DataParallel, which runs one process that copies the model to "
                "every GPU on every step and is slower than DistributedDataParallel even on one machine; "
                "gputrain unwraps it (model.module) and uses DDP when started with torchrun or --nproc",
                stacklevel=2)
            model = model.module
        self.dist, self.device = distributed.init_distributed(config.device)
        self.is_main = self.dist.is_main
        device = self.device
        self.precision: Precision = resolve_precision(config.precision, device)
        apply_matmul_settings(self.precision, device)
        torch.manual_seed(config.seed + self.dist.rank)
        self.loss_fn = loss_fn
        self.task = task or infer_task(loss_fn)

        # Data given as a workload's DataSplits carries its own normalization and augmentation.
        transform, train_data, eval_data = _unpack_splits(train_data, eval_data, transform)
        self.speed = decide_speed(config, model, device)
        transform.channels_last = self.speed.channels_last
        eval_transform = BatchTransform(transform.mean, transform.std, None, transform.channels_last)

        # Model: on the device, then memory layout, activation checkpointing, wrapping, compiling.
        self.module = move(model, device)
        if self.speed.channels_last:
            self.module = self.module.to(memory_format=torch.channels_last)
        # Process-wide; restored by close() so that code run after fit keeps its own setting.
        self._cudnn_benchmark_before = torch.backends.cudnn.benchmark
        if device.type == "cuda":
            torch.backends.cudnn.benchmark = self.speed.cudnn_benchmark
        self.checkpointed: list[str] = []
        if config.checkpointing:
            from gputrain.diagnostics.memory import apply_activation_checkpointing

            targets = None if config.checkpointing is True else list(config.checkpointing)
            self.checkpointed = apply_activation_checkpointing(self.module, targets)
        self.model = distributed.wrap_model(self.module, self.dist, device, shard=config.shard)
        if config.compile:
            kwargs = {"mode": config.compile_mode} if config.compile_mode else {}
            self.model = torch.compile(self.model, **kwargs)

        # Data.
        self.train_loader, self.placement = make_loader(
            train_data, config.batch_size, device=device, train=True, seed=config.seed, rank=self.dist.rank,
            world_size=self.dist.world_size, on_device=config.data_on_device,
            memory_fraction=config.device_memory_fraction, num_workers=config.num_workers, transform=transform)
        self.eval_loader = None
        if eval_data is not None:
            self.eval_loader, _ = make_loader(
                eval_data, max(config.batch_size, 256), device=device, train=False, seed=config.seed,
                rank=self.dist.rank, world_size=self.dist.world_size, on_device=config.data_on_device,
                memory_fraction=config.device_memory_fraction, num_workers=config.num_workers,
                transform=eval_transform)

        # Length of the run in optimizer steps.
        self.batches_per_epoch = len(self.train_loader)
        if config.steps is not None:
            self.total_steps = config.steps
        else:
            epochs = config.epochs if config.epochs is not None else 1
            self.total_steps = max(1, epochs * self.batches_per_epoch // config.accumulate)

        # Optimizer, schedule, loss scaling.
        blockers_pre = graph_blockers(device=device, accumulate=config.accumulate, world_size=self.dist.world_size,
                                      precision=self.precision, compiled=config.compile,
                                      checkpointing=bool(config.checkpointing),
                                      optimizer=_CapturableProbe())
        want_graphs = self.speed.cuda_graphs and blockers_pre is None and optimizer is None
        self.optimizer, self.optimizer_desc = make_optimizer(
            optimizer, self.model.parameters(), lr=config.lr, weight_decay=config.weight_decay, device=device,
            fused=config.fused_optimizer, capturable=want_graphs)
        move_optimizer_state(self.optimizer, device)
        self.scheduler = make_scheduler(self.optimizer, config.schedule, self.total_steps, config.warmup_steps)
        self.scaler = make_scaler(self.precision, device)

        self.graphed: GraphedTrainStep | None = None
        self.graph_status = "off"
        if self.speed.cuda_graphs:
            blocker = graph_blockers(device=device, accumulate=config.accumulate, world_size=self.dist.world_size,
                                     precision=self.precision, compiled=config.compile,
                                     checkpointing=bool(config.checkpointing), optimizer=self.optimizer)
            if blocker is None:
                self.graphed = GraphedTrainStep(self.model, loss_fn, self.optimizer, self.precision, device,
                                                config.max_grad_norm, self._eager_single_step)
                self.graph_status = "on"
            else:
                self.graph_status = f"off: {blocker}"
                if config.cuda_graphs is True:
                    log.warning("CUDA graphs requested but not used: %s", blocker)

        # Run state (saved in checkpoints).
        self.step = 0
        self.stream = BatchStream(self.train_loader)
        self.history = History(records=[], config=config.to_dict(), summary={})
        self.splits = 1  # micro-batch splits after OOM recovery (1 = none)
        self.samples_seen = 0
        self.run_dir = Path(config.run_dir) if config.run_dir else None
        # Device scalars: the running loss sum since the last log point. Its storage never changes
        # (a captured graph writes to it).
        self.loss_acc = torch.zeros((), device=device, dtype=torch.float32)
        self.steps_since_log = 0
        self.carried_loss = 0.0  # loss summed before a resume, within the current log interval
        if config.resume:
            self._resume()

    # ------------------------------------------------------------ one step

    def _eager_single_step(self, x: torch.Tensor, y: torch.Tensor, loss_acc: torch.Tensor) -> None:
        """A whole optimizer step on one batch, eagerly (graph fallback path)."""
        self._accumulate([(x, y)])
        self._optimizer_step()

    def _micro(self, x: torch.Tensor, y: torch.Tensor, weight: float, sync: bool) -> torch.Tensor:
        with distributed.no_sync(self.model, sync):
            with autocast(self.precision, self.device):
                loss = self.loss_fn(self.model(x), y)
            self.scaler.scale(loss * weight).backward()
        return loss.detach()

    def _accumulate(self, batches: list) -> None:
        """Forward and backward over the step's micro-batches; the gradient is the mean over all.

        Each micro-batch's loss is weighted by its share of the step's samples, so k micro-batches
        of n give the update of one batch of k*n. Losses join the running sum only once the whole
        step has succeeded (an OOM retry must not count them twice).
        """
        n_batches = len(batches)
        last = n_batches - 1
        losses = []
        for i, batch in enumerate(batches):
            chunks = split_batch(batch, self.splits) if self.splits > 1 else [batch]
            total = batch[0].shape[0]
            for j, (x, y) in enumerate(chunks):
                weight = (x.shape[0] / total) / n_batches
                losses.append((self._micro(x, y, weight, sync=(i == last and j == len(chunks) - 1)), weight))
        for loss, weight in losses:
            self.loss_acc.add_(loss.float(), alpha=weight)

    def _optimizer_step(self) -> None:
        if self.config.max_grad_norm is not None:
            self.scaler.unscale_(self.optimizer)
            nn.utils.clip_grad_norm_(self.model.parameters(), self.config.max_grad_norm)
        self.scaler.step(self.optimizer)
        self.scaler.update()
        self.optimizer.zero_grad(set_to_none=True)

    def _train_step(self, batches: list) -> None:
        if self.graphed is not None and len(batches) == 1:
            self.graphed.step(batches[0][0], batches[0][1], self.loss_acc)
            return
        while True:
            try:
                self._accumulate(batches)
                self._optimizer_step()
                return
            except Exception as exc:  # only OOM is handled; everything else propagates
                from gputrain.diagnostics.memory import free_after_oom, is_oom

                if not (self.config.oom_recovery and is_oom(exc)):
                    raise
                smallest = min(b[0].shape[0] for b in batches)
                if self.splits * 2 > smallest:
                    raise GputrainError(
                        f"out of memory on {self.device} even with micro-batches of "
                        f"{math.ceil(smallest / self.splits)} sample(s): use a smaller model, bf16, "
                        "activation checkpointing (--checkpointing), or a device with more memory") from None
                self.optimizer.zero_grad(set_to_none=True)
                del exc
                free_after_oom(self.device)
                self.splits *= 2
                micro = math.ceil(self.config.batch_size / self.splits)
                log.warning("out of memory: micro-batch halved to %d and accumulation doubled to %d "
                            "(effective batch unchanged at %d); retrying the same step",
                            micro, self.config.accumulate * self.splits,
                            self.config.batch_size * self.config.accumulate * self.dist.world_size)

    # ------------------------------------------------------------ the loop

    def run(self) -> History:
        cfg = self.config
        self._announce()
        from gputrain.report.reporting import MetricsLog, TrainProgress

        # A resumed run drops rows logged after its checkpoint (they are logged again).
        metrics = MetricsLog(self.run_dir, truncate_after_step=self.step) if (self.run_dir and self.is_main) else None
        progress = TrainProgress(enabled=bool(cfg.progress and self.is_main), total_steps=self.total_steps,
                                 description=self._label())
        self.model.train()
        sync = _synchronizer(self.device)
        t_start = t_log = time.perf_counter()
        samples_at_log = self.samples_seen
        peak = 0
        stop = min(self.total_steps, cfg.stop_at_step) if cfg.stop_at_step else self.total_steps
        world = self.dist.world_size
        try:
            with progress:
                while self.step < stop:
                    batches = []
                    for _ in range(cfg.accumulate):
                        _, _, batch = self.stream.next()
                        batches.append(batch)
                        self.samples_seen += batch[0].shape[0] * world  # shapes are host metadata: no sync
                    self._train_step(batches)
                    self.scheduler.step()
                    self.step += 1
                    self.steps_since_log += 1
                    # The run's last step is a log point; an early stop is not (the loss since the
                    # last log point goes into the checkpoint, so a resumed history matches).
                    last = self.step == self.total_steps
                    if self.step % cfg.log_every == 0 or last:
                        record = self._log_point(t_log, samples_at_log)
                        peak = max(peak, record.get("peak_memory_bytes") or 0)
                        t_log, samples_at_log = time.perf_counter(), self.samples_seen
                        record["wall_time_s"] = t_log - t_start
                        self.history.add(record)
                        if metrics:
                            metrics.append(record)
                        progress.update(self.step, epoch=record["epoch"], loss=record["loss"],
                                        samples_per_s=record["samples_per_s"],
                                        memory_bytes=record.get("peak_memory_bytes"))
                        t_log = time.perf_counter()  # evaluation and logging stay out of samples/s
                    if cfg.checkpoint_every and self.step % cfg.checkpoint_every == 0 and self.step < stop:
                        self.save_checkpoint()
        except KeyboardInterrupt:
            if self.run_dir:
                log.warning("interrupted at step %d: saving a checkpoint to resume from", self.step)
                self.save_checkpoint()
            raise
        finally:
            if metrics:
                metrics.close()
        sync()
        elapsed = time.perf_counter() - t_start
        if self.run_dir:
            self.save_checkpoint()
        self._summarize(elapsed, peak, stopped=self.step < self.total_steps)
        if self.run_dir and self.is_main:
            self.history.save(self.run_dir / "history.json")
            from gputrain.report.reporting import plot_history

            plot_history(self.history, self.run_dir / "curves.png")
        return self.history

    def _log_point(self, t_log: float, samples_at_log: int) -> dict[str, Any]:
        """Read the device-side loss (one sync), evaluate, and build the record."""
        loss_sum = distributed.all_reduce_mean(self.loss_acc.clone(), self.dist)
        loss = (float(loss_sum.item()) + self.carried_loss) / self.steps_since_log
        self.loss_acc.zero_()
        self.carried_loss = 0.0
        self.steps_since_log = 0
        now = time.perf_counter()
        record: dict[str, Any] = {
            "step": self.step,
            "epoch": round(self.samples_seen / max(1, self.train_loader.num_samples * self.dist.world_size), 4),
            "loss": loss,
            "lr": self.scheduler.get_last_lr()[0],  # host value: no device read
            "samples_per_s": (self.samples_seen - samples_at_log) / max(1e-9, now - t_log),
            "peak_memory_bytes": _peak_memory(self.device),
        }
        if self.eval_loader is not None and self._eval_due():
            record.update(self.evaluate())
        return record

    def close(self) -> None:
        """Give back the process-wide settings the run changed (cudnn.benchmark)."""
        torch.backends.cudnn.benchmark = self._cudnn_benchmark_before

    def _eval_due(self) -> bool:
        every = self.config.eval_every
        return every is None or self.step % every == 0 or self.step >= self.total_steps

    @torch.no_grad()
    def evaluate(self) -> dict[str, float]:
        """Loss (and accuracy for classification) over the whole eval set; one host read."""
        self.model.eval()
        loss_sum = torch.zeros((), device=self.device)
        correct = torch.zeros((), device=self.device)
        count = 0
        for x, y in self.eval_loader.iter_epoch(0, 0):
            with autocast(self.precision, self.device):
                out = self.model(x)
                loss = self.loss_fn(out, y)
            n = x.shape[0]
            loss_sum += loss.float() * n
            if self.task == "classification":
                correct += (out.argmax(dim=1) == y).sum()
            elif self.task == "binary":
                correct += ((out > 0).to(y.dtype) == y).sum()
            count += n
        totals = distributed.all_reduce_sum(torch.stack([loss_sum, correct.float()]), self.dist)
        count *= self.dist.world_size
        loss_total, correct_total = totals.tolist()
        self.model.train()
        out = {"eval_loss": loss_total / max(1, count)}
        if self.task in ("classification", "binary"):
            out["eval_accuracy"] = correct_total / max(1, count)
        return out

    # ------------------------------------------------------------ checkpoints

    def checkpoint_path(self) -> Path:
        if isinstance(self.config.resume, str):
            return Path(self.config.resume)
        return self.run_dir / CHECKPOINT_NAME

    def state_dict(self) -> dict[str, Any]:
        from gputrain.io.checkpoint import capture_rng_state

        if self.dist.enabled:
            model_state = distributed.model_state_dict(self.model, self.dist)
            optim_state = distributed.optimizer_state_dict(self.model, self.optimizer, self.dist)
        else:
            model_state = self.module.state_dict()
            optim_state = self.optimizer.state_dict()
        return {
            "model": model_state,
            "optimizer": optim_state,
            "scaler": self.scaler.state_dict(),
            "scheduler": self.scheduler.state_dict(),
            "rng": capture_rng_state(self.device),
            "step": self.step,
            "epoch": self.stream.epoch,
            "batch_in_epoch": self.stream.batch_in_epoch,
            "samples_seen": self.samples_seen,
            "splits": self.splits,
            "loss_since_log": float(self.loss_acc.item()) + self.carried_loss,
            "steps_since_log": self.steps_since_log,
            "world_size": self.dist.world_size,
            "config": self.config.to_dict(),
            "history": list(self.history.records),
        }

    def save_checkpoint(self, path: Path | None = None) -> Path | None:
        from gputrain.io.checkpoint import save_checkpoint

        state = self.state_dict()  # collective under DDP/FSDP: every rank takes part
        path = path or (self.run_dir / CHECKPOINT_NAME)
        if self.is_main:
            save_checkpoint(path, state)
        distributed.barrier(self.dist)
        return path

    def _resume(self) -> None:
        from gputrain.io.checkpoint import check_model_state, load_checkpoint, restore_rng_state

        path = self.checkpoint_path()
        if not path.exists() and self.config.resume is True:
            log.info("no checkpoint at %s: starting a new run", path)
            return
        state = load_checkpoint(path)
        check_model_state(state["model"], self.module, path=str(path))
        saved_cfg = state.get("config", {})
        # The data order depends on the seed and the global batch (per-process batch x accumulation
        # x processes), so a run may resume with another process count if the global batch is kept.
        saved_global = saved_cfg.get("batch_size", 0) * saved_cfg.get("accumulate", 1) * int(state.get("world_size", 1))
        global_batch = self.config.batch_size * self.config.accumulate * self.dist.world_size
        if saved_cfg and saved_global != global_batch:
            raise CheckpointError(
                f"{path}: the checkpoint was trained with a global batch of {saved_global} "
                f"(batch_size x accumulate x processes) but this run has {global_batch}; an exact resume needs "
                "the same global batch")
        if "seed" in saved_cfg and saved_cfg["seed"] != self.config.seed:
            raise CheckpointError(f"{path}: the checkpoint was trained with seed={saved_cfg['seed']} but this run "
                                  f"has seed={self.config.seed}; an exact resume needs the same seed")
        if self.dist.enabled:
            distributed.load_model_state_dict(self.model, state["model"], self.dist)
            distributed.load_optimizer_state_dict(self.model, self.optimizer, state["optimizer"], self.dist)
        else:
            self.module.load_state_dict(state["model"])
            _load_optimizer_state(self.optimizer, state["optimizer"])
        move_optimizer_state(self.optimizer, self.device)
        self.scaler.load_state_dict(state["scaler"])
        self.scheduler.load_state_dict(state["scheduler"])
        restore_rng_state(state["rng"], self.device)
        self.step = int(state["step"])
        self.samples_seen = int(state["samples_seen"])
        self.splits = int(state.get("splits", 1))
        self.stream = BatchStream(self.train_loader, int(state["epoch"]), int(state["batch_in_epoch"]))
        self.carried_loss = float(state.get("loss_since_log", 0.0))
        self.steps_since_log = int(state.get("steps_since_log", 0))
        self.history.records = list(state.get("history", []))
        log.info("resumed from %s at step %d", path, self.step)

    # ------------------------------------------------------------ reporting

    def _label(self) -> str:
        return f"{self.device} {self.precision.name}"

    def _announce(self) -> None:
        if not self.is_main:
            return
        log.info("device: %s", _device_name(self.device))
        log.info("precision: %s", self.precision.reason)
        log.info("data: %s", self.placement.reason)
        log.info("optimizer: %s; %d steps of %d x %d samples%s", self.optimizer_desc, self.total_steps,
                 self.config.batch_size, self.config.accumulate,
                 f" x {self.dist.world_size} processes" if self.dist.world_size > 1 else "")
        for name, reason in self.speed.reasons.items():
            value = getattr(self.speed, name)
            log.info("%s: %s (%s)", name, "on" if value else "off", reason)
        if self.speed.cuda_graphs:
            log.info("cuda_graphs: %s", self.graph_status)

    def _summarize(self, elapsed: float, peak: int, stopped: bool) -> None:
        recs = self.history.records
        summary: dict[str, Any] = {
            "device": _device_name(self.device),
            "precision": self.precision.name,
            "precision_reason": self.precision.reason,
            "data": self.placement.kind,
            "data_reason": self.placement.reason,
            "optimizer": self.optimizer_desc,
            "steps": self.step,
            "total_steps": self.total_steps,
            "stopped_early": stopped,
            "time_s": elapsed,
            "samples": self.samples_seen,
            "samples_per_s": self._steady_rate(elapsed),
            "peak_memory_bytes": peak or None,
            "world_size": self.dist.world_size,
            "batch_size": self.config.batch_size,
            "accumulate": self.config.accumulate,
            "effective_batch": self.config.batch_size * self.config.accumulate * self.dist.world_size,
            "oom_splits": self.splits,
            "cuda_graphs": self.graph_status if self.graphed is None or self.graphed.failed is None
            else f"off: {self.graphed.failed}",
            "channels_last": self.speed.channels_last,
            "compile": self.speed.compile,
            "activation_checkpointing": self.checkpointed,
            "task": self.task,
        }
        if recs:
            summary["final_loss"] = recs[-1].get("loss")
            for key in ("eval_loss", "eval_accuracy"):
                vals = [r[key] for r in recs if r.get(key) is not None]
                if vals:
                    summary[f"final_{key}"] = vals[-1]
                    summary[f"best_{key}"] = max(vals) if key == "eval_accuracy" else min(vals)
        self.history.summary = summary

    def _steady_rate(self, elapsed: float) -> float:
        rates = [r["samples_per_s"] for r in self.history.records if r.get("samples_per_s")]
        # The first interval includes warm-up (allocation, autotuning, capture); report the rest.
        if len(rates) > 2:
            rates = rates[1:]
        return sorted(rates)[len(rates) // 2] if rates else self.samples_seen / max(elapsed, 1e-9)


class _CapturableProbe:
    """Stands in for an optimizer we will create capturable, to ask graph_blockers about the rest."""

    param_groups = [{"capturable": True}]


def _load_optimizer_state(optimizer: torch.optim.Optimizer, state: dict) -> None:
    try:
        optimizer.load_state_dict(state)
    except (ValueError, KeyError) as exc:
        raise CheckpointError(f"the checkpoint's optimizer state does not fit this optimizer: {exc}") from None


def _unpack_splits(train_data, eval_data, transform: BatchTransform | None):
    from gputrain.workloads.base import DataSplits

    if isinstance(train_data, DataSplits):
        splits = train_data
        transform = transform or BatchTransform(splits.mean, splits.std, splits.augment)
        if eval_data is None:
            eval_data = splits.test
        train_data = splits.train
    return transform or BatchTransform(), train_data, eval_data


def _peak_memory(device: torch.device) -> int | None:
    if device.type == "cuda":
        peak = torch.cuda.max_memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        return int(peak)
    if device.type == "mps":
        return int(torch.mps.driver_allocated_memory())
    return None


def _device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return f"{device} ({torch.cuda.get_device_name(device)})"
    if device.type == "cpu":
        from gputrain.runtime.devices import cpu_model_name

        return f"cpu ({cpu_model_name()}, {torch.get_num_threads()} threads)"
    return str(device)


def _synchronizer(device: torch.device):
    from gputrain.runtime.devices import synchronizer

    return synchronizer(device)


def fit(model: nn.Module, train_data, *, loss_fn: Callable, optimizer=None, config: TrainConfig | None = None,
        eval_data=None, task: str | None = None) -> History:
    """Train `model` and return its History.

    train_data / eval_data: (inputs, targets) tensors, a Dataset, a DataLoader, or a workload's
    DataSplits (which brings its test split, normalization and augmentation).
    optimizer: an optimizer, a callable params -> optimizer, or None for AdamW(config.lr).
    config: TrainConfig; None means the defaults. Raises ConfigError / DeviceError / DataError /
    CheckpointError with a message saying what to change.
    """
    trainer = Trainer(model, train_data, loss_fn=loss_fn, optimizer=optimizer, config=config,
                      eval_data=eval_data, task=task)
    info = trainer.dist
    try:
        return trainer.run()
    finally:
        trainer.close()
        del trainer  # cleanup() frees the DDP wrapper before the process group goes (see there)
        distributed.cleanup(info)


def fit_workload(workload, config: TrainConfig | None = None, full_batch: bool | None = None
                 ) -> tuple[History, nn.Module]:
    """Train a Workload with its defaults under `config`; returns (history, trained model).

    full_batch: train on the whole training set per step (default: the workload's own choice,
    unless `config` is given).
    """
    if full_batch is None:
        full_batch = workload.full_batch and config is None
    config = config or TrainConfig(**workload.defaults)
    torch.manual_seed(config.seed)  # the same initial weights on every rank and every rerun
    data = workload.make_data()
    if full_batch:
        config = config.replace(batch_size=data.num_train)
    model = workload.make_model()
    history = fit(model, data, loss_fn=workload.loss_fn, config=config, task=workload.task)
    return history, model
