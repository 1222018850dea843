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

The contenders are contenders.py's, with the tutorials' recipe (fp32, AdamW's defaults, a
DataLoader in the main process). Every contender is timed the same way: from its model, built, to
the end of its last step (synchronized; `Run.whole_s`), so each tool's setup (data to the device,
DataLoader, Trainer, capture) is inside its time. Precision: the plain loops, Lightning and
Accelerate run fp32 unless named -bf16; gputrain-default and -fast run gputrain's automatic choice
(bf16 on the GPU).

Usage:
  python -m benchmarks.train_speed                # all workloads, CPU (and GPU if present)
  python -m benchmarks.train_speed --quick        # a short run for smoke testing
  python -m benchmarks.train_speed --workloads digits-cnn,mnist1d-cnn --json out.json
  python -m benchmarks.train_speed --iris-epochs 2000  # a shorter iris run (the seed's is 20000)

A GPU run writes benchmarks/results/train_speed_<device>_<date>.json (see shared BENCHMARKS.md).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime as dt
import functools
import importlib.util
import os
import statistics
import sys
import time
from dataclasses import dataclass
from typing import Callable

import torch

from benchmarks.contenders import (Contender, Length, NotAvailable, Recipe, Run, Spec, accelerate_run, gputrain_run,
                                   hand_loop, lightning_module, lightning_run, seed_loop)
from benchmarks.result_files import results_path, write_json
from gputrain import TrainConfig
from gputrain.bench.common import environment
from gputrain.runtime.devices import device_name, synchronizer
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
# contenders.py's, with the tutorials' recipe: fp32 (unless named -bf16), AdamW with its defaults
# and LR, a DataLoader in the main process for the peers. The plain loops and the peers get float
# inputs normalized once up front (as the tutorials do); gputrain gets the workload's own data
# (uint8 images stay uint8 and are normalized per batch on the device).

PLAIN = Recipe(precision="fp32", lr=LR)
BF16 = dataclasses.replace(PLAIN, precision="bf16")


def workload_options(workload: str) -> dict:
    """The workload's options here: synthetic-cifar at 10000 images."""
    return {"n": 10000} if workload == "synthetic-cifar" else {}


def train_only(splits):
    """A workload's data without its test split and augmentation: what gputrain trains on here."""
    return dataclasses.replace(splits, test=None, augment=None)


def workload_spec(workload: str, batch: int | None, name: str | None = None, **options) -> Spec:
    """A built-in workload as the contenders see it (`batch` None: full batch)."""
    wl = get_workload(workload, **(options or workload_options(workload)))
    splits = wl.make_data()
    x, y = normalized_float(splits)
    return Spec(name or workload, batch or x.shape[0], x, y, wl.make_model, wl.loss_fn, fit_data=train_only(splits))


AUTOTUNE: dict[str, dict] = {}  # case name -> {"choice", "trial_s", "rows"}


def autotuned_run(case) -> Contender:
    """gputrain with autotune's choice for this case: the trial on the first call (the untimed
    warm-up round), the chosen switches on every call."""

    def run(spec: Spec, device: torch.device, length: Length) -> Run:
        if case.name not in AUTOTUNE:
            from gputrain.diagnostics.autotune import autotune

            wl = get_workload(case.workload, **workload_options(case.workload))
            cfg = TrainConfig(device=str(device), batch_size=spec.batch, lr=LR, log_every=50)
            t0 = time.perf_counter()
            tuned, report = autotune(wl, cfg, force=True)
            AUTOTUNE[case.name] = {"choice": report["choice"], "trial_s": time.perf_counter() - t0,
                                   "rows": report["rows"]}
        choice = AUTOTUNE[case.name]["choice"] or {}
        return gputrain_run(spec, device, length, PLAIN, **{"log_every": 50, **choice})

    return run


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


def contenders(device: torch.device, case: Case, compiled: bool = False) -> dict[str, tuple[torch.device, Contender]]:
    """name -> (the device it trains on, the contender)."""
    out: dict[str, tuple[torch.device, Contender]] = {}
    cuda = device.type == "cuda"
    out["seed-cpu"] = (torch.device("cpu"), functools.partial(seed_loop, recipe=PLAIN))
    if device.type != "cpu":
        out["seed-gpu"] = (device, functools.partial(seed_loop, recipe=PLAIN))
    out["hand"] = (device, functools.partial(hand_loop, recipe=PLAIN))

    def ours(**config) -> tuple[torch.device, Contender]:
        return device, functools.partial(gputrain_run, recipe=PLAIN, **config)

    out["gputrain-default"] = ours(log_every=50)
    fast = {"log_every": 1000}
    if cuda:
        fast["cuda_graphs"] = True  # forced: a capture failure is logged as a warning
    out["gputrain-fast"] = ours(**fast)
    if cuda:
        out["gputrain-fp32"] = ours(log_every=50, precision="fp32")
    if cuda and compiled and case.workload != "iris-mlp":
        out["gputrain-compile"] = ours(log_every=50, compile=True)
        out["gputrain-autotuned"] = (device, autotuned_run(case))
    # bf16 cannot speed up iris's 4-10-3 MLP; skipping the -bf16 peers there keeps the 20000-epoch
    # case (minutes per Lightning run) inside one device session.
    best_peers = cuda and case.workload != "iris-mlp"
    if cuda:
        try:
            lightning_module()
            out["lightning"] = (device, functools.partial(lightning_run, recipe=PLAIN))
            if best_peers:
                out["lightning-bf16"] = (device, functools.partial(lightning_run, recipe=BF16))
        except NotAvailable:
            pass
        if importlib.util.find_spec("accelerate"):
            out["accelerate"] = (device, functools.partial(accelerate_run, recipe=PLAIN))
            if best_peers:
                out["accelerate-bf16"] = (device, functools.partial(accelerate_run, recipe=BF16))
    return out


def interleaved(names: list[str], run: Callable[[str], float], repeats: int,
                fits: Callable[[str, list[float]], bool] | None = None) -> tuple[dict[str, list[float]], int]:
    """Every contender once per round (A B C A B C ...): name -> the seconds of each of its runs, and
    how many runs `fits(name, its times so far)` held back (a budget)."""
    times: dict[str, list[float]] = {k: [] for k in names}
    skipped = 0
    for _ in range(repeats):
        for name in names:
            if fits is not None and not fits(name, times[name]):
                skipped += 1
                continue
            times[name].append(run(name))
    return times, skipped


def whole_runs(who: dict[str, tuple[torch.device, Contender]], spec: Spec, case: Case, device: torch.device,
               repeats: int, fits: Callable[[str, list[float]], bool] | None = None
               ) -> tuple[dict[str, list[float]], int]:
    """Each contender's whole runs of `case`, interleaved, after a warm-up round (allocator, cuDNN's
    autotuning, lazy init: one short run each, not timed)."""
    warm = Length.of_epochs(spec, 1 if case.batch_size else min(case.epochs, 50))
    length = Length.of_epochs(spec, case.epochs)
    for target, fn in who.values():
        _call(target, fn, spec, warm, device)
    return interleaved(list(who), lambda name: _call(*who[name], spec, length, device), repeats, fits)


def run_case(case: Case, device: torch.device, repeats: int, only: set[str] | None, compiled: bool = False) -> dict:
    spec = workload_spec(case.workload, case.batch_size, case.name)
    n, batch, epochs = spec.inputs.shape[0], spec.batch, case.epochs
    who = {k: v for k, v in contenders(device, case, compiled).items() if only is None or k in only}
    times, _ = whole_runs(who, spec, case, device, repeats)
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


def _call(target: torch.device, fn: Contender, spec: Spec, length: Length, device: torch.device) -> float:
    """Seconds for one whole run of a contender, its setup included: from its model, built (seed 0),
    to its last step, synchronized (the device synchronized before, too)."""
    synchronizer(device)()
    return fn(spec, target, length).whole_s


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
    env = environment([torch.device("cpu")] + ([device] if device.type != "cpu" else []))
    # the keys this benchmark's results have had since their first file, beside the common ones
    env.update(threads=torch.get_num_threads(), device=str(device),
               **({"device_name": device_name(device)} if device.type == "cuda" else {}))
    out = {"benchmark": "train_speed", "environment": env,
           "config": {"lr": LR, "optimizer": "AdamW", "repeats": args.repeats, "quick": args.quick,
                      "iris_epochs": args.iris_epochs, "precision": "per contender, see each row",
                      "timing": "whole run including each tool's setup, synchronized, median of repeats"},
           "cases": results, "bars": bars(results, device)}
    _print_bars(out["bars"])
    path = args.json
    if path is None and device.type == "cuda":
        path = results_path("train_speed", device, dt.date.today().isoformat())
    if path:
        print(f"wrote {write_json(path, out)}")
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
