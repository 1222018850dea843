"""Checkpoints: written atomically, loaded safely, and explained when they are bad.

A checkpoint is a dict of tensors and plain data (no pickled objects), so it loads with
`torch.load(weights_only=True)`. Writing goes to a temporary file in the same folder, which is
fsynced and then renamed over the target: a crash at any moment leaves either the old checkpoint
or the new one, never half of one.
"""

from __future__ import annotations

import os
import pickle
import random
import tempfile
import zipfile
from pathlib import Path
from typing import Any

import numpy as np
import torch

from gputrain.errors import CheckpointError

FORMAT = "gputrain-checkpoint"
VERSION = 1


def save_checkpoint(path: str | os.PathLike, state: dict[str, Any]) -> Path:
    """Write `state` to `path` atomically (temp file, fsync, rename, fsync of the folder)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    payload = {"format": FORMAT, "version": VERSION, **state}
    fd, tmp_name = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            torch.save(payload, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp_name, path)
    except BaseException:
        try:
            os.unlink(tmp_name)
        except FileNotFoundError:
            pass
        raise
    _fsync_dir(path.parent)
    return path


def _fsync_dir(folder: Path) -> None:
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return  # not every platform lets a folder be opened (Windows)
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def load_checkpoint(path: str | os.PathLike, map_location: str | torch.device = "cpu") -> dict[str, Any]:
    """Load a gputrain checkpoint; CheckpointError naming the file and the problem otherwise."""
    path = Path(path)
    if not path.exists():
        raise CheckpointError(f"{path}: no checkpoint there; check --run-dir / --resume (a run writes "
                              f"checkpoint.pt in its run directory)")
    if path.is_dir():
        raise CheckpointError(f"{path} is a folder; give the checkpoint file (e.g. {path / 'checkpoint.pt'})")
    size = path.stat().st_size
    if size == 0:
        raise CheckpointError(f"{path}: the file is empty (a write was interrupted?); "
                              "use an earlier checkpoint or start a new run")
    try:
        state = torch.load(path, map_location=map_location, weights_only=True)
    except pickle.UnpicklingError as exc:
        msg = str(exc)
        if "Unsupported global" in msg or "Unsupported class" in msg:
            raise CheckpointError(
                f"{path}: holds Python objects that a safe load refuses; gputrain checkpoints hold only "
                f"tensors and plain data ({msg.splitlines()[0][:200]})") from None
        detail = next((line.strip() for line in msg.splitlines() if "Unsupported" in line), msg.splitlines()[0][:120])
        raise CheckpointError(f"{path}: corrupt or not a PyTorch file ({detail})") from None
    except (RuntimeError, EOFError, zipfile.BadZipFile, ValueError, OSError) as exc:
        first = str(exc).strip().splitlines()[0][:200] if str(exc).strip() else type(exc).__name__
        hint = "truncated or corrupt" if size < 1024 or "zip" in first.lower() or "EOF" in first else "unreadable"
        raise CheckpointError(f"{path}: {hint} checkpoint ({size} bytes): {first}") from None
    if not isinstance(state, dict) or state.get("format") != FORMAT:
        raise CheckpointError(f"{path}: a PyTorch file but not a gputrain checkpoint (no '{FORMAT}' marker); "
                              "to start from plain weights, load them into the model before fit()")
    version = state.get("version")
    if not isinstance(version, int) or version > VERSION:
        raise CheckpointError(f"{path}: checkpoint format version {version!r} is newer than this gputrain "
                              f"reads ({VERSION}); upgrade gputrain")
    return state


def check_model_state(model_state: dict[str, torch.Tensor], model: torch.nn.Module, path: str = "") -> None:
    """Raise CheckpointError when a checkpoint's weights do not belong to `model`."""
    own = model.state_dict()
    missing = [k for k in own if k not in model_state]
    unexpected = [k for k in model_state if k not in own]
    shapes = [f"{k} {tuple(model_state[k].shape)} vs {tuple(v.shape)}" for k, v in own.items()
              if k in model_state and hasattr(model_state[k], "shape") and tuple(model_state[k].shape) != tuple(v.shape)]
    if not (missing or unexpected or shapes):
        return
    parts = []
    if missing:
        parts.append(f"missing {len(missing)} key(s): {', '.join(missing[:3])}")
    if unexpected:
        parts.append(f"unexpected {len(unexpected)} key(s): {', '.join(unexpected[:3])}")
    if shapes:
        parts.append(f"{len(shapes)} shape mismatch(es) (checkpoint vs model): {'; '.join(shapes[:3])}")
    where = f"{path}: " if path else ""
    raise CheckpointError(f"{where}the checkpoint belongs to another model: {'; '.join(parts)}")


def capture_rng_state(device: torch.device | None = None) -> dict[str, Any]:
    """Every random-number state a run draws from, in weights_only-loadable form."""
    np_state = np.random.get_state()
    py_state = random.getstate()
    state: dict[str, Any] = {
        "torch": torch.get_rng_state(),
        "numpy": {"name": np_state[0], "keys": torch.from_numpy(np_state[1].astype(np.int64)),
                  "pos": int(np_state[2]), "has_gauss": int(np_state[3]), "cached_gauss": float(np_state[4])},
        "python": {"version": py_state[0], "state": list(py_state[1]),
                   "gauss": py_state[2]},
    }
    if device is not None and device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    return state


def restore_rng_state(state: dict[str, Any], device: torch.device | None = None) -> None:
    torch.set_rng_state(state["torch"])
    n = state["numpy"]
    np.random.set_state((n["name"], n["keys"].numpy().astype(np.uint32), n["pos"], n["has_gauss"], n["cached_gauss"]))
    p = state["python"]
    random.setstate((p["version"], tuple(p["state"]), p["gauss"]))
    if device is not None and device.type == "cuda" and "cuda" in state:
        torch.cuda.set_rng_state(state["cuda"], device)
