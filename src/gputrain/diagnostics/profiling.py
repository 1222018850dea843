"""Where the time of a training step goes, and what bounds it.

- `profile_workload(workload, config, ...)`: runs a few instrumented training steps and returns
  the step-time breakdown (data, host-to-device, forward, backward, optimizer, logging), the top ops
  of a torch.profiler run (device time on a GPU, CPU time on the CPU), a Chrome trace, GPU
  utilization sampled from NVML, MFU where the device's peak is known, the host syncs and a verdict
  (`gputrain.diagnostics.verdict.diagnose`).
- `detect_syncs(step_fn, steps)`: every call that makes the host wait for the GPU, with the file
  and line that made it (CUDA's sync debug mode).
- `count_host_reads(step_fn, steps)`: the same question on any device: the calls that read a tensor
  on the host (.item(), .tolist(), `if tensor:` ...), each of which syncs when the tensor is on a GPU.
- `trace_summary(trace)`: kernel, sync and busy figures from a Chrome trace (a pure function).
"""

from __future__ import annotations

import datetime as _dt
import json
import linecache
import os
import statistics
import sys
import sysconfig
import tempfile
import threading
import time
import warnings
from pathlib import Path
from typing import Any, Callable

import torch
from torch.overrides import TorchFunctionMode

from gputrain.config import TrainConfig
from gputrain.diagnostics.verdict import diagnose

PHASES = ("data", "h2d", "forward", "backward", "optimizer", "logging")
BURN_IN_STEPS = 3  # first steps: lazy init, cuDNN autotuning, optimizer state creation


# ---------------------------------------------------------------- whose line is it


_TORCH_DIR = os.path.dirname(torch.__file__) + os.sep
_GPUTRAIN_DIR = os.path.dirname(os.path.abspath(__file__)) + os.sep
_STDLIB_DIRS = tuple({os.path.abspath(sysconfig.get_paths()[k]) + os.sep for k in ("stdlib", "platstdlib")})


def _kind_of(filename: str) -> str:
    path = os.path.abspath(filename) if not filename.startswith("<") else filename
    if path.startswith(_TORCH_DIR):
        return "torch"
    if path.startswith(_GPUTRAIN_DIR):
        return "gputrain"
    if path.startswith(_STDLIB_DIRS) and "site-packages" not in path:
        return "stdlib"
    return "user"


def _call_site(frame, boundary) -> tuple[str, int, str]:
    """The (file, line, function) responsible for the call being made in `frame`'s stack.

    Walks outward until `boundary` (the frame of detect_syncs/count_host_reads): the first frame in
    user code wins; failing that, the first in gputrain; failing that, the innermost.
    """
    frames = []
    f = frame
    while f is not None and f is not boundary:
        frames.append(f)
        f = f.f_back
    best = None
    for wanted in ("user", "gputrain"):
        best = next((f for f in frames if _kind_of(f.f_code.co_filename) == wanted), None)
        if best is not None:
            break
    best = best or (frames[0] if frames else frame)
    return best.f_code.co_filename, best.f_lineno, best.f_code.co_name


class _SiteCounter:
    """Counts calls per (file, line) and per step."""

    def __init__(self, boundary):
        self.boundary = boundary
        self.step = 0
        self.sites: dict[tuple[str, int], dict[str, Any]] = {}

    def hit(self, frame, what: str) -> None:
        file, line, func = _call_site(frame, self.boundary)
        site = self.sites.get((file, line))
        if site is None:
            site = self.sites[(file, line)] = {
                "file": file, "line": line, "function": func,
                "code": linecache.getline(file, line).strip(), "what": set(), "count": 0}
        site["count"] += 1
        site["what"].add(what)

    def result(self, steps: int, **extra: Any) -> dict[str, Any]:
        sites = sorted(self.sites.values(), key=lambda s: -s["count"])
        for s in sites:
            s["what"] = ", ".join(sorted(s["what"]))
            s["per_step"] = s["count"] / max(steps, 1)
        total = sum(s["count"] for s in sites)
        return {"supported": True, "reason": None, "steps": steps, "total": total,
                "per_step": total / max(steps, 1), "sites": sites, **extra}


def _unsupported(reason: str, **extra: Any) -> dict[str, Any]:
    return {"supported": False, "reason": reason, "steps": 0, "total": None, "per_step": None, "sites": [], **extra}


# ---------------------------------------------------------------- syncs (CUDA)


def detect_syncs(step_fn: Callable[[], Any], steps: int = 3, warmup: int = 1,
                 device: torch.device | str | None = None) -> dict[str, Any]:
    """Every synchronizing CUDA call that `steps` calls of `step_fn()` make, with its source line.

    Runs `warmup` steps first (lazy initialization syncs once; it is not counted), then `steps`
    steps under torch.cuda.set_sync_debug_mode("warn"), catches each "called a synchronizing CUDA
    operation" warning and walks the Python stack to the line that caused it (frames inside torch
    are skipped, and gputrain's unless nothing else is there).

    Returns {"supported", "reason", "steps", "total", "per_step", "sites": [{"file", "line",
    "function", "code", "what", "count", "per_step"}], "kind": "cuda-syncs"}, sites most frequent
    first. Without a CUDA GPU it returns supported=False and a reason, and runs nothing. Not every
    sync is reported: CUDA's debug mode misses some (torch.distributed, sparse ops).
    """
    if not torch.cuda.is_available():
        return _unsupported("the sync detector needs a CUDA GPU (it uses CUDA's sync debug mode); on this "
                            "machine `count_host_reads` lists the .item()/.cpu()/`if tensor:` calls that "
                            "would sync on one", kind="cuda-syncs")
    device = torch.device(device) if device is not None else torch.device("cuda", torch.cuda.current_device())
    for _ in range(warmup):
        step_fn()
    torch.cuda.synchronize(device)
    counter = _SiteCounter(sys._getframe())
    previous = torch.cuda.get_sync_debug_mode()

    def on_warning(message, category, filename, lineno, file=None, line=None):
        if "synchroniz" in str(message):
            counter.hit(sys._getframe(1), str(message).split(" (Triggered")[0])

    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = on_warning
        torch.cuda.set_sync_debug_mode("warn")
        try:
            for s in range(steps):
                counter.step = s
                step_fn()
        finally:
            torch.cuda.set_sync_debug_mode(previous)
    torch.cuda.synchronize(device)
    return counter.result(steps, kind="cuda-syncs")


# ---------------------------------------------------------------- host reads (any device)

_READS = {"item", "tolist", "numpy", "__bool__", "__float__", "__int__", "__index__", "__format__", "cpu"}
_DATA_DEPENDENT = {"nonzero", "argwhere", "masked_select", "unique", "unique_consecutive"}


def _to_host(args, kwargs) -> bool:
    """Whether a .to(...) call copies a device tensor to the host."""
    if not args or not isinstance(args[0], torch.Tensor) or args[0].device.type == "cpu":
        return False
    targets = list(args[1:]) + [kwargs.get("device")]
    return any((isinstance(t, str) and t.startswith("cpu")) or (isinstance(t, torch.device) and t.type == "cpu")
               for t in targets)


class _HostReadMode(TorchFunctionMode):
    def __init__(self, counter: _SiteCounter):
        super().__init__()
        self.counter = counter

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        what = None
        if name in _READS:
            what = f".{name}()" if not name.startswith("__") else name
        elif name in _DATA_DEPENDENT:
            what = f"{name} (output size depends on the data)"
        elif name == "to" and _to_host(args, kwargs):
            what = ".to('cpu')"
        elif name in ("__getitem__", "__setitem__") and len(args) > 1 and isinstance(args[1], torch.Tensor) \
                and args[1].dtype == torch.bool:
            what = "boolean-mask indexing"
        if what is not None:
            self.counter.hit(sys._getframe(1), what)
        return func(*args, **kwargs)


def count_host_reads(step_fn: Callable[[], Any], steps: int = 3, warmup: int = 0) -> dict[str, Any]:
    """The calls in `steps` calls of `step_fn()` that read tensor values on the host, on any device.

    Counts .item(), .tolist(), .numpy(), .cpu(), .to('cpu'), float()/int()/bool() of a tensor
    (`if loss < best:`), formatting a tensor (f"{loss:.3f}"), boolean-mask indexing and ops whose
    output size depends on the data (nonzero, masked_select, unique). On a GPU each of these makes
    the host wait for the device; on the CPU they are free, so this shows what would sync there.
    Returns the same shape as `detect_syncs` with kind "host-reads".
    """
    for _ in range(warmup):
        step_fn()
    counter = _SiteCounter(sys._getframe())
    with _HostReadMode(counter):
        for s in range(steps):
            counter.step = s
            step_fn()
    return counter.result(steps, kind="host-reads")


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


class GpuUtilSampler:
    """Samples NVML's GPU utilization (% of time a kernel ran) in a background thread.

    `result()` is None where NVML is absent (no nvidia-ml-py, no driver, not CUDA).
    """

    def __init__(self, device: torch.device, interval_s: float = 0.02):
        self.device, self.interval_s = device, interval_s
        self.samples: list[int] = []
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.error: str | None = None

    def __enter__(self) -> "GpuUtilSampler":
        if self.device.type != "cuda":
            self.error = "not a CUDA device"
            return self
        try:
            import pynvml

            pynvml.nvmlInit()
            try:
                index = torch.cuda._get_nvml_device_index(self.device)  # honours CUDA_VISIBLE_DEVICES
            except Exception:  # noqa: BLE001 - private helper; fall back to the CUDA index
                index = self.device.index or 0
            handle = pynvml.nvmlDeviceGetHandleByIndex(index)
            pynvml.nvmlDeviceGetUtilizationRates(handle)
        except Exception as exc:  # noqa: BLE001 - NVML missing or unusable: report None
            self.error = f"NVML unavailable: {exc}"
            return self

        def run():
            while not self._stop.is_set():
                try:
                    self.samples.append(int(pynvml.nvmlDeviceGetUtilizationRates(handle).gpu))
                except Exception:  # noqa: BLE001
                    break
                self._stop.wait(self.interval_s)

        self._thread = threading.Thread(target=run, name="gputrain-nvml", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=2)

    def result(self) -> dict[str, Any] | None:
        if not self.samples:
            return None
        return {"mean_pct": statistics.fmean(self.samples), "median_pct": statistics.median(self.samples),
                "max_pct": max(self.samples), "samples": len(self.samples)}


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
            from gputrain.diagnostics.memory import apply_activation_checkpointing

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


# ---------------------------------------------------------------- the profiler trace


def _union_ms(intervals: list[tuple[float, float]]) -> float:
    total, end = 0.0, None
    for a, b in sorted(intervals):
        if end is None or a > end:
            total += b - a
            end = b
        elif b > end:
            total += b - end
            end = b
    return total / 1000.0


def trace_summary(trace: dict | str | os.PathLike) -> dict[str, Any]:
    """Kernel, copy and sync figures per profiled step from a torch.profiler Chrome trace.

    trace: the trace's JSON (a dict with "traceEvents") or its path. Steps are the ProfilerStep#N
    spans (CPU side); GPU events count when they start inside them. Returns steps, step_ms (mean
    profiled step), kernels_per_step, median_kernel_us,
    kernel_ms_per_step, memcpy_per_step, syncs_per_step (cuda*Synchronize and blocking cudaMemcpy
    calls), sync_ms_per_step, sync_wait_share and gpu_busy (the share of the steps' span with a kernel or
    copy running); GPU figures are None in a CPU-only trace.
    """
    if not isinstance(trace, dict):
        with open(trace) as f:
            trace = json.load(f)
    events = [e for e in trace.get("traceEvents", []) if e.get("ph") == "X"]
    steps = [e for e in events if str(e.get("name", "")).startswith("ProfilerStep#")
             and not str(e.get("cat", "")).startswith("gpu_")]  # not the GPU-timeline copies
    if steps:
        t0 = min(float(e["ts"]) for e in steps)
        t1 = max(float(e["ts"]) + float(e.get("dur", 0)) for e in steps)
    else:
        t0 = min((float(e["ts"]) for e in events), default=0.0)
        t1 = max((float(e["ts"]) + float(e.get("dur", 0)) for e in events), default=0.0)
    n_steps = max(1, len(steps))

    def inside(e) -> bool:
        return t0 <= float(e["ts"]) <= t1

    cats = lambda e: str(e.get("cat", "")).lower()  # noqa: E731
    kernels = [e for e in events if cats(e) == "kernel" and inside(e)]
    copies = [e for e in events if cats(e) in ("gpu_memcpy", "gpu_memset") and inside(e)]
    runtime = [e for e in events if cats(e) in ("cuda_runtime", "cuda_driver") and inside(e)]
    syncs = [e for e in runtime if "Synchronize" in str(e.get("name", "")) or e.get("name") == "cudaMemcpy"]
    window_ms = (t1 - t0) / 1000.0
    has_gpu = bool(kernels or copies or runtime)
    durations = sorted(float(e.get("dur", 0)) for e in kernels)
    sync_ms = sum(float(e.get("dur", 0)) for e in syncs) / 1000.0
    busy = _union_ms([(float(e["ts"]), float(e["ts"]) + float(e.get("dur", 0))) for e in kernels + copies])
    return {
        "steps": len(steps),
        "step_ms": window_ms / n_steps if steps else None,
        "kernels_per_step": len(kernels) / n_steps if has_gpu else None,
        "median_kernel_us": statistics.median(durations) if durations else None,
        "kernel_ms_per_step": sum(durations) / 1000.0 / n_steps if has_gpu else None,
        "memcpy_per_step": len(copies) / n_steps if has_gpu else None,
        "syncs_per_step": len(syncs) / n_steps if has_gpu else None,
        "sync_ms_per_step": sync_ms / n_steps if has_gpu else None,
        "sync_wait_share": (sync_ms / window_ms) if has_gpu and window_ms > 0 else None,
        "gpu_busy": min(1.0, busy / window_ms) if has_gpu and window_ms > 0 else None,
    }


def _top_ops(prof, device: torch.device, limit: int, active: int) -> list[dict[str, Any]]:
    rows = []
    on_gpu = device.type == "cuda"
    for avg in prof.key_averages():
        if avg.key.startswith("ProfilerStep"):
            continue
        self_dev = getattr(avg, "self_device_time_total", 0.0) or 0.0
        rows.append({
            "name": avg.key,
            "calls_per_step": avg.count / active,
            "self_device_ms_per_step": self_dev / 1000.0 / active if on_gpu else None,
            "device_ms_per_step": (getattr(avg, "device_time_total", 0.0) or 0.0) / 1000.0 / active if on_gpu else None,
            "self_cpu_ms_per_step": avg.self_cpu_time_total / 1000.0 / active,
            "cpu_ms_per_step": avg.cpu_time_total / 1000.0 / active,
        })
    key = "self_device_ms_per_step" if on_gpu else "self_cpu_ms_per_step"
    rows = [r for r in rows if (r[key] or 0) > 0]
    rows.sort(key=lambda r: r[key], reverse=True)
    total = sum(r[key] for r in rows) or 1.0
    for r in rows:
        r["share"] = r[key] / total
    return rows[:limit]


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
