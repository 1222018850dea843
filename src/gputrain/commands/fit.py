"""`gputrain fit [WORKLOAD]`: train a built-in or user workload and report what happened.

The command line parses into a run spec and renders what training returns: the flags are generated
from the spec's fields (gputrain/runs/flags.py), the spec is resolved and trained below the command
line (gputrain/runs/), and --config's file is one more source under the flags.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys

from gputrain.runs.spec import DEFAULT_WORKLOAD


def add_arguments(p: argparse.ArgumentParser) -> None:
    from gputrain.runs.flags import add_spec_arguments

    p.add_argument("workload", nargs="?", default=argparse.SUPPRESS,
                   help=f"a built-in workload (see --list; default {DEFAULT_WORKLOAD}) or module:function returning a gputrain.Workload")
    p.add_argument("--list", action="store_true", help="list the built-in workloads and exit")
    p.add_argument("--config", default=None, metavar="FILE",
                   help="a TOML file of the run (workload, [options], [train]: TrainConfig's fields, [fit]: the run's "
                        "own settings); flags given here override it. A run's own: RUN_DIR/config.toml")
    p.add_argument("--print-config", action="store_true",
                   help="print the resolved config of this command line (TOML, as RUN_DIR/config.toml) and exit")
    add_spec_arguments(p)
    p.add_argument("--no-tensorboard", action="store_true", default=argparse.SUPPRESS,
                   help="no TensorBoard event files: the loggers (--logger, or the default) without tensorboard")
    p.add_argument("--data-dir", default=argparse.SUPPRESS, help="folder of a local data set (cifar10-cnn, mnist-cnn)")
    p.add_argument("--option", action="append", default=argparse.SUPPRESS, metavar="KEY=VALUE",
                   help="a workload option, e.g. --option n=2000 for synthetic-cifar (repeatable)")
    p.add_argument("--optimizer", action="append", default=argparse.SUPPRESS, metavar="NAME.KEY=VALUE",
                   help="a setting of a named optimizer of a step of your own ([optimizers.NAME]), e.g. "
                        "--optimizer generator.lr=1e-3 or generator.betas=0.5,0.999 (repeatable)")


def build_config(args: argparse.Namespace, workload=None):
    """The TrainConfig this command line trains with (the resolved spec's)."""
    from gputrain.runs.flags import stated_run
    from gputrain.runs.resolve import resolve

    return resolve(stated_run(args), workload)[0].train


def run(args: argparse.Namespace) -> int:
    """Train as the flags (and --config's file) say, where the run's settings say (runs/launch.py);
    render the summary."""
    if args.list:
        return _list(getattr(args, "json", False))
    from gputrain.runs.flags import stated_run
    from gputrain.runs.launch import TORCHRUN, launch, launcher_of
    from gputrain.runs.resolve import resolve
    from gputrain.runs.spec import RunSettings, spec_text
    from gputrain.runtime.distributed import is_main_process

    argv = _argv_without(getattr(args, "_argv", sys.argv[1:]), ("--nproc", "--max-restarts"))
    stated = stated_run(args)
    settings = RunSettings(**stated.fit)
    if args.print_config or launcher_of(settings) != TORCHRUN:  # torchrun's processes show their own log
        _setup_logging(settings.quiet or settings.json, is_main_process())
    if not args.print_config:
        result = launch(stated, argv=argv)
        return _render(result, settings.json)
    spec, workload = resolve(stated)  # --print-config: the spec as RUN_DIR/config.toml would hold it; runs nothing
    print(spec_text(spec, record=False, workload_name=workload.name), end="")
    return 0


def _render(result, as_json: bool) -> int:
    """Rank 0's summary (and autotune's report): printed as JSON or as the run's tables; nothing when
    the run's own processes showed it (torchrun's rank 0), and then their exit status."""
    if not result.is_main or result.shown:
        return result.exit_code
    if as_json:
        out = {"summary": result.summary, "final": result.history.records[-1] if result.history.records else None}
        if result.autotune_report is not None:
            out["autotune"] = result.autotune_report
        print(json.dumps(out, indent=2, default=str))
        return 0
    from rich.console import Console

    from gputrain.report.summary import render_summary

    console = Console()
    if result.autotune_report is not None:
        from gputrain.diagnostics.autotune import render_report

        render_report(result.autotune_report, console)
    render_summary(result.summary, console)
    return 0


def _setup_logging(quiet: bool, is_main: bool) -> None:
    logger = logging.getLogger("gputrain")
    if logger.handlers:
        return
    from rich.console import Console
    from rich.logging import RichHandler

    handler = RichHandler(console=Console(stderr=True), show_time=False, show_path=False, markup=False)
    logger.addHandler(handler)
    logger.setLevel(logging.WARNING if (quiet or not is_main) else logging.INFO)
    logger.propagate = False


def _list(as_json: bool) -> int:
    from gputrain.workloads import list_workloads

    rows = list_workloads()
    if as_json:
        print(json.dumps(rows, indent=2, default=str))
        return 0
    from rich.console import Console
    from rich.table import Table

    table = Table(title="gputrain workloads")
    for col in ("name", "description", "data", "parameters", "defaults"):
        table.add_column(col)
    for r in rows:
        defaults = ", ".join(f"{k}={v}" for k, v in (r.get("defaults") or {}).items())
        params = r.get("parameters")
        table.add_row(str(r.get("name")), str(r.get("description", "")), str(r.get("data", "")),
                      f"{params:,}" if isinstance(params, int) else str(params or ""), defaults)
    Console().print(table)
    return 0


def _argv_without(argv: list[str], flags: tuple[str, ...]) -> list[str]:
    """The command line again, for the processes torchrun starts, without the launcher's flags."""
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
            continue
        if a in flags:
            skip = True
            continue
        if any(a.startswith(f + "=") for f in flags):
            continue
        out.append(a)
    return out
