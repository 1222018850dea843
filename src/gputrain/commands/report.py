"""`gputrain report RUN_DIR`: write RUN_DIR/report.html, one self-contained page about the run.
`gputrain report --sweep SWEEP_DIR`: rewrite a sweep's page from its study (on a shared study,
every machine's trials as they are now)."""

from __future__ import annotations

import argparse


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("run_dir", metavar="RUN_DIR", help="a run directory (the --run-dir of `gputrain fit`)")
    p.add_argument("--out", default=None, metavar="FILE", help="where the page goes (default RUN_DIR/report.html)")
    p.add_argument("--sweep", action="store_true",
                   help="RUN_DIR is a sweep's folder: its report.html rewritten from the study's database, every "
                        "trial with the machine that ran it")


def run(args) -> int:
    from pathlib import Path

    from gputrain.errors import ConfigError
    from gputrain.io.preflight import check_output_file
    from gputrain.io.run_layout import REPORT_FILE
    from gputrain.report.html import write_report

    if args.sweep:
        if args.out:
            raise ConfigError("--out: a sweep's page is SWEEP_DIR/report.html (its links are relative to the folder); "
                              "drop --out")
        from gputrain.sweeps.runner import report_sweep

        print(f"report: {report_sweep(args.run_dir)} (self-contained: open it in any browser, no network needed)")
        return 0
    if args.out or Path(args.run_dir).is_dir():  # a missing RUN_DIR is write_report's to explain
        check_output_file(args.out or Path(args.run_dir) / REPORT_FILE, "--out" if args.out else "RUN_DIR",
                          example=REPORT_FILE, run_dir=args.run_dir)
    try:
        path = write_report(args.run_dir, out=args.out)
    except OSError as exc:  # a full disk, a file that cannot be read: the page is written whole or not at all
        raise ConfigError(f"{exc.filename or args.out or args.run_dir}: {exc.strerror or exc}; nothing was written "
                          "(check the run directory and --out)") from None
    print(f"report: {path} (self-contained: open it in any browser, no network needed)")
    return 0
