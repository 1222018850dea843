"""Checkpoints: written atomically, loaded safely, and explained when they are bad.

A checkpoint is a dict of tensors and plain data (no pickled objects), so it loads with
`torch.load(weights_only=True)`; `write_checkpoint` refuses anything else before it writes, so a
run fails at its first checkpoint rather than at the resume hours later. Writing goes through
`io.atomic.atomic_file` (a temporary file in the same folder, fsynced, then renamed over the
target): a crash at any moment leaves either the old checkpoint or the new one, never half of one.
"""

from __future__ import annotations

import collections
import os
import pickle
import re
import zipfile
from pathlib import Path
from typing import Any, Callable

import torch

from gputrain.checkpoint.digests import Sha256Writer
from gputrain.checkpoint.names import step_file_name
from gputrain.errors import CheckpointError
from gputrain.io.atomic import atomic_file
from gputrain.io.run_layout import CHECKPOINTS_DIR
from gputrain.torch_compat import COMPILED_MODULE_ATTR

FORMAT = "gputrain-checkpoint"
VERSION = 1


# ---------------------------------------------------------------- save / load

# Types torch.load(weights_only=True) accepts without an allowlist. Exact types: np.float64 is a
# float subclass and an IntEnum an int subclass, and both are refused on load.
_PLAIN_SCALARS = (int, float, bool, str, bytes, complex, type(None), torch.dtype, torch.device)
_CONTAINERS = (dict, collections.OrderedDict, list, tuple, set, torch.Size)


def check_plain(value: Any, where: str = "state") -> None:
    """Raise CheckpointError naming the first value a weights_only load would refuse."""
    kind = type(value)
    if isinstance(value, torch.Tensor) or kind in _PLAIN_SCALARS:
        return
    if kind in (dict, collections.OrderedDict, collections.Counter):  # Counter: MultiStepLR's milestones
        for k, v in value.items():
            check_plain(k, f"{where} key {k!r}")
            check_plain(v, f"{where}[{k!r}]")
        return
    if kind in _CONTAINERS:
        for i, v in enumerate(value):
            check_plain(v, f"{where}[{i}]")
        return
    hint = " (convert it with float() / int() / torch.as_tensor)" if kind.__module__ == "numpy" else ""
    raise CheckpointError(f"cannot checkpoint {where}: it is a {kind.__module__}.{kind.__qualname__}; gputrain "
                          f"checkpoints hold only tensors and plain data (numbers, strings, lists, dicts){hint}")


def write_checkpoint(path: str | os.PathLike, state: dict[str, Any], *,
                    before_replace: Callable[[str], None] | None = None) -> Path:
    """Write `state` (tensors and plain data) to `path` atomically; returns the path.

    Adds {"format": FORMAT, "version": VERSION}. Raises CheckpointError, before anything is
    written, when `state` holds a value that `load_checkpoint` could not read back.

    `before_replace(sha256_hex)`, when given, is called with the sha256 of the bytes written (hashed
    as they are written, no second read), after the whole file is written and before it is renamed
    over `path`: a checkpoint store writes the file's hash there, so that no checkpoint ever exists
    under its final name without its hash. If it raises, `path` is left untouched.
    """
    path = Path(path)
    payload = {"format": FORMAT, "version": VERSION, **state}
    check_plain(payload)
    with atomic_file(path, "wb") as f:
        if before_replace is None:
            torch.save(payload, f)
        else:
            writer = Sha256Writer(f)
            # torch.save takes any object with write() and flush() (its docs); its FileLike type says IO[bytes].
            torch.save(payload, writer)  # pyright: ignore[reportArgumentType]
            before_replace(writer.hexdigest())
    return path


def load_checkpoint(path: str | os.PathLike, map_location: str | torch.device = "cpu") -> dict[str, Any]:
    """Load a gputrain checkpoint with torch.load(weights_only=True); returns its dict.

    Raises CheckpointError naming the file and the problem: missing, a folder, empty, truncated,
    corrupt, not a gputrain checkpoint, written by a newer gputrain, or holding pickled objects.
    """
    path = Path(path)
    if not path.exists():
        raise CheckpointError(f"{path}: no checkpoint there{_neighbours(path)}; check --resume / --run-dir "
                              "(TrainConfig.resume / run_dir): a run writes checkpoints/step-N.pt in its run directory")
    if path.is_dir():
        raise CheckpointError(f"{path} is a folder; give a checkpoint file (e.g. {path / CHECKPOINTS_DIR / step_file_name(100)}), or resume the run directory (--resume DIR)")
    size = path.stat().st_size
    if size == 0:
        raise CheckpointError(f"{path}: the file is empty (a write was interrupted?); "
                              "use an earlier checkpoint or start a new run")
    try:
        state = torch.load(path, map_location=map_location, weights_only=True)
    except pickle.UnpicklingError as exc:
        msg = re.sub(r"\x1b\[[0-9;]*m", "", str(exc))  # torch puts terminal bold codes in it
        refused = re.search(r"Unsupported (?:global|class):? *(?:GLOBAL )?([\w.]+)", msg)
        if refused:
            raise CheckpointError(
                f"{path}: holds Python objects that a safe (weights_only) load refuses ({refused.group(1)}); "
                "gputrain checkpoints hold only tensors and plain data, so this file was not written by "
                "gputrain's write_checkpoint") from None
        raise CheckpointError(_explain(path, size, msg)) from None
    except Exception as exc:  # noqa: BLE001
        # Damaged bytes can make the unpickler fail in any way (EOFError, BadZipFile, also
        # IndexError or KeyError from its stack and memo); all of them mean the same to the user.
        raise CheckpointError(_explain(path, size, str(exc) or type(exc).__name__)) from None
    if not isinstance(state, dict) or state.get("format") != FORMAT:
        raise CheckpointError(f"{path}: a PyTorch file but not a gputrain checkpoint (no format={FORMAT!r} "
                              "marker); to start from plain weights, load them into the model before fit()")
    version = state.get("version")
    if not isinstance(version, int) or version > VERSION:
        raise CheckpointError(f"{path}: checkpoint format version {version!r} is newer than this gputrain "
                              f"reads (up to {VERSION}); upgrade gputrain")
    return state


def _explain(path: Path, size: int, error: str) -> str:
    """Why torch.load failed, judged from the file's first bytes, with torch's own first line."""
    with open(path, "rb") as f:
        head = f.read(4)
    error = error.strip().splitlines()[0][:200] if error.strip() else "no message"
    if head == b"PK\x03\x04" and zipfile.is_zipfile(path):  # torch.save's zip format, intact
        return f"{path}: cannot load the checkpoint: {error}"
    if head == b"PK\x03\x04":
        what = "truncated or corrupt checkpoint (a zip archive without its end: was the write cut short?)"
    elif head[:1] == b"\x80":  # a pickle: torch's legacy format
        what = "truncated or corrupt checkpoint (legacy pickle format)"
    else:
        what = "corrupt or not a PyTorch file"
    return f"{path}: {what} ({size} bytes; {error}); use an earlier checkpoint or start a new run"


def _neighbours(path: Path) -> str:
    if not path.parent.is_dir():
        return f" (the folder {path.parent} does not exist)"
    others = sorted(p.name for p in path.parent.glob("*.pt"))[:5]
    return f" (the folder holds {', '.join(others)})" if others else ""


# ---------------------------------------------------------------- does it fit the model?

_WRAPPER_PREFIXES = ("module.", COMPILED_MODULE_ATTR + ".")  # DDP / DataParallel, torch.compile


def check_model_state(model_state: dict[str, torch.Tensor], model: torch.nn.Module,
                      path: str | os.PathLike = "") -> None:
    """Raise CheckpointError when a checkpoint's weights do not belong to `model`.

    Lists missing keys, unexpected keys and shape mismatches (the first 3 of each, and how many),
    so the mismatch is explained before load_state_dict is attempted.
    """
    where = f"{path}: " if path else ""
    if not isinstance(model_state, dict):
        raise CheckpointError(f"{where}the checkpoint's 'model' entry is a {type(model_state).__name__}, "
                              "not a state_dict")
    own = model.state_dict()
    missing = [k for k in own if k not in model_state]
    unexpected = [k for k in model_state if k not in own]
    shapes = [f"{k} {tuple(model_state[k].shape)} vs {tuple(v.shape)}" for k, v in own.items()
              if k in model_state and hasattr(model_state[k], "shape") and hasattr(v, "shape")
              and tuple(model_state[k].shape) != tuple(v.shape)]
    if not (missing or unexpected or shapes):
        return
    parts = []
    if missing:
        parts.append(f"missing {len(missing)} key(s): {', '.join(missing[:3])}{' ...' if len(missing) > 3 else ''}")
    if unexpected:
        parts.append(f"unexpected {len(unexpected)} key(s): {', '.join(unexpected[:3])}"
                     f"{' ...' if len(unexpected) > 3 else ''}")
    if shapes:
        parts.append(f"{len(shapes)} shape mismatch(es) (checkpoint vs model): {'; '.join(shapes[:3])}"
                     f"{' ...' if len(shapes) > 3 else ''}")
    hint = ""
    for prefix in _WRAPPER_PREFIXES:
        if unexpected and all(k.startswith(prefix) for k in unexpected) and \
                {k[len(prefix):] for k in unexpected} >= set(missing):
            hint = (f" (every checkpoint key starts with {prefix!r}: it was saved from a wrapped model; "
                    "save the inner module's state_dict)")
        elif missing and all(k.startswith(prefix) for k in missing) and \
                {k[len(prefix):] for k in missing} >= set(unexpected):
            hint = f" (the model's keys start with {prefix!r}: load into the inner module)"
    raise CheckpointError(f"{where}the checkpoint belongs to another model: {'; '.join(parts)}{hint}")
