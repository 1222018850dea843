"""What `gputrain eval`, `predict` and `export` share: a run directory and which of its weights."""

from __future__ import annotations

import argparse
import sys

from gputrain.commands.argtypes import workload_options


def add_run_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("run_dir", metavar="RUN_DIR", help="a run directory of `gputrain fit` (with checkpoints)")
    p.add_argument("--checkpoint", default="best", metavar="best|last|FILE",
                   help="the run's best checkpoint (by its best_metric; the newest when none), the newest, or a "
                        "checkpoint: a step-N.pt file or, from a run of several processes, a step-N.dcp folder")
    p.add_argument("--weights", choices=["auto", "ema", "raw"], default="auto",
                   help="auto: the EMA weights when the run kept them (--ema), else the trained ones")
    p.add_argument("--workload", default=None,
                   help="the workload (name or module:function) when RUN_DIR/workload.json does not say")
    p.add_argument("--option", action="append", default=[], metavar="KEY=VALUE", help="a workload option (repeatable)")
    p.add_argument("--part", default=None, metavar="NAME",
                   help="use this part of the model (a submodule, e.g. generator); default: the workload's eval_part, "
                        "else the whole model")


def load(args):
    """The TrainedRun the arguments name (workloads/from_run.py)."""
    from gputrain.workloads.from_run import choose_part, load_run

    run = choose_part(load_run(args.run_dir, checkpoint=args.checkpoint, weights=args.weights, workload=args.workload,
                               options=workload_options(args.option)), args.part)
    for note in run.skipped:
        print(f"gputrain {args.command}: warning: checkpoint {note}; using {run.checkpoint.name}", file=sys.stderr)
    return run


def describe(run) -> str:
    part = f" (part {run.part})" if run.part else ""
    return f"{run.workload.name}{part}: {run.weights} weights of step {run.step} from {run.checkpoint}"
