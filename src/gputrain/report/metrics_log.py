"""metrics.jsonl and metrics.csv in a run directory, appended at each log point."""

from __future__ import annotations

import csv
import json
from pathlib import Path
from typing import Any

from gputrain.io.history import json_default
from gputrain.io.run_layout import METRICS_CSV, METRICS_JSONL

# The CSV's first columns, always present and in this order so that a reader can rely on them.
# A record with another key (a new metric, say) widens the CSV: the file is rewritten once, atomically,
# with the key as a new last column and empty cells in the rows before. Every key is also in the
# JSON-lines file, one object per log point.
CSV_COLUMNS = ["step", "epoch", "loss", "lr", "samples_per_s", "peak_memory_bytes", "wall_time_s",
               "eval_loss", "eval_accuracy"]


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
        self.jsonl_path = self.dir / METRICS_JSONL
        self.csv_path = self.dir / METRICS_CSV
        if truncate_after_step is not None:
            self._truncate(truncate_after_step)
        self.columns = list(CSV_COLUMNS)
        header = self._csv_header()
        if header:
            self.columns = header  # keep a resumed run's columns (widened ones included)
        self._jsonl = open(self.jsonl_path, "a", encoding="utf-8")
        self._open_csv(write_header=not header)  # sets _csv_file and _csv

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
        from gputrain.io.atomic import atomic_file

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
        from gputrain.io.atomic import atomic_file

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
