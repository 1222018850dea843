"""Training speed: the seed tutorials' loop vs a minimal hand loop vs gputrain (vs Lightning, Accelerate).

Same model, batch size, optimizer (AdamW, same lr), precision and number of samples on every side;
run in one process, interleaved (A B C A B C ...), median of --repeats, ratios against the seed's
loop. Contenders:

  seed-cpu / seed-gpu   the tutorials' loop: DataLoader(TensorDataset, shuffle=True), .to(device)
                        per batch, loss.item() every step
  hand                  a minimal loop over tensors already on the device (randperm + slices)
  gputrain-default      gputrain.fit with its defaults
  gputrain-fast         gputrain.fit with its fastest switches (CUDA graphs forced, a loss read
                        every 1000 steps instead of 50)
  gputrain-fp32         (GPU) gputrain defaults at fp32, the precision of the plain loops
  gputrain-compile      (GPU, --compile-contenders, not iris) gputrain defaults with compile=True
                        (compile time inside)
  gputrain-autotuned    (GPU, --compile-contenders, not iris) gputrain with the switches
                        `--autotune` chose; the trial
                        runs once, in the untimed warm-up round, as a later run finds it cached
                        (its seconds and choice are recorded apart, under "autotune")
  lightning, accelerate (GPU, where installed) with their documented defaults (fp32)
  lightning-bf16,       (GPU) their best documented setting: bf16 mixed precision; not on
  accelerate-bf16       iris, where a 4-10-3 MLP has nothing for bf16 to speed up

Every contender is timed the same way: from the call that gets the model and the data to the end
of its last step (synchronized), so each tool's setup (data to the device, DataLoader, Trainer,
capture) is inside its time. Precision: the plain loops, Lightning and Accelerate run fp32 unless
named -bf16; gputrain-default and -fast run gputrain's automatic choice (bf16 on the GPU).

Usage:
  python benchmarks/train_speed.py                 # all workloads, CPU (and GPU if present)
  python benchmarks/train_speed.py --quick         # a short run for smoke testing
  python benchmarks/train_speed.py --workloads digits-cnn,mnist1d-cnn --json out.json
  python benchmarks/train_speed.py --iris-epochs 2000  # a shorter iris run (the seed's is 20000)

A GPU run writes benchmarks/results/train_speed_<device>_<date>.json (see shared BENCHMARKS.md).
"""

from __future__ import annotations

import argparse
import datetime as dt
import functools
import json
import os
import platform
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from gputrain import TrainConfig, fit
from gputrain.runtime.devices import cpu_model_name, synchronizer
from gputrain.workloads import get_workload

LR = 1e-3


@dataclass
class Case:
    name: str  # e.g. "digits-cnn@64"
    workload: str
    batch_size: int | None  # None: full batch
    epochs: int


def cases(quick: bool, iris_epochs: int = 20000) -> list[Case]:
    if quick:
        return [Case("iris-mlp", "iris-mlp", None, 200), Case("digits-cnn@64", "digits-cnn", 64, 1),
                Case("mnist1d-cnn@64", "mnist1d-cnn", 64, 1)]
    return [
        Case("iris-mlp", "iris-mlp", None, iris_epochs),
        Case("digits-cnn@64", "digits-cnn", 64, 5),
        Case("mnist1d-cnn@64", "mnist1d-cnn", 64, 5),
        Case("synthetic-cifar@64", "synthetic-cifar", 64, 1),
        Case("synthetic-cifar@512", "synthetic-cifar", 512, 1),
    ]


# ---------------------------------------------------------------- contenders
# Each trains `epochs` epochs over (x, y) and returns; `_call` times the whole call. The plain loops
# get float inputs normalized once up front (as the tutorials do); gputrain gets the workload's own
# data (uint8 images stay uint8 and are normalized per batch on the device).


def seed_loop(model, x, y, loss_fn, batch, epochs, device) -> None:
    from torch.utils.data import DataLoader, TensorDataset

    loader = DataLoader(TensorDataset(x, y), batch_size=batch, shuffle=True)
    model.to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    for _ in range(epochs):
        for xb, yb in loader:
            xb, yb = xb.to(device), yb.to(device)
            opt.zero_grad()
            loss = loss_fn(model(xb), yb)
            loss.backward()
            opt.step()
            _ = loss.item()  # the tutorials record the loss every step


def hand_loop(model, x, y, loss_fn, batch, epochs, device) -> None:
    model.to(device)
    x, y = x.to(device), y.to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    n = x.shape[0]
    for _ in range(epochs):
        perm = torch.randperm(n, device=device)
        for lo in range(0, n, batch):
            idx = perm[lo:lo + batch]
            loss = loss_fn(model(x[idx]), y[idx])
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()


def gputrain_run(extra: dict) -> Callable:
    def run(model, splits, loss_fn, batch, epochs, device) -> None:
        cfg = TrainConfig(device=str(device), batch_size=batch, epochs=epochs, lr=LR, **extra)
        fit(model, _no_test(splits), loss_fn=loss_fn, config=cfg)
    return run


AUTOTUNE: dict[str, dict] = {}  # case name -> {"choice", "trial_s", "rows"}


def autotuned_run(case) -> Callable:
    """gputrain with autotune's choice for this case: the trial on the first call (the untimed
    warm-up round), the chosen switches on every call."""

    def run(model, splits, loss_fn, batch, epochs, device) -> None:
        if case.name not in AUTOTUNE:
            from gputrain.diagnostics.autotune import autotune
            from gputrain.workloads import get_workload

            wl = get_workload(case.workload, **({"n": 10000} if case.workload == "synthetic-cifar" else {}))
            cfg = TrainConfig(device=str(device), batch_size=batch, lr=LR, log_every=50)
            t0 = time.perf_counter()
            tuned, report = autotune(wl, cfg, force=True)
            AUTOTUNE[case.name] = {"choice": report["choice"], "trial_s": time.perf_counter() - t0,
                                   "rows": report["rows"]}
        choice = AUTOTUNE[case.name]["choice"] or {}
        gputrain_run({"log_every": 50, **choice})(model, splits, loss_fn, batch, epochs, device)

    return run


def _no_test(splits):
    import dataclasses

    return dataclasses.replace(splits, test=None, augment=None)


def lightning_run(model, x, y, loss_fn, batch, epochs, device, precision: str = "32-true") -> None:
    import lightning.pytorch as pl
    from torch.utils.data import DataLoader, TensorDataset

    class Module(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.model = model

        def training_step(self, b, i):
            xb, yb = b
            return loss_fn(self.model(xb), yb)

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=LR)

    loader = DataLoader(TensorDataset(x, y), batch_size=batch, shuffle=True)
    trainer = pl.Trainer(max_epochs=epochs, accelerator="gpu" if device.type == "cuda" else "cpu", devices=1,
                         precision=precision, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False)
    trainer.fit(Module(), loader)


def accelerate_run(model, x, y, loss_fn, batch, epochs, device, mixed_precision: str = "no") -> None:
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState, GradientState
    from torch.utils.data import DataLoader, TensorDataset

    # Accelerate keeps one process-wide state and refuses another precision in the same process;
    # reset it (as its own test suite does) so fp32 and bf16 runs can alternate.
    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()
    acc = Accelerator(cpu=device.type == "cpu", mixed_precision=mixed_precision)
    loader = DataLoader(TensorDataset(x, y), batch_size=batch, shuffle=True)
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    model, opt, loader = acc.prepare(model, opt, loader)
    for _ in range(epochs):
        for xb, yb in loader:
            opt.zero_grad()
            loss = loss_fn(model(xb), yb)
            acc.backward(loss)
            opt.step()


# ---------------------------------------------------------------- driver


def normalized_float(splits) -> tuple[torch.Tensor, torch.Tensor]:
    """The training inputs as the tutorials hold them: float32, normalized once up front."""
    x, y = splits.train
    if splits.mean is not None:
        shape = (1, -1) + (1,) * (x.dim() - 2)
        x = (x.float() - torch.tensor(splits.mean).view(shape)) / torch.tensor(splits.std).view(shape)
    return x.float().contiguous(), y


# contender -> the precision it trains in (recorded in the results)
PRECISION = {"seed-cpu": "fp32", "seed-gpu": "fp32", "hand": "fp32", "gputrain-default": "auto",
             "gputrain-compile": "auto", "gputrain-autotuned": "autotune's choice",
             "gputrain-fast": "auto", "gputrain-fp32": "fp32", "lightning": "fp32 (32-true)",
             "lightning-bf16": "bf16-mixed", "accelerate": "fp32 (no)", "accelerate-bf16": "bf16"}


def contenders(device: torch.device, case: Case, compiled: bool = False) -> dict[str, tuple[str, Callable]]:
    """name -> (kind, fn); kind says which data the fn takes ("plain" float tensors or "splits")."""
    out: dict[str, tuple[str, Callable]] = {}
    cuda = device.type == "cuda"
    out["seed-cpu"] = ("plain-cpu", seed_loop)
    if device.type != "cpu":
        out["seed-gpu"] = ("plain", seed_loop)
    out["hand"] = ("plain", hand_loop)
    out["gputrain-default"] = ("splits", gputrain_run({"log_every": 50}))
    fast = {"log_every": 1000}
    if cuda:
        fast["cuda_graphs"] = True  # forced: a capture failure is logged as a warning
    out["gputrain-fast"] = ("splits", gputrain_run(fast))
    if cuda:
        out["gputrain-fp32"] = ("splits", gputrain_run({"log_every": 50, "precision": "fp32"}))
    if cuda and compiled and case.workload != "iris-mlp":
        out["gputrain-compile"] = ("splits", gputrain_run({"log_every": 50, "compile": True}))
        out["gputrain-autotuned"] = ("splits", autotuned_run(case))
    # bf16 cannot speed up iris's 4-10-3 MLP; skipping the -bf16 peers there keeps the 20000-epoch
    # case (minutes per Lightning run) inside one device session.
    best_peers = cuda and case.workload != "iris-mlp"
    if cuda:
        try:
            import lightning.pytorch  # noqa: F401

            out["lightning"] = ("plain", lightning_run)
            if best_peers:
                out["lightning-bf16"] = ("plain", functools.partial(lightning_run, precision="bf16-mixed"))
        except Exception:
            pass
        try:
            import accelerate  # noqa: F401

            out["accelerate"] = ("plain", accelerate_run)
            if best_peers:
                out["accelerate-bf16"] = ("plain", functools.partial(accelerate_run, mixed_precision="bf16"))
        except Exception:
            pass
    return out


def run_case(case: Case, device: torch.device, repeats: int, only: set[str] | None, compiled: bool = False) -> dict:
    wl = get_workload(case.workload, **({"n": 10000} if case.workload == "synthetic-cifar" else {}))
    splits = wl.make_data()
    x, y = normalized_float(splits)
    n = x.shape[0]
    batch = case.batch_size or n
    epochs = case.epochs
    who = {k: v for k, v in contenders(device, case, compiled).items() if only is None or k in only}
    times: dict[str, list[float]] = {k: [] for k in who}
    # Warm-up round (allocator, cuDNN autotuning, lazy init): one short run each, not timed.
    for name, (kind, fn) in who.items():
        _call(fn, kind, wl, splits, x, y, batch, 1 if case.batch_size else min(epochs, 50), device)
    for _ in range(repeats):  # interleaved: A B C A B C ...
        for name, (kind, fn) in who.items():
            times[name].append(_call(fn, kind, wl, splits, x, y, batch, epochs, device))
    samples = n * epochs
    rows = {}
    for name, ts in times.items():
        med = statistics.median(ts)
        rows[name] = {"precision": PRECISION.get(name), "median_s": med, "min_s": min(ts), "max_s": max(ts),
                      "n": len(ts), "times_s": ts, "samples_per_s": samples / med}
    base = rows.get("seed-gpu", rows.get("seed-cpu"))
    for name, r in rows.items():
        r["x_vs_seed_same_device"] = r["samples_per_s"] / base["samples_per_s"] if base else None
        r["x_vs_seed_cpu"] = r["samples_per_s"] / rows["seed-cpu"]["samples_per_s"] if "seed-cpu" in rows else None
        r["x_vs_hand"] = r["samples_per_s"] / rows["hand"]["samples_per_s"] if "hand" in rows else None
        r["x_vs"] = {other: r["samples_per_s"] / o["samples_per_s"] for other, o in rows.items() if other != name}
    return {"case": case.name, "workload": case.workload, "batch_size": batch, "epochs": epochs,
            "samples": samples, "results": rows, "autotune": AUTOTUNE.get(case.name)}


def _call(fn, kind, wl, splits, x, y, batch, epochs, device) -> float:
    """Seconds for one whole run of a contender, its setup included (synchronized at both ends)."""
    torch.manual_seed(0)
    model = wl.make_model()
    target = torch.device("cpu") if kind == "plain-cpu" else device
    data = (x, y) if kind.startswith("plain") else (splits,)
    sync = synchronizer(device)
    sync()
    t0 = time.perf_counter()
    fn(model, *data, wl.loss_fn, batch, epochs, target)
    sync()
    return time.perf_counter() - t0


def environment(device: torch.device) -> dict:
    env = {"date": dt.date.today().isoformat(), "torch": torch.__version__, "cuda": torch.version.cuda,
           "python": platform.python_version(), "cpu": cpu_model_name(), "threads": torch.get_num_threads(),
           "device": str(device), "command": " ".join([Path(sys.argv[0]).name] + sys.argv[1:])}
    if device.type == "cuda":
        env["device_name"] = torch.cuda.get_device_name(device)
        try:
            import pynvml

            pynvml.nvmlInit()
            env["driver"] = pynvml.nvmlSystemGetDriverVersion()
        except Exception:
            env["driver"] = None
    return env


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="auto")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--workloads", default=None, help="comma-separated case or workload names")
    ap.add_argument("--only", default=None, help="comma-separated contenders")
    ap.add_argument("--iris-epochs", type=int, default=20000, help="iris-mlp run length (the seed's: 20000)")
    ap.add_argument("--json", default=None, help="write results here (a GPU run defaults to benchmarks/results/)")
    ap.add_argument("--compile-contenders", action="store_true",
                    help="(GPU) add gputrain-compile and gputrain-autotuned (minutes of compiling and trials)")
    args = ap.parse_args(argv)
    import logging

    logging.getLogger("gputrain").setLevel(logging.WARNING)
    from gputrain.runtime.devices import pick_device

    device = pick_device(args.device)
    chosen = cases(args.quick, args.iris_epochs)
    if args.workloads:
        want = set(args.workloads.split(","))
        chosen = [c for c in chosen if c.name in want or c.workload in want]
    only = set(args.only.split(",")) if args.only else None
    results = []
    for case in chosen:
        r = run_case(case, device, args.repeats, only, args.compile_contenders)
        results.append(r)
        _print_case(r)
    out = {"benchmark": "train_speed", "environment": environment(device),
           "config": {"lr": LR, "optimizer": "AdamW", "repeats": args.repeats, "quick": args.quick,
                      "iris_epochs": args.iris_epochs, "precision": "per contender, see each row",
                      "timing": "whole run including each tool's setup, synchronized, median of repeats"},
           "cases": results, "bars": bars(results, device)}
    _print_bars(out["bars"])
    path = args.json
    if path is None and device.type == "cuda":
        from gputrain.bench.common import device_slug

        path = f"benchmarks/results/train_speed_{device_slug(device)}_{dt.date.today().isoformat()}.json"
    if path:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(json.dumps(out, indent=2))
        print(f"wrote {path}")
    return 0


# The bars: (case, contender, against, at least). gputrain-default is what a user gets.
CPU_BARS = [("digits-cnn@64", "gputrain-default", "seed-cpu", 1.2), ("mnist1d-cnn@64", "gputrain-default", "seed-cpu", 1.2),
            ("digits-cnn@64", "gputrain-default", "hand", 0.95), ("mnist1d-cnn@64", "gputrain-default", "hand", 0.95)]
GPU_BARS = [("iris-mlp", "gputrain-default", "seed-cpu", 2.0), ("iris-mlp", "gputrain-default", "seed-gpu", 5.0),
            ("synthetic-cifar@64", "gputrain-default", "seed-gpu", 5.0),
            ("synthetic-cifar@64", "gputrain-default", "lightning", 1.5),
            ("synthetic-cifar@64", "gputrain-default", "accelerate", 1.5),
            # Issue 14: seed 000's CNN at batch 64, >= 10x the seed's GPU loop with compile or autotune's choice.
            ("synthetic-cifar@64", "gputrain-compile", "seed-gpu", 10.0),
            ("synthetic-cifar@64", "gputrain-autotuned", "seed-gpu", 10.0)]
# (case, contender, at most seconds for the whole run): issue 14's iris bar, 20000 full-batch epochs.
GPU_SECONDS_BARS = [("iris-mlp", "gputrain-default", 1.0)]


def bars(results: list[dict], device: torch.device) -> list[dict]:
    """Each bar with the measured ratio (samples/s over samples/s) and whether it is met."""
    by_case = {r["case"]: r["results"] for r in results}
    out = []
    for case, who, against, need in (GPU_BARS if device.type == "cuda" else CPU_BARS):
        rows = by_case.get(case, {})
        if who in rows and against in rows:
            ratio = rows[who]["x_vs"][against]
            out.append({"case": case, "contender": who, "against": against, "bar": need,
                        "ratio": ratio, "met": ratio >= need})
    for case, who, most in (GPU_SECONDS_BARS if device.type == "cuda" else []):
        row = by_case.get(case, {}).get(who)
        if row is not None:
            out.append({"case": case, "contender": who, "bar_s": most, "median_s": row["median_s"],
                        "met": row["median_s"] <= most})
    return out


def _print_bars(rows: list[dict]) -> None:
    if rows:
        print("\nbars (samples/s ratio)")
    for b in rows:
        if "bar_s" in b:
            print(f"  {b['case']:20s} {b['contender']} whole run {b['median_s']:.3f} s  "
                  f"(bar <= {b['bar_s']} s: {'met' if b['met'] else 'NOT met'})")
            continue
        print(f"  {b['case']:20s} {b['contender']} vs {b['against']:12s} {b['ratio']:6.2f}x  "
              f"(bar {b['bar']}x: {'met' if b['met'] else 'NOT met'})")


def _print_case(r: dict) -> None:
    print(f"\n{r['case']}: batch {r['batch_size']}, {r['epochs']} epochs, {r['samples']} samples")
    if r.get("autotune"):
        print(f"  autotune (untimed warm-up round): {r['autotune']['trial_s']:.1f} s of trials, "
              f"chose {r['autotune']['choice']}")
    peers = [p for p in ("lightning", "accelerate") if p in r["results"]]
    head = "".join(f" {'x ' + p[:5]:>8s}" for p in peers)
    print(f"  {'contender':18s} {'precision':>14s} {'median s':>9s} {'spread s':>9s} {'samples/s':>11s} "
          f"{'x seed':>7s} {'x seed-cpu':>10s} {'x hand':>7s}{head}")
    fmt = lambda v: f"{v:.2f}" if v is not None else "-"  # noqa: E731
    for name, row in r["results"].items():
        spread = row["max_s"] - row["min_s"]
        extra = "".join(f" {fmt(row['x_vs'].get(p)):>8s}" for p in peers)
        print(f"  {name:18s} {row['precision'] or '-':>14s} {row['median_s']:9.3f} {spread:9.3f} "
              f"{row['samples_per_s']:11.0f} {fmt(row['x_vs_seed_same_device']):>7s} "
              f"{fmt(row['x_vs_seed_cpu']):>10s} {fmt(row['x_vs_hand']):>7s}{extra}")


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
