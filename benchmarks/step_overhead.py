"""Per-step host overhead: gputrain's step (through the Trainer, on the CPU) against a minimal loop.

Cases: an iris-size MLP (4-10-3, full batch of 150), the MLP 64-128-2 of issue 21 (batch 64 of
4096), the digits CNN (uint8 8x8, normalized, channels_last, batch 64), a small GPT (2 layers of
64, context 64, batch 8) and a ResNet-18 of width 8 (uint8 32x32 images, batch 16); fp32, random
data of the real shapes.

The minimal loop is the floor of BENCHMARKS.md ("On the CPU machine"): the same model, data and
batch, tensors resident on the device, a randperm per epoch and slices of it gathered with
index_select, the op gputrain gathers with (`x[idx]` costs more on the CPU; full batch: the data as
it is), fused AdamW with the same lr and weight decay, no host sync. gputrain runs a `Trainer`
built before the clock starts; its time per step is taken between its log points after the
warm-up (log_every = --log-every, the loss read and the log-point work included, as in a real run).
The two are interleaved finely: at each of gputrain's log points the minimal loop runs as many steps
as a log interval (its own model and optimizer, timed alone and taken out of gputrain's interval),
so every gputrain interval has a minimal chunk beside it in time, and other load on the machine
(2 shared cores) falls on both. Overhead = gputrain's seconds per step minus the minimal loop's,
interval by interval, median over the run's intervals; ratio = minimal time over gputrain time
(1.0: as fast as the floor). Over rounds: medians.

Each of gputrain's per-step additions is switched off in turn (a variant), by patching the
Trainer's parts from here, never through user config:

  default          gputrain as it runs
  no-nan-guard     the non-finite check: the per-step gradient norm (trees that have one) and the
                   probe of the parameters, gradients and optimizer state where the loss is read
                   (trees that have one)
  no-weighting     the micro-batches' weights (every piece weighs 1.0)
  no-accumulators  the device loss sum and the non-finite count, and their read at log points (with
                   it the state probe)
  no-schedule      the learning-rate schedule's per-step call
  no-progress      the progress bar object (disabled by default: expected ~0)
  all-off          all of the above at once: what is left is the loop, the data stream and the step

A variant that a tree has nothing to patch for reports "n/a". For every variant the script also
counts the tensor operations of one steady training step (a TorchDispatchMode counter: all ops,
and those that are not views; on a GPU each non-view op is a kernel launch).

A whole-run figure is kept apart (`--whole`): `gputrain.fit` from the model to the History (setup
included) against the minimal loop from the model to its last step, and against the seed
tutorials' loop (DataLoader over a TensorDataset with shuffle, .to(device) per batch, loss.item()
every step), for the cases with `epochs`; "speedup over seed" is the seed loop's time over fit's.

Rounds are interleaved: every contender once per round, in a rotated order; figures are medians
over rounds. With `--tree NAME=PATH` (twice or more) the script runs itself once per round per
tree as a subprocess with PYTHONPATH=PATH/src, alternating the trees, and compares them: A/B of a
change in one run (BENCHMARKS.md). Threads: --threads (default 2).

Clock: --clock cpu (default) times with this process's CPU time, so that the milliseconds in which
the OS gives the shared cores to other jobs are not counted (with other test runs beside it, the
minimal loop's wall time per step moved 3-18x between rounds here, its CPU time up to 1.6x);
--clock wall for elapsed time on a quiet machine.

Usage:
  python -m benchmarks.step_overhead                            # this tree, all cases
  python -m benchmarks.step_overhead --cases iris-mlp,mlp --rounds 7 --json out.json
  python -m benchmarks.step_overhead --tree before=/tmp/base --tree after=. --rounds 5
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import json
import os
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch
from torch import nn

ROOT = Path(__file__).resolve().parents[1]
LR = 1e-3
WEIGHT_DECAY = 0.01
# The clock: CPU time of this process (default) or wall time. On 2 cores shared with other jobs the
# OS hands the cores to those jobs for whole milliseconds; CPU time leaves that out, wall time not.
CLOCKS = {"cpu": time.process_time, "wall": time.perf_counter}
clock = CLOCKS["cpu"]
VARIANTS = ("default", "no-nan-guard", "no-weighting", "no-accumulators", "no-schedule", "no-progress", "all-off")


# ---------------------------------------------------------------- cases


@dataclass
class Case:
    name: str
    what: str
    batch: int
    steps: int  # measured steps (a multiple of --log-every)
    make_model: Callable[[], nn.Module]
    make_data: Callable[[], tuple[torch.Tensor, torch.Tensor]]
    loss_fn: Callable
    mean: tuple[float, ...] | None = None  # uint8 images: normalized per batch (x * scale + shift)
    std: tuple[float, ...] | None = None
    channels_last: bool = False
    epochs: int | None = None  # whole-run length (--whole)


def _classes(n: int, features: int, classes: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, features, generator=g)
    return x, torch.randint(0, classes, (n,), generator=g)


def _images(n: int, seed: int = 0, shape: tuple[int, ...] = (1, 8, 8), top: int = 17
            ) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, top, (n, *shape), generator=g, dtype=torch.uint8), torch.randint(0, 10, (n,), generator=g)


def _tokens(n: int, block: int, vocab: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    seq = torch.randint(0, vocab, (n, block + 1), generator=g)
    return seq[:, :-1].contiguous(), seq[:, 1:].contiguous()


def cases(quick: bool) -> dict[str, Case]:
    from gputrain.workloads.models import DigitsCNN, IrisMLP
    from gputrain.workloads.real_models import GPTMini, ResNet18Cifar, next_token_loss

    def mlp() -> nn.Module:
        return nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 2))

    gpt = {"n_layer": 2, "n_embd": 64, "n_head": 2, "block_size": 64}
    k = 4 if quick else 1
    out = [
        Case("iris-mlp", "iris-size MLP 4-10-3, full batch of 150", 150, 2000 // k, IrisMLP,
             lambda: _classes(150, 4, 3), nn.CrossEntropyLoss()),
        Case("mlp", "MLP 64-128-2, batch 64 of 4096 samples", 64, 400 // k, mlp,
             lambda: _classes(4096, 64, 2), nn.CrossEntropyLoss(), epochs=3),
        Case("digits-cnn", "digits CNN (8x8 uint8, normalized, channels_last), batch 64 of 1437", 64, 200 // k,
             DigitsCNN, lambda: _images(1437), nn.CrossEntropyLoss(), mean=(8.0,), std=(5.0,), channels_last=True),
        Case("gpt-mini", f"GPT {gpt['n_layer']}x{gpt['n_embd']}, context {gpt['block_size']}, batch 8 of 512",
             8, 100 // k if not quick else 50, lambda: GPTMini(65, dropout=0.1, **gpt),
             lambda: _tokens(512, gpt["block_size"], 65), next_token_loss),
        Case("resnet18", "ResNet-18 (width 8) on 32x32 uint8 images, normalized, channels_last, batch 16 of 512",
             16, 100 // k if not quick else 50, lambda: ResNet18Cifar(num_classes=10, width=8),
             lambda: _images(512, shape=(3, 32, 32), top=256), nn.CrossEntropyLoss(),
             mean=(125.3, 123.0, 113.9), std=(63.0, 62.1, 66.7), channels_last=True),
    ]
    return {c.name: c for c in out}


def _prep(case: Case) -> Callable[[torch.Tensor], torch.Tensor]:
    """The minimal loop's per-batch input work, the same as gputrain's transform does."""
    if case.mean is None:
        return lambda x: x
    std = torch.tensor(case.std).view(1, -1, 1, 1)
    scale, shift = 1.0 / std, -torch.tensor(case.mean).view(1, -1, 1, 1) / std
    fmt = torch.channels_last if case.channels_last else torch.contiguous_format
    return lambda x: torch.addcmul(shift, x.float(), scale).contiguous(memory_format=fmt)


# ---------------------------------------------------------------- the minimal loop


class Minimal:
    """The floor: resident tensors, randperm slices (none for a full batch), fused AdamW, no sync."""

    def __init__(self, case: Case):
        torch.manual_seed(0)
        model = case.make_model()
        self.model = model.to(memory_format=torch.channels_last) if case.channels_last else model
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=LR, weight_decay=WEIGHT_DECAY, fused=True)
        self.x, self.y = case.make_data()
        self.prep, self.loss_fn, self.batch = _prep(case), case.loss_fn, case.batch
        self.gen = torch.Generator().manual_seed(0)
        self.it = self._batches()

    def _batches(self):
        n, B, x, y = self.x.shape[0], self.batch, self.x, self.y
        while True:
            if B >= n:
                yield x, y
                continue
            perm = torch.randperm(n, generator=self.gen)
            for lo in range(0, n, B):
                idx = perm[lo:lo + B]
                yield x.index_select(0, idx), y.index_select(0, idx)

    def step(self) -> None:
        x, y = next(self.it)
        loss = self.loss_fn(self.model(self.prep(x)), y)
        loss.backward()
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)


def minimal_whole(case: Case) -> float:
    """Seconds for case.epochs epochs, from the model to the last step (the model made outside)."""
    torch.manual_seed(0)
    model = case.make_model()
    x, y = case.make_data()
    t0 = clock()
    if case.channels_last:
        model = model.to(memory_format=torch.channels_last)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WEIGHT_DECAY, fused=True)
    prep, gen, n, B = _prep(case), torch.Generator().manual_seed(0), x.shape[0], case.batch
    for _ in range(case.epochs or 1):
        perm = torch.randperm(n, generator=gen)
        for lo in range(0, n, B):
            idx = perm[lo:lo + B]
            loss = case.loss_fn(model(prep(x.index_select(0, idx))), y.index_select(0, idx))
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
    return clock() - t0


def seed_whole(case: Case) -> float:
    """The seed tutorials' loop (BENCHMARKS.md's baseline), seconds for case.epochs epochs from the
    model to the last step: DataLoader(TensorDataset, shuffle=True), .to(device) per batch (a no-op
    on the CPU), and loss.item() every step, the tutorials' way of watching the loss."""
    from torch.utils.data import DataLoader, TensorDataset

    torch.manual_seed(0)
    model = case.make_model()
    x, y = case.make_data()
    t0 = clock()
    device = torch.device("cpu")
    model = model.to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WEIGHT_DECAY, fused=True)
    prep = _prep(case)
    loader = DataLoader(TensorDataset(x, y), batch_size=case.batch, shuffle=True)
    running = 0.0
    for _ in range(case.epochs or 1):
        for xb, yb in loader:
            xb, yb = xb.to(device), yb.to(device)
            loss = case.loss_fn(model(prep(xb)), yb)
            opt.zero_grad()
            loss.backward()
            opt.step()
            running += loss.item()
    return clock() - t0


# ---------------------------------------------------------------- gputrain and its variants


def _data(case: Case):
    x, y = case.make_data()
    if case.mean is None:
        return (x, y)
    from gputrain.data.splits import DataSplits

    return DataSplits(train=(x, y), test=None, mean=case.mean, std=case.std)


def _config(case: Case, steps: int, log_every: int):
    from gputrain import TrainConfig

    return TrainConfig(device="cpu", batch_size=case.batch, steps=steps, log_every=log_every, lr=LR,
                       weight_decay=WEIGHT_DECAY, progress=False)


class _NullProgress:
    def __init__(self, *args, **kwargs):
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

    def update(self, *args, **kwargs):
        pass


class _NoAdd:
    """Stands in for a device accumulator: add_ does nothing."""

    def add_(self, *args, **kwargs):
        return self

    def zero_(self):
        return self


@contextlib.contextmanager
def _patched(obj, name: str, value):
    old = getattr(obj, name)
    setattr(obj, name, value)
    try:
        yield
    finally:
        setattr(obj, name, old)


def _variant(name: str, trainer, stack: contextlib.ExitStack) -> list[str]:
    """Switch one of gputrain's per-step additions off in `trainer`; returns what was patched
    (empty: this tree has nothing to switch off for that variant). Works on the trees before and after
    the run's parts were built once (`trainer.parts`, train/loop/parts.py), so that --tree compares them."""
    parts = getattr(trainer, "parts", None)
    if parts is not None:
        return _variant_parts(name, parts, stack)
    from gputrain.train.step import train_step as step_mod

    step = trainer.train_step
    cls = type(step)
    done: list[str] = []
    names = VARIANTS[1:-1] if name == "all-off" else (name,)
    for part in names:
        if part == "no-nan-guard":
            zero = torch.zeros(())
            if hasattr(cls, "_state_probe"):  # the check of the run's state at log points / checkpoints
                stack.enter_context(_patched(cls, "_state_probe", lambda self: zero))
                done.append("TrainStep._state_probe")
            if "get_total_norm" in cls.run.__code__.co_names:  # a per-step gradient norm
                stack.enter_context(_patched(step_mod.nn.utils, "get_total_norm", lambda grads, **kw: zero))
                done.append("nn.utils.get_total_norm (the per-step gradient norm)")
        elif part == "no-weighting":
            stack.enter_context(_patched(step, "_weights", lambda pieces: [1.0] * len(pieces)))
            done.append("TrainStep._weights")
        elif part == "no-accumulators":
            stack.enter_context(_patched(step, "loss_sum", _NoAdd()))
            stack.enter_context(_patched(step, "nonfinite", _NoAdd()))
            if hasattr(cls, "read_totals"):  # the step reads its own totals (since issue 20)
                stack.enter_context(_patched(step, "read_totals", lambda: (0.0, 0)))
                done.append("TrainStep.loss_sum/nonfinite/read_totals")
            else:
                stack.enter_context(_patched(trainer, "_read_step_totals", lambda: (0.0, 0)))
                done.append("TrainStep.loss_sum/nonfinite, Trainer._read_step_totals")
        elif part == "no-schedule":
            stack.enter_context(_patched(trainer.scheduler, "step", lambda: None))
            done.append("scheduler.step")
        elif part == "no-progress":
            import gputrain.report.progress as progress

            stack.enter_context(_patched(progress, "TrainProgress", _NullProgress))
            done.append("TrainProgress")
    return done


def _variant_parts(name: str, parts, stack: contextlib.ExitStack) -> list[str]:
    """`_variant` on a tree whose run is built into parts: the step's pieces (train/step/micro.py,
    totals.py) and the schedule's interval (train/optim/intervals.py) are patched."""
    from gputrain.train.step.totals import TotalsRead

    step = parts.step.body
    done: list[str] = []
    for part in VARIANTS[1:-1] if name == "all-off" else (name,):
        if part == "no-nan-guard":
            zero = torch.zeros(())
            stack.enter_context(_patched(type(step.totals), "_state_probe", lambda self: zero))
            done.append("StepTotals._state_probe")
        elif part == "no-weighting":
            stack.enter_context(_patched(step.micro, "weights", lambda pieces: [1.0] * len(pieces)))
            done.append("MicroBatches.weights")
        elif part == "no-accumulators":
            stack.enter_context(_patched(step.totals, "keep", lambda loss: None))
            stack.enter_context(_patched(step.totals, "nonfinite", _NoAdd()))
            stack.enter_context(_patched(step, "read_totals", lambda: TotalsRead(0.0, 0)))
            done.append("StepTotals.keep/nonfinite, TrainStep.read_totals")
        elif part == "no-schedule":
            stack.enter_context(_patched(parts.optim.steps, "per_step", lambda: None))
            done.append("SchedulerSteps.per_step")
        elif part == "no-progress":
            import gputrain.report.progress as progress

            stack.enter_context(_patched(progress, "TrainProgress", _NullProgress))
            done.append("TrainProgress")
    return done


def gputrain_steady(case: Case, variant: str, warmup: int, steps: int, log_every: int
                    ) -> tuple[list[tuple[float, float]] | None, list[str]]:
    """gputrain's Trainer.run, with a chunk of the minimal loop (as many steps as a log interval)
    run at each of its log points and taken out of its time: returns (gputrain, minimal) seconds
    per step for each log interval after the warm-up, side by side in time, and what was patched.
    None: this tree has nothing to switch off for the variant."""
    from gputrain.train.loop.trainer import Trainer

    torch.manual_seed(0)
    model = case.make_model()
    trainer = Trainer(model, _data(case), loss_fn=case.loss_fn, config=_config(case, warmup + steps, log_every))
    floor = Minimal(case)
    floor.model.train()
    for _ in range(warmup):
        floor.step()
    marks: dict[int, tuple[float, float]] = {}  # log point step -> (clock before, after the minimal chunk)
    log_point = trainer._log_point

    def log_point_then_floor(*args, **kwargs):
        record = log_point(*args, **kwargs)
        t0 = clock()
        for _ in range(log_every):
            floor.step()
        marks[record["step"]] = (t0, clock())
        return record

    with contextlib.ExitStack() as stack:
        patched = _variant(variant, trainer, stack) if variant != "default" else ["-"]
        if not patched:
            trainer.close()
            return None, []
        stack.enter_context(_patched(trainer, "_log_point", log_point_then_floor))
        try:
            trainer.run()
        finally:
            trainer.close()
    steps_at = sorted(s for s in marks if s >= warmup)
    # gputrain's interval (a, b]: from the end of the minimal chunk at log point a to the start of the
    # one at b (the rest of log point a's work, b - a steps, log point b's read); the chunk at b beside it.
    return [((marks[b][0] - marks[a][1]) / (b - a), (marks[b][1] - marks[b][0]) / log_every)
            for a, b in zip(steps_at, steps_at[1:])], patched


def gputrain_whole(case: Case) -> float:
    import gputrain

    torch.manual_seed(0)
    model = case.make_model()
    data = _data(case)
    n = case.make_data()[0].shape[0]
    steps = (case.epochs or 1) * -(-n // case.batch)
    t0 = clock()
    gputrain.fit(model, data, loss_fn=case.loss_fn, config=_config(case, steps, 50))
    return clock() - t0


# ---------------------------------------------------------------- counting ops


class OpCounter(contextlib.AbstractContextManager):
    VIEWS = ("aten.t.", "aten.detach.", "aten.view.", "aten.slice.", "aten.expand.", "aten.alias.",
             "aten._unsafe_view.", "aten.unsqueeze.", "aten.squeeze.", "aten.permute.", "aten.transpose.",
             "aten.as_strided.", "aten.select.", "aten._reshape_alias.", "profiler.")

    def __init__(self):
        from torch.utils._python_dispatch import TorchDispatchMode

        counter = self

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                counter.ops[str(func)] += 1
                return func(*args, **(kwargs or {}))

        self.ops: collections.Counter[str] = collections.Counter()
        self.mode = Mode()

    def __enter__(self):
        self.mode.__enter__()
        return self

    def __exit__(self, *exc):
        return self.mode.__exit__(*exc)

    @property
    def total(self) -> int:
        return sum(self.ops.values())

    @property
    def kernels(self) -> int:
        return sum(n for op, n in self.ops.items() if not op.startswith(self.VIEWS))


def count_ops(case: Case, variant: str) -> dict[str, Any] | None:
    """Ops of one steady step: the minimal loop's, or gputrain's train_one_step (+ one log point)."""
    if variant == "minimal":
        m = Minimal(case)
        for _ in range(3):
            m.step()
        with OpCounter() as c:
            m.step()
        return {"ops": c.total, "kernels": c.kernels, "log_point_kernels": 0, "detail": dict(c.ops)}
    from gputrain.train.loop.trainer import Trainer

    torch.manual_seed(0)
    trainer = Trainer(case.make_model(), _data(case), loss_fn=case.loss_fn, config=_config(case, 100, 50))
    with contextlib.ExitStack() as stack:
        if variant != "default" and not _variant(variant, trainer, stack):
            trainer.close()
            return None
        getattr(getattr(trainer, "parts", None), "model", trainer).model.train()  # either tree's model
        for _ in range(3):
            trainer.train_one_step()
        with OpCounter() as c:
            trainer.train_one_step()
        with OpCounter() as lp:  # what a log point reads (the loss, the non-finite check)
            read = getattr(trainer, "collect_step_totals", None) or getattr(trainer, "_read_step_totals")
            read()
        trainer.close()
    return {"ops": c.total, "kernels": c.kernels, "log_point_kernels": lp.kernels, "detail": dict(c.ops)}


# ---------------------------------------------------------------- the Python on the hot path


def _enter(cm) -> None:
    with cm:
        pass


def python_costs(number: int = 20000, repeat: int = 5) -> dict[str, float]:
    """Nanoseconds per call (best of `repeat`) of each Python construct the step runs per step, in
    this tree's gputrain, beside the plain alternative."""
    import timeit

    from gputrain import batch as batches
    from gputrain.runtime import distributed
    from gputrain.runtime.precision import RunPrecision, resolve_precision

    cpu = torch.device("cpu")
    model = nn.Linear(4, 3)
    prec = RunPrecision(resolve_precision("fp32", cpu), cpu)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)  # no gradients: step() only walks its groups
    x, y = torch.randn(8, 4), torch.randint(0, 3, (8,))
    loss = torch.tensor(1.0)
    grads = [torch.randn(10, 4), torch.randn(10), torch.randn(3, 10), torch.randn(3)]
    items: dict[str, Callable[[], Any]] = {
        "distributed.no_sync(model, sync=True) entered": lambda: _enter(distributed.no_sync(model, sync=True)),
        "precision.autocast() entered (fp32)": lambda: _enter(prec.autocast()),
        "batches.batch_size((x, y))": lambda: batches.batch_size((x, y)),
        "batches.map_tensors(f, (x, y))": lambda: batches.map_tensors(lambda t: t, (x, y)),
        "  plain: tuple(f(t) for t in (x, y))": lambda: tuple(t for t in (x, y)),
        "precision.backward's scaler.scale(loss) (off)": lambda: prec.scaler.scale(loss),
        "precision.step(opt) (scaler off)": lambda: prec.step(opt),
        "  plain: opt.step()": lambda: opt.step(),
        "loss.detach().float()": lambda: loss.detach().float(),
        "  plain: loss.detach()": lambda: loss.detach(),
        "pieces list of one micro-batch": lambda: [p for mb in [(x, y)] for p in [mb]],
        "nn.utils.get_total_norm(4 grads)": lambda: torch.nn.utils.get_total_norm(grads),
        "  plain: torch._foreach_norm(4 grads)": lambda: torch._foreach_norm(grads),
    }
    out = {}
    for name, fn in items.items():
        fn()
        best = min(timeit.repeat(fn, number=number, repeat=repeat))
        out[name] = best / number * 1e9
    return out


# ---------------------------------------------------------------- one round (a worker)


def one_round(names: list[str], variants: list[str], rnd: int, warmup: int, log_every: int, whole: bool,
              quick: bool, counts: bool) -> list[dict[str, Any]]:
    all_cases = cases(quick)
    rows: list[dict[str, Any]] = []
    for name in names:
        case = all_cases[name]
        shift = rnd % len(variants)  # rotate the order: no variant always runs first
        for who in variants[shift:] + variants[:shift]:
            pairs, patched = gputrain_steady(case, who, warmup, case.steps, log_every)
            rows.append({"case": name, "contender": who, "round": rnd, "kind": "steady", "pairs": pairs,
                         "patched": patched})
        if whole and case.epochs:
            order = ["minimal", "default", "seed"]
            for who in order[rnd % 3:] + order[:rnd % 3]:
                t = {"minimal": minimal_whole, "default": gputrain_whole, "seed": seed_whole}[who](case)
                rows.append({"case": name, "contender": who, "round": rnd, "kind": "whole", "s": t})
        if counts:
            for who in ["minimal", *variants]:
                c = count_ops(case, who)
                rows.append({"case": name, "contender": who, "round": rnd, "kind": "ops", "counts": c})
    if counts:
        rows.append({"case": "python", "contender": "-", "round": rnd, "kind": "python", "ns": python_costs()})
    return rows


# ---------------------------------------------------------------- summary and table


def summarize(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    out = []
    keys = list(dict.fromkeys((r.get("tree", ""), r["case"]) for r in rows if r["kind"] != "python"))
    for tree, case in keys:
        mine = [r for r in rows if r.get("tree", "") == tree and r["case"] == case]
        steady = [r for r in mine if r["kind"] == "steady"]
        # Per round: the median over a run's log intervals; over rounds: the median of those.
        floor = [statistics.median(m for _, m in r["pairs"]) for r in steady if r["pairs"]]
        if floor:
            ops = next((r["counts"] for r in mine if r["kind"] == "ops" and r["contender"] == "minimal"), None)
            out.append({"tree": tree, "case": case, "contender": "minimal", "n": len(floor),
                        "us_per_step": statistics.median(floor) * 1e6, "min_us": min(floor) * 1e6,
                        "max_us": max(floor) * 1e6, "overhead_us": None, "ratio": 1.0,
                        **({"ops": ops["ops"], "kernels": ops["kernels"], "log_point_kernels": 0} if ops else {})})
        for who in dict.fromkeys(r["contender"] for r in steady):
            runs = [r["pairs"] for r in steady if r["contender"] == who and r["pairs"]]
            ops = next((r["counts"] for r in mine if r["kind"] == "ops" and r["contender"] == who and r["counts"]), None)
            row: dict[str, Any] = {"tree": tree, "case": case, "contender": who, "n": len(runs)}
            if runs:
                g = [statistics.median(a for a, _ in p) for p in runs]
                m = [statistics.median(b for _, b in p) for p in runs]
                over = [statistics.median(a - b for a, b in p) for p in runs]  # interval by interval
                row.update(us_per_step=statistics.median(g) * 1e6, min_us=min(g) * 1e6, max_us=max(g) * 1e6,
                           minimal_us=statistics.median(m) * 1e6, overhead_us=statistics.median(over) * 1e6,
                           ratio=statistics.median(b / a for a, b in zip(g, m)))
            else:
                row.update(us_per_step=None, note="n/a in this tree")
            if ops:
                row.update(ops=ops["ops"], kernels=ops["kernels"], log_point_kernels=ops["log_point_kernels"])
            out.append(row)
        whole = [r for r in mine if r["kind"] == "whole"]
        if whole:
            m = statistics.median(r["s"] for r in whole if r["contender"] == "minimal")
            g = statistics.median(r["s"] for r in whole if r["contender"] == "default")
            seed = [r["s"] for r in whole if r["contender"] == "seed"]
            sd = statistics.median(seed) if seed else None
            out.append({"tree": tree, "case": case, "contender": "whole-run", "minimal_ms": m * 1e3,
                        "gputrain_ms": g * 1e3, "ratio": m / g, "n": len(seed) or len(whole) // 2,
                        # gputrain's speed over the seed loop's (>= 1.7: the seed loop takes <= 1/1.7)
                        "seed_ms": sd * 1e3 if sd else None, "speedup_over_seed": sd / g if sd else None})
    for r in rows:
        if r["kind"] == "python":
            out.append({"tree": r.get("tree", ""), "case": "python", "contender": "python", "ns": r["ns"]})
    return out


def print_table(summary: list[dict[str, Any]], meta: dict[str, Any]) -> None:
    print(f"# step overhead on {meta['device']}, {meta['threads']} thread(s), {meta['clock']} clock, "
          f"torch {meta['torch']}; medians of "
          f"{meta['rounds']} rounds, each interleaving gputrain's log intervals with minimal-loop chunks; "
          "ratio = minimal time / gputrain time")
    hdr = (f"{'tree':<8} {'case':<11} {'contender':<16} {'us/step':>9} {'spread':>13} {'minimal':>8} "
           f"{'overhead us':>11} {'ratio':>6} {'ops':>5} {'kernels':>7} {'log-pt k':>8}")
    print(hdr)
    print("-" * len(hdr))

    def f(v, fmt, width):
        return format(v, fmt) if v is not None else "-".rjust(width)

    for s in summary:
        if s["contender"] == "python":
            continue
        if s["contender"] == "whole-run":
            seed = (f"; seed loop {s['seed_ms']:.1f} ms: gputrain {s['speedup_over_seed']:.2f}x its speed"
                    if s.get("seed_ms") else "")
            print(f"{s['tree']:<8} {s['case']:<11} {'whole run':<16} gputrain {s['gputrain_ms']:.1f} ms vs minimal "
                  f"{s['minimal_ms']:.1f} ms: ratio {s['ratio']:.2f}{seed} (n={s['n']})")
            continue
        if s.get("us_per_step") is None:
            print(f"{s['tree']:<8} {s['case']:<11} {s['contender']:<16} n/a (nothing to switch off in this tree)")
            continue
        spread = f"{s['min_us']:.0f}-{s['max_us']:.0f}"
        print(f"{s['tree']:<8} {s['case']:<11} {s['contender']:<16} {s['us_per_step']:9.1f} {spread:>13} "
              f"{f(s.get('minimal_us'), '8.1f', 8)} {f(s.get('overhead_us'), '11.1f', 11)} "
              f"{f(s.get('ratio'), '6.2f', 6)} {f(s.get('ops'), '5d', 5)} "
              f"{f(s.get('kernels'), '7d', 7)} {f(s.get('log_point_kernels'), '8d', 8)}")
    py = [s for s in summary if s["contender"] == "python"]
    if py:
        print("\n# the Python on the hot path: ns per call (best of 5), " + ", ".join(s["tree"] or "this tree" for s in py))
        for name in py[0]["ns"]:
            print(f"{name:<48} " + " ".join(f"{s['ns'].get(name, float('nan')):9.0f}" for s in py))


# ---------------------------------------------------------------- main


def _worker_args(args) -> list[str]:
    out = ["--cases", args.cases, "--variants", args.variants, "--warmup", str(args.warmup),
           "--log-every", str(args.log_every), "--threads", str(args.threads), "--clock", args.clock]
    return out + (["--whole"] if args.whole else []) + (["--quick"] if args.quick else [])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--cases", default="iris-mlp,mlp,digits-cnn,gpt-mini,resnet18")
    p.add_argument("--variants", default=",".join(VARIANTS))
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--warmup", type=int, default=50, help="steps before the window (= the first log point)")
    p.add_argument("--log-every", type=int, default=50)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--clock", choices=sorted(CLOCKS), default="cpu",
                   help="cpu: this process's CPU time (default; the cores are shared); wall: elapsed time")
    p.add_argument("--whole", action="store_true", help="also time whole runs (setup included) for cases with epochs")
    p.add_argument("--quick", action="store_true", help="shorter windows (a smoke check)")
    p.add_argument("--no-counts", action="store_true", help="skip counting ops")
    p.add_argument("--tree", action="append", default=[], metavar="NAME=PATH",
                   help="compare source trees (PATH/src on PYTHONPATH), alternating rounds between them")
    p.add_argument("--json", default=None, help="write every row and the summary here ('-': stdout only JSON)")
    p.add_argument("--worker-round", type=int, default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    global clock
    clock = CLOCKS[args.clock]
    names = [c.strip() for c in args.cases.split(",") if c.strip()]
    variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    unknown = sorted(set(variants) - set(VARIANTS))
    if unknown:
        raise SystemExit(f"unknown variants {unknown}: choose from {', '.join(VARIANTS)}")
    if args.warmup % args.log_every:
        raise SystemExit("--warmup must be a multiple of --log-every (the window starts at a log point)")
    import logging

    logging.getLogger("gputrain").setLevel(logging.WARNING)

    if args.worker_round is not None:  # one round in this process, rows as JSON on stdout
        rows = one_round(names, variants, args.worker_round, args.warmup, args.log_every, args.whole, args.quick,
                         counts=args.worker_round == 0 and not args.no_counts)
        print(json.dumps(rows))
        return 0

    rows: list[dict[str, Any]] = []
    trees = [t.split("=", 1) for t in args.tree]
    for rnd in range(args.rounds):
        if not trees:
            rows += one_round(names, variants, rnd, args.warmup, args.log_every, args.whole, args.quick,
                              counts=rnd == 0 and not args.no_counts)
            continue
        order = trees if rnd % 2 == 0 else trees[::-1]
        for tree, path in order:
            env = dict(os.environ, PYTHONPATH=str(Path(path).resolve() / "src"))
            # this tree's benchmark (run from its root), the other tree's gputrain
            cmd = [sys.executable, "-m", "benchmarks.step_overhead", *_worker_args(args), "--worker-round", str(rnd)]
            if args.no_counts:
                cmd.append("--no-counts")
            print(f"round {rnd + 1}/{args.rounds}: {tree}", file=sys.stderr, flush=True)
            done = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, check=False)
            if done.returncode:
                sys.stderr.write(done.stderr)
                raise SystemExit(f"the worker for {tree} failed (exit {done.returncode})")
            rows += [dict(r, tree=tree) for r in json.loads(done.stdout.strip().splitlines()[-1])]
    from gputrain.bench.common import environment

    env_info = environment([torch.device("cpu")])
    meta = {"device": env_info.get("cpu") or "cpu", "threads": args.threads, "clock": args.clock,
            "torch": torch.__version__,
            "rounds": args.rounds, "cases": {n: cases(args.quick)[n].what for n in names},
            "trees": {t: p for t, p in trees}, "warmup": args.warmup, "log_every": args.log_every,
            "lr": LR, "weight_decay": WEIGHT_DECAY}
    summary = summarize(rows)
    result = {"benchmark": "step_overhead", "meta": meta, "environment": env_info, "summary": summary, "rows": rows}
    if args.json == "-":
        print(json.dumps(result, default=str))
        return 0
    print_table(summary, meta)
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1, default=str) + "\n")
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
