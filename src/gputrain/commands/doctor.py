"""`gputrain doctor`: checks with a one-line fix each; exit code 1 when any check fails."""

from __future__ import annotations

import json

STYLE = {"pass": "[green]pass[/]", "warn": "[yellow]warn[/]", "fail": "[bold red]FAIL[/]"}


def add_arguments(p) -> None:
    p.add_argument("--json", action="store_true", help="print JSON for programs")
    p.add_argument("--no-measure", action="store_true",
                   help="skip the host-to-device bandwidth and matmul measurements (about 1 s on a CPU)")


def run(args) -> int:
    from gputrain.diagnostics.doctor import doctor

    report = doctor(run_measurements=not args.no_measure)
    if args.json:
        print(json.dumps(report, indent=2, default=str))
    else:
        render(report)
    return 0 if report["ok"] else 1


def render(report) -> None:
    from rich.console import Console
    from rich.markup import escape
    from rich.table import Table

    console = Console()
    probe = report["probe"]
    console.print(f"[bold]gputrain doctor[/] · PyTorch {probe['torch_version']}"
                  + (f" · CUDA {probe['torch_cuda']}" if probe["torch_cuda"] else
                     f" · ROCm {probe['torch_hip']}" if probe.get("torch_hip") else " · CPU-only build")
                  + (f" · driver {probe['driver_version']}" if probe["driver_version"] else ""))
    # A borderless grid: the finding and its fix get the whole width instead of two narrow columns.
    grid = Table.grid(padding=(0, 1))
    grid.add_column(no_wrap=True)
    grid.add_column(no_wrap=True, style="bold")
    grid.add_column()
    for c in report["checks"]:
        text = escape(c["message"]) + (f"\n[dim]fix:[/] {escape(c['fix'])}" if c["fix"] and c["status"] != "pass" else "")
        grid.add_row(STYLE[c["status"]], c["name"], text)
    console.print(grid)
    counts = {s: sum(c["status"] == s for c in report["checks"]) for s in ("fail", "warn")}
    if counts["fail"]:
        console.print(f"[bold red]{counts['fail']} check(s) failed[/], {counts['warn']} warning(s): fix the failures first.")
    elif counts["warn"]:
        console.print(f"[green]no failures[/], {counts['warn']} warning(s).")
    else:
        console.print("[green]all checks passed.[/]")
