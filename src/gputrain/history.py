"""History: what a run measured at each log point, and its summary; saved and loaded as JSON."""

from __future__ import annotations

import json
import os
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gputrain.errors import GputrainError

KIND = "gputrain-history"


@dataclass
class History:
    # One dict per log point: step, epoch, loss, lr, samples_per_s, peak_memory_bytes, wall_time_s,
    # and eval_loss / eval_accuracy where evaluated.
    records: list[dict[str, Any]] = field(default_factory=list)
    config: dict[str, Any] = field(default_factory=dict)
    # device, precision (+ reason), time_s, samples_per_s, final/best metrics, peak memory, ...
    summary: dict[str, Any] = field(default_factory=dict)

    def add(self, record: dict[str, Any]) -> None:
        self.records.append(dict(record))

    def column(self, key: str) -> list:
        return [r.get(key) for r in self.records]

    def final(self, key: str):
        """The last recorded value of `key` (None if never recorded)."""
        for r in reversed(self.records):
            if r.get(key) is not None:
                return r[key]
        return None

    def best(self, key: str, mode: str = "max"):
        values = [r[key] for r in self.records if r.get(key) is not None]
        if not values:
            return None
        return max(values) if mode == "max" else min(values)

    def to_dict(self) -> dict[str, Any]:
        return {"kind": KIND, "records": self.records, "config": self.config, "summary": self.summary}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "History":
        if not isinstance(data, dict) or data.get("kind") != KIND:
            raise GputrainError("not a gputrain history (expected a JSON object with kind 'gputrain-history')")
        return cls(records=list(data.get("records", [])), config=dict(data.get("config", {})),
                   summary=dict(data.get("summary", {})))

    def save(self, path: str | os.PathLike) -> Path:
        """Write as JSON atomically (a reader never sees half a file)."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
        try:
            with os.fdopen(fd, "w") as f:
                json.dump(self.to_dict(), f, indent=1, default=str)
            os.replace(tmp, path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
        return path

    @classmethod
    def load(cls, path: str | os.PathLike) -> "History":
        path = Path(path)
        try:
            data = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError) as exc:
            raise GputrainError(f"{path}: cannot read a history: {exc}") from None
        try:
            return cls.from_dict(data)
        except GputrainError as exc:
            raise GputrainError(f"{path}: {exc}") from None
