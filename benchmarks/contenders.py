"""The contenders of the speed benchmarks, written once: the seed tutorials' loop, a hand loop (eager
or torch.compile'd), gputrain.fit, PyTorch Lightning and Hugging Face Accelerate.

Every contender has the one signature `contender(spec, device, length, recipe, **options) -> Run`:
it builds the model from `spec` (seed 0, timed apart as `Run.model_s`), trains `length.warmup`
untimed steps and then `length.steps` measured ones on `device` the way its tool is meant to be
used, synchronizes, and returns its times. The `recipe` is what all the contenders of one benchmark
share (precision, optimizer, the peers' DataLoader, torch.compile's arguments), so that a comparison
differs in the tool alone. train_speed.py binds the tutorials' recipe (fp32, AdamW's defaults) and
times whole runs (`Run.whole_s`: from the model to the last step, setup included); real_models.py
binds a tuned one (bf16 autocast, fused AdamW, DataLoader workers) and times the steps after the
warm-up (`Run.measured_s`); the GPU day's speed part (gpu_day/speed.py) runs both tables.
"""

from __future__ import annotations

import contextlib
import os
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

# Lightning's and Accelerate's names for a recipe's precision.
LIGHTNING_PRECISION = {"fp32": "32-true", "bf16": "bf16-mixed"}
ACCELERATE_PRECISION = {"fp32": "no", "bf16": "bf16"}


class NotAvailable(Exception):
    """A contender that cannot run here (package missing, feature absent): a recorded skip."""


# ---------------------------------------------------------------- what a contender is given


@dataclass
class Spec:
    """One workload as every contender sees it: host data, a model factory, the per-batch prep."""

    name: str
    batch: int
    inputs: torch.Tensor  # host: uint8 (N, 3, 32, 32) images, int64 (N, T) tokens, or float features
    targets: torch.Tensor  # host: int64 (N,) labels or (N, T) next tokens
    make_model: Callable[[], torch.nn.Module]
    loss_fn: Callable
    task: str | None = None  # gputrain.fit's task ("classification", "regression"); None: fit's own
    channels_last: bool = False
    tokens_per_sample: int = 1  # T for the GPT: throughput in tokens/s too
    mean: tuple[float, ...] | None = None  # per-channel, 0..255 units: uint8 images normalized on the device
    std: tuple[float, ...] | None = None
    config: dict[str, Any] = field(default_factory=dict)  # the model's sizes and the data, for the results
    fit_data: Any = None  # what gputrain.fit trains on (a DataSplits); None: inputs, targets, mean and std

    @property
    def batches_per_epoch(self) -> int:
        """Batches in one pass over the inputs, the last one partial."""
        return -(-self.inputs.shape[0] // self.batch)

    def splits(self):
        """gputrain.fit's data: `fit_data`, else the inputs and targets (normalized by fit with mean, std)."""
        if self.fit_data is not None:
            return self.fit_data
        from gputrain.workloads.base import DataSplits

        return DataSplits(train=(self.inputs, self.targets), test=None, mean=self.mean, std=self.std)

    def prepare(self, device: torch.device) -> Callable[[torch.Tensor], torch.Tensor]:
        """The on-device batch prep every loop does: uint8 -> normalized float (NHWC for the CNN)."""
        if self.mean is None:
            return lambda x: x
        mean = torch.tensor(self.mean, device=device).view(1, -1, 1, 1)
        std = torch.tensor(self.std, device=device).view(1, -1, 1, 1)
        scale, shift = 1.0 / std, -mean / std  # (1, C, 1, 1): x * scale + shift == (x - mean) / std
        fmt = torch.channels_last if self.channels_last else torch.contiguous_format

        def prep(x: torch.Tensor) -> torch.Tensor:
            return torch.addcmul(shift, x.float(), scale).contiguous(memory_format=fmt)

        return prep


@dataclass(frozen=True)
class Length:
    """How long a contender trains: `warmup` untimed steps, then `steps` measured ones. `epochs`
    names the same run in whole passes over the data, for gputrain.fit, which then counts it so."""

    steps: int
    warmup: int = 0
    epochs: int | None = None

    @classmethod
    def of_epochs(cls, spec: Spec, epochs: int) -> "Length":
        """`epochs` whole passes over `spec`'s inputs (every batch of each, the last one partial)."""
        return cls(steps=epochs * spec.batches_per_epoch, epochs=epochs)

    @property
    def total(self) -> int:
        return self.warmup + self.steps


@dataclass(frozen=True)
class Recipe:
    """What all the contenders of one benchmark train with, besides the workload."""

    precision: str = "fp32"  # "fp32" or "bf16" (autocast); Lightning's 32-true / bf16-mixed, Accelerate's no / bf16
    lr: float = 1e-3
    weight_decay: float | None = None  # None: AdamW's own default (0.01)
    fused: bool = False  # fused AdamW; else torch's default implementation (foreach on CUDA)
    workers: bool = False  # the peers' DataLoader: worker processes, pinned on CUDA; else the main process
    compile_kw: dict[str, Any] = field(default_factory=dict)  # torch.compile's arguments (the hand loop's)

    def adamw(self, params) -> torch.optim.AdamW:
        kw: dict[str, Any] = {"lr": self.lr}
        if self.weight_decay is not None:
            kw["weight_decay"] = self.weight_decay
        if self.fused:  # fused=False would also turn foreach off: leave it to torch unless asked
            kw["fused"] = True
        return torch.optim.AdamW(params, **kw)

    def autocast(self, device: torch.device):
        """The loops' autocast: bf16 on the device, or none (fp32)."""
        if self.precision == "bf16":
            return torch.autocast(device.type, dtype=torch.bfloat16)
        return contextlib.nullcontext()


# ---------------------------------------------------------------- what a contender returns


@dataclass
class Run:
    warmup_steps: int
    measured_steps: int
    measured_s: float  # seconds of the measured steps
    wall_s: float  # the whole call: model, setup, warm-up, compile, measured steps, teardown
    model_s: float = 0.0  # of wall_s: the model's build on the host, before anything else
    compile_s: float | None = None
    peak_memory_bytes: int | None = None
    recompilations: int | None = None
    graph_breaks: int | None = None
    notes: list[str] = field(default_factory=list)

    @property
    def whole_s(self) -> float:
        """From the model built to the end of the last step (synchronized): the run with its setup."""
        return self.wall_s - self.model_s


Contender = Callable[[Spec, torch.device, Length], Run]  # a contender with its recipe and options bound


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _reset_peak(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def _peak(device: torch.device) -> int | None:
    return int(torch.cuda.max_memory_allocated(device)) if device.type == "cuda" else None


class _Clock:
    """The points of one contender's call: its start (the peak memory reset), the model built (seed
    0), the warm-up's end and the last step's end (both synchronized)."""

    def __init__(self, device: torch.device):
        self.device = device
        self.t0 = time.perf_counter()
        _reset_peak(device)

    def build_model(self, spec: Spec) -> torch.nn.Module:
        torch.manual_seed(0)
        model = spec.make_model()
        self.t_model = time.perf_counter()
        return model

    def steps(self, step: Callable[[], None], length: Length) -> None:
        """`length.warmup` steps, a synchronize, then `length.steps` timed ones and a synchronize."""
        for _ in range(length.warmup):
            step()
        self.mark()
        for _ in range(length.steps):
            step()
        self.end()

    def mark(self) -> None:
        sync(self.device)
        self.t1 = time.perf_counter()

    def end(self) -> None:
        sync(self.device)
        self.t2 = time.perf_counter()

    def run(self, length: Length, **fields) -> Run:
        return Run(length.warmup, length.steps, self.t2 - self.t1, time.perf_counter() - self.t0,
                   model_s=self.t_model - self.t0, **fields)


@contextlib.contextmanager
def _watch(compiled: bool):
    """A RecompileWatcher around compiled runs (dynamo reset first: a fresh model per run would
    otherwise pile up cache entries for the same forward and reach the recompile limit)."""
    if not compiled:
        yield None
        return
    from gputrain.runtime.recompiles import RecompileWatcher

    torch._dynamo.reset()
    watcher = RecompileWatcher().start()
    try:
        yield watcher
    finally:
        watcher.stop()


def _fill_compile(run: Run, watcher) -> Run:
    if watcher is not None:
        rep = watcher.report()
        run.compile_s, run.recompilations, run.graph_breaks = rep["compile_time_s"], rep["recompilations"], rep["graph_breaks"]
        if rep["recompilations"] or rep["graph_breaks"]:
            run.notes.append(rep["summary"])
    return run


def _cycle(loader):
    """A DataLoader's batches, epoch after epoch (a fresh shuffle each)."""
    while True:
        yield from loader


# ---------------------------------------------------------------- the loops written by hand


def seed_loop(spec: Spec, device: torch.device, length: Length, recipe: Recipe) -> Run:
    """The seed tutorials' loop: DataLoader(TensorDataset, shuffle=True) in this process, .to(device)
    per batch, loss.item() every step (the tutorials record the loss each step)."""
    from torch.utils.data import DataLoader, TensorDataset

    clock = _Clock(device)
    model = clock.build_model(spec).to(device)
    opt = recipe.adamw(model.parameters())
    loader = DataLoader(TensorDataset(spec.inputs, spec.targets), batch_size=spec.batch, shuffle=True)
    prep, it = spec.prepare(device), _cycle(loader)

    def step() -> None:
        xb, yb = next(it)
        xb, yb = xb.to(device), yb.to(device)
        opt.zero_grad()
        with recipe.autocast(device):
            loss = spec.loss_fn(model(prep(xb)), yb)
        loss.backward()
        opt.step()
        _ = loss.item()

    clock.steps(step, length)
    return clock.run(length)


def hand_loop(spec: Spec, device: torch.device, length: Length, recipe: Recipe, compile: bool = False) -> Run:
    """A hand-tuned loop: the data on the device once, randperm batches (a seeded generator), the
    recipe's autocast, channels_last where the spec says so, no per-step host sync; with `compile`,
    torch.compile(model, **recipe.compile_kw)."""
    with _watch(compile) as watcher:
        clock = _Clock(device)
        model = clock.build_model(spec).to(device)
        if spec.channels_last:
            model = model.to(memory_format=torch.channels_last)
        x_all, y_all = spec.inputs.to(device), spec.targets.to(device)  # once, for the whole run
        opt = recipe.adamw(model.parameters())
        fwd = torch.compile(model, **recipe.compile_kw) if compile else model
        prep = spec.prepare(device)
        gen = torch.Generator(device=device).manual_seed(0)
        n, B = x_all.shape[0], spec.batch

        def batches():
            while True:
                perm = torch.randperm(n, device=device, generator=gen)
                for lo in range(0, n, B):
                    idx = perm[lo:lo + B]
                    yield x_all[idx], y_all[idx]

        it = batches()

        def step() -> None:
            x, y = next(it)
            with recipe.autocast(device):
                loss = spec.loss_fn(fwd(prep(x)), y)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)

        clock.steps(step, length)
        peak = _peak(device)
        del model, fwd, opt, x_all, y_all, it
    return _fill_compile(clock.run(length, peak_memory_bytes=peak), watcher)


# ---------------------------------------------------------------- gputrain


def gputrain_run(spec: Spec, device: torch.device, length: Length, recipe: Recipe, **config) -> Run:
    """gputrain.fit on spec.splits() with the recipe's lr and weight decay and `config` (TrainConfig's
    fields: precision, compile, log_every, ...). With a warm-up, one log point ends it and then one
    every `length.warmup` steps (each synchronizes): the measured window runs from the first log
    point to the last. Without one, the measured window is the whole run (whole_s)."""
    import gputrain
    from gputrain.config import TrainConfig

    if "autotune" in config and "autotune" not in TrainConfig.field_names():
        raise NotAvailable("TrainConfig has no autotune field in this gputrain")
    compiled = bool(config.get("compile") or config.get("autotune"))
    span: dict[str, Any] = ({"epochs": length.epochs} if length.epochs else
                            {"steps": length.total, **({"log_every": length.warmup} if length.warmup else {})})
    if recipe.weight_decay is not None:
        span["weight_decay"] = recipe.weight_decay
    with _watch(compiled) as watcher:
        clock = _Clock(device)
        model = clock.build_model(spec)
        cfg = TrainConfig(device=str(device), batch_size=spec.batch, lr=recipe.lr, **{**span, **config})
        history = gputrain.fit(model, spec.splits(), loss_fn=spec.loss_fn, config=cfg, task=spec.task)
        clock.end()
        peak = history.summary.get("peak_memory_bytes") or _peak(device)
        del model
    recs = history.records
    if length.warmup:
        if len(recs) < 2:
            raise RuntimeError(f"gputrain logged {len(recs)} point(s) in {length.total} steps: no window to time")
        first, last = recs[0], recs[-1]
        run = Run(first["step"], last["step"] - first["step"], last["wall_time_s"] - first["wall_time_s"],
                  time.perf_counter() - clock.t0, model_s=clock.t_model - clock.t0, peak_memory_bytes=peak)
    else:  # the whole run is the window, its setup included
        clock.t1 = clock.t_model
        run = clock.run(Length(length.total), peak_memory_bytes=peak)
    for key in ("cuda_graphs", "channels_last", "data", "autotune"):
        if key in history.summary:
            run.notes.append(f"{key}: {history.summary[key]}")
    return _fill_compile(run, watcher)


# ---------------------------------------------------------------- the peers, fed by a DataLoader


class AutocastSeen:
    """What autocast the model's first inner module saw on its first forward of the run: a peer's row
    says it trained in bf16 only when its forward ran under bf16 autocast, and in fp32 only when it
    ran under none (a peer that ignored the setting, on a device or release where it does, would
    otherwise time one precision as the other).

    The hook sits on a child, not on the model itself: Accelerate wraps `model.forward` (inside
    `__call__`, after the model's own hooks) in its autocast."""

    def __init__(self, model: torch.nn.Module, device: torch.device):
        self.device_type, self.seen = device.type, None
        child = next((m for m in model.modules() if m is not model), model)
        self.handle = child.register_forward_pre_hook(self._hook)

    def _hook(self, module, args) -> None:
        if self.seen is None:
            on = torch.is_autocast_enabled(self.device_type)
            self.seen = str(torch.get_autocast_dtype(self.device_type)).removeprefix("torch.") if on else "off"
        self.handle.remove()

    def check(self, who: str, precision: str = "bf16") -> str:
        """The note for the row; raises when the forward did not run as `precision` ("bf16": under
        bf16 autocast; "fp32": under none)."""
        self.handle.remove()
        want = {"bf16": "bfloat16", "fp32": "off"}[precision]
        if self.seen != want:
            raise RuntimeError(f"{who}: the model's forward ran with autocast {self.seen or 'never called'} on "
                               f"{self.device_type}, not {precision}: its row would not be a {precision} figure")
        if precision == "fp32":
            return f"forward without autocast on {self.device_type} (checked in the run)"
        return f"forward under bf16 autocast on {self.device_type} (checked in the run)"


def _loader(spec: Spec, device: torch.device, recipe: Recipe):
    """The peers' DataLoader (shuffled, the last batch kept) and its number of worker processes."""
    from torch.utils.data import DataLoader, TensorDataset

    workers = 0
    if recipe.workers:
        cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
        workers = max(1, min(8, cpus - 1))
    pin = workers > 0 and device.type == "cuda"
    return DataLoader(TensorDataset(spec.inputs, spec.targets), batch_size=spec.batch, shuffle=True,
                      num_workers=workers, pin_memory=pin, persistent_workers=workers > 0), workers


def _loader_note(workers: int, device: torch.device, who: str) -> str:
    return f"DataLoader: {workers} workers, pin_memory={workers > 0 and device.type == 'cuda'}; NCHW ({who} default)"


def lightning_module():
    """Lightning's `pytorch` package (lightning.pytorch, else pytorch_lightning); NotAvailable without it."""
    try:
        import lightning.pytorch as pl
    except ImportError:
        try:
            import pytorch_lightning as pl
        except ImportError:
            raise NotAvailable("neither lightning nor pytorch_lightning is importable") from None
    return pl


def lightning_run(spec: Spec, device: torch.device, length: Length, recipe: Recipe) -> Run:
    """PyTorch Lightning's Trainer at the recipe's precision (32-true / bf16-mixed), fed by a DataLoader;
    its documented defaults otherwise (NCHW), the recipe's AdamW."""
    pl = lightning_module()

    class Clock(pl.Callback):
        def on_train_start(self, trainer, module):
            if not length.warmup:
                clock.mark()

        def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
            if length.warmup and trainer.global_step == length.warmup:
                clock.mark()

        def on_train_end(self, trainer, module):
            clock.end()

    class Module(pl.LightningModule):
        def __init__(self, model):
            super().__init__()
            self.model = model
            self.prep = None

        def training_step(self, batch, batch_idx):
            if self.prep is None:
                self.prep = spec.prepare(self.device)
            x, y = batch
            return spec.loss_fn(self.model(self.prep(x)), y)  # no self.log: no per-step sync

        def configure_optimizers(self):
            return recipe.adamw(self.parameters())

    clock = _Clock(device)
    module = Module(clock.build_model(spec))
    seen = AutocastSeen(module.model, device)
    loader, workers = _loader(spec, device, recipe)
    trainer = pl.Trainer(accelerator="gpu" if device.type == "cuda" else "cpu", devices=1,
                         precision=LIGHTNING_PRECISION[recipe.precision], max_steps=length.total, max_epochs=-1,
                         logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, num_sanity_val_steps=0, callbacks=[Clock()])
    trainer.fit(module, loader)
    run = clock.run(length, peak_memory_bytes=_peak(device), notes=[
        _loader_note(workers, device, "Lightning"),
        seen.check(f"Lightning precision={LIGHTNING_PRECISION[recipe.precision]!r}", recipe.precision)])
    del trainer, module, loader
    return run


def accelerate_run(spec: Spec, device: torch.device, length: Length, recipe: Recipe) -> Run:
    """Hugging Face Accelerate at the recipe's precision (mixed_precision no / bf16), fed by a DataLoader."""
    try:
        from accelerate import Accelerator
        from accelerate.state import AcceleratorState, GradientState
    except ImportError:
        raise NotAvailable("accelerate is not importable") from None
    clock = _Clock(device)
    model = clock.build_model(spec)
    # Accelerate keeps one process-wide state and refuses another precision in the same process;
    # reset it (as its own test suite does) so that runs of either precision can alternate.
    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()
    acc = Accelerator(mixed_precision=ACCELERATE_PRECISION[recipe.precision], cpu=device.type == "cpu")
    seen = AutocastSeen(model, device)
    opt = recipe.adamw(model.parameters())
    loader, workers = _loader(spec, device, recipe)
    model, opt, loader = acc.prepare(model, opt, loader)
    prep, it = spec.prepare(acc.device), _cycle(loader)

    def step() -> None:
        x, y = next(it)
        loss = spec.loss_fn(model(prep(x)), y)  # prepare() wrapped forward in the precision's autocast
        acc.backward(loss)
        opt.step()
        opt.zero_grad(set_to_none=True)

    clock.steps(step, length)
    run = clock.run(length, peak_memory_bytes=_peak(device), notes=[
        _loader_note(workers, device, "Accelerate"),
        seen.check(f"Accelerate mixed_precision={ACCELERATE_PRECISION[recipe.precision]!r}", recipe.precision)])
    del model, opt, loader, it, acc
    return run
