"""Rendering a run: metrics files, curves, the summary table and the progress bar.

The library returns data (History, summary dicts); this module turns it into files and terminal
output. The trainer calls it only at log points, never per step.
"""

from __future__ import annotations

import csv
import json
import math
import sys
from pathlib import Path
from typing import Any

from gputrain.io.history import json_default

# The CSV's first columns, always present and in this order so that a reader can rely on them.
# A record with another key (a new metric, say) widens the CSV: the file is rewritten once, atomically,
# with the key as a new last column and empty cells in the rows before. Every key is also in the
# JSON-lines file, one object per log point.
CSV_COLUMNS = ["step", "epoch", "loss", "lr", "samples_per_s", "peak_memory_bytes", "wall_time_s",
               "eval_loss", "eval_accuracy"]


def format_bytes(n: int | float | None) -> str:
    """1536 -> '1.5 KiB' (binary units); None -> '-'."""
    if n is None:
        return "-"
    n = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


def format_duration(seconds: float | None) -> str:
    """3.5 -> '3.50 s', 125 -> '2 min 05 s', 3725 -> '1 h 02 min'."""
    if seconds is None:
        return "-"
    if seconds < 60:
        return f"{seconds:.2f} s"
    minutes, s = divmod(int(round(seconds)), 60)
    if minutes < 60:
        return f"{minutes} min {s:02d} s"
    hours, minutes = divmod(minutes, 60)
    return f"{hours} h {minutes:02d} min"


# ---------------------------------------------------------------- metrics files

class MetricsLog:
    """metrics.jsonl (one JSON object per log point) and metrics.csv in `run_dir`, appended and
    flushed at each log point.

    A resumed run reopens the files and appends. `truncate_after_step=N` first drops what was
    logged after step N (a resumed run passes the checkpoint's step, so that the steps between that
    checkpoint and the crash are not in the files twice; a fresh run passes 0 to start empty files).
    """

    def __init__(self, run_dir: str | Path, truncate_after_step: int | None = None):
        self.dir = Path(run_dir)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.jsonl_path = self.dir / "metrics.jsonl"
        self.csv_path = self.dir / "metrics.csv"
        if truncate_after_step is not None:
            self._truncate(truncate_after_step)
        self.columns = list(CSV_COLUMNS)
        header = self._csv_header()
        if header:
            self.columns = header  # keep a resumed run's columns (widened ones included)
        self._jsonl = open(self.jsonl_path, "a", encoding="utf-8")
        self._csv_file = None
        self._open_csv(write_header=not header)

    def append(self, record: dict[str, Any]) -> None:
        """Write one log point to both files (a line of JSON, a CSV row) and flush them."""
        self._jsonl.write(json.dumps(record, default=json_default) + "\n")
        self._jsonl.flush()
        new = [k for k in record if k not in self.columns]
        if new:
            self._widen(new)
        self._csv.writerow([_cell(record.get(k)) for k in self.columns])
        self._csv_file.flush()

    def close(self) -> None:
        self._jsonl.close()
        if self._csv_file is not None:
            self._csv_file.close()

    def __enter__(self) -> "MetricsLog":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- helpers

    def _open_csv(self, write_header: bool) -> None:
        self._csv_file = open(self.csv_path, "a", newline="", encoding="utf-8")
        self._csv = csv.writer(self._csv_file)
        if write_header:
            self._csv.writerow(self.columns)
            self._csv_file.flush()

    def _csv_header(self) -> list[str] | None:
        if not self.csv_path.exists() or self.csv_path.stat().st_size == 0:
            return None
        with open(self.csv_path, newline="", encoding="utf-8") as f:
            return next(csv.reader(f), None) or None

    def _read_csv_rows(self) -> list[dict[str, str]]:
        with open(self.csv_path, newline="", encoding="utf-8") as f:
            return list(csv.DictReader(f))

    def _widen(self, new_keys: list[str]) -> None:
        """Rewrite the CSV with `new_keys` as extra columns (rare: the first time a metric appears)."""
        from gputrain.io.checkpoint import atomic_file

        self._csv_file.close()
        rows = self._read_csv_rows()
        self.columns = self.columns + new_keys
        with atomic_file(self.csv_path, "w") as f:
            w = csv.writer(f)
            w.writerow(self.columns)
            for row in rows:
                w.writerow([row.get(k) or "" for k in self.columns])
        self._open_csv(write_header=False)

    def _truncate(self, after_step: int) -> None:
        from gputrain.io.checkpoint import atomic_file

        def keep(step) -> bool:
            try:
                return float(step) <= after_step
            except (TypeError, ValueError):
                return True  # a row without a step is not ours to judge

        if self.jsonl_path.exists():
            lines = self.jsonl_path.read_text(encoding="utf-8").splitlines()
            kept = []
            for line in lines:
                try:
                    record = json.loads(line)
                except json.JSONDecodeError:
                    continue  # a line cut short by a crash
                if keep(record.get("step") if isinstance(record, dict) else None):
                    kept.append(line)
            if kept != lines:
                with atomic_file(self.jsonl_path, "w") as f:
                    f.writelines(line + "\n" for line in kept)
        header = self._csv_header()
        if header:
            rows = self._read_csv_rows()
            kept_rows = [r for r in rows if keep(r.get("step"))]
            if len(kept_rows) != len(rows):
                with atomic_file(self.csv_path, "w") as f:
                    w = csv.writer(f)
                    w.writerow(header)
                    for row in kept_rows:
                        w.writerow([row.get(k) or "" for k in header])


def _cell(value: Any) -> Any:
    if value is None:
        return ""
    if isinstance(value, (dict, list, tuple)):
        return json.dumps(value, default=json_default)
    return value


# ---------------------------------------------------------------- curves

def plot_history(history, path: str | Path) -> Path | None:
    """Loss (train, and eval where present) and accuracy against step as a PNG.

    Returns the path, or None when the history has no records. Uses matplotlib's Agg canvas
    directly (no pyplot: no GUI backend, no global figure state).
    """
    recs = [r for r in history.records if r.get("step") is not None]
    if not recs:
        return None
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    from gputrain.io.checkpoint import atomic_file

    def series(key: str) -> tuple[list, list]:
        points = [(r["step"], r[key]) for r in recs if isinstance(r.get(key), (int, float))]
        return [p[0] for p in points], [p[1] for p in points]

    acc_keys = sorted({k for r in recs for k in r if k.endswith("accuracy") and r[k] is not None})
    fig = Figure(figsize=(10 if acc_keys else 6, 4), dpi=100)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot(1, 2 if acc_keys else 1, 1)
    losses = []
    for key, label, style in (("loss", "train loss", {}), ("eval_loss", "eval loss", {"marker": "o", "markersize": 3})):
        x, y = series(key)
        if x:
            ax.plot(x, y, label=label, **style)
            losses += y
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("loss")
    if losses and all(math.isfinite(v) and v > 0 for v in losses):
        ax.set_yscale("log")
    if losses:
        ax.legend()
    ax.grid(alpha=0.3)
    if acc_keys:
        ax2 = fig.add_subplot(1, 2, 2)
        for key in acc_keys:
            x, y = series(key)
            ax2.plot(x, y, marker="o", markersize=3, label=key.replace("_", " "))
        ax2.set_xlabel("optimizer step")
        ax2.set_ylabel("accuracy")
        ax2.legend()
        ax2.grid(alpha=0.3)
    summary = history.summary or {}
    title = " | ".join(str(summary[k]) for k in ("device", "precision") if summary.get(k))
    if title:
        fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    path = Path(path)
    with atomic_file(path, "wb") as f:
        fig.savefig(f, format="png")
    return path


# ---------------------------------------------------------------- summary table

_KNOWN_METRICS = ("loss", "eval_loss", "eval_accuracy")


def summary_rows(summary: dict[str, Any]) -> list[tuple[str, str]]:
    """(label, value) pairs of a run summary, formatted for people; missing entries are left out."""
    rows: list[tuple[str, str]] = []

    def add(label: str, value) -> None:
        if value is not None and value != "":
            rows.append((label, str(value)))

    add("workload", summary.get("workload"))
    add("device", summary.get("device"))
    if summary.get("precision"):
        reason = summary.get("precision_reason")
        add("precision", f"{summary['precision']} ({reason})" if reason else summary["precision"])
    add("data", summary.get("data_reason"))
    add("optimizer", summary.get("optimizer"))
    eff = summary.get("effective_batch")
    if eff is not None:
        ws, acc, bs = summary.get("world_size") or 1, summary.get("accumulate") or 1, summary.get("batch_size")
        parts = [f"{bs} per step"] if bs is not None else []
        if acc > 1:
            parts.append(f"{acc} accumulated")
        if ws > 1:
            parts.append(f"{ws} processes")
        add("effective batch", f"{eff} = {' x '.join(parts)}" if bs is not None and (acc > 1 or ws > 1) else eff)
    steps = summary.get("steps")
    if steps is not None:
        total = summary.get("total_steps")
        add("steps", (f"{steps} of {total}" if total is not None else str(steps))
            + (" (stopped early)" if summary.get("stopped_early") else ""))
    if summary.get("time_s") is not None:
        add("time", format_duration(summary["time_s"]))
    if summary.get("samples_per_s") is not None:
        add("samples/s", f"{summary['samples_per_s']:,.0f} (median over log intervals after the first)")
    if summary.get("final_loss") is not None:
        add("final train loss", _num(summary["final_loss"]))
    others = sorted(k[len("final_"):] for k in summary if k.startswith("final_"))
    for key in ("eval_loss", "eval_accuracy", *[k for k in others if k not in _KNOWN_METRICS]):
        final, best = summary.get(f"final_{key}"), summary.get(f"best_{key}")
        if final is None:
            continue
        label = key.replace("_", " ")
        add(f"{label} (final / best)" if best is not None else label,
            f"{_num(final)} / {_num(best)}" if best is not None else _num(final))
    peak = summary.get("peak_memory_bytes")
    add("peak device memory", format_bytes(peak) if peak else "not measured on this device")
    add("CUDA graphs", summary.get("cuda_graphs"))
    if (summary.get("oom_splits") or 1) > 1:
        add("OOM recovery", f"micro-batches split {summary['oom_splits']}x")
    add("run directory", summary.get("run_dir"))
    return rows


def _num(value) -> str:
    return f"{value:.4f}" if isinstance(value, float) else str(value)


def summary_table(summary: dict[str, Any]):
    """A two-column rich Table of `summary_rows(summary)`."""
    from rich.table import Table

    table = Table(title="gputrain fit", show_header=False, title_justify="left")
    table.add_column("what", style="bold")
    table.add_column("value")
    for label, value in summary_rows(summary):
        table.add_row(label, value)
    return table


def render_summary(summary: dict[str, Any], console=None) -> None:
    """Print the summary table to `console` (a new rich Console on stdout when None)."""
    from rich.console import Console

    (console or Console()).print(summary_table(summary))


# ---------------------------------------------------------------- progress bar

class TrainProgress:
    """A rich progress bar (step/total, epoch, loss, samples/s, memory, ETA), redrawn only when the
    trainer calls update() at a log point: no refresh thread competes with the training loop.

    With enabled=False no rich object is created and every method returns at once.
    """

    def __init__(self, enabled: bool, total_steps: int, description: str = "training", console=None):
        self.enabled = enabled
        self.total = total_steps
        self.description = description
        self.console = console
        self._progress = None
        self._task = None

    @staticmethod
    def auto(force: bool | None = None) -> bool:
        """Whether to show a bar: `force` when given, else whether stderr is a terminal."""
        if force is not None:
            return bool(force)
        try:
            return sys.stderr.isatty()
        except (AttributeError, ValueError):  # replaced or closed stderr
            return False

    def __enter__(self) -> "TrainProgress":
        if not self.enabled:
            return self
        from rich.console import Console
        from rich.markup import escape
        from rich.progress import (BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn,
                                   TimeRemainingColumn)

        self._progress = Progress(
            TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(),
            TextColumn("epoch {task.fields[epoch]}"), TextColumn("loss {task.fields[loss]}"),
            TextColumn("{task.fields[rate]} samples/s"), TextColumn("mem {task.fields[mem]}"),
            TimeElapsedColumn(), TextColumn("ETA"), TimeRemainingColumn(),
            console=self.console or Console(stderr=True), auto_refresh=False, transient=False)
        self._progress.start()
        self._task = self._progress.add_task(escape(self.description), total=self.total,
                                             epoch="-", loss="-", rate="-", mem="-")
        self._progress.refresh()
        return self

    def update(self, step: int, epoch: float | None = None, loss: float | None = None,
               samples_per_s: float | None = None, memory_bytes: int | None = None) -> None:
        """Show the state at optimizer step `step` (memory_bytes: the device's peak, None on the CPU)."""
        if self._progress is None:
            return
        self._progress.update(
            self._task, completed=step,
            epoch=f"{epoch:.2f}" if epoch is not None else "-",
            loss=f"{loss:.4f}" if loss is not None else "-",
            rate=f"{samples_per_s:,.0f}" if samples_per_s is not None else "-",
            mem=format_bytes(memory_bytes) if memory_bytes else "-")
        self._progress.refresh()

    def __exit__(self, *exc) -> None:
        if self._progress is not None:
            self._progress.stop()
            self._progress = None
