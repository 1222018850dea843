"""Where the time of a training step goes, and what bounds it: the profile orchestrator.

`profile_workload(workload, config, ...)` runs a few instrumented training steps and returns the
step-time breakdown (data, host-to-device, forward, backward, optimizer, logging; `_PhaseClock`
times the phases of `_StepRunner`'s step), the top ops and figures of a torch.profiler run
(`trace`), a Chrome trace, GPU utilization sampled from NVML (`gpu_util`), MFU where the device's
peak is known, the host syncs (`syncs`) and a verdict (`gputrain.diagnostics.verdict.diagnose`).
`default_config(workload)` gives the settings it profiles when none are given.
"""

from __future__ import annotations

import datetime as _dt
import json
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from gputrain.config import TrainConfig
from gputrain.diagnostics.gpu_util import GpuUtilSampler
from gputrain.diagnostics.syncs import count_host_reads, detect_syncs
from gputrain.diagnostics.trace import _top_ops, trace_summary
from gputrain.diagnostics.verdict import diagnose

PHASES = ("data", "h2d", "forward", "backward", "optimizer", "logging")
BURN_IN_STEPS = 3  # first steps: lazy init, cuDNN autotuning, optimizer state creation


# ---------------------------------------------------------------- timing the phases of a step


class _PhaseClock:
    """Per-step, per-phase times: host perf_counter always, CUDA events on a GPU.

    `start()` opens a step, `mark(phase)` closes the span since the last mark and adds it to
    `phase` (a phase may be marked more than once per step).
    """

    def __init__(self, device: torch.device, steps: int):
        self.steps = steps
        self.host = [[0.0] * len(PHASES) for _ in range(steps)]
        self.cuda = device.type == "cuda"
        self.events: list[list[tuple[int, Any]]] = [[] for _ in range(steps)]
        self.step = -1
        self._t = 0.0

    def start(self) -> None:
        self.step += 1
        if self.cuda:
            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
            self.events[self.step].append((-1, ev))
        self._t = time.perf_counter()

    def mark(self, phase: str) -> None:
        i = PHASES.index(phase)
        now = time.perf_counter()
        self.host[self.step][i] += now - self._t
        if self.cuda:
            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
            self.events[self.step].append((i, ev))
        self._t = time.perf_counter()

    def per_step_ms(self) -> tuple[list[list[float]], list[list[float]] | None]:
        """(host ms, device ms or None) as [step][phase]; synchronizes on a GPU."""
        host = [[1000 * t for t in row] for row in self.host[: self.step + 1]]
        if not self.cuda:
            return host, None
        torch.cuda.synchronize()
        device = []
        for evs in self.events[: self.step + 1]:
            row = [0.0] * len(PHASES)
            for (_, a), (i, b) in zip(evs, evs[1:]):
                row[i] += a.elapsed_time(b)
            device.append(row)
        return host, device


class _NullClock:
    def start(self) -> None:
        pass

    def mark(self, phase: str) -> None:
        pass


# ---------------------------------------------------------------- the instrumented step


class _StepRunner:
    """One workload's training step, split into timed phases.

    The data set lives on the device (uint8 images stay uint8 there) and batches are contiguous
    slices of a shuffled copy, as gputrain's trainer does; with data_on_device=False on a GPU the
    slices are cut from pinned host memory and copied per step (the host-to-device phase).
    """

    def __init__(self, workload, config: TrainConfig, device: torch.device, precision):
        from gputrain.data.loading import BatchTransform
        from gputrain.train.optim import make_optimizer
        from gputrain.runtime.precision import apply_matmul_settings, make_scaler

        self.device, self.precision, self.config = device, precision, config
        torch.manual_seed(config.seed)
        data = workload.make_data()
        x, y = data.train
        n = int(x.shape[0])
        self.batch_size = min(config.batch_size, n)
        perm = torch.randperm(n, generator=torch.Generator().manual_seed(config.seed))
        x, y = x[perm], y[perm]
        self.on_device = device.type == "cpu" or config.data_on_device is not False
        if self.on_device:
            self.x, self.y = x.to(device), y.to(device)
        else:
            self.x, self.y = x.pin_memory(), y.pin_memory()
        self.n = n
        self.transform = BatchTransform(data.mean, data.std, data.augment)
        self.gen = torch.Generator(device=device).manual_seed(config.seed)
        self.model = workload.make_model().to(device)
        self.checkpointed: list[str] = []
        if config.checkpointing:
            from gputrain.train.activation_checkpointing import apply_activation_checkpointing

            targets = None if config.checkpointing is True else list(config.checkpointing)
            self.checkpointed = apply_activation_checkpointing(self.model, targets)
        self.model.train()
        self.loss_fn = workload.loss_fn
        apply_matmul_settings(precision, device)
        self.optimizer, self.optimizer_desc = make_optimizer(
            None, self.model.parameters(), lr=config.lr, weight_decay=config.weight_decay, device=device,
            fused=config.fused_optimizer)
        self.scaler = make_scaler(precision, device)
        self.loss_sum = torch.zeros((), device=device)
        self.log_every = config.log_every
        self.logged_loss: float | None = None
        self.i = 0

    def _slice(self) -> tuple[torch.Tensor, torch.Tensor]:
        B = self.batch_size
        start = (self.i * B) % max(1, self.n - B + 1)
        return self.x[start:start + B], self.y[start:start + B]

    def _forward_loss(self, x, y):
        from gputrain.runtime.precision import autocast

        with autocast(self.precision, self.device):
            return self.loss_fn(self.model(x), y)

    def step(self, clock=None) -> None:
        clock = clock or _NullClock()
        clock.start()
        x, y = self._slice()
        clock.mark("data")
        x = x.to(self.device, non_blocking=True)
        y = y.to(self.device, non_blocking=True)
        clock.mark("h2d")
        x = self.transform(x, train=True, generator=self.gen)
        clock.mark("data")
        loss = self._forward_loss(x, y)
        clock.mark("forward")
        self.scaler.scale(loss).backward()
        clock.mark("backward")
        self.scaler.step(self.optimizer)
        self.scaler.update()
        self.optimizer.zero_grad(set_to_none=True)
        clock.mark("optimizer")
        self.loss_sum += loss.detach().float()
        self.i += 1
        if self.i % self.log_every == 0:  # the only host read: once per log_every steps
            self.logged_loss = self.loss_sum.item() / self.log_every
            self.loss_sum.zero_()
        clock.mark("logging")

    def flops(self) -> int:
        """FLOPs of one forward + backward (FlopCounterMode); the weights are left unchanged."""
        from torch.utils.flop_counter import FlopCounterMode

        x, y = self._slice()
        x = self.transform(x.to(self.device), train=True, generator=self.gen)
        y = y.to(self.device)
        counter = FlopCounterMode(display=False)
        with counter:
            self._forward_loss(x, y).backward()
        self.optimizer.zero_grad(set_to_none=True)
        return int(counter.get_total_flops())


# ---------------------------------------------------------------- the whole profile


def _device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    from gputrain.runtime.devices import cpu_model_name

    return cpu_model_name() if device.type == "cpu" else str(device)


def default_config(workload, **overrides: Any) -> TrainConfig:
    """The workload's own settings (full-batch workloads: the whole training set) with `overrides`."""
    config = TrainConfig(**{**workload.defaults, **{k: v for k, v in overrides.items() if v is not None}})
    if workload.full_batch and overrides.get("batch_size") is None:
        config = config.replace(batch_size=workload.make_data().num_train)
    return config


def profile_workload(workload, config: TrainConfig | None = None, steps: int = 20, wait: int = 1, warmup: int = 2,
                     active: int = 3, out_dir: str | os.PathLike | None = None, top: int = 15,
                     sync_steps: int = 3) -> dict[str, Any]:
    """Profile a few training steps of `workload` and say what bounds them.

    workload: a Workload or a name (as `gputrain.workloads.resolve_workload` takes).
    config: device, precision, batch_size, lr, weight_decay, log_every (how often the loss is read on
        the host), data_on_device, checkpointing, fused_optimizer; None: the workload's defaults. The
        step is eager: compile, cuda_graphs and channels_last are not applied.
    steps: timed steps for the breakdown (after BURN_IN_STEPS unmeasured ones); wait/warmup/active:
        torch.profiler's schedule for the traced steps; out_dir: where trace.json and
        profile_summary.json go (None: a new temporary directory).

    Returns the summary (also written as JSON): step_ms, samples_per_s, breakdown (per phase:
    ms, share, host_ms, device_ms), top_ops, trace (trace_summary), gpu_utilization (NVML, or None),
    flops_per_step, achieved_tflops, peak_tflops, mfu (None without a known peak), syncs
    (detect_syncs; unsupported off CUDA), host_reads (count_host_reads), verdict (diagnose) and
    the files written. Raises ConfigError/DeviceError for an impossible config.
    """
    from gputrain.runtime.devices import pick_device, synchronizer
    from gputrain.diagnostics.peaks import peak_tflops
    from gputrain.runtime.precision import resolve_precision

    from gputrain.errors import ConfigError

    if steps < 1 or active < 1 or wait < 0 or warmup < 0 or sync_steps < 1:
        raise ConfigError(f"profile_workload needs steps >= 1, active >= 1, sync_steps >= 1 and wait, warmup >= 0; "
                          f"got steps={steps}, active={active}, sync_steps={sync_steps}, wait={wait}, warmup={warmup}")
    if isinstance(workload, str):
        from gputrain.workloads import resolve_workload

        workload = resolve_workload(workload)
    config = config or default_config(workload)
    device = pick_device(config.device)
    precision = resolve_precision(config.precision, device)
    sync = synchronizer(device)
    out = Path(out_dir) if out_dir is not None else Path(tempfile.mkdtemp(prefix="gputrain-profile-"))
    out.mkdir(parents=True, exist_ok=True)

    runner = _StepRunner(workload, config, device, precision)
    for _ in range(BURN_IN_STEPS):
        runner.step()
    flops = runner.flops()

    # 1. Timed steps: the breakdown, the step time, NVML utilization (at least a second of it).
    clock = _PhaseClock(device, steps)
    with GpuUtilSampler(device) as sampler:
        sync()
        t0 = time.perf_counter()
        for _ in range(steps):
            runner.step(clock)
        sync()
        wall = time.perf_counter() - t0
        extra_until = time.perf_counter() + (1.0 - wall if device.type == "cuda" else 0.0)
        while time.perf_counter() < extra_until:  # NVML averages over 1/6 s .. 1 s
            runner.step()
        sync()
    wall_step_ms = 1000 * wall / steps
    host, dev = clock.per_step_ms()
    primary = dev if dev is not None else host  # CUDA events on a GPU: what the device saw
    step_ms = statistics.median(sum(row) for row in primary)
    medians = {p: statistics.median(row[i] for row in primary) for i, p in enumerate(PHASES)}
    total_med = sum(medians.values()) or 1.0
    breakdown = []
    for i, p in enumerate(PHASES):
        breakdown.append({
            "phase": p,
            "ms": medians[p],
            "share": medians[p] / total_med,
            "host_ms": statistics.median(row[i] for row in host),
            "device_ms": statistics.median(row[i] for row in dev) if dev is not None else None,
        })

    # 2. Traced steps: top ops and the Chrome trace.
    from torch.profiler import ProfilerActivity, profile, schedule

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities, schedule=schedule(wait=wait, warmup=warmup, active=active, repeat=1)) as prof:
        for _ in range(wait + warmup + active):
            runner.step()
            prof.step()
    sync()
    trace_path = out / "trace.json"
    prof.export_chrome_trace(str(trace_path))
    top_ops = _top_ops(prof, device, top, active)
    trace = trace_summary(trace_path)

    # 3. Syncs: CUDA's own report where there is one; host reads everywhere.
    syncs = detect_syncs(runner.step, steps=sync_steps, warmup=0, device=device)
    host_reads = count_host_reads(runner.step, steps=sync_steps)

    util = sampler.result()
    peak = peak_tflops(_device_name(device), precision.name) if device.type == "cuda" else None
    achieved = flops / (step_ms / 1000) / 1e12 if step_ms > 0 else None
    mfu = achieved / peak if peak and achieved is not None else None
    syncs_per_step = trace["syncs_per_step"] if trace["syncs_per_step"] is not None else syncs["per_step"]
    metrics = {
        "device_type": device.type,
        "step_ms": step_ms,
        "breakdown_ms": medians,
        "kernels_per_step": trace["kernels_per_step"],
        "median_kernel_us": trace["median_kernel_us"],
        "gpu_busy": trace["gpu_busy"],
        "gpu_util_pct": util["mean_pct"] if util else None,
        "syncs_per_step": syncs_per_step,
        "sync_wait_share": trace["sync_wait_share"],
        "mfu": mfu,
    }
    summary_path = out / "profile_summary.json"
    summary = {
        "workload": workload.name,
        "device": str(device),
        "device_name": _device_name(device),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "date": _dt.datetime.now().isoformat(timespec="seconds"),
        "config": config.to_dict(),
        "precision": precision.name,
        "precision_reason": precision.reason,
        "batch_size": runner.batch_size,
        "optimizer": runner.optimizer_desc,
        "data": "on the device (slices)" if runner.on_device else "pinned host memory, copied per step",
        "activation_checkpointing": runner.checkpointed,
        "timed_steps": steps,
        "timing": "CUDA events per phase, median step" if device.type == "cuda"
                  else "host perf_counter per phase, median step",
        "step_ms": step_ms,
        "step_ms_spread": [min(sum(r) for r in primary), max(sum(r) for r in primary)],
        "wall_step_ms": wall_step_ms,
        "samples_per_s": runner.batch_size / (step_ms / 1000) if step_ms > 0 else None,
        "breakdown": breakdown,
        "top_ops": top_ops,
        "top_ops_by": "self device time" if device.type == "cuda" else "self CPU time",
        "profiled_steps": {"wait": wait, "warmup": warmup, "active": active},
        "trace": trace,
        "gpu_utilization": util,
        "gpu_utilization_note": sampler.error,
        "flops_per_step": flops,
        "achieved_tflops": achieved,
        "peak_tflops": peak,
        "mfu": mfu,
        "syncs": syncs,
        "host_reads": host_reads,
        "metrics": metrics,
        "verdict": diagnose(metrics),
        "files": {"trace": str(trace_path), "summary": str(summary_path)},
    }
    with open(summary_path, "w") as f:
        json.dump(summary, f, indent=2, default=str)
    return summary
