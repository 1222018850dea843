"""The checkpoint store, RUN_DIR/checkpoints/: how checkpoints are kept there (each with its content
hash, the last keep_last and the best), and which one a resume takes after any crash.

Layout, in RUN_DIR/checkpoints/ (names.py has every name):

    step-000123.pt          the checkpoint (format.py's one file), written atomically
    step-000123.pt.sha256   "HEX  step-000123.pt" (sha256sum's format: `sha256sum -c` checks it)
    latest                  the name of the newest checkpoint written, one line
    index.json              {"best": {...}}: which file is the best by a metric, kept across restarts

One `save` writes, in this order, each step atomically (temp file, fsync, rename):
  1. the checkpoint's bytes to a temp file, hashed as they are written;
  2. its `.sha256` (before the checkpoint is renamed into place, so that no checkpoint exists
     under its final name without its hash; when a file of that step already exists, the
     `.sha256` lists both digests until the rename is done, and then the new one alone);
  3. the rename of the checkpoint; 4. `index.json` when the metric improved; 5. `latest`;
  6. pruning: older checkpoints beyond `keep_last` are deleted, the checkpoint first and its
     `.sha256` after it, never the newest nor the best.
A SIGKILL or a power cut at any moment therefore leaves the previous checkpoint or the new one,
both verifying; what it can leave besides (a temp file, a `.sha256` without its checkpoint, a
checkpoint not yet pruned) is harmless and cleaned by the next save.

`load_latest` tries the file `latest` names, then the others from the highest step down, and
takes the first whose hash verifies, with a warning naming each file it skipped and why. Files
with a higher step than the one `latest` names come last: they are either a save cut short
before it moved `latest` (the previous checkpoint is as good) or what remains of a run that was
resumed from an earlier step (older work, not newer). Step numbers come from the file names, not
modification times, which copies and clocks change.

Sharded checkpoints (checkpoint/sharded.py) live beside the files as folders, step-000123.dcp/, with
the same promises: a folder appears under its step name only whole (every rank's files, DCP's
metadata and MANIFEST.sha256, renamed into place by `commit_dir`), `latest` moves after it, the
last keep_last and the best are kept whatever their format, and `load_latest` / `find_latest` skip
a folder any of whose files does not match its manifest, with a warning naming that file.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import shutil
import tempfile
import warnings
from pathlib import Path
from typing import Any, Callable

import torch

from gputrain.checkpoint.digests import Damage, listed_digests, verify, write_sidecar
from gputrain.checkpoint.format import write_checkpoint
from gputrain.checkpoint.names import (BEST_INDEX, DCP_SUFFIX, LATEST, SHA256_SUFFIX, sha256_sidecar, step_dir_name,
                                       step_file_name, step_of)
from gputrain.checkpoint.read import read_checkpoint
from gputrain.errors import CheckpointError, ConfigError
from gputrain.io.atomic import atomic_file, fsync_dir, remove_stale_temps
from gputrain.io.run_layout import CHECKPOINTS_DIR, LEGACY_CHECKPOINT
from gputrain.metric_direction import Direction, metric_direction

log = logging.getLogger(__name__)


class CheckpointWarning(UserWarning):
    """A checkpoint was skipped (damaged, unverifiable) and an earlier one used instead."""


class CheckpointStore:
    """Saves, retains, verifies and finds a run's checkpoints (see the module's docstring).

    keep_last: how many of the newest checkpoints to keep (>= 1). best_metric: a key of the
    `metrics` given to `save` (e.g. "eval_accuracy"); the checkpoint with its best value is kept
    as well, whatever its age. best_mode: "max", "min", or "auto": by the name, as
    gputrain/metric_direction.py decides (lower for a loss, an error, ...). One process writes a
    run directory (rank 0 under torch.distributed).
    """

    def __init__(self, run_dir: str | os.PathLike, keep_last: int = 2, best_metric: str | None = None,
                 best_mode: str = "auto"):
        if isinstance(keep_last, bool) or not isinstance(keep_last, int) or keep_last < 1:
            raise ConfigError(f"keep_last must be an integer >= 1 (checkpoints to keep), got {keep_last!r}")
        if best_mode not in ("auto", "max", "min"):
            raise ConfigError(f"best_mode must be 'auto', 'max' or 'min', got {best_mode!r}")
        self.run_dir = Path(run_dir)
        self.folder = self.run_dir / CHECKPOINTS_DIR
        self.keep_last = keep_last
        self.best_metric = best_metric
        self.best_direction = (metric_direction(best_metric or "") if best_mode == "auto"
                               else Direction(best_mode, "stated"))
        self.best_mode = self.best_direction.mode

    # ------------------------------------------------------------ saving

    def save(self, state: dict[str, Any], step: int, metrics: dict[str, Any] | None = None) -> Path:
        """Write `state` as the checkpoint of `step`, with its hash; move `latest`; prune.

        Returns the checkpoint's path. Raises CheckpointError before writing anything when
        `state` holds values a safe load refuses; an OSError (disk full, ...) leaves the earlier
        checkpoints as they were.
        """
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise ValueError(f"step must be an integer >= 0, got {step!r}")
        value = self._metric_value(metrics)  # a bad metric fails before anything is written
        self.folder.mkdir(parents=True, exist_ok=True)
        path = self.folder / step_file_name(step)
        sidecar = sha256_sidecar(path)
        # Overwriting a step (a run resumed from before it): keep the old file's digest valid
        # until the new file has replaced it, so that a crash in between leaves the old one usable.
        old_digests = listed_digests(sidecar) if path.exists() else []
        # What a writer killed between its write and its prune left beyond retention goes first, so
        # the folder never holds more than keep_last + best + the one being written, whatever
        # crashed before (each crash before a prune would otherwise leave one more file).
        self._prune(step, path)
        new_digest: list[str] = []

        def write_hash(digest: str) -> None:
            new_digest.append(digest)
            self._write_hash(path, [digest, *[d for d in old_digests if d != digest]])

        write_checkpoint(path, state, before_replace=write_hash)
        if len(listed_digests(sidecar)) > 1:
            self._write_hash(path, new_digest)
        self._update_best(path, step, value)
        self._write_latest(path)
        self._prune(step, path)
        return path

    def commit_dir(self, staging: str | os.PathLike, step: int, metrics: dict[str, Any] | None = None) -> Path:
        """Commit a sharded checkpoint written into the folder `staging` (every rank's files, DCP's
        metadata and MANIFEST.sha256 already there): rename it to step-N.dcp, record the best,
        move `latest`, prune. Returns the checkpoint's path. One process calls this (rank 0).

        The rename is the commit: before it the folder has a staging name no reader takes. A
        folder of the same step already there (a run resumed from an earlier step) is set aside
        under a temporary name first and deleted after.
        """
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise ValueError(f"step must be an integer >= 0, got {step!r}")
        value = self._metric_value(metrics)
        final = self.folder / step_dir_name(step)
        aside = final.with_name(f".{final.name}.replaced-{os.getpid()}.tmp")
        if final.exists():
            os.replace(final, aside)
        os.replace(staging, final)
        fsync_dir(self.folder)
        if aside.exists():
            shutil.rmtree(aside, ignore_errors=True)
        self._update_best(final, step, value)
        self._write_latest(final)
        self._prune(step, final)
        return final

    def _write_hash(self, path: Path, digests: list[str]) -> None:
        write_sidecar(path, digests)

    def _write_latest(self, path: Path) -> None:
        with atomic_file(self.folder / LATEST, "w") as f:
            f.write(path.name + "\n")

    def _metric_value(self, metrics: dict[str, Any] | None) -> float | None:
        """best_metric's value in `metrics` as a float; None when absent, None, NaN or infinite."""
        if not self.best_metric or not metrics or metrics.get(self.best_metric) is None:
            return None
        value = metrics[self.best_metric]
        try:
            value = float(value)
        except (TypeError, ValueError):
            raise ConfigError(f"metric {self.best_metric!r} (best_metric) is {value!r}, not a number: pass "
                              "numbers in the metrics given to save()") from None
        return value if math.isfinite(value) else None  # a NaN or inf is never the best

    def _update_best(self, path: Path, step: int, value: float | None) -> None:
        best = self._best_record()
        if value is None:
            if best is not None and best["file"] == path.name:  # the best's file now holds another state
                self._write_index(None)
            return
        if best is not None and best["file"] != path.name and (self.folder / best["file"]).exists() \
                and (best.get("metric"), best.get("mode")) == (self.best_metric, self.best_mode):
            if not self.best_direction.better(value, best["value"]):
                return
        self._write_index({"file": path.name, "step": step, "metric": self.best_metric, "mode": self.best_mode,
                           "value": value})

    def _write_index(self, best: dict[str, Any] | None) -> None:
        with atomic_file(self.folder / BEST_INDEX, "w") as f:
            json.dump({"version": 1, "best": best}, f, indent=1)
            f.write("\n")

    def _prune(self, step: int, newest: Path) -> None:
        """Delete checkpoints beyond keep_last among steps <= `step`; keep the newest and the
        best. Checkpoints of higher steps (a run resumed from an earlier one) are left alone."""
        files = self._step_files()
        current = sorted(s for s in files if s <= step)
        keep = set(current[-self.keep_last:]) | {step}
        best = self.best_path()
        protected = {newest.name, best.name if best else None, self._latest_name()}
        for s, path in files.items():
            if s in keep or s > step or path.name in protected:
                continue
            if path.is_dir():  # a sharded checkpoint: out of the step names first, then deleted
                doomed = path.with_name(f".{path.name}.pruned-{os.getpid()}.tmp")
                with contextlib.suppress(OSError):
                    os.replace(path, doomed)
                    shutil.rmtree(doomed, ignore_errors=True)
                continue
            with contextlib.suppress(FileNotFoundError):
                path.unlink()  # the checkpoint first: a crash here leaves a harmless lone .sha256
            with contextlib.suppress(FileNotFoundError):
                sha256_sidecar(path).unlink()
        # What killed writers left: temp files, staging folders of sharded checkpoints, and hashes
        # whose checkpoint never arrived.
        for leftover in self.folder.glob(".step-*.tmp"):
            if leftover.is_dir():
                shutil.rmtree(leftover, ignore_errors=True)
                continue
            with contextlib.suppress(OSError):
                leftover.unlink()
        for sidecar in self.folder.glob(f"step-*.pt{SHA256_SUFFIX}"):
            if not sidecar.with_name(sidecar.name[: -len(SHA256_SUFFIX)]).exists():
                with contextlib.suppress(OSError):
                    sidecar.unlink()
        # `latest` and the best's index are rewritten only when they change: a temp file of a writer
        # killed while writing one would otherwise stay until the next such write.
        for name in (LATEST, BEST_INDEX):
            remove_stale_temps(self.folder / name)

    def bytes_held(self) -> int:
        """The bytes of the one-file checkpoints here and of a RUN_DIR/checkpoint.pt from before the
        store: room a resumed run's preflight counts as its own (io/preflight.py), as they are pruned."""
        total = 0
        for path in [self.run_dir / LEGACY_CHECKPOINT, *self.folder.glob("step-*.pt")]:
            try:
                total += path.stat().st_size
            except OSError:
                pass
        return total

    def check_writable(self) -> None:
        """Raise ConfigError, in one line, when no checkpoint could be written here, before a run
        trains toward its first save: the checkpoints folder is a file, `latest` or `index.json` is a
        folder, or the folder takes no new file (permissions, a read-only disk)."""
        if self.folder.exists() and not self.folder.is_dir():
            raise ConfigError(f"{self.folder} is a file where the run keeps its checkpoints (a folder): move it away, "
                              "or choose another --run-dir")
        for name, what in ((LATEST, "the name of the newest checkpoint"), (BEST_INDEX, "which checkpoint is the best")):
            if (self.folder / name).is_dir():
                raise ConfigError(f"{self.folder / name} is a folder where the store writes a file ({what}): remove "
                                  "it, or choose another --run-dir")
        if not self.folder.is_dir():
            return  # made at the first save, in a run directory the preflight wrote in
        try:
            fd, probe = tempfile.mkstemp(prefix=".gputrain-write-probe.", dir=self.folder)
            os.close(fd)
            os.unlink(probe)
        except OSError as exc:
            raise ConfigError(f"cannot write in {self.folder} ({exc.strerror or exc}): fix its permissions, or choose "
                              "another --run-dir") from None

    # ------------------------------------------------------------ finding

    def list(self) -> list[Path]:
        """The checkpoints (step-*.pt files and step-*.dcp folders), lowest step first; verified or not."""
        files = self._step_files()
        return [files[s] for s in sorted(files)]

    def latest_path(self) -> Path | None:
        """The checkpoint `latest` names when that file exists, else the highest step; None when
        there is none. Not verified: load_latest is what checks."""
        name = self._latest_name()
        if name and (self.folder / name).exists():
            return self.folder / name
        files = self._step_files()
        return files[max(files)] if files else None

    def best_path(self) -> Path | None:
        """The best checkpoint by best_metric as recorded in index.json, when that file exists."""
        best = self._best_record()
        if best is None:
            return None
        path = self.folder / best["file"]
        return path if path.exists() else None

    def best_record(self) -> dict[str, Any] | None:
        """index.json's record of the best: {"file", "step", "metric", "mode", "value"}, or None."""
        return self._best_record()

    def verify(self, path: str | os.PathLike) -> bool | Damage:
        """True when the checkpoint (a file or a .dcp folder) matches its hashes; otherwise a Damage
        (a str, false in a test) saying what is wrong (digests.py)."""
        return verify(path)

    def load_latest(self, map_location: str | torch.device = "cpu") -> tuple[dict[str, Any], Path] | None:
        """The newest checkpoint that verifies, loaded: (state, path); None when the run has none.

        Damaged or unverifiable files are skipped, with a CheckpointWarning naming each and why.
        For a sharded checkpoint (a .dcp folder) the state is rank 0's run state, without "model"
        and "optimizer" (checkpoint.sharded.load_weights, or read.read_checkpoint whole, read those).
        A run directory from before the store (a single RUN_DIR/checkpoint.pt, no hash) loads
        with a note in the log. Raises CheckpointError when checkpoints exist but none verifies
        (the message lists them and why), or when one verifies but cannot be loaded (e.g.
        written by a newer gputrain: an older checkpoint would silently lose work).
        """
        skipped: list[tuple[Path, str]] = []
        for path in self._candidates():
            why = self.verify(path)
            if why is not True:
                skipped.append((path, str(why)))
                continue
            state = read_checkpoint(path, weights=False, map_location=map_location)
            self._warn_skipped(skipped, path)
            return state, path
        legacy = self.run_dir / LEGACY_CHECKPOINT
        if legacy.is_file():
            try:
                state = read_checkpoint(legacy, map_location=map_location)
            except CheckpointError as exc:
                if not skipped:
                    raise
                skipped.append((legacy, str(exc).removeprefix(f"{legacy}: ")))
            else:
                log.info("%s: a checkpoint from before checkpoints/ existed; no hash to verify it by, "
                         "loaded as it is", legacy)
                self._warn_skipped(skipped, legacy)
                return state, legacy
        if not skipped:
            return None
        raise self._none_verifies(skipped)

    def find_latest(self, verify: Callable[[Path], bool | str] | None = None, candidates: list[Path] | None = None,
                    warn: bool = True) -> Path | None:
        """The newest checkpoint that verifies (a file or a .dcp folder), not loaded; None when the run
        has none. The same order and warnings as load_latest; a legacy RUN_DIR/checkpoint.pt is
        returned unverified (it has no hash) when nothing else verifies.

        verify: path -> True or the reason it fails (default: self.verify); a job's ranks pass one
        that verifies a share of the files each and agrees (a collective), with the same
        `candidates` (rank 0's listing) everywhere and warn=True on one rank only. Raises
        CheckpointError when checkpoints exist but none verifies.
        """
        skipped: list[tuple[Path, str]] = []
        for path in self.candidates() if candidates is None else candidates:
            why = verify(path) if verify is not None else self.verify(path)
            if why is not True:
                skipped.append((path, str(why)))
                continue
            if warn:
                self._warn_skipped(skipped, path)
            return path
        legacy = self.run_dir / LEGACY_CHECKPOINT
        if legacy.is_file():
            if warn:
                self._warn_skipped(skipped, legacy)
            return legacy
        if not skipped:
            return None
        raise self._none_verifies(skipped)

    def _none_verifies(self, skipped: list[tuple[Path, str]]) -> CheckpointError:
        listing = "; ".join(f"{p.name}: {why}" for p, why in skipped)
        return CheckpointError(
            f"{self.folder}: no checkpoint verifies ({listing}); start a new run (or use another --run-dir), "
            "or pass one of them to --resume if you trust it")

    def candidates(self) -> list[Path]:
        """The checkpoints in the order resuming tries them: the one `latest` names, then lower steps
        from the highest down, then higher ones (see the module's docstring)."""
        return self._candidates()

    def _warn_skipped(self, skipped: list[tuple[Path, str]], used: Path) -> None:
        for path, why in skipped:
            warnings.warn(f"checkpoint {path} skipped: {why}; resuming from {used.name} instead",
                          CheckpointWarning, stacklevel=3)

    def _candidates(self) -> list[Path]:
        files = self._step_files()
        name = self._latest_name()
        pointed = step_of(name) if name else None
        if pointed is None or pointed not in files or files[pointed].name != name:
            if name:
                log.warning("%s names %r, which is not a checkpoint here; taking the highest step instead",
                            self.folder / LATEST, name)
            return [files[s] for s in sorted(files, reverse=True)]
        below = [files[s] for s in sorted(files, reverse=True) if s < pointed]
        above = [files[s] for s in sorted(files, reverse=True) if s > pointed]
        if above:
            log.info("%s: %s has a higher step than %s, which `latest` names (a save cut short before it "
                     "moved `latest`, or a run resumed from an earlier step); trying %s first",
                     self.folder, above[0].name, name, name)
        return [files[pointed], *below, *above]

    # ------------------------------------------------------------ small files

    def _step_files(self) -> dict[int, Path]:
        if not self.folder.is_dir():
            return {}
        files: dict[int, Path] = {}
        latest = self._latest_name()

        def rank(path: Path, step: int) -> tuple[bool, bool, bool]:
            # step-123.pt and step-000123.pt would be the same step: the canonical name wins; a file
            # and a folder of one step (the format changed between runs): the one `latest` names.
            return (path.name == latest, path.name in (step_file_name(step), step_dir_name(step)),
                    path.is_dir())

        for path in self.folder.iterdir():
            step = step_of(path)
            if step is None or not (path.is_dir() if path.name.endswith(DCP_SUFFIX) else path.is_file()):
                continue
            if step not in files or rank(path, step) > rank(files[step], step):
                files[step] = path
        return files

    def _latest_name(self) -> str | None:
        try:
            name = (self.folder / LATEST).read_text(encoding="utf-8").strip()
        except (OSError, UnicodeDecodeError):
            return None
        return name if name and "/" not in name and os.sep not in name else None

    def _best_record(self) -> dict[str, Any] | None:
        path = self.folder / BEST_INDEX
        try:
            best = json.loads(path.read_text(encoding="utf-8")).get("best")
        except FileNotFoundError:
            return None
        except (OSError, ValueError, AttributeError) as exc:
            log.warning("%s is unreadable (%s): the best checkpoint is not known until the next save "
                        "with %s", path, exc, self.best_metric)
            return None
        ok = isinstance(best, dict) and isinstance(best.get("file"), str) and step_of(best["file"]) is not None \
            and isinstance(best.get("value"), (int, float))
        return best if ok else None
