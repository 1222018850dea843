"""Everything a run writes, behind one object the trainer feeds.

At each log point: every tracker the run names (`TrainConfig.loggers`, report/trackers.py): by
default a row in metrics.jsonl / metrics.csv and TensorBoard scalars; MLflow and W&B when asked. At
the end: history.json, curves.png and report.html in the run directory, then each tracker's finish
(the summary, and those files as artifacts). Only the main process writes; a resumed run drops rows
logged after its checkpoint (they are logged again). A failing plot, report or tracker never fails
a run: it is logged as a warning.
"""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path
from typing import Any

from gputrain.config import DEFAULT_LOGGERS
from gputrain.io.run_layout import CURVES_FILE, HISTORY_FILE, REPORT_FILE
from gputrain.report.trackers import Trackers, open_trackers

log = logging.getLogger("gputrain")


class RunOutputs:
    def __init__(self, run_dir: Path | None, config, enabled: bool, start_step: int = 0):
        self.run_dir = run_dir
        self.enabled = bool(enabled and run_dir is not None)
        names = tuple(getattr(config, "loggers", DEFAULT_LOGGERS))
        opened = open_trackers(names, run_dir, dataclasses.asdict(config), start_step) \
            if self.enabled and run_dir is not None else []
        self.trackers = Trackers(opened)

    def append(self, record: dict[str, Any]) -> None:
        self.trackers.log(record)

    def close(self, summary: dict[str, Any] | None = None, error: BaseException | None = None) -> None:
        """No more log points (TensorBoard writes `summary` as text when given). With `error` (the run
        failed or was stopped by a signal) the trackers end here, marked failed; otherwise `finish`
        ends them."""
        self.trackers.close(summary)
        if error is not None:
            self.trackers.fail(error)

    def finish(self, history) -> None:
        """history.json, curves.png and report.html (after close), then the trackers' finish."""
        run_dir = self.run_dir
        if not self.enabled or run_dir is None:
            return
        history.save(run_dir / HISTORY_FILE)
        from gputrain.report.html import write_report
        from gputrain.report.plots import plot_history

        for what, write in ((CURVES_FILE, lambda: plot_history(history, run_dir / CURVES_FILE)),
                            (REPORT_FILE, lambda: write_report(run_dir))):
            try:
                write()
            except Exception as exc:  # the run itself succeeded; say what is missing
                log.warning("could not write %s: %s: %s", what, type(exc).__name__, exc)
        files = [run_dir / name for name in (REPORT_FILE, CURVES_FILE, HISTORY_FILE)]
        self.trackers.finish(dict(history.summary), files)
