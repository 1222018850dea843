"""Where the data lives for a run, decided once by `make_loader` (the memory rule), and why.

- tensors (columns) on a GPU that fit in `memory_fraction` of free memory: kept on the device
  (`TensorBatches`);
- tensors on the CPU: slices of the tensors, without a DataLoader's per-sample collation;
- tensors that do not fit, or a `Dataset` (of pairs, dicts, ...): a pinned DataLoader with workers
  and a side-stream prefetcher (`LoaderBatches`);
- a user's `DataLoader`, an IterableDataset, a Hugging Face dataset or any iterable of batches:
  data/sources.py.
"""

from __future__ import annotations

import collections.abc
import logging
from dataclasses import dataclass
from typing import Any, Callable, TypedDict

import torch
from torch.utils.data import Dataset, TensorDataset

from gputrain import batch as batches
from gputrain.data.loader import ColumnsByIndex, LoaderBatches
from gputrain.data.resident import TensorBatches, column_length
from gputrain.data.transforms import BatchTransform
from gputrain.errors import ConfigError, DataError

log = logging.getLogger("gputrain")


@dataclass
class Placement:
    """Where the data lives for this run, and why (for the run log)."""

    kind: str  # "device" | "host-slices" | "dataloader" | "user-dataloader" | "iterable"
    reason: str


def fits_on_device(nbytes: int, device: torch.device, fraction: float) -> tuple[bool, str]:
    """Whether `nbytes` fits in `fraction` of the device's free memory, with the figures."""
    if device.type != "cuda":
        return False, f"{device.type} has no separate device memory"
    free, _total = torch.cuda.mem_get_info(device)
    budget = int(free * fraction)
    ok = nbytes <= budget
    return ok, (f"{nbytes / 2**20:.1f} MiB of data {'fits in' if ok else 'exceeds'} "
                f"{fraction:.0%} of {free / 2**30:.1f} GiB free on {device}")


def choose_device_resident(nbytes: int, device: torch.device, on_device: str | bool,
                           fraction: float) -> tuple[bool, str]:
    """The memory rule: keep the data on the device when it fits in `fraction` of free memory."""
    if on_device != "auto":
        return bool(on_device), f"data_on_device={on_device} was requested"
    if device.type == "mps":
        return True, "MPS shares memory with the host"
    return fits_on_device(nbytes, device, fraction)


def as_columns(data: Any) -> Any | None:
    """The tensor columns behind `data`: a tuple/list of tensors, a TensorDataset, or a Mapping of tensors."""
    if isinstance(data, TensorDataset):
        return tuple(data.tensors)
    if isinstance(data, (tuple, list)) and data and all(isinstance(t, torch.Tensor) for t in data):
        return tuple(data) if not hasattr(data, "_fields") else data
    if (isinstance(data, collections.abc.Mapping) and data
            and all(isinstance(t, torch.Tensor) for t in data.values())):
        return data
    return None


def as_tensors(data: Any) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The (inputs, targets) tensors behind `data`, when it is a pair or a 2-tensor TensorDataset."""
    cols = as_columns(data)
    if isinstance(cols, tuple) and len(cols) == 2:
        return cols[0], cols[1]
    return None


class _BatchesArgs(TypedDict):
    """The keyword arguments that `TensorBatches` and `LoaderBatches` share."""

    device: torch.device
    shuffle: bool
    drop_last: bool
    seed: int
    rank: int
    world_size: int
    transform: BatchTransform | None


def nbytes_of(columns: Any) -> int:
    return sum(t.numel() * t.element_size() for t in batches.tensor_leaves(columns))


def column_placement(columns: Any, device: torch.device, on_device: str | bool = "auto",
                     memory_fraction: float = 0.5) -> Placement:
    """Where tensor columns live for a run on `device` (the memory rule), and why; builds nothing."""
    if device.type == "cpu":
        return Placement("host-slices", "CPU training: batches are slices of the tensors (no DataLoader)")
    put, why = choose_device_resident(nbytes_of(columns), device, on_device, memory_fraction)
    if put:
        return Placement("device", f"data kept on the device: {why}")
    return Placement("dataloader", f"data streamed from the host (pinned, prefetched): {why}")


def make_loader(data: Any, batch_size: int, *, device: torch.device, train: bool, seed: int = 0, rank: int = 0,
                world_size: int = 1, on_device: str | bool = "auto", memory_fraction: float = 0.5,
                num_workers: int | None = None, transform: BatchTransform | None = None,
                drop_last: bool = False, collate_fn: Callable | None = None,
                rebuild_loader: bool = True) -> tuple[Any, Placement]:
    """Pick the fastest safe way to feed `data` to `device` and build it.

    data: tensor columns ((inputs, targets), any tuple of tensors, or a dict of equal-length
    tensors), a Dataset (of any nested samples), a DataLoader, a torch IterableDataset, a Hugging
    Face Dataset or IterableDataset, or any iterable of batches (data/sources.py). collate_fn makes
    the batches of a Dataset or IterableDataset (e.g. one that pads); rebuild_loader=False uses a
    user's DataLoader as is (data/user_loader.py).
    """
    from gputrain.data import sources

    adopted = sources.adopt(data, batch_size, device=device, train=train, seed=seed, rank=rank,
                            world_size=world_size, num_workers=num_workers, transform=transform,
                            collate_fn=collate_fn, rebuild_loader=rebuild_loader, drop_last=drop_last)
    if adopted is not None:
        return adopted
    columns = as_columns(data)
    common = _BatchesArgs(device=device, shuffle=train, drop_last=drop_last, seed=seed, rank=rank,
                          world_size=world_size, transform=transform)
    if columns is not None:
        if collate_fn is not None:
            raise ConfigError("collate_fn was given with tensor columns, which are sliced into batches without "
                              "collation: drop collate_fn, or pass a Dataset of samples")
        n = column_length(columns)
        placement = column_placement(columns, device, on_device, memory_fraction)
        if placement.kind != "dataloader":
            return TensorBatches(columns, batch_size, **common), placement
        # Host-fed: pinned batches gathered in one index op per column, prefetched on a side stream.
        return (LoaderBatches(ColumnsByIndex(columns, n), batch_size, num_workers=num_workers, batched_dataset=True,
                              **common), placement)
    if isinstance(data, Dataset):
        if device.type == "cpu" and num_workers is None:
            num_workers = 0
        return (LoaderBatches(data, batch_size, num_workers=num_workers, collate_fn=collate_fn, **common),
                Placement("dataloader", "a Dataset was given: DataLoader with "
                          + ("pinned memory and a side-stream prefetcher" if device.type == "cuda" else "no workers")))
    adopted = sources.adopt_iterable(data, device=device, train=train, rank=rank, world_size=world_size,
                                     transform=transform, collate_fn=collate_fn)
    if adopted is not None:
        return adopted
    raise DataError(f"cannot train on {type(data).__name__}: pass tensors ((inputs, targets), or a dict of "
                    "equal-length tensors), a torch Dataset or IterableDataset, a DataLoader, a Hugging Face "
                    "dataset, or an iterable of batches")
