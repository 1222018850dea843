"""Checks before a run starts: can its run directory be written, and does the disk hold its checkpoints?

A run that finds out at its first checkpoint, an hour in, that the folder is read-only or the disk
is full has lost that hour. These checks take milliseconds and fail with one line saying what is
wrong and what to do.
"""

from __future__ import annotations

import errno
import os
import shutil
import tempfile
from pathlib import Path

import torch

from gputrain.batch import OptimizerLike
from gputrain.errors import ConfigError
from gputrain.io.run_layout import CHECKPOINTS_DIR, is_record

# What a checkpoint holds besides tensors (config, history, random-number states, pickling):
# generous for a long history, small beside any real model.
METADATA_BYTES = 1 << 20

# Optimizer state tensors per parameter tensor, each the parameter's size (torch.optim's names).
_STATE_PER_PARAM = {"adamw": 2, "adam": 2, "nadam": 2, "radam": 2, "adamax": 2, "adagrad": 1, "rmsprop": 1,
                    "sgd": 1, "adadelta": 2, "asgd": 2, "rprop": 2, "lbfgs": 0, "none": 0}


def _describe(exc: OSError) -> str:
    return exc.strerror or type(exc).__name__


def preflight_run_dir(run_dir: str | os.PathLike, needed_bytes: int, keep_last: int = 2, held_bytes: int = 0) -> None:
    """Create `run_dir` (and its parents), check that files can be written in it and that its
    disk has room for the run's checkpoints; raise ConfigError with one line when not.

    `needed_bytes`: one checkpoint's size (estimate_checkpoint_bytes). The disk must hold
    keep_last + 2 of them: the keep_last kept, the best by the metric (which may be older than all
    of them), and the next one being written while all those still exist (it replaces nothing
    until it is complete). `held_bytes`, the checkpoints already in the run directory (a resumed run's:
    CheckpointStore.bytes_held), count as room already taken: they are pruned as the new ones arrive.
    """
    run_dir = Path(run_dir)
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
    except (FileExistsError, NotADirectoryError):  # the file is the run directory's name, or a parent's
        raise ConfigError(f"cannot create run directory {run_dir}: a file of that name (or of a parent's "
                          "name) is in the way: choose another --run-dir") from None
    except OSError as exc:
        raise ConfigError(f"cannot create run directory {run_dir}: {_describe(exc)}: choose another "
                          "--run-dir") from None
    if not run_dir.is_dir():
        raise ConfigError(f"run directory {run_dir} is not a folder: choose another --run-dir")
    try:
        fd, probe = tempfile.mkstemp(prefix=".gputrain-write-probe.", dir=run_dir)
        try:
            os.write(fd, b"probe")
            os.fsync(fd)
        finally:
            os.close(fd)
            os.unlink(probe)
    except OSError as exc:
        raise ConfigError(f"cannot write in run directory {run_dir}: {_describe(exc)}: fix its permissions "
                          "or choose another --run-dir") from None

    if needed_bytes <= 0:
        return
    limit = file_size_limit()
    if limit is not None and needed_bytes > limit:
        raise ConfigError(f"a checkpoint of this run takes about {_size(needed_bytes)}, but this process may write no "
                          f"file over {_size(limit)} (its file-size limit, ulimit -f): raise the limit (ulimit -f "
                          "unlimited) before starting the run")
    copies = keep_last + 2
    required = needed_bytes * copies
    held = held_bytes
    free = shutil.disk_usage(run_dir).free
    if free + held < required:
        raise ConfigError(
            f"not enough free disk for checkpoints in {run_dir}: {_size(free)} free"
            f"{f' (plus {_size(held)} in checkpoints already there)' if held else ''}, a run keeping "
            f"{keep_last} needs about {_size(required)} ({copies} x {_size(needed_bytes)}: the kept ones, the "
            "best, and the one being written): free disk space, choose another --run-dir, or keep fewer "
            "checkpoints")


def check_run_dir(run_dir: str | os.PathLike) -> None:
    """`preflight_run_dir`'s refusals that need nothing created: a file in the way of `run_dir` (its
    name, or a parent's), or a folder where it cannot be made or written; for a launcher, before the
    processes that would make it start (the first of them preflights it)."""
    run_dir = Path(run_dir)
    existing = _nearest_existing(run_dir)
    if not existing.is_dir():
        raise ConfigError(f"cannot create run directory {run_dir}: a file of that name (or of a parent's "
                          "name) is in the way: choose another --run-dir")
    if not os.access(existing, os.W_OK | os.X_OK):
        what = "write in run directory" if existing == run_dir else "create run directory"
        raise ConfigError(f"cannot {what} {run_dir}: {os.strerror(errno.EACCES)} ({existing}): fix its permissions "
                          "or choose another --run-dir")


def file_size_limit() -> int | None:
    """The largest file this process may write, in bytes (RLIMIT_FSIZE, `ulimit -f`); None: no limit."""
    try:
        import resource
    except ImportError:  # not a Unix
        return None
    soft = resource.getrlimit(resource.RLIMIT_FSIZE)[0]
    return None if soft == resource.RLIM_INFINITY else soft


def check_output_file(path: str | os.PathLike, flag: str = "--out", example: str = "out.pt",
                      run_dir: str | os.PathLike | None = None) -> Path:
    """Raise ConfigError, in one line, unless a file can be written at `path`: it is no folder, not a
    file the run in `run_dir` holds (run_held), and the nearest folder that exists above it is a
    folder in which files can be created (folders missing in between are made when the file is
    written). Checked by creating and removing a probe file there: permissions, a read-only disk and
    /proc-like trees all answer. Creates nothing that stays. Returns the path."""
    path = Path(path)
    if path.is_dir():
        raise ConfigError(f"{flag} {path} is a folder: give a file name, e.g. {path / example}")
    _refuse_run_held(path, flag, run_dir, example)
    _probe_folder(path.parent, flag, path)
    return path


def check_output_dir(path: str | os.PathLike, flag: str = "--out", run_dir: str | os.PathLike | None = None) -> Path:
    """Raise ConfigError, in one line, unless `path` is a folder (or can be made one) in which files
    can be created, and neither holds nor is what the run in `run_dir` holds; creates nothing that
    stays. Returns the path."""
    path = Path(path)
    if path.exists() and not path.is_dir():
        raise ConfigError(f"{flag} {path} is a file, but a folder is needed there: give a folder's path")
    _refuse_run_held(path, flag, run_dir, "export")
    _probe_folder(path, flag, path)
    return path


def run_held(path: str | os.PathLike, run_dir: str | os.PathLike) -> str | None:
    """What of the run in `run_dir` the path `path` is (or holds, for a folder), said as "the record
    history.json of the run R", "in the checkpoints of the run R", ...; None when it is none of them.
    Paths are compared resolved (symbolic links, ..).

    What a run directory holds that a later command must never write over: its checkpoints (the folder
    and everything in it) and the records `gputrain fit` wrote (io/run_layout.py's RECORDS and
    TensorBoard's event files). report.html, predictions.pt and export/ are the outputs of report,
    predict and export, written again by each."""
    run, target = Path(run_dir).resolve(), Path(path).resolve()
    if target == run or target in run.parents:
        return f"the run directory {run_dir} (or a folder above it)"
    if target.parent == run and is_record(target.name):
        return f"the record {target.name} of the run {run_dir}"
    if target == run / CHECKPOINTS_DIR or run / CHECKPOINTS_DIR in target.parents:
        return f"in the checkpoints of the run {run_dir}"
    return None


def _refuse_run_held(path: Path, flag: str, run_dir: str | os.PathLike | None, example: str) -> None:
    held = run_held(path, run_dir) if run_dir is not None and Path(run_dir).is_dir() else None
    if held is not None:
        raise ConfigError(f"{flag} {path} is {held}: writing there would destroy what the run holds; give another "
                          f"path, e.g. {Path(run_dir or '.') / example}")


def _nearest_existing(path: Path) -> Path:
    """`path`, or the nearest of its parents that exists (a file or a folder)."""
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def _probe_folder(folder: Path, flag: str, target: Path) -> None:
    existing = _nearest_existing(folder)
    if not existing.is_dir():
        raise ConfigError(f"{flag} {target}: {existing} is a file, not a folder, so nothing can be written below "
                          "it: choose another path")
    try:
        fd, probe = tempfile.mkstemp(prefix=".gputrain-write-probe.", dir=existing)
        os.close(fd)
        os.unlink(probe)
    except OSError as exc:
        raise ConfigError(f"{flag} {target}: cannot write in {existing} ({_describe(exc)}): choose a folder you "
                          "can write to") from None


def _size(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n} B"


def _tensor_bytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if t is not None)


def estimate_checkpoint_bytes(model: torch.nn.Module, optimizer: str | OptimizerLike | None = "adamw") -> int:
    """About how many bytes a checkpoint of `model` and its optimizer takes.

    Parameters and buffers (numel x element_size; module.parameters() lists tied weights once, as
    torch.save stores them once), plus the optimizer's state:
    from its state tensors when it has stepped, else per parameter by its kind (AdamW: two moments
    of each parameter's size; SGD: one momentum buffer), plus METADATA_BYTES. `optimizer` is an
    optimizer, a name ("adamw", "sgd", ...; None means gputrain's default AdamW).
    """
    params = list(model.parameters())
    weights = _tensor_bytes([*params, *model.buffers()])
    param_bytes = _tensor_bytes(params)
    if optimizer is None:
        optimizer = "adamw"
    if isinstance(optimizer, torch.optim.Optimizer):
        opt_bytes = _optimizer_bytes(optimizer)
    elif not isinstance(optimizer, str):  # several by name (a step of your own: train/optim/by_name.py)
        opt_bytes = sum(_optimizer_bytes(o) for o in getattr(optimizer, "optimizers").values())
    else:
        key = str(optimizer).strip().lower()
        if key not in _STATE_PER_PARAM:
            raise ConfigError(f"unknown optimizer {optimizer!r} for the checkpoint size estimate: give one of "
                              f"{', '.join(sorted(_STATE_PER_PARAM))}, or the optimizer itself")
        opt_bytes = _STATE_PER_PARAM[key] * param_bytes
    return weights + opt_bytes + METADATA_BYTES


def _optimizer_bytes(optimizer: torch.optim.Optimizer) -> int:
    """Its state's bytes: from its state tensors when it has stepped, else the state it will have."""
    state = [v for s in optimizer.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
    if state:
        return _tensor_bytes(state)
    name = type(optimizer).__name__.lower()
    per = _STATE_PER_PARAM.get(name, 2)
    group = optimizer.param_groups[0] if optimizer.param_groups else {}
    if name == "sgd" and not group.get("momentum"):
        per = 0
    if name in ("adam", "adamw") and group.get("amsgrad"):
        per = 3
    if name == "rmsprop":
        per += bool(group.get("momentum")) + bool(group.get("centered"))
    return per * _tensor_bytes(p for g in optimizer.param_groups for p in g["params"])
