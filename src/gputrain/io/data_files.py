"""A user's data file for `gputrain eval / predict --data FILE`: .npy (numpy.save) or .pt (torch.save).

Both are read without running code from the file: a .npy array of Python objects (dtype=object) is
refused, because loading one means unpickling it, and a .pt file is read with
`torch.load(weights_only=True)`, which refuses pickled objects the same way. Every failure is one
DataError that says what the file holds (or why it cannot be read) and how to write one that works.
"""

from __future__ import annotations

import pickle
import re
from pathlib import Path
from typing import Any

import numpy as np
import torch

from gputrain.errors import DataError

_NUMERIC_KINDS = "biufc"  # numpy's kinds of bool, signed, unsigned, float and complex arrays: what a tensor holds
_REFUSED_GLOBAL = re.compile(r"Unsupported (?:global|class):? *(?:GLOBAL )?([\w.]+)")


def load_data_file(path: str | Path) -> Any:
    """The tensors in a .npy file (one tensor) or a .pt file (a tensor, a tuple or list of tensors,
    or a dict of them), on the CPU. Raises DataError naming the file and what is wrong with it."""
    path = Path(path)
    try:
        size = path.stat().st_size
    except OSError as exc:
        raise DataError(f"{path}: cannot read it ({exc.strerror or exc})") from None
    if size == 0:
        raise DataError(f"{path}: the file is empty; write the data with numpy.save (.npy) or torch.save (.pt)")
    return _load_npy(path) if path.suffix.lower() == ".npy" else _load_pt(path)


def _first_line(exc: BaseException) -> str:
    text = re.sub(r"\x1b\[[0-9;]*m", "", str(exc)).strip()  # torch puts terminal bold codes in its messages
    return text.splitlines()[0][:200] if text else type(exc).__name__


def _load_npy(path: Path) -> torch.Tensor:
    try:
        array = np.load(path, allow_pickle=False)
    except ValueError as exc:
        if "allow_pickle" in str(exc) or "Object arrays" in str(exc):
            raise DataError(
                f"{path}: an array of Python objects (dtype=object), which loads only by unpickling it, and "
                "unpickling a file can run any code in it, so gputrain does not; save a numeric array instead, "
                "e.g. np.save(path, np.asarray(x, dtype=np.float32))") from None
        raise DataError(f"{path}: not a readable .npy file ({_first_line(exc)}); write it with numpy.save") from None
    except (OSError, EOFError) as exc:
        raise DataError(f"{path}: not a readable .npy file ({_first_line(exc)}); write it with numpy.save") from None
    if not isinstance(array, np.ndarray):  # np.load opens a .npz archive whatever its name
        raise DataError(f"{path}: a .npz archive of several arrays, not one .npy array; save the inputs alone with "
                        "numpy.save, or (inputs, targets) with torch.save to a .pt file")
    if array.dtype.kind not in _NUMERIC_KINDS:
        raise DataError(f"{path}: an array of {array.dtype} ({array.dtype.kind!r} kind), but tensors hold numbers; "
                        "convert it before saving, e.g. np.save(path, array.astype(np.float32))")
    if not array.dtype.isnative:  # torch takes only this machine's byte order
        array = array.astype(array.dtype.newbyteorder("="))
    return torch.from_numpy(array)


def _load_pt(path: Path) -> Any:
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as exc:
        refused = _REFUSED_GLOBAL.search(_first_line(exc)) or _REFUSED_GLOBAL.search(str(exc))
        if refused:
            raise DataError(
                f"{path}: holds Python objects ({refused.group(1)}) that a safe (weights_only) load refuses, because "
                "loading them would run code from the file; save tensors instead, e.g. "
                "torch.save((torch.as_tensor(inputs), torch.as_tensor(targets)), path)") from None
        raise DataError(_not_torch(path, exc)) from None
    except Exception as exc:  # noqa: BLE001 - damaged bytes fail inside the unpickler in any way (IndexError, EOFError...)
        raise DataError(_not_torch(path, exc)) from None


def _not_torch(path: Path, exc: BaseException) -> str:
    return (f"{path}: not a PyTorch file, or a damaged one (torch.load: {_first_line(exc)}); write the data with "
            "torch.save (a tensor, (inputs, targets), or a dict of tensors), or as a .npy array with numpy.save")
