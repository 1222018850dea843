"""`make_loader`: the one place that turns what a user passes as data into the source a run reads.

Sources that need no placement decision are asked first (a DataLoader, a Hugging Face dataset, an
IterableDataset: data/sources.py); tensor columns go where the memory rule puts them
(data/placement.py: resident on the device, host slices, or a pinned DataLoader); a map-style
Dataset gets a DataLoader; any other iterable of batches is asked of data/sources.py last.
"""

from __future__ import annotations

from typing import Any, Callable, TypedDict

import torch
from torch.utils.data import Dataset

from gputrain.data import sources
from gputrain.data.loader import ColumnsByIndex, LoaderBatches
from gputrain.data.placement import Placement, as_columns, column_placement
from gputrain.data.resident import TensorBatches, column_length
from gputrain.data.transforms import BatchTransform
from gputrain.errors import ConfigError, DataError


class _BatchesArgs(TypedDict):
    """The keyword arguments that `TensorBatches` and `LoaderBatches` share."""

    device: torch.device
    shuffle: bool
    drop_last: bool
    seed: int
    rank: int
    world_size: int
    transform: BatchTransform | None


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
