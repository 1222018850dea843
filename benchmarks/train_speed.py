"""Training speed: the seed tutorials' loop vs a minimal hand loop vs gputrain (vs Lightning, Accelerate).

Same model, batch size, optimizer (AdamW, same lr), precision and number of samples on every side;
run in one process, interleaved (A B C A B C ...), median of --repeats, ratios against the seed's
loop. Contenders:

  seed-cpu / seed-gpu   the tutorials' loop: DataLoader(TensorDataset, shuffle=True), .to(device)
                        per batch, loss.item() every step
  hand                  a minimal loop over tensors already on the device (randperm + slices)
  gputrain-default      gputrain.fit with its defaults
  gputrain-fast         gputrain.fit with its fastest switches (CUDA graphs; on the GPU also
                        channels_last etc. as the defaults decide)
  lightning, accelerate on a GPU machine where they are installed, with their documented defaults

Usage:
  python benchmarks/train_speed.py                 # all workloads, CPU (and GPU if present)
  python benchmarks/train_speed.py --quick         # a short run for smoke testing
  python benchmarks/train_speed.py --workloads digits-cnn,mnist1d-cnn --json out.json

A GPU run writes benchmarks/results/train_speed_<device>_<date>.json (see shared BENCHMARKS.md).
"""

from __future__ import annotations

import argparse
import datetime as dt
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
from gputrain.devices import cpu_model_name, synchronizer
from gputrain.workloads import get_workload

LR = 1e-3


@dataclass
class Case:
    name: str  # e.g. "digits-cnn@64"
    workload: str
    batch_size: int | None  # None: full batch
    epochs: int


def cases(quick: bool) -> list[Case]:
    if quick:
        return [Case("iris-mlp", "iris-mlp", None, 200), Case("digits-cnn@64", "digits-cnn", 64, 1),
                Case("mnist1d-cnn@64", "mnist1d-cnn", 64, 1)]
    return [
        Case("iris-mlp", "iris-mlp", None, 20000),
        Case("digits-cnn@64", "digits-cnn", 64, 5),
        Case("mnist1d-cnn@64", "mnist1d-cnn", 64, 5),
        Case("synthetic-cifar@64", "synthetic-cifar", 64, 1),
        Case("synthetic-cifar@512", "synthetic-cifar", 512, 1),
    ]


# ---------------------------------------------------------------- contenders
# Each returns seconds for `epochs` epochs over (x, y); inputs are float and already normalized for
# the plain loops (the tutorials normalize up front); gputrain gets the workload's own data.


def seed_loop(model, x, y, loss_fn, batch, epochs, device) -> float:
    from torch.utils.data import DataLoader, TensorDataset

    loader = DataLoader(TensorDataset(x, y), batch_size=batch, shuffle=True)
    model.to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    sync = synchronizer(device)
    sync()
    t0 = time.perf_counter()
    for _ in range(epochs):
        for xb, yb in loader:
            xb, yb = xb.to(device), yb.to(device)
            opt.zero_grad()
            loss = loss_fn(model(xb), yb)
            loss.backward()
            opt.step()
            _ = loss.item()  # the tutorials record the loss every step
    sync()
    return time.perf_counter() - t0


def hand_loop(model, x, y, loss_fn, batch, epochs, device) -> float:
    model.to(device)
    x, y = x.to(device), y.to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    n = x.shape[0]
    sync = synchronizer(device)
    sync()
    t0 = time.perf_counter()
    for _ in range(epochs):
        perm = torch.randperm(n, device=device)
        for lo in range(0, n, batch):
            idx = perm[lo:lo + batch]
            loss = loss_fn(model(x[idx]), y[idx])
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
    sync()
    return time.perf_counter() - t0


def gputrain_run(extra: dict) -> Callable:
    def run(model, splits, loss_fn, batch, epochs, device) -> float:
        cfg = TrainConfig(device=str(device), batch_size=batch, epochs=epochs, lr=LR, **extra)
        h = fit(model, splits.train, loss_fn=loss_fn, config=cfg) if splits.mean is None else \
            fit(model, _no_test(splits), loss_fn=loss_fn, config=cfg)
        return h.summary["time_s"]
    return run


def _no_test(splits):
    import dataclasses

    return dataclasses.replace(splits, test=None, augment=None)


def lightning_run(model, x, y, loss_fn, batch, epochs, device) -> float:
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
                         logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False)
    sync = synchronizer(device)
    sync()
    t0 = time.perf_counter()
    trainer.fit(Module(), loader)
    sync()
    return time.perf_counter() - t0


def accelerate_run(model, x, y, loss_fn, batch, epochs, device) -> float:
    from accelerate import Accelerator
    from torch.utils.data import DataLoader, TensorDataset

    acc = Accelerator(cpu=device.type == "cpu")
    loader = DataLoader(TensorDataset(x, y), batch_size=batch, shuffle=True)
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    model, opt, loader = acc.prepare(model, opt, loader)
    sync = synchronizer(device)
    sync()
    t0 = time.perf_counter()
    for _ in range(epochs):
        for xb, yb in loader:
            opt.zero_grad()
            loss = loss_fn(model(xb), yb)
            acc.backward(loss)
            opt.step()
    sync()
    return time.perf_counter() - t0


# ---------------------------------------------------------------- driver


def normalized_float(splits) -> tuple[torch.Tensor, torch.Tensor]:
    """The training inputs as the tutorials hold them: float32, normalized once up front."""
    x, y = splits.train
    if splits.mean is not None:
        shape = (1, -1) + (1,) * (x.dim() - 2)
        x = (x.float() - torch.tensor(splits.mean).view(shape)) / torch.tensor(splits.std).view(shape)
    return x.float().contiguous(), y


def contenders(device: torch.device) -> dict[str, tuple[str, Callable]]:
    """name -> (kind, fn); kind says which data the fn takes ("plain" float tensors or "splits")."""
    out: dict[str, tuple[str, Callable]] = {}
    out["seed-cpu"] = ("plain-cpu", seed_loop)
    if device.type != "cpu":
        out["seed-gpu"] = ("plain", seed_loop)
    out["hand"] = ("plain", hand_loop)
    out["gputrain-default"] = ("splits", gputrain_run({"log_every": 50}))
    fast = {"log_every": 1000}
    if device.type == "cuda":
        fast["cuda_graphs"] = True  # forced: a capture failure is logged as a warning
    out["gputrain-fast"] = ("splits", gputrain_run(fast))
    if device.type == "cuda":
        try:
            import lightning.pytorch  # noqa: F401

            out["lightning"] = ("plain", lightning_run)
        except Exception:
            pass
        try:
            import accelerate  # noqa: F401

            out["accelerate"] = ("plain", accelerate_run)
        except Exception:
            pass
    return out


def run_case(case: Case, device: torch.device, repeats: int, only: set[str] | None) -> dict:
    wl = get_workload(case.workload, **({"n": 10000} if case.workload == "synthetic-cifar" else {}))
    splits = wl.make_data()
    x, y = normalized_float(splits)
    n = x.shape[0]
    batch = case.batch_size or n
    epochs = case.epochs
    who = {k: v for k, v in contenders(device).items() if only is None or k in only}
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
        rows[name] = {"median_s": med, "min_s": min(ts), "max_s": max(ts), "n": len(ts),
                      "samples_per_s": samples / med}
    base = rows.get("seed-gpu", rows.get("seed-cpu"))
    for name, r in rows.items():
        r["x_vs_seed_same_device"] = r["samples_per_s"] / base["samples_per_s"] if base else None
        r["x_vs_seed_cpu"] = r["samples_per_s"] / rows["seed-cpu"]["samples_per_s"] if "seed-cpu" in rows else None
        r["x_vs_hand"] = r["samples_per_s"] / rows["hand"]["samples_per_s"] if "hand" in rows else None
    return {"case": case.name, "workload": case.workload, "batch_size": batch, "epochs": epochs,
            "samples": samples, "results": rows}


def _call(fn, kind, wl, splits, x, y, batch, epochs, device) -> float:
    torch.manual_seed(0)
    model = wl.make_model()
    if kind == "plain-cpu":
        return fn(model, x, y, wl.loss_fn, batch, epochs, torch.device("cpu"))
    if kind == "plain":
        return fn(model, x, y, wl.loss_fn, batch, epochs, device)
    return fn(model, splits, wl.loss_fn, batch, epochs, device)


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
    ap.add_argument("--json", default=None, help="write results here (a GPU run defaults to benchmarks/results/)")
    args = ap.parse_args(argv)
    import logging

    logging.getLogger("gputrain").setLevel(logging.WARNING)
    from gputrain.devices import pick_device

    device = pick_device(args.device)
    chosen = cases(args.quick)
    if args.workloads:
        want = set(args.workloads.split(","))
        chosen = [c for c in chosen if c.name in want or c.workload in want]
    only = set(args.only.split(",")) if args.only else None
    results = []
    for case in chosen:
        r = run_case(case, device, args.repeats, only)
        results.append(r)
        _print_case(r)
    out = {"benchmark": "train_speed", "environment": environment(device),
           "config": {"lr": LR, "optimizer": "AdamW", "repeats": args.repeats, "quick": args.quick,
                      "precision": "each tool's default (gputrain: auto)"},
           "cases": results}
    path = args.json
    if path is None and device.type == "cuda":
        name = torch.cuda.get_device_name(device).replace(" ", "-")
        path = f"benchmarks/results/train_speed_{name}_{dt.date.today().isoformat()}.json"
    if path:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(json.dumps(out, indent=2))
        print(f"wrote {path}")
    return 0


def _print_case(r: dict) -> None:
    print(f"\n{r['case']}: batch {r['batch_size']}, {r['epochs']} epochs, {r['samples']} samples")
    print(f"  {'contender':18s} {'median s':>9s} {'spread s':>9s} {'samples/s':>11s} {'x seed':>7s} {'x seed-cpu':>10s} {'x hand':>7s}")
    for name, row in r["results"].items():
        spread = row["max_s"] - row["min_s"]
        fmt = lambda v: f"{v:.2f}" if v is not None else "-"  # noqa: E731
        print(f"  {name:18s} {row['median_s']:9.3f} {spread:9.3f} {row['samples_per_s']:11.0f} "
              f"{fmt(row['x_vs_seed_same_device']):>7s} {fmt(row['x_vs_seed_cpu']):>10s} {fmt(row['x_vs_hand']):>7s}")


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
