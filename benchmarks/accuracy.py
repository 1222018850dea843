"""Accuracy of the built-in workloads' default runs: does each reach its bar, and how fast?

Trains each workload with its own defaults (Workload.defaults; full batch where the workload says
so) and prints test accuracy (MSE for regression), wall time (data + model + training + final
evaluation) and pass/fail against the bars below, which must hold on a 2-core CPU in < 2 minutes.

Two training loops:
  trainer    gputrain's own trainer (`gputrain.train.fit_workload`, what `gputrain fit` runs)
  reference  a small loop here with the trainer's semantics: AdamW(lr, weight_decay), the schedule
             from gputrain.train.optim.build (linear warm-up; cosine to 0; onecycle), a seeded reshuffle each
             epoch, the last partial batch kept, uint8 images normalized per batch
--loop auto (the default) takes the trainer when it imports and the reference loop otherwise.

Measured with the trainer, seeds 0/1/2, torch 2.13 CPU, 2 threads (AMD EPYC), unloaded machine:
  iris-mlp      1.000 / 1.000 / 1.000   0.2-2 s   (epochs=20000, the seed's length: 0.967, 10 s)
  digits-cnn    0.986 / 0.992 / 0.994   3 s
  mnist1d-cnn   0.942 / 0.945 / 0.949   7-9 s     (paper 94%)
  mnist1d-mlp   0.654 / 0.645 / 0.662   5 s       (paper 68%)
  mnist1d-gru   0.904 / 0.923 / 0.871   ~22 s     (paper 91%)
  mlp-binary    0.992 / 0.986 / 0.987   0.5 s;  linear-regression test MSE 0.0096 (noise floor 0.01)

Usage:
  python benchmarks/accuracy.py                          # the four workloads with bars + the rest that need no files
  python benchmarks/accuracy.py mnist1d-cnn --seeds 0 1 2
  python benchmarks/accuracy.py digits-cnn --set epochs=10 --set lr=3e-3   # try other settings
  python benchmarks/accuracy.py --json benchmarks/results/accuracy_cpu_<date>.json
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import math
import platform
import sys
import time
from typing import Any

import torch

from gputrain.config import TrainConfig
from gputrain.errors import DataError
from gputrain.workloads import get_workload

# Minimum test accuracy of the default run (None: no bar; reported only). Time bar: TIME_LIMIT_S.
BARS: dict[str, float | None] = {
    "iris-mlp": 0.93,
    "digits-cnn": 0.97,
    "mnist1d-cnn": 0.90,  # paper: 94%
    "mnist1d-mlp": 0.60,  # paper: 68%
    "mnist1d-gru": None,  # paper: 91%
    "linear-regression": None,  # reports test MSE (noise floor 0.01)
    "mlp-binary": None,
    "cifar10-cnn": None,  # needs the CIFAR-10 files
    "mnist-cnn": None,  # needs the MNIST files
}
DEFAULT_RUN = ["iris-mlp", "digits-cnn", "mnist1d-cnn", "mnist1d-mlp", "mnist1d-gru", "linear-regression",
               "mlp-binary", "cifar10-cnn", "mnist-cnn"]
TIME_LIMIT_S = 120.0


# ---------------------------------------------------------------- the two loops


def trainer_loop():
    """gputrain's trainer, or None (with the reason) when it cannot be imported yet."""
    try:
        from gputrain.train import fit_workload
    except Exception as exc:  # the trainer is optional for this script
        return None, f"{type(exc).__name__}: {exc}"
    return fit_workload, ""


def run_with_trainer(fit_workload, workload, config: TrainConfig) -> dict[str, Any]:
    history, _ = fit_workload(workload, config, full_batch=workload.full_batch)
    s = history.summary
    return {"accuracy": s.get("final_eval_accuracy"), "eval_loss": s.get("final_eval_loss"),
            "steps": s.get("steps"), "train_time_s": s.get("time_s")}


def run_reference(workload, config: TrainConfig) -> dict[str, Any]:
    """The trainer's semantics in a few lines, on the CPU in fp32."""
    from gputrain.data import BatchTransform, epoch_seed
    from gputrain.train.optim.build import make_scheduler

    torch.manual_seed(config.seed)
    data = workload.make_data()
    model = workload.make_model()
    x, y = data.train
    n = x.shape[0]
    B = n if workload.full_batch else config.batch_size
    transform = BatchTransform(data.mean, data.std, data.augment)
    per_epoch = math.ceil(n / B)  # the last partial batch is kept
    total = config.steps or (config.epochs or 1) * per_epoch
    opt = torch.optim.AdamW(model.parameters(), lr=config.lr, weight_decay=config.weight_decay)
    sched = make_scheduler(opt, config.schedule, total, config.warmup_steps)
    loss_fn = workload.loss_fn
    t0 = time.perf_counter()
    step, epoch = 0, 0
    model.train()
    while step < total:
        g = torch.Generator().manual_seed(epoch_seed(config.seed, epoch))
        order = torch.randperm(n, generator=g)
        for i in range(0, n, B):
            if step == total:
                break
            idx = order[i:i + B]
            xb = transform(x[idx], train=True, generator=g)
            loss = loss_fn(model(xb), y[idx])
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            sched.step()
            step += 1
        epoch += 1
    train_time = time.perf_counter() - t0
    return {**evaluate(model, workload, data, transform), "steps": step, "train_time_s": train_time}


@torch.no_grad()
def evaluate(model, workload, data, transform) -> dict[str, Any]:
    model.eval()
    xt, yt = data.test
    out = model(transform(xt, train=False))
    result: dict[str, Any] = {"eval_loss": float(workload.loss_fn(out, yt))}
    if workload.task == "classification":
        result["accuracy"] = float((out.argmax(1) == yt).float().mean())
    elif workload.task == "binary":
        result["accuracy"] = float(((out > 0).to(yt.dtype) == yt).float().mean())
    else:
        result["accuracy"] = None
    return result


# ---------------------------------------------------------------- driver


def parse_value(text: str) -> Any:
    for cast in (int, float):
        try:
            return cast(text)
        except ValueError:
            pass
    return {"true": True, "false": False, "none": None}.get(text.lower(), text)


def measure(name: str, seed: int, overrides: dict[str, Any], loop: str, fit_workload) -> dict[str, Any]:
    workload = get_workload(name)
    settings = {**workload.defaults, **overrides, "seed": seed}
    config = TrainConfig(**settings)
    if loop == "trainer":
        config = config.replace(device="cpu", precision="fp32")
    row: dict[str, Any] = {"workload": name, "seed": seed, "loop": loop, "config": settings,
                           "full_batch": workload.full_batch}
    t0 = time.perf_counter()
    try:
        result = run_with_trainer(fit_workload, workload, config) if loop == "trainer" else \
            run_reference(workload, config)
    except DataError as exc:
        row.update(status="skipped", reason=str(exc).split(". ")[0])
        return row
    row.update(result)
    row["wall_time_s"] = time.perf_counter() - t0
    bar = BARS.get(name)
    row["bar"] = bar
    ok_time = row["wall_time_s"] < TIME_LIMIT_S
    if bar is None:
        row["status"] = "ok" if ok_time else "slow"
    else:
        row["status"] = "pass" if (row["accuracy"] or 0) >= bar and ok_time else "FAIL"
    return row


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("workloads", nargs="*", help=f"default: {' '.join(DEFAULT_RUN)}")
    p.add_argument("--seeds", type=int, nargs="+", default=[0])
    p.add_argument("--loop", choices=("auto", "trainer", "reference"), default="auto")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="override a default (TrainConfig field), e.g. --set epochs=10")
    p.add_argument("--json", metavar="PATH", help="write the rows and the environment as JSON")
    args = p.parse_args(argv)
    overrides = {}
    for item in args.set:
        key, _, value = item.partition("=")
        overrides[key] = parse_value(value)

    fit_workload, why = trainer_loop()
    loop = args.loop
    if loop == "auto":
        loop = "trainer" if fit_workload else "reference"
        if not fit_workload:
            print(f"gputrain's trainer is not importable ({why}): using the reference loop", file=sys.stderr)
    elif loop == "trainer" and not fit_workload:
        print(f"--loop trainer: gputrain's trainer is not importable ({why})", file=sys.stderr)
        return 2

    rows = []
    print(f"{'workload':<18} {'seed':>4} {'accuracy':>9} {'eval loss':>10} {'steps':>6} {'time s':>7}  status")
    for name in args.workloads or DEFAULT_RUN:
        for seed in args.seeds:
            row = measure(name, seed, overrides, loop, fit_workload)
            rows.append(row)
            if row["status"] == "skipped":
                print(f"{name:<18} {seed:>4} {'-':>9} {'-':>10} {'-':>6} {'-':>7}  skipped ({row['reason']})")
                continue
            acc = f"{row['accuracy']:.4f}" if row.get("accuracy") is not None else "-"
            print(f"{name:<18} {seed:>4} {acc:>9} {row['eval_loss']:>10.4f} {row['steps']:>6} "
                  f"{row['wall_time_s']:>7.1f}  {row['status']}"
                  + (f" (bar {row['bar']})" if row.get("bar") else ""), flush=True)

    if args.json:
        from gputrain.runtime.devices import cpu_model_name

        report = {
            "benchmark": "accuracy",
            "date": dt.datetime.now().isoformat(timespec="seconds"),
            "device": f"cpu ({cpu_model_name()}, {torch.get_num_threads()} threads)",
            "python": platform.python_version(),
            "torch": torch.__version__,
            "loop": loop,
            "time_limit_s": TIME_LIMIT_S,
            "overrides": overrides,
            "rows": rows,
        }
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2, default=str)
    return 1 if any(r["status"] in ("FAIL", "slow") for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
