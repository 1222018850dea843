"""`gputrain sweep [WORKLOAD] --config sweep.toml`: search hyperparameters with Optuna.

The config file is a run's (workload, [options], [train], [fit]) with a [sweep] table: the budget,
the metric and [sweep.space] (gputrain/sweeps/settings.py). Each trial is an ordinary run directory
under SWEEP_DIR/trials; the study is SWEEP_DIR/study.db (SQLite), so a sweep that is stopped or
killed resumes where it stopped when run again, or with `gputrain sweep --sweep-dir SWEEP_DIR`.
SWEEP_DIR/report.html shows every trial, the metric per trial and the best so far.
"""

from __future__ import annotations

import argparse
import json
import logging

from gputrain.commands.argtypes import positive_int as _positive_int


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("workload", nargs="?", default=None, help="the workload (default: the config file's workload)")
    p.add_argument("--config", default=None, metavar="FILE",
                   help="the sweep's TOML file: a run's config with [sweep] (trials, metric, [sweep.space])")
    p.add_argument("--sweep-dir", default=None,
                   help="the sweep's folder (default sweeps/NAME for --config NAME.toml: the same command again resumes); "
                        "alone, resumes the sweep in it")
    p.add_argument("--trials", type=_positive_int, default=None, help="the budget: finished trials the study ends with")
    p.add_argument("--workers", type=_positive_int, default=None,
                   help="trials at once (default: one per GPU; on the CPU, 1): processes, never two on one GPU")
    p.add_argument("--metric", default=None, help="the value each trial is judged by (default eval_loss)")
    p.add_argument("--direction", choices=["min", "max"], default=None,
                   help="which way the metric improves (default: gputrain's rule for its name)")
    p.add_argument("--json", action="store_true", help="print the result as JSON")
    p.add_argument("--quiet", action="store_true", help="no progress lines")


def run(args) -> int:
    _setup_logging(args.quiet or args.json)
    from gputrain.sweeps import sweep

    result = sweep(args.config, workload=args.workload, sweep_dir=args.sweep_dir, trials=args.trials,
                   workers=args.workers, metric=args.metric, direction=args.direction)
    if args.json:
        out = {"sweep_dir": str(result.sweep_dir), "metric": result.metric, "direction": result.direction,
               "best_trial": result.best_trial, "best_value": result.best_value, "best_params": result.best_params,
               "best_run_dir": str(result.best_run_dir) if result.best_run_dir else None,
               "report": str(result.report) if result.report else None, "storage": result.storage,
               "study_name": result.study_name, "trials": result.trials}
        print(json.dumps(out, indent=2, default=str))
        return 0
    from rich.console import Console
    from rich.table import Table

    from gputrain.report.sweep_page import short

    names = list(dict.fromkeys(k for r in result.trials for k in r["params"]))
    table = Table(title=f"gputrain sweep: {result.metric} ({'lower' if result.direction == 'min' else 'higher'} "
                        "is better)")
    for col in ("trial", "state", result.metric, *names, "last step", "time"):
        table.add_column(col, justify="right")
    for r in sorted(result.trials, key=lambda r: r["number"]):
        table.add_row(str(r["number"]), r["state"], short(r["value"]), *[short(r["params"].get(n)) for n in names],
                      short(r["last_step"]), f"{r['seconds']:.1f} s" if r["seconds"] is not None else "")
    console = Console()
    console.print(table)
    if result.best_trial is not None:
        params = ", ".join(f"{k}={short(v)}" for k, v in result.best_params.items())
        console.print(f"best: trial {result.best_trial}, {result.metric} {short(result.best_value)} ({params}); "
                      f"its run: {result.best_run_dir}", markup=False, highlight=False)
    console.print(f"report: {result.report}   study: {result.storage} (study_name={result.study_name!r})",
                  markup=False, highlight=False)
    return 0


def _setup_logging(quiet: bool) -> None:
    logger = logging.getLogger("gputrain")
    if logger.handlers:
        return
    handler = logging.StreamHandler()  # stderr: the progress lines, one per finished trial
    handler.setFormatter(logging.Formatter("%(message)s"))
    logger.addHandler(handler)
    logger.setLevel(logging.WARNING if quiet else logging.INFO)
    logger.propagate = False
