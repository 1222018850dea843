"""What every tracker shares (report/trackers.py opens them; mlflow_tracker.py and wandb_tracker.py
implement it): the interface, the error for a tracker that cannot run here, a record's numbers, the
run's name, and the run ids kept in the run directory so that a resumed run continues its tracker run.
"""

from __future__ import annotations

import importlib
import json
import numbers
from pathlib import Path
from types import ModuleType
from typing import Any

IDS_FILE = "trackers.json"  # the MLflow / W&B run ids of a run directory, so that a resume continues them


class TrackerUnavailable(Exception):
    """A tracker cannot run here (its package is missing, its server unreachable); the message says why."""


class Tracker:
    """The interface every tracker implements (no-op defaults). Called on rank 0 only."""

    name = "tracker"

    def log(self, record: dict[str, Any]) -> None:
        pass

    def close(self, summary: dict[str, Any] | None = None) -> None:
        pass

    def finish(self, summary: dict[str, Any], files: list[Path]) -> None:
        pass

    def fail(self, error: BaseException) -> None:
        pass


def numeric(value: Any) -> float | None:
    """A record value as a float, or None when it is not a number (bools, strings, None, lists)."""
    if isinstance(value, bool):
        return None
    if isinstance(value, numbers.Real):
        return float(value)
    return None


def run_name(run_dir: Path, config: dict[str, Any]) -> str:
    """The name a tracker shows for a run: the workload (or config name) and the run directory's name."""
    name = config.get("name")
    return f"{name}/{run_dir.name}" if name else run_dir.name


def read_ids(run_dir: Path) -> dict[str, str]:
    try:
        data = json.loads((run_dir / IDS_FILE).read_text())
    except (OSError, ValueError):
        return {}
    return {str(k): str(v) for k, v in data.items()} if isinstance(data, dict) else {}


def write_id(run_dir: Path, tracker: str, run_id: str) -> None:
    from gputrain.io.atomic import atomic_file

    ids = read_ids(run_dir)
    ids[tracker] = run_id
    with atomic_file(run_dir / IDS_FILE, "w") as f:
        f.write(json.dumps(ids, indent=2) + "\n")


def numbers_at_step(record: dict[str, Any]) -> tuple[int, dict[str, float]]:
    """(record["step"], the record's other numeric values): what a tracker logs at a log point."""
    step = int(record.get("step") or 0)
    return step, {k: x for k, v in record.items() if k != "step" and (x := numeric(v)) is not None}


def require(package: str, install_hint: str) -> ModuleType:
    """The tracker's package, imported; TrackerUnavailable naming how to install it when it is missing."""
    try:
        return importlib.import_module(package)
    except ImportError as exc:
        raise TrackerUnavailable(f"{package} is not installed ({exc}): {install_hint}") from None


def resumed_id(run_dir: Path, tracker: str, start_step: int) -> str | None:
    """The tracker's run id saved in `run_dir` when this run resumes (start_step > 0), else None."""
    return read_ids(run_dir).get(tracker) if start_step > 0 else None
