"""Weights & Biases behind the tracker interface (report/trackers.py), through the wandb library.

Mode: WANDB_MODE when set; else online when you have logged in (`wandb login`: WANDB_API_KEY or an
entry in ~/.netrc), and offline otherwise, with a line saying how to upload the run later (`wandb
sync`). Files go under the run directory (RUN_DIR/wandb/). The project is WANDB_PROJECT, else
"gputrain"; the run is named after the workload and the run directory.

What: the TrainConfig as the run's config; every number of each log point at its step; at the end
the summary's numbers and strings in the run summary and report.html, curves.png and history.json
as run files. A resumed run continues its W&B run (the id is kept in RUN_DIR/trackers.json).
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any, Literal

from gputrain.report.tracker_base import (Tracker, TrackerUnavailable, numbers_at_step, numeric, require, resumed_id,
                                          run_name, write_id)

log = logging.getLogger("gputrain")

INSTALL_HINT = "pip install 'gputrain[track]' (wandb)"


class WandbTracker(Tracker):
    name = "wandb"

    def __init__(self, run_dir: Path, config: dict[str, Any], start_step: int):
        wandb: Any = require("wandb", INSTALL_HINT)
        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        mode = _mode(os.environ.get("WANDB_MODE") or ("online" if logged_in() else "offline"))
        previous = resumed_id(self.run_dir, self.name, start_step)
        # console="off": wandb leaves stdout/stderr (the progress bar, the run log) alone; no git or
        # code capture, no system-metrics sampler thread beside the training loop.
        settings = wandb.Settings(silent=True, console="off", save_code=False, disable_git=True,
                                  x_disable_stats=True)
        self.run = wandb.init(project=os.environ.get("WANDB_PROJECT") or "gputrain",
                              name=run_name(self.run_dir, config), config=config, dir=str(self.run_dir),
                              mode=mode, id=previous, resume="allow" if previous else None,
                              reinit="create_new", settings=settings)
        self.mode = mode
        write_id(self.run_dir, self.name, self.run.id)
        if mode == "offline" and not os.environ.get("WANDB_MODE"):
            log.info("W&B: not logged in, so the run is recorded offline in %s; upload it later with "
                     "`wandb sync %s`", self.run.dir, Path(self.run.dir).parent)

    def log(self, record: dict[str, Any]) -> None:
        step, values = numbers_at_step(record)
        if values:
            self.run.log(values, step=step)

    def finish(self, summary: dict[str, Any], files: list[Path]) -> None:
        kept = {k: v for k, v in summary.items()
                if numeric(v) is not None or (isinstance(v, str) and v)}
        self.run.summary.update(kept)
        for path in files:
            if path.is_file():
                self.run.save(str(path), base_path=str(path.parent), policy="now")
        self.run.finish(exit_code=0)

    def fail(self, error: BaseException) -> None:
        self.run.finish(exit_code=1)


def logged_in() -> bool:
    """Whether wandb would find an API key: WANDB_API_KEY, or a ~/.netrc entry for its host."""
    if os.environ.get("WANDB_API_KEY"):
        return True
    import netrc
    from urllib.parse import urlparse

    host = urlparse(os.environ.get("WANDB_BASE_URL") or "https://api.wandb.ai").hostname or "api.wandb.ai"
    path = os.environ.get("NETRC") or os.path.expanduser("~/.netrc")
    try:
        return netrc.netrc(path).authenticators(host) is not None
    except (OSError, netrc.NetrcParseError):
        return False


def _mode(value: str) -> Literal["online", "offline", "disabled", "shared"]:
    value = value.strip().lower()
    if value == "dryrun":  # wandb's old name for offline
        return "offline"
    if value == "online":
        return "online"
    if value == "offline":
        return "offline"
    if value == "disabled":
        return "disabled"
    if value == "shared":
        return "shared"
    raise TrackerUnavailable(f"WANDB_MODE={value!r}: use online, offline or disabled")
