"""`gputrain report RUN_DIR`: write RUN_DIR/report.html, one self-contained page about the run."""

from __future__ import annotations

import argparse


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("run_dir", metavar="RUN_DIR", help="a run directory (the --run-dir of `gputrain fit`)")
    p.add_argument("--out", default=None, metavar="FILE", help="where the page goes (default RUN_DIR/report.html)")


def run(args) -> int:
    from gputrain.report.html import write_report

    path = write_report(args.run_dir, out=args.out)
    print(f"report: {path} (self-contained: open it in any browser, no network needed)")
    return 0
