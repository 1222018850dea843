"""Experiment trackers: one interface, with CSV/JSONL files, TensorBoard, MLflow and W&B behind it.

The trainer feeds `RunOutputs` (report/run_outputs.py), which feeds every tracker the run names
(`TrainConfig.loggers`, `gputrain fit --logger ...`; default: csv and tensorboard):

    log(record)             at each log point: the record's numbers at record["step"] (evaluations included)
    close(summary)          no more log points (the loop ended, well or not; the summary when known)
    finish(summary, files)  the run ended well: its summary, and report.html / curves.png / history.json
    fail(error)             the run ended with an error or a stop signal

Only rank 0 tracks. A tracker is a side channel: one that cannot start or fails later (no server, a
bad URI, a missing package) costs one warning line and is dropped for the rest of the run; training
goes on. MLflow and W&B are imported only when named, so `import gputrain` does not load them.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any, Callable

from gputrain.config import check_loggers
from gputrain.report.tracker_base import Tracker, TrackerUnavailable

log = logging.getLogger("gputrain")

# ---------------------------------------------------------------- the files in the run directory


class FilesTracker(Tracker):
    """metrics.jsonl and metrics.csv in the run directory (report/metrics_log.py)."""

    name = "csv"

    def __init__(self, run_dir: Path, start_step: int):
        from gputrain.report.metrics_log import MetricsLog

        self.metrics: Any = MetricsLog(run_dir, truncate_after_step=start_step)

    def log(self, record: dict[str, Any]) -> None:
        self.metrics.append(record)

    def close(self, summary: dict[str, Any] | None = None) -> None:
        if self.metrics is not None:
            self.metrics.close()
            self.metrics = None


class TensorBoardTracker(Tracker):
    """TensorBoard event files in the run directory (report/tensorboard.py)."""

    name = "tensorboard"

    def __init__(self, run_dir: Path, config: dict[str, Any], start_step: int):
        from gputrain.report.tensorboard import TensorBoardLog

        self.board: Any = TensorBoardLog(run_dir, config, truncate_after_step=start_step)

    def log(self, record: dict[str, Any]) -> None:
        self.board.append(record)

    def close(self, summary: dict[str, Any] | None = None) -> None:
        if self.board is not None:
            self.board.close(summary)
            self.board = None


# ---------------------------------------------------------------- opening them, and keeping failures small


def _factory(name: str) -> Callable[[Path, dict[str, Any], int], Tracker]:
    if name == "csv":
        return lambda run_dir, config, start: FilesTracker(run_dir, start)
    if name == "tensorboard":
        return TensorBoardTracker
    if name == "mlflow":
        from gputrain.report.mlflow_tracker import MLflowTracker

        return MLflowTracker
    from gputrain.report.wandb_tracker import WandbTracker

    return WandbTracker


def open_trackers(names: tuple[str, ...], run_dir: Path, config: dict[str, Any], start_step: int) -> list[Tracker]:
    """The trackers `names`, each started; one that cannot start is a warning and is left out."""
    trackers = []
    for name in check_loggers(names):
        try:
            trackers.append(_factory(name)(run_dir, config, start_step))
        except Exception as exc:  # a side channel: never stops the run
            warn_off(name, exc)
    return trackers


def warn_off(name: str, exc: BaseException) -> None:
    text = str(exc).strip().splitlines()
    why = text[0] if text else ""
    if len(why) > 240:
        why = why[:237] + "..."
    kind = "" if isinstance(exc, TrackerUnavailable) else f"{type(exc).__name__}: "
    log.warning("%s tracking is off for this run: %s%s (training goes on)", name, kind, why)


class Trackers:
    """Every tracker of a run, called in turn; the first failure of one drops it with a warning."""

    def __init__(self, trackers: list[Tracker]):
        self.trackers = list(trackers)

    def _each(self, call: Callable[[Tracker], None]) -> None:
        for tracker in list(self.trackers):
            try:
                call(tracker)
            except Exception as exc:
                self.trackers.remove(tracker)
                warn_off(tracker.name, exc)
                try:
                    tracker.close()
                except Exception:
                    pass

    def log(self, record: dict[str, Any]) -> None:
        self._each(lambda t: t.log(record))

    def close(self, summary: dict[str, Any] | None = None) -> None:
        self._each(lambda t: t.close(summary))

    def finish(self, summary: dict[str, Any], files: list[Path]) -> None:
        self._each(lambda t: t.finish(summary, files))
        self.trackers = []

    def fail(self, error: BaseException) -> None:
        self._each(lambda t: t.fail(error))
        self.trackers = []
