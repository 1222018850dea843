"""Ray Train's side of a run's reports and checkpoints: metrics to `ray.train.report` at log points,
each committed checkpoint handed to Ray as a `ray.train.Checkpoint`, and a restarted worker group
resumed from the newest one Ray holds.

    def train_func():                       # what TorchTrainer runs on each worker
        with resume_from_ray(TrainConfig(run_dir="/shared/run", ...)) as config:
            fit(model, data, config=config, callbacks=[RayReport()])

A Ray checkpoint holds the run's own checkpoint as the run's store wrote it, under its own name:
`step-000123.pt` with its `.sha256`, or the sharded folder `step-000123.dcp/` (DCP's files and their
MANIFEST.sha256); the run directory keeps its own store as under torchrun. The folder handed to Ray
is a staging folder of hard links beside the store (no copy on the same file system), verified
before Ray copies it into its storage, and removed after.

`ray.train.report` is a barrier across the workers: every rank calls it equally often (the trainer
tells every rank of each checkpoint, checkpoint/manager.py's `_hand_over`); rank 0 alone hands Ray the
checkpoint, and its metrics are the ones Ray keeps with it. A log point's record is reported with the
checkpoint of the same step when one follows it (so Ray's Result knows each checkpoint's metrics: the
best by CheckpointConfig's score and the latest), else at the next log point or the run's end.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any, Iterator

from gputrain.errors import CheckpointError, ConfigError

log = logging.getLogger("gputrain")

STAGING_PREFIX = ".ray-checkpoint-"  # the staging folder's name in the run directory, while Ray copies it


class RayReport:
    """Reports each log point's record to Ray Train and hands it every committed checkpoint (see the
    module docstring). Give it to `fit` inside a TorchTrainer's training function; `gputrain fit
    --launcher ray` adds it itself. A callback by its hooks (train/loop/callbacks.py), without state of its
    own in checkpoints; `run` is the trainer's RunControl."""

    def __init__(self) -> None:
        self._pending: dict[str, Any] | None = None  # the last log point's values, not reported yet
        self._last: dict[str, Any] = {}  # the values last reported

    def on_run_start(self, run: Any) -> None:
        from gputrain.runtime.ray_train import in_ray_worker

        if not in_ray_worker():
            raise ConfigError("RayReport reports to Ray Train: give it to fit inside the training function a "
                              "TorchTrainer runs (or train with `gputrain fit --launcher ray`), not in this process")

    def on_log(self, run: Any, record: dict[str, Any]) -> None:
        if self._pending is not None:
            self._report(self._pending)
        self._pending = _numbers(record)

    def on_checkpoint(self, run: Any, path: Path) -> None:
        metrics = self._pending if self._pending is not None and self._pending.get("step") == run.step else \
            {**self._last, "step": run.step}
        if self._pending is not None and self._pending is not metrics:
            self._report(self._pending)
        self._pending = None
        if not run.is_main:
            self._report(metrics)
            return
        staging = stage_checkpoint(path)
        try:
            self._report(metrics, staging)
        finally:
            shutil.rmtree(staging, ignore_errors=True)

    def on_run_end(self, run: Any, history: Any) -> None:
        if self._pending is not None:
            self._report(self._pending)
            self._pending = None

    def _report(self, metrics: dict[str, Any], staging: Path | None = None) -> None:
        import ray.train

        checkpoint = ray.train.Checkpoint.from_directory(str(staging)) if staging is not None else None
        ray.train.report(dict(metrics), checkpoint=checkpoint)
        self._last = dict(metrics)


def _numbers(record: dict[str, Any]) -> dict[str, Any]:
    """A record's numbers (Ray's metrics; None and text left out)."""
    return {k: v for k, v in record.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}


def stage_checkpoint(path: Path) -> Path:
    """A new folder beside the run's store holding `path` (a one-file checkpoint with its .sha256, or a
    sharded folder) under its own name, as hard links; verified. Raises CheckpointError when the
    checkpoint does not verify (nothing is handed to Ray then)."""
    from gputrain.checkpoint.digests import verify
    from gputrain.checkpoint.names import sha256_sidecar

    run_dir = path.parent.parent  # RUN_DIR/checkpoints/step-N.*
    staging = Path(tempfile.mkdtemp(prefix=STAGING_PREFIX, dir=run_dir))
    try:
        if path.is_dir():
            for source in sorted(path.rglob("*")):
                target = staging / path.name / source.relative_to(path)
                if source.is_dir():
                    target.mkdir(parents=True, exist_ok=True)
                else:
                    _link(source, target)
        else:
            _link(path, staging / path.name)
            _link(sha256_sidecar(path), staging / sha256_sidecar(path).name)
        verdict = verify(staging / path.name)
        if verdict is not True:
            raise CheckpointError(f"{path} does not verify ({verdict}): not handed to Ray")
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return staging


def _link(source: Path, target: Path) -> None:
    """A hard link (the same bytes, no copy); a copy through io/atomic.py across file systems."""
    target.parent.mkdir(parents=True, exist_ok=True)
    try:
        os.link(source, target)
    except OSError:
        from gputrain.io.atomic import atomic_file

        with open(source, "rb") as src, atomic_file(target, "wb") as dst:
            shutil.copyfileobj(src, dst)


def checkpoint_in(folder: Path) -> Path:
    """The run's checkpoint inside a Ray checkpoint's folder (step-N.pt or step-N.dcp, the newest
    step when several); CheckpointError when it holds none."""
    from gputrain.checkpoint.names import step_of

    found = sorted((p for p in folder.iterdir() if step_of(p) is not None and not p.name.endswith(".sha256")),
                   key=lambda p: step_of(p) or 0)
    if not found:
        raise CheckpointError(f"Ray's checkpoint {folder} holds no gputrain checkpoint (step-N.pt or step-N.dcp): "
                              "it was not written by gputrain's RayReport")
    return found[-1]


@contextlib.contextmanager
def resume_from_ray(config: Any) -> Iterator[Any]:
    """`config` (a TrainConfig) to resume from the newest checkpoint Ray holds for this run, while the
    context lasts (a restarted worker group after a failure, under FailureConfig(max_failures=...));
    `config` itself on the first start, or outside a Ray Train worker. The checkpoint is verified
    first (CheckpointError when it does not)."""
    from gputrain.checkpoint.digests import verify
    from gputrain.runtime.ray_train import ray_checkpoint_dir

    with ray_checkpoint_dir() as folder:
        if folder is None:
            yield config
            return
        path = checkpoint_in(folder)
        verdict = verify(path)
        if verdict is not True:
            raise CheckpointError(f"Ray's newest checkpoint {path} does not verify ({verdict})")
        log.info("resuming from Ray's newest checkpoint %s", path)
        yield config.replace(resume=str(path))
