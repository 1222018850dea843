"""`gputrain sweep [WORKLOAD] --config sweep.toml`: search hyperparameters with Optuna.

The config file is a run's (workload, [options], [train], [fit]) with a [sweep] table: the budget,
the metric and [sweep.space] (gputrain/sweeps/settings.py). Each trial is an ordinary run directory
under SWEEP_DIR/trials; the study is SWEEP_DIR/study.db (SQLite), so a sweep that is stopped or
killed resumes where it stopped when run again, or with `gputrain sweep --sweep-dir SWEEP_DIR`.
With `--storage URL --study NAME` the study is in a database server or a journal file: the same
command on another machine (its own --sweep-dir) joins it with more workers.
SWEEP_DIR/report.html shows every trial, the metric per trial and the best so far.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from dataclasses import dataclass

from gputrain.fields import boolean, setting

# The [sweep] keys the command line sets (gputrain/sweeps/settings.py declares them with their flags).
SWEEP_FLAGS = ("sweep_dir", "trials", "workers", "metric", "direction", "storage", "study")


@dataclass
class SweepOutput:
    """How `gputrain sweep` shows its result."""

    json: bool = setting(False, flag="--json", action="store_true", check=boolean, help="print the result as JSON")
    quiet: bool = setting(False, flag="--quiet", action="store_true", check=boolean, help="no progress lines")


def add_arguments(p: argparse.ArgumentParser) -> None:
    from gputrain.runs.flags import add_flags
    from gputrain.sweeps.settings import SweepSettings

    p.add_argument("workload", nargs="?", default=None, help="the workload (default: the config file's workload)")
    p.add_argument("--config", default=None, metavar="FILE",
                   help="the sweep's TOML file: a run's config with [sweep] (trials, metric, [sweep.space])")
    add_flags(p, SweepSettings, SWEEP_FLAGS)
    add_flags(p, SweepOutput)


def run(args) -> int:
    from gputrain.runs.flags import given
    from gputrain.sweeps import sweep
    from gputrain.sweeps.settings import SweepSettings

    output = SweepOutput(**given(args, SweepOutput))
    _setup_logging(output.quiet or output.json)
    result = sweep(args.config, workload=args.workload, **given(args, SweepSettings, SWEEP_FLAGS))
    if output.json:
        out = {"sweep_dir": str(result.sweep_dir), "metric": result.metric, "direction": result.direction,
               "best_trial": result.best_trial, "best_value": result.best_value, "best_params": result.best_params,
               "best_run_dir": str(result.best_run_dir) if result.best_run_dir else None,
               "report": str(result.report) if result.report else None, "storage": result.storage,
               "study_name": result.study_name, "trials": result.trials}
        print(json.dumps(out, indent=2, default=str))
        return _every_trial_failed(result)
    from rich.console import Console
    from rich.table import Table

    from gputrain.report.sweep_page import short

    names = list(dict.fromkeys(k for r in result.trials for k in r["params"]))
    machines = len({(r.get("machine"), r.get("sweep_dir")) for r in result.trials if r.get("machine")}) > 1
    table = Table(title=f"gputrain sweep: {result.metric} ({'lower' if result.direction == 'min' else 'higher'} "
                        "is better)")
    for col in ("trial", "state", result.metric, *names, "last step", "time", *(["machine"] if machines else [])):
        table.add_column(col, justify="right")
    for r in sorted(result.trials, key=lambda r: r["number"]):
        table.add_row(str(r["number"]), r["state"], short(r["value"]), *[short(r["params"].get(n)) for n in names],
                      short(r["last_step"]), f"{r['seconds']:.1f} s" if r["seconds"] is not None else "",
                      *([r.get("machine") or ""] if machines else []))
    console = Console()
    console.print(table)
    if result.best_trial is not None:
        params = ", ".join(f"{k}={short(v)}" for k, v in result.best_params.items())
        console.print(f"best: trial {result.best_trial}, {result.metric} {short(result.best_value)} ({params}); "
                      f"its run: {result.best_run_dir}"
                      f"{f' on {result.best_machine}' if machines and result.best_machine else ''}", markup=False,
                      highlight=False)
    console.print(f"report: {result.report}   study: {result.storage} (study_name={result.study_name!r})",
                  markup=False, highlight=False)
    return _every_trial_failed(result)


def _every_trial_failed(result) -> int:
    """1, with one line on stderr, when trials ran and none completed (every one failed): a sweep that
    found nothing is not a success; else 0."""
    states = [r["state"] for r in result.trials]
    if not states or "complete" in states or "fail" not in states:
        return 0
    first = next((r for r in sorted(result.trials, key=lambda r: r["number"]) if r.get("error")), None)
    why = f"; trial {first['number']}: {str(first['error']).splitlines()[0]}" if first else ""
    print(f"gputrain sweep: error: every trial failed ({len(states)} of {len(states)}{why}); the report says more: "
          f"{result.report}", file=sys.stderr)
    return 1


def _setup_logging(quiet: bool) -> None:
    logger = logging.getLogger("gputrain")
    if logger.handlers:
        return
    handler = logging.StreamHandler()  # stderr: the progress lines, one per finished trial
    handler.setFormatter(logging.Formatter("%(message)s"))
    logger.addHandler(handler)
    logger.setLevel(logging.WARNING if quiet else logging.INFO)
    logger.propagate = False
