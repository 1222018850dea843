"""`gputrain doctor`: checks with a one-line fix each; exit code 1 when any check fails."""

from __future__ import annotations

import json

STYLE = {"pass": "[green]pass[/]", "warn": "[yellow]warn[/]", "fail": "[red]FAIL[/]"}


def add_arguments(p) -> None:
    p.add_argument("--json", action="store_true", help="print JSON for programs")
    p.add_argument("--no-measure", action="store_true", help="skip the bandwidth and matmul measurements")


def run(args) -> int:
    from gputrain.doctor import doctor

    report = doctor(run_measurements=not args.no_measure)
    if args.json:
        print(json.dumps(report, indent=2, default=str))
    else:
        from rich.console import Console
        from rich.markup import escape
        from rich.table import Table

        table = Table(title="gputrain doctor", title_justify="left", show_lines=False)
        table.add_column("", no_wrap=True)
        table.add_column("check", no_wrap=True)
        table.add_column("finding")
        table.add_column("fix")
        for c in report["checks"]:
            table.add_row(STYLE[c["status"]], c["name"], escape(c["message"]), escape(c["fix"]))
        Console().print(table)
    return 0 if report["ok"] else 1
