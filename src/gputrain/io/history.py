"""History: what a run measured at each log point, and its summary; saved and loaded as JSON."""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gputrain.errors import GputrainError
from gputrain.metric_direction import metric_direction

KIND = "gputrain-history"


@dataclass
class History:
    """A run's measurements. `fit` returns one; `run_dir/history.json` holds the same.

    records: one dict per log point: step, epoch, loss, lr, samples_per_s, peak_memory_bytes
        (None on the CPU), wall_time_s (s since the run started), and eval_loss / eval_accuracy /
        any other metric where evaluated.
    config: the TrainConfig as a dict.
    summary: device, precision (+ precision_reason), time_s, samples_per_s, final_* / best_*
        metrics, peak_memory_bytes, world_size, effective_batch, ...
    """

    records: list[dict[str, Any]] = field(default_factory=list)
    config: dict[str, Any] = field(default_factory=dict)
    summary: dict[str, Any] = field(default_factory=dict)

    def add(self, record: dict[str, Any]) -> None:
        """Append one log point (copied, so later changes to `record` do not leak in)."""
        if not isinstance(record, dict):
            raise TypeError(f"a history record is a dict, got {type(record).__name__}")
        self.records.append(dict(record))

    def column(self, key: str) -> list:
        """`key` of every record, None where a record lacks it (eval metrics are sparse)."""
        return [r.get(key) for r in self.records]

    def final(self, key: str):
        """The last recorded value of `key`; None if never recorded."""
        for r in reversed(self.records):
            if r.get(key) is not None:
                return r[key]
        return None

    def best(self, key: str, mode: str = "auto"):
        """The best recorded value of `key`, NaN skipped; None if never recorded. mode: "max" (the
        largest), "min" (the smallest), or "auto": the direction the run's summary used for `key`,
        else gputrain's rule for its name (metric_direction.py: eval_loss lowest, accuracy highest)."""
        if mode == "auto":
            used = (self.summary.get("metric_directions") or {}).get(key)
            stated = (self.config or {}).get("metric_modes") or None
            mode = used["mode"] if isinstance(used, dict) and used.get("mode") in ("max", "min") \
                else metric_direction(key, stated).mode
        if mode not in ("max", "min"):
            raise ValueError(f"mode must be 'auto', 'max' or 'min', got {mode!r}")
        values = [r[key] for r in self.records
                  if r.get(key) is not None and not (isinstance(r[key], float) and math.isnan(r[key]))]
        if not values:
            return None
        return max(values) if mode == "max" else min(values)

    def to_dict(self) -> dict[str, Any]:
        return {"kind": KIND, "records": self.records, "config": self.config, "summary": self.summary}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "History":
        """The inverse of to_dict; GputrainError when `data` is not a history."""
        if not isinstance(data, dict) or data.get("kind") != KIND:
            got = f"an object with keys {sorted(data)[:5]}" if isinstance(data, dict) else type(data).__name__
            raise GputrainError(f"not a gputrain history (expected a JSON object with kind {KIND!r}, got {got})")
        records = data.get("records", [])
        if not isinstance(records, list) or not all(isinstance(r, dict) for r in records):
            raise GputrainError("not a gputrain history: 'records' must be a list of objects")
        return cls(records=[dict(r) for r in records], config=dict(data.get("config") or {}),
                   summary=dict(data.get("summary") or {}))

    def save(self, path: str | os.PathLike) -> Path:
        """Write as JSON atomically (a reader never sees half a file); returns the path."""
        from gputrain.io.atomic import atomic_file

        path = Path(path)
        with atomic_file(path, "w") as f:
            json.dump(self.to_dict(), f, indent=1, default=json_default)
        return path

    @classmethod
    def load(cls, path: str | os.PathLike) -> "History":
        """Read a history.json; GputrainError naming the file when it is missing or not a history."""
        path = Path(path)
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
        except FileNotFoundError:
            raise GputrainError(f"{path}: no such file (fit writes history.json in its run directory)") from None
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise GputrainError(f"{path}: cannot read a history: {exc}") from None
        try:
            return cls.from_dict(data)
        except GputrainError as exc:
            raise GputrainError(f"{path}: {exc}") from None


def json_default(value: Any) -> Any:
    """JSON for what json cannot write itself: numpy / 0-d torch scalars as numbers, paths etc. as text."""
    item = getattr(value, "item", None)
    if callable(item):
        try:
            return item()
        except (ValueError, RuntimeError, TypeError):
            pass
    if isinstance(value, (set, frozenset)):
        return sorted(value, key=str)
    return str(value)
