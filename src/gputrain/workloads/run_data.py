"""The data `gputrain eval / predict RUN_DIR --data ...` run on: the workload's own split, or a file of
tensors, checked against the workload's data before the model sees it.

A file must hold what the workload's data hold: for (inputs, targets) workloads a tensor of inputs
(predict) or an (inputs, targets) pair (eval, which needs the targets); for dict workloads a dict
with the same keys. What is plainly wrong (another structure, no targets for eval, columns of
different lengths, no samples, complex numbers for a real model) is refused before anything runs.
Shapes and dtypes are not refused up front: a model may take other sizes (a shorter sequence, say).
When the model then fails on samples whose shape or dtype differ from the workload's, that is said
as the data's fault, in one line naming both; when it fails on samples like the workload's own,
the error is the model's, and keeps its traceback with a note of what gputrain was doing.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import torch

from gputrain.errors import ConfigError, DataError, GputrainError
from gputrain.workloads.from_run import TrainedRun


@dataclass
class RunData:
    data: Any  # what evaluate / predict take: DataSplits (with the workload's normalization) or tensors
    source: str  # how the user named it: "--data test", "--data x.npy"
    given: str  # its tensors' shapes and dtypes, batch dimension first: "inputs (5, 3, 8, 8) float32"
    expected: str  # the workload's, with N for the batch dimension: "inputs (N, 1, 8, 8) uint8, targets (N,) int64"
    differs: str | None  # how the file's samples differ from the workload's (shape, dtype, label range), or None
    workload: str

    @contextlib.contextmanager
    def blame(self, command: str) -> Iterator[None]:
        """Run the model on this data: a failure on samples unlike the workload's becomes one DataError
        line; any other failure keeps its traceback, with a note of what was running on what."""
        try:
            yield
        except GputrainError:
            raise
        except Exception as exc:
            if self.differs:
                text = str(exc).strip()
                first = text.splitlines()[0][:240] if text else ""
                raise DataError(f"{self.source}: the model failed on it ({type(exc).__name__}: {first}): "
                                f"{self.differs}; give data shaped like {self.workload}'s ({self.expected})") from exc
            exc.add_note(f"gputrain {command}: the model raised while running on {self.source} ({self.given}, "
                         f"like {self.workload}'s data): the error above is in the model or its loss")
            raise


def run_data(run: TrainedRun, which: str, *, targets: bool) -> RunData:
    """The data to evaluate (targets=True: they must hold targets) or predict on: "test" / "train"
    (the workload's splits, with its normalization), or a .pt / .npy file of tensors in the
    workload's stored units (its normalization is applied). Raises ConfigError / DataError."""
    from gputrain.data.splits import DataSplits
    from gputrain.io.data_files import load_data_file

    wl = run.workload
    splits = wl.make_data()
    reference = splits.train
    expected = _describe(reference, batch="N")
    if which in ("test", "train"):
        if which == "test" and splits.test is None:
            raise ConfigError(f"{wl.name} has no test split: use --data train or a file")
        chosen = splits.test if which == "test" else splits.train
        data = splits if which == "test" else DataSplits(train=splits.train, test=splits.train, mean=splits.mean,
                                                         std=splits.std, transform_key=splits.transform_key)
        return RunData(data, f"--data {which}", _describe(chosen), expected, None, wl.name)
    path = Path(which)
    if not path.is_file():
        raise ConfigError(f"--data {which}: use test, train, or a .pt / .npy file of "
                          f"{'inputs and targets' if targets else 'inputs'}")
    given = load_data_file(path)
    source = f"--data {which}"
    differs = _check(given, reference, source=source, expected=expected, workload=wl.name, targets=targets)
    described = _describe(given)
    data = (given,) if isinstance(given, torch.Tensor) else given  # inputs alone: the model is called with them
    if splits.mean is not None:  # raw data in the workload's stored units (uint8 images) get its normalization
        data = DataSplits(train=data, test=data, mean=splits.mean, std=splits.std, transform_key=splits.transform_key)
    return RunData(data, source, described, expected, differs, wl.name)


# ---------------------------------------------------------------- describing and comparing columns


def _names(data: Any) -> list[tuple[str, Any]]:
    """(name, leaf) of tensor columns: a tensor is the inputs; a pair its inputs and targets; a dict its keys."""
    if isinstance(data, torch.Tensor):
        return [("inputs", data)]
    if isinstance(data, dict):
        return [(str(k), v) for k, v in data.items()]
    if isinstance(data, (tuple, list)):
        names = ["inputs", "targets"] if len(data) == 2 else ["inputs"] if len(data) == 1 else \
            [f"column {i}" for i in range(len(data))]
        return list(zip(names, data))
    return []


def _shape(t: torch.Tensor, batch: str | None = None) -> str:
    dims = [batch if batch is not None and i == 0 else str(n) for i, n in enumerate(t.shape)]
    inside = ", ".join(dims) + ("," if len(dims) == 1 else "")
    return f"({inside}) {str(t.dtype).removeprefix('torch.')}"


def _describe(data: Any, batch: str | None = None) -> str:
    columns = _names(data)
    if not columns or not all(isinstance(v, torch.Tensor) for _, v in columns):
        return type(data).__name__
    return ", ".join(f"{name} {_shape(v, batch)}" for name, v in columns)


def _check(given: Any, reference: Any, *, source: str, expected: str, workload: str, targets: bool) -> str | None:
    """Refuse what cannot be right; return how the samples differ from the workload's (or None)."""
    ref = dict(_names(reference)) if all(isinstance(v, torch.Tensor) for _, v in _names(reference)) else {}
    columns = _names(given)
    if not columns or not all(isinstance(v, torch.Tensor) for _, v in columns):
        what = type(given).__name__ if not columns else \
            f"a {type(given).__name__} holding {', '.join(sorted({type(v).__name__ for _, v in columns}))}"
        raise DataError(f"{source}: holds {what}, not tensors; save {_wanted(reference, targets)} "
                        f"({workload}'s data: {expected})")
    if ref:
        _check_structure(given, reference, source, expected, workload, targets)
    lengths = {name: (v.shape[0] if v.dim() else None) for name, v in columns}
    if None in lengths.values():
        raise DataError(f"{source}: holds a single value (a 0-dimensional tensor), not samples along a batch "
                        f"dimension; save {_wanted(reference, targets)} ({workload}'s data: {expected})")
    if len(set(lengths.values())) > 1:
        listing = ", ".join(f"{name} {n}" for name, n in lengths.items())
        raise DataError(f"{source}: its columns hold different numbers of samples ({listing}); every column needs "
                        "one row per sample")
    if next(iter(lengths.values())) == 0:
        raise DataError(f"{source}: holds no samples (a batch dimension of 0)")
    differences = []
    for name, v in columns:
        r = ref.get(name)
        if r is None:
            continue
        if v.is_complex() and not r.is_complex():
            raise DataError(f"{source}: {name} are complex numbers ({_shape(v)}), but {workload}'s are real "
                            f"({_shape(r, 'N')}); save real values")
        if tuple(v.shape[1:]) != tuple(r.shape[1:]) or v.dtype != r.dtype:
            differences.append(f"{name} {_shape(v)} where {workload}'s are {_shape(r, 'N')}")
        elif name == "targets" and not r.is_floating_point() and r.numel() and v.numel():
            low, high, ref_low, ref_high = int(v.min()), int(v.max()), int(r.min()), int(r.max())
            if low < ref_low or high > ref_high:
                differences.append(f"targets in [{low}, {high}] where {workload}'s are in [{ref_low}, {ref_high}]")
    return "; ".join(differences) or None


def _check_structure(given: Any, reference: Any, source: str, expected: str, workload: str, targets: bool) -> None:
    wanted = _wanted(reference, targets)
    if isinstance(reference, dict):
        if not isinstance(given, dict):
            raise DataError(f"{source}: holds {_describe(given)}, but {workload}'s data are a dict of tensors "
                            f"({expected}); save {wanted}")
        missing = [k for k in reference if k not in given]
        if (targets and missing) or len(missing) == len(reference):
            raise DataError(f"{source}: the dict has no {', '.join(map(repr, missing))} ({workload}'s data: "
                            f"{expected}); save {wanted}")
        return
    if isinstance(given, dict):
        raise DataError(f"{source}: holds a dict ({', '.join(map(repr, given))}), but {workload}'s data are "
                        f"{expected}; save {wanted}")
    pair = isinstance(reference, (tuple, list)) and len(reference) == 2
    n = 1 if isinstance(given, torch.Tensor) else len(given)
    if pair and targets and n == 1:
        raise DataError(f"{source}: holds inputs alone ({_describe(given)}), but eval needs targets too "
                        f"({workload}'s data: {expected}); save {wanted}")
    if n > (2 if pair else 1):
        raise DataError(f"{source}: holds {n} tensors ({_describe(given)}), but {workload}'s data are {expected}; "
                        f"save {wanted}")


def _wanted(reference: Any, targets: bool) -> str:
    if isinstance(reference, dict):
        return "a dict of tensors with the same keys, torch.save({...}, path)"
    if targets:
        return "(inputs, targets) with torch.save((inputs, targets), path)"
    return "the inputs as one tensor (torch.save(inputs, path), or numpy.save for a .npy file)"
