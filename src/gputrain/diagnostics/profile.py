"""Where the time of a training step goes, and what bounds it: the profile orchestrator.

`profile_workload(workload, config, ...)` times the training step `fit` runs (built by the Trainer,
with the same switches: graphed when fit captures it) and returns that step time, the breakdown of
the same step body run eagerly with phase marks (data, host-to-device, forward, backward,
optimizer, logging; `_PhaseClock` times them), the top ops and figures of a torch.profiler run
(`trace`), a Chrome trace, GPU utilization sampled from NVML (`gpu_util`), MFU where the device's
peak is known, the host syncs (`syncs`) and a verdict (`gputrain.diagnostics.verdict.diagnose`).
With no config it profiles the workload's own settings (gputrain.config.workload_config).
"""

from __future__ import annotations

import datetime as _dt
import json
import os
import statistics
import tempfile
import time
from pathlib import Path
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Any, Callable, Protocol

import torch

from gputrain.config import TrainConfig, workload_config
from gputrain.diagnostics.gpu_util import GpuUtilSampler
from gputrain.diagnostics.syncs import count_host_reads, detect_syncs
from gputrain.diagnostics.trace import STEP_LABEL, op_tables, trace_summary
from gputrain.diagnostics.verdict import diagnose
from gputrain.io.atomic import atomic_file
from gputrain.io.run_layout import PROFILE_SUMMARY, PROFILE_TRACE
from gputrain.runtime.devices import device_name

if TYPE_CHECKING:
    from gputrain.data.placement import Placement
    from gputrain.runtime.precision import RunPrecision
    from gputrain.runtime.timing import PhaseClock

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


# ---------------------------------------------------------------- the instrumented step


class _StepRunner:
    """The training loop `fit` runs for a workload, built by gputrain's own Trainer.

    `step()` is one iteration of the trainer's own loop (`Trainer.run_steps`: the step, graphed when
    fit would capture it, and the log point's read of the loss every `log_every` steps).
    `phased_step(clock)` is the same iteration with the trainer's phases marked on `clock`
    (`Trainer.timed_phases`: data, forward, backward, optimizer, logging); a CUDA graph cannot be
    split into phases, so the breakdown is always of the eager step.
    """

    def __init__(self, workload, config: TrainConfig):
        from gputrain.train import Trainer

        torch.manual_seed(config.seed)
        config = config.replace(steps=10**9, run_dir=None, resume=False, progress=False)
        self.trainer = Trainer(workload.make_model(), workload.make_data(), config=config,
                               task=workload.task, **workload.loss_kwargs())
        parts = self.trainer.parts
        self.device, self.precision, self.config = parts.device, parts.precision, config
        self.batch_size = config.batch_size
        self.placement = parts.data.placement
        self.recomputed = parts.model.recomputed
        self.optimizer_desc = parts.optim.optimizer_desc

    def step(self) -> None:
        self.trainer.run_steps(1)

    def marked_steps(self) -> AbstractContextManager[None]:
        """While active, each training step runs inside a record_function range (STEP_LABEL), so a
        trace tells the steps from the loop's other work (a log point's loss read, evaluation)."""
        return self.trainer.steps_inside(lambda: torch.profiler.record_function(STEP_LABEL))

    def phased_step(self, clock) -> None:
        with self.trainer.timed_phases(clock):
            self.trainer.run_steps(1)

    def flops(self) -> int:
        """FLOPs of one forward + backward of the next batch (FlopCounterMode, for the MFU): no optimizer
        step, and the gradients are cleared after, so the weights stay as they are."""
        from torch.utils.flop_counter import FlopCounterMode

        from gputrain.data.deferred import materialize

        parts = self.trainer.parts
        batch = materialize(self.trainer.next_step_batches()[0])
        counter = FlopCounterMode(display=False)
        with counter:
            loss, _ = parts.precision.forward(parts.step.loss, parts.model.model, batch)
            loss.backward()
        parts.step.body.zero_grad()
        return int(counter.get_total_flops())

    def close(self) -> None:
        self.trainer.close()


# ---------------------------------------------------------------- the whole profile


def profile_workload(workload, config: TrainConfig | None = None, steps: int = 20, wait: int = 1, warmup: int = 2,
                     active: int = 3, out_dir: str | os.PathLike | None = None, top: int = 15,
                     sync_steps: int = 3) -> dict[str, Any]:
    """Profile a few training steps of `workload` and say what bounds them.

    workload: a Workload or a name (as `gputrain.workloads.resolve_workload` takes).
    config: a TrainConfig (None: the workload's defaults); the profiled step is the one `fit` builds
        from it, with the same switches (CUDA graphs, channels_last, compile, fused AdamW, data
        placement); log_every says how often the loss is read on the host.
    steps: timed steps for the breakdown (after BURN_IN_STEPS unmeasured ones); wait/warmup/active:
        torch.profiler's schedule for the traced steps; out_dir: where trace.json and
        profile_summary.json go (None: a new temporary directory).

    Returns the summary (also written as JSON): step_ms, samples_per_s, breakdown (per phase:
    ms, share, host_ms, device_ms), top_ops (per training step), other_ops (the traced window's
    other work: log points' loss reads and evaluations, totals), trace (trace_summary), gpu_utilization (NVML, or None),
    flops_per_step, achieved_tflops, peak_tflops, mfu (None without a known peak), syncs
    (detect_syncs; unsupported off CUDA), host_reads (count_host_reads), verdict (diagnose) and
    the files written. Raises ConfigError/DeviceError for an impossible config.
    """
    from gputrain.runtime.devices import synchronizer
    from gputrain.runtime.distributed import process_device
    from gputrain.runtime.precision import resolve_precision

    from gputrain.errors import ConfigError

    if steps < 1 or active < 1 or wait < 0 or warmup < 0 or sync_steps < 1:
        raise ConfigError(f"profile_workload needs steps >= 1, active >= 1, sync_steps >= 1 and wait, warmup >= 0; "
                          f"got steps={steps}, active={active}, sync_steps={sync_steps}, wait={wait}, warmup={warmup}")
    if isinstance(workload, str):
        from gputrain.workloads import resolve_workload

        workload = resolve_workload(workload)
    config = config or workload_config(workload)
    device = process_device(config.device)
    precision = resolve_precision(config.precision, device)
    sync = synchronizer(device)
    out = Path(out_dir) if out_dir is not None else Path(tempfile.mkdtemp(prefix="gputrain-profile-"))
    out.mkdir(parents=True, exist_ok=True)

    runner = _StepRunner(workload, config)
    try:
        return _profile(runner, workload, config, device, precision, sync, out, steps, wait, warmup, active, top,
                        sync_steps)
    finally:
        runner.close()


def _profile(runner: _StepRunner, workload, config: TrainConfig, device, precision, sync, out: Path, steps: int,
             wait: int, warmup: int, active: int, top: int, sync_steps: int) -> dict[str, Any]:
    from gputrain.diagnostics.peaks import peak_tflops

    for _ in range(BURN_IN_STEPS + 2):  # lazy init, autotuning, and the graph capture when fit captures
        runner.step()
    graphs_fit_uses = runner.trainer.graph_status()
    flops = runner.flops()

    # 1. The step as fit runs it (graphed when fit captures it): the headline step time, and NVML
    # utilization (at least a second of it).
    # Timed in chunks of synchronized steps; the median chunk is the figure (a stray slow step, a
    # collection or a thread wake-up, does not move it).
    chunk = max(1, steps // 5)
    chunk_ms = []
    with GpuUtilSampler(device) as sampler:
        sync()
        t_all = time.perf_counter()
        for _ in range(max(1, steps // chunk)):
            t0 = time.perf_counter()
            for _ in range(chunk):
                runner.step()
            sync()
            chunk_ms.append(1000 * (time.perf_counter() - t0) / chunk)
        wall = time.perf_counter() - t_all
        extra_until = time.perf_counter() + (1.0 - wall if device.type == "cuda" else 0.0)
        while time.perf_counter() < extra_until:  # NVML averages over 1/6 s .. 1 s
            runner.step()
        sync()
    step_ms = statistics.median(chunk_ms)
    wall_step_ms = 1000 * wall / (chunk * len(chunk_ms))

    # 2. The same step body run eagerly with phase marks: where its time goes.
    clock = _PhaseClock(device, steps)
    for _ in range(steps):
        runner.phased_step(clock)
    host, dev = clock.per_step_ms()
    primary = dev if dev is not None else host  # CUDA events on a GPU: what the device saw
    phased_step_ms = statistics.median(sum(row) for row in primary)
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
    with runner.marked_steps(), profile(activities=activities,
                                        schedule=schedule(wait=wait, warmup=warmup, active=active, repeat=1)) as prof:
        for _ in range(wait + warmup + active):
            runner.step()
            prof.step()
    sync()
    trace_path = out / PROFILE_TRACE
    prof.export_chrome_trace(str(trace_path))
    ops = op_tables(prof, device, top, active)  # per training step; the window's other work apart
    trace = trace_summary(trace_path)

    # 3. Syncs: CUDA's own report where there is one; host reads everywhere.
    syncs = detect_syncs(runner.step, steps=sync_steps, warmup=0, device=device)
    host_reads = count_host_reads(runner.step, steps=sync_steps)

    util = sampler.result()
    peak = peak_tflops(device_name(device), precision.name) if device.type == "cuda" else None
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
        "host_reads_per_step": host_reads["per_step"],
        "host_read_site": _first_site(host_reads),
        "sync_wait_share": trace["sync_wait_share"],
        "mfu": mfu,
    }
    summary_path = out / PROFILE_SUMMARY
    summary = {
        "workload": workload.name,
        "device": str(device),
        "device_name": device_name(device),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "date": _dt.datetime.now().isoformat(timespec="seconds"),
        "config": config.to_dict(),
        "precision": precision.name,
        "precision_reason": precision.reason,
        "batch_size": runner.batch_size,
        "optimizer": runner.optimizer_desc,
        "data": runner.placement.reason,
        "cuda_graphs": graphs_fit_uses,
        "recompute": runner.recomputed,
        "timed_steps": steps,
        "timing": (f"step_ms: median over chunks of {chunk} synchronized steps of the step fit runs "
                   f"(cuda_graphs {graphs_fit_uses}); breakdown: the same step body run eagerly with "
                   + ("CUDA events per phase" if device.type == "cuda" else "host perf_counter per phase")
                   + ", median step"),
        "step_ms": step_ms,
        "step_ms_chunks": chunk_ms,
        "phased_step_ms": phased_step_ms,
        "phased_step_ms_spread": [min(sum(r) for r in primary), max(sum(r) for r in primary)],
        "wall_step_ms": wall_step_ms,
        "samples_per_s": runner.batch_size / (step_ms / 1000) if step_ms > 0 else None,
        "breakdown": breakdown,
        "top_ops": ops["per_step"],  # per training step: the steps' own ops only
        "top_ops_by": "self device time" if device.type == "cuda" else "self CPU time",
        "top_ops_steps": ops["steps"],  # the training steps the table counts
        # the profiled window's work outside the training steps (a log point's loss read, evaluation):
        # totals over the window, not per step
        "other_ops": ops["other"],
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
    with atomic_file(summary_path, "w") as f:
        json.dump(summary, f, indent=2, default=str)
    return summary


def _first_site(reads: dict[str, Any]) -> str | None:
    """The most frequent host read as "file:line (what)", for the verdict."""
    if not reads.get("sites"):
        return None
    site = reads["sites"][0]
    return f"{os.path.basename(site['file'])}:{site['line']} ({site['what']})"
