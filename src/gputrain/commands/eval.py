"""`gputrain eval RUN_DIR`: evaluate a run's trained weights (best or last, EMA when kept) on its data."""

from __future__ import annotations

import argparse
import json

from gputrain.commands import trained
from gputrain.commands.argtypes import positive_int


def add_arguments(p: argparse.ArgumentParser) -> None:
    trained.add_run_arguments(p)
    p.add_argument("--data", default="test", metavar="test|train|FILE",
                   help="the workload's test or train split, or a .pt file of (inputs, targets) tensors")
    p.add_argument("--device", default="auto", help="auto (cuda > mps > cpu), cpu, cuda, cuda:N or mps")
    p.add_argument("--batch-size", type=positive_int, default=256)
    p.add_argument("--json", action="store_true", help="print the metrics as JSON")


def run(args) -> int:
    from gputrain.train.evaluation.inference import evaluate
    from gputrain.workloads.run_data import run_data

    r = trained.load(args)
    w = r.workload
    data = run_data(r, args.data, targets=True)
    with data.blame("eval"):
        metrics = evaluate(r.model, data.data, loss_fn=w.loss_fn, compute_loss=w.compute_loss, metrics=w.metrics,
                           task=w.task, batch_size=args.batch_size, device=args.device)
    if args.json:
        print(json.dumps({"run_dir": str(r.run_dir), "checkpoint": str(r.checkpoint), "step": r.step,
                          "weights": r.weights, "part": r.part, "data": args.data, "metrics": metrics}, indent=2))
        return 0
    print(trained.describe(r))
    for key, value in metrics.items():
        print(f"{key:<24} {value:.4f}")
    return 0
