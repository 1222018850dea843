"""Everything a run writes into its run directory, behind one object the trainer feeds.

At each log point: a row in metrics.jsonl / metrics.csv and TensorBoard scalars. At the end:
history.json, curves.png and report.html. Only the main process writes; a resumed run drops rows
logged after its checkpoint (they are logged again). A failing plot or report never fails a
finished run: it is logged as a warning.
"""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path
from typing import Any

from gputrain.report.metrics_log import MetricsLog
from gputrain.report.tensorboard import TensorBoardLog

log = logging.getLogger("gputrain")


class RunOutputs:
    def __init__(self, run_dir: Path | None, config, enabled: bool, start_step: int = 0):
        self.run_dir = run_dir
        self.enabled = bool(enabled and run_dir is not None)
        self.metrics: MetricsLog | None = None
        self.tensorboard: TensorBoardLog | None = None
        if enabled and run_dir is not None:
            self.metrics = MetricsLog(run_dir, truncate_after_step=start_step)
            self.tensorboard = TensorBoardLog(run_dir, dataclasses.asdict(config), enabled=config.tensorboard,
                                              truncate_after_step=start_step)

    def append(self, record: dict[str, Any]) -> None:
        if self.metrics:
            self.metrics.append(record)
        if self.tensorboard:
            self.tensorboard.append(record)

    def close(self, summary: dict[str, Any] | None = None) -> None:
        if self.metrics:
            self.metrics.close()
            self.metrics = None
        if self.tensorboard:
            self.tensorboard.close(summary)
            self.tensorboard = None

    def finish(self, history) -> None:
        """history.json, curves.png and report.html (after close)."""
        run_dir = self.run_dir
        if not self.enabled or run_dir is None:
            return
        history.save(run_dir / "history.json")
        from gputrain.report.html import write_report
        from gputrain.report.plots import plot_history

        for what, write in (("curves.png", lambda: plot_history(history, run_dir / "curves.png")),
                            ("report.html", lambda: write_report(run_dir))):
            try:
                write()
            except Exception as exc:  # the run itself succeeded; say what is missing
                log.warning("could not write %s: %s: %s", what, type(exc).__name__, exc)
