"""TensorBoard event files in a run directory, written at each log point.

`tensorboard --logdir runs/` then shows every run directory under runs/ as one run: train loss
and lr, samples/s, peak memory and every eval metric against the optimizer step, and the run's
config (as hparams and as a text table).

Uses tensorboard's own writer (torch.utils.tensorboard.SummaryWriter), so the files are exactly
what TensorBoard reads. Without the tensorboard package the log says how to install it and does
nothing else: a run never fails for want of it.
"""

from __future__ import annotations

import json
import logging
import math
import numbers
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

# Record keys with a fixed place; any other key goes to train/<key>, eval_<name> to eval/<name>.
TAGS = {
    "loss": "train/loss",
    "lr": "train/lr",
    "epoch": "train/epoch",
    "samples_per_s": "speed/samples_per_s",
    "wall_time_s": "speed/wall_time_s",
    "peak_memory_bytes": "memory/peak_memory_bytes",
}
_SKIP = {"step"}  # the x axis (global_step), not a series

INSTALL_HINT = "pip install tensorboard"


def tag_for(key: str) -> str:
    """The TensorBoard tag of a record key: loss -> train/loss, eval_accuracy -> eval/accuracy, ..."""
    if key in TAGS:
        return TAGS[key]
    if key.startswith("eval_") and len(key) > len("eval_"):
        return "eval/" + key[len("eval_"):]
    return "train/" + key


def _scalar(value: Any) -> float | None:
    """A record value as a float, or None when it is not a number (None, strings, lists; bools too)."""
    if isinstance(value, bool):
        return None
    if isinstance(value, numbers.Real):
        return float(value)
    if hasattr(value, "item") and getattr(value, "ndim", None) == 0:  # a numpy or torch scalar
        return _scalar(value.item())
    return None


def _hparam(value: Any) -> int | float | str | bool:
    """A config value as TensorBoard's hparams plugin takes it (numbers, strings and bools; the rest as JSON)."""
    if isinstance(value, (bool, int, float, str)):
        return value
    return json.dumps(value, default=str)


def config_markdown(config: dict[str, Any]) -> str:
    """The config as a markdown table (TensorBoard's Text tab renders markdown)."""
    rows = ["| setting | value |", "|---|---|"]
    for key in sorted(config):
        value = json.dumps(config[key], default=str).replace("|", "\\|")
        rows.append(f"| {key} | `{value}` |")
    return "\n".join(rows)


class TensorBoardLog:
    """Event files in `run_dir` for TensorBoard: one scalar per numeric key of each record.

    run_dir: where the event files go (the run directory itself, so `tensorboard --logdir` on a
        folder of run directories lists each run by its directory name).
    config: the run's config (TrainConfig as a dict): written at once as text, and as hparams at
        close() together with the metrics the run logged.
    enabled: False makes every method a no-op (the `--no-tensorboard` switch).
    truncate_after_step: as in MetricsLog: a resumed run passes its checkpoint's step so that
        TensorBoard hides what an earlier attempt logged after it; a fresh run passes 0 to hide
        what an earlier run in the same directory logged. None keeps everything.

    Under torch.distributed only rank 0 writes: on any other rank this is disabled whatever
    `enabled` says.
    """

    def __init__(self, run_dir: str | Path, config: dict[str, Any] | None = None, enabled: bool = True,
                 truncate_after_step: int | None = None):
        self.dir = Path(run_dir)
        self.config = dict(config or {})
        self.tags: dict[str, str] = {}  # tag -> record key, in first-seen order
        self.last: dict[str, float] = {}  # tag -> last finite value
        self._writer = None
        self.enabled = bool(enabled) and _is_rank_zero()
        if not self.enabled:
            return
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError as exc:
            log.warning("TensorBoard logging is off: the tensorboard package is not importable (%s). "
                        "Install it with `%s` to get event files in the run directory, "
                        "or pass --no-tensorboard to silence this.", exc, INSTALL_HINT)
            self.enabled = False
            return
        self.dir.mkdir(parents=True, exist_ok=True)
        purge = None if truncate_after_step is None else int(truncate_after_step) + 1
        self._writer = SummaryWriter(log_dir=str(self.dir), purge_step=purge, flush_secs=30)
        if self.config:
            self._writer.add_text("config", config_markdown(self.config), global_step=0)
        self._writer.flush()

    @property
    def path(self) -> Path | None:
        """The event file being written (None when disabled)."""
        # SummaryWriter holds its file_writer from __init__ until its close(), when ours is None too.
        file_writer = self._writer.file_writer if self._writer is not None else None
        return Path(file_writer.event_writer._file_name) if file_writer is not None else None

    def append(self, record: dict[str, Any]) -> None:
        """Write every numeric key of `record` as a scalar at global_step=record["step"], and flush."""
        if self._writer is None:
            return
        step = record.get("step")
        if step is None or _scalar(step) is None:
            raise ValueError(f"a TensorBoard record needs a numeric 'step' (the x axis), got {step!r}")
        step = int(step)
        for key, value in record.items():
            if key in _SKIP:
                continue
            x = _scalar(value)
            if x is None:
                continue
            tag = tag_for(key)
            self.tags.setdefault(tag, key)
            self._writer.add_scalar(tag, x, global_step=step)
            if math.isfinite(x):
                self.last[tag] = x
        self._writer.flush()  # log points are rare; a crashed run keeps what it logged

    def close(self, summary: dict[str, Any] | None = None) -> None:
        """Write the hparams (config against the last value of each logged metric) and close the file.

        summary: the run summary, written as text too when given.
        """
        if self._writer is None:
            return
        try:
            if summary:
                self._writer.add_text("summary", config_markdown(summary).replace("| setting |", "| what |"),
                                      global_step=0)
            if self.config:
                from torch.utils.tensorboard.summary import hparams

                hp = {k: _hparam(v) for k, v in self.config.items()}
                metrics = dict(self.last) or {"train/loss": float("nan")}
                file_writer = self._writer.file_writer
                if file_writer is None:  # never: SummaryWriter holds it until its close()
                    raise RuntimeError("the TensorBoard event file was closed before the run's end")
                for summary_pb in hparams(hp, metrics):
                    file_writer.add_summary(summary_pb)
        finally:
            self._writer.close()
            self._writer = None

    def __enter__(self) -> "TensorBoardLog":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _is_rank_zero() -> bool:
    try:
        import torch.distributed as dist
    except ImportError:
        return True
    return not (dist.is_available() and dist.is_initialized()) or dist.get_rank() == 0
