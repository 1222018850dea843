"""Rendering a run: metrics files, curves, the summary table and the progress bar.

The trainer calls these only at log points, never per step.
"""

from __future__ import annotations

import csv
import json
from pathlib import Path
from typing import Any

# The CSV has fixed columns so that it stays rectangular; anything else a record holds is in the
# JSON-lines file.
CSV_COLUMNS = ["step", "epoch", "loss", "lr", "samples_per_s", "peak_memory_bytes", "wall_time_s",
               "eval_loss", "eval_accuracy"]


def format_bytes(n: int | float | None) -> str:
    if n is None:
        return "-"
    n = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


class MetricsLog:
    """metrics.jsonl (every key) and metrics.csv (CSV_COLUMNS) in the run directory, appended per log point."""

    def __init__(self, run_dir: str | Path):
        self.dir = Path(run_dir)
        self.dir.mkdir(parents=True, exist_ok=True)
        jsonl, csv_path = self.dir / "metrics.jsonl", self.dir / "metrics.csv"
        # A resumed run appends to the files of the run it continues.
        new_csv = not csv_path.exists() or csv_path.stat().st_size == 0
        self._jsonl = open(jsonl, "a")
        self._csv_file = open(csv_path, "a", newline="")
        self._csv = csv.DictWriter(self._csv_file, fieldnames=CSV_COLUMNS, extrasaction="ignore")
        if new_csv:
            self._csv.writeheader()

    def append(self, record: dict[str, Any]) -> None:
        self._jsonl.write(json.dumps(record, default=str) + "\n")
        self._jsonl.flush()
        self._csv.writerow({k: ("" if record.get(k) is None else record.get(k)) for k in CSV_COLUMNS})
        self._csv_file.flush()

    def close(self) -> None:
        self._jsonl.close()
        self._csv_file.close()

    def __enter__(self) -> "MetricsLog":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def plot_history(history, path: str | Path) -> Path | None:
    """Loss (train, eval) and accuracy against step as a PNG; None when nothing was recorded."""
    recs = history.records
    if not recs:
        return None
    from matplotlib.figure import Figure  # no pyplot: no GUI backend, no global state

    steps = [r["step"] for r in recs]
    has_acc = any(r.get("eval_accuracy") is not None for r in recs)
    fig = Figure(figsize=(10 if has_acc else 6, 4), dpi=100)
    ax = fig.add_subplot(1, 2 if has_acc else 1, 1)
    ax.plot(steps, [r.get("loss") for r in recs], label="train loss")
    ev = [(r["step"], r["eval_loss"]) for r in recs if r.get("eval_loss") is not None]
    if ev:
        ax.plot(*zip(*ev), label="eval loss", marker="o", markersize=3)
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("loss")
    if all((r.get("loss") or 0) > 0 for r in recs):
        ax.set_yscale("log")
    ax.legend()
    ax.grid(alpha=0.3)
    if has_acc:
        ax2 = fig.add_subplot(1, 2, 2)
        acc = [(r["step"], r["eval_accuracy"]) for r in recs if r.get("eval_accuracy") is not None]
        ax2.plot(*zip(*acc), marker="o", markersize=3, color="tab:green")
        ax2.set_xlabel("optimizer step")
        ax2.set_ylabel("eval accuracy")
        ax2.grid(alpha=0.3)
    title = history.summary.get("device", "") if history.summary else ""
    if title:
        fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    return path


def summary_rows(summary: dict[str, Any]) -> list[tuple[str, str]]:
    """(label, value) pairs of a run summary, formatted for people."""
    rows: list[tuple[str, str]] = []

    def add(label: str, value) -> None:
        if value is not None and value != "":
            rows.append((label, str(value)))

    add("workload", summary.get("workload"))
    add("device", summary.get("device"))
    add("precision", f"{summary.get('precision')} ({summary.get('precision_reason', '')})")
    add("data", summary.get("data_reason"))
    add("optimizer", summary.get("optimizer"))
    eff = summary.get("effective_batch")
    if eff is not None:
        ws = summary.get("world_size", 1)
        acc = summary.get("accumulate", 1)
        add("effective batch", f"{eff} = {summary.get('batch_size')} per step"
            + (f" x {acc} accumulated" if acc and acc > 1 else "") + (f" x {ws} processes" if ws and ws > 1 else ""))
    steps = summary.get("steps")
    if steps is not None:
        add("steps", f"{steps} of {summary.get('total_steps')}" + (" (stopped early)" if summary.get("stopped_early") else ""))
    if summary.get("time_s") is not None:
        add("time", f"{summary['time_s']:.2f} s")
    if summary.get("samples_per_s") is not None:
        add("samples/s", f"{summary['samples_per_s']:,.0f} (median over log intervals after the first)")
    if summary.get("final_loss") is not None:
        add("final train loss", f"{summary['final_loss']:.4f}")
    if summary.get("final_eval_loss") is not None:
        add("eval loss (final / best)", f"{summary['final_eval_loss']:.4f} / {summary.get('best_eval_loss', 0):.4f}")
    if summary.get("final_eval_accuracy") is not None:
        add("eval accuracy (final / best)",
            f"{summary['final_eval_accuracy']:.4f} / {summary.get('best_eval_accuracy', 0):.4f}")
    add("peak device memory", format_bytes(summary.get("peak_memory_bytes")) if summary.get("peak_memory_bytes")
        else "not measured on the CPU")
    add("CUDA graphs", summary.get("cuda_graphs"))
    if summary.get("oom_splits", 1) and summary.get("oom_splits", 1) > 1:
        add("OOM recovery", f"micro-batches split {summary['oom_splits']}x")
    add("run directory", summary.get("run_dir"))
    return rows


def summary_table(summary: dict[str, Any]):
    from rich.table import Table

    table = Table(title="gputrain fit", show_header=False, title_justify="left")
    table.add_column("what", style="bold")
    table.add_column("value")
    for label, value in summary_rows(summary):
        table.add_row(label, value)
    return table


def render_summary(summary: dict[str, Any], console=None) -> None:
    from rich.console import Console

    (console or Console()).print(summary_table(summary))


class TrainProgress:
    """A rich progress bar updated at log points; a cheap no-op when disabled."""

    def __init__(self, enabled: bool, total_steps: int, description: str = "training", console=None):
        self.enabled = enabled
        self.total = total_steps
        self.description = description
        self.console = console
        self._progress = None
        self._task = None

    @staticmethod
    def auto(force: bool | None = None) -> bool:
        """On for a terminal unless forced either way."""
        if force is not None:
            return bool(force)
        import sys

        return sys.stderr.isatty()

    def __enter__(self) -> "TrainProgress":
        if not self.enabled:
            return self
        from rich.console import Console
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

        self._progress = Progress(
            TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(),
            TextColumn("epoch {task.fields[epoch]}"), TextColumn("loss {task.fields[loss]}"),
            TextColumn("{task.fields[rate]} samples/s"), TextColumn("mem {task.fields[mem]}"),
            TimeRemainingColumn(), console=self.console or Console(stderr=True), transient=False)
        self._progress.__enter__()
        self._task = self._progress.add_task(self.description, total=self.total, epoch="-", loss="-", rate="-", mem="-")
        return self

    def update(self, step: int, epoch=None, loss=None, samples_per_s=None, memory_bytes=None) -> None:
        if self._progress is None:
            return
        self._progress.update(
            self._task, completed=step,
            epoch=f"{epoch:.2f}" if epoch is not None else "-",
            loss=f"{loss:.4f}" if loss is not None else "-",
            rate=f"{samples_per_s:,.0f}" if samples_per_s is not None else "-",
            mem=format_bytes(memory_bytes) if memory_bytes else "-")

    def __exit__(self, *exc) -> None:
        if self._progress is not None:
            self._progress.__exit__(*exc)
            self._progress = None
