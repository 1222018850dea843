"""Data that are not tensor columns nor a plain torch map-style Dataset: the source that feeds each.

- a DataLoader (yours): data/user_loader.py;
- a Hugging Face `datasets.Dataset` or `IterableDataset`: data/hf.py;
- a torch IterableDataset: a DataLoader over it (a StatefulDataLoader with torchdata);
- any other iterable of batches: a list of batches, an object whose __iter__ starts over, a
  generator (read once). Under several processes each rank keeps one batch of every `world_size`.

`adopt` (loaders, Hugging Face, IterableDatasets; asked first) and `adopt_iterable` (asked last,
after tensor columns and map-style Datasets) return (source, Placement), or None for data they
do not handle. A list or tuple that is not tensor columns is a list of batches.
"""

from __future__ import annotations

import collections.abc
from typing import Any, Callable

import torch
from torch.utils.data import DataLoader, IterableDataset

from gputrain.data.hf import HFColumns, HFRows, collate_rows, is_hf_dataset, is_hf_iterable, split_by_node
from gputrain.data.iterable import IterableBatches, build_iterable_loader, stateful_loader_class
from gputrain.data.loader import LoaderBatches, UserLoaderBatches, default_workers
from gputrain.data.placement import Placement
from gputrain.data.transforms import BatchTransform
from gputrain.errors import ConfigError, DataError


def adopt(data: Any, batch_size: int, *, device: torch.device, train: bool, seed: int = 0, rank: int = 0,
          world_size: int = 1, num_workers: int | None = None, transform: BatchTransform | None = None,
          collate_fn: Callable | None = None, rebuild_loader: bool = True,
          drop_last: bool = False) -> tuple[Any, Placement] | None:
    if isinstance(data, DataLoader):
        if collate_fn is not None:
            raise ConfigError("collate_fn was given with a DataLoader, which has its own: set it on the DataLoader "
                              "(DataLoader(..., collate_fn=...)), or pass the Dataset with collate_fn")
        from gputrain.data.user_loader import adopt_loader

        return adopt_loader(data, device=device, train=train, seed=seed, rank=rank, world_size=world_size,
                            transform=transform, rebuild=rebuild_loader)
    if is_hf_dataset(data):
        return _hf_map(data, batch_size, device=device, train=train, seed=seed, rank=rank, world_size=world_size,
                       num_workers=num_workers, transform=transform, collate_fn=collate_fn, drop_last=drop_last)
    if isinstance(data, IterableDataset):
        return _iterable_dataset(data, batch_size, device=device, train=train, seed=seed, rank=rank,
                                 world_size=world_size, num_workers=num_workers, transform=transform,
                                 collate_fn=collate_fn)
    return None


def adopt_iterable(data: Any, *, device: torch.device, train: bool, rank: int = 0, world_size: int = 1,
                   transform: BatchTransform | None = None,
                   collate_fn: Callable | None = None) -> tuple[Any, Placement] | None:
    """Any other iterable (after tensor columns and map-style Datasets): its items are the batches."""
    if isinstance(data, (str, bytes, collections.abc.Mapping, torch.Tensor)):
        return None
    if not isinstance(data, collections.abc.Iterable):
        return None
    return _python_iterable(data, device=device, train=train, rank=rank, world_size=world_size,
                            transform=transform, collate_fn=collate_fn)


def _workers(num_workers: int | None, device: torch.device) -> int:
    if num_workers is not None:
        return num_workers
    return 0 if device.type == "cpu" else default_workers()


def _hf_map(data: Any, batch_size: int, *, device: torch.device, train: bool, seed: int, rank: int,
            world_size: int, num_workers: int | None, transform: BatchTransform | None,
            collate_fn: Callable | None, drop_last: bool) -> tuple[Any, Placement]:
    rows = collate_fn is not None  # a collate_fn batches the rows (and pads); else one Arrow read per batch
    source = LoaderBatches(HFRows(data) if rows else HFColumns(data), batch_size, device=device, shuffle=train,
                           drop_last=drop_last, seed=seed, rank=rank, world_size=world_size,
                           num_workers=_workers(num_workers, device), transform=transform, batched_dataset=not rows,
                           collate_fn=collate_fn, describe="the Hugging Face Dataset")
    how = (f"rows batched by {getattr(collate_fn, '__name__', type(collate_fn).__name__)}" if rows
           else "one Arrow read per batch, columns as tensors")
    return source, Placement("dataloader", f"a Hugging Face Dataset of {len(data)} rows was given: {how}, "
                             f"through gputrain's sampler ({source.num_workers} workers)")


def _iterable_dataset(data: IterableDataset, batch_size: int, *, device: torch.device, train: bool, seed: int,
                      rank: int, world_size: int, num_workers: int | None, transform: BatchTransform | None,
                      collate_fn: Callable | None) -> tuple[Any, Placement]:
    hf = is_hf_iterable(data)
    name = "the Hugging Face IterableDataset" if hf else type(data).__name__
    how = []
    if world_size > 1 and train:
        if hf:
            data, split = split_by_node(data, rank, world_size)
            how.append(f"split across {world_size} processes (split_dataset_by_node)" if split else "split already")
        elif not getattr(data, "sharded_by_rank", False):
            raise DataError(
                f"{name} is an IterableDataset, and under {world_size} processes each rank must read its own part, "
                "which gputrain cannot do for it: every rank would read every sample. Make its __iter__ yield only "
                "this rank's and this worker's part (gputrain.data.my_part() tells which; take_part() keeps it "
                "from a stream), and set sharded_by_rank = True on it; or wrap it: gputrain.data.Sharded(dataset)")
    # Workers each run __iter__: only a dataset that reads its part per worker may have several.
    if num_workers is None:
        workers = 0 if device.type == "cpu" else default_workers()
        if hf:
            workers = min(workers, int(getattr(data, "num_shards", 1) or 1))
        elif not getattr(data, "sharded_by_rank", False):
            workers = 0
    else:
        workers = num_workers
    settings: dict[str, Any] = dict(batch_size=batch_size, num_workers=workers, pin_memory=device.type == "cuda",
                                    collate_fn=collate_fn or (collate_rows if hf else None))
    if settings["collate_fn"] is None:
        del settings["collate_fn"]
    loader = build_iterable_loader(data, settings)
    how.append(f"batches of {batch_size} by a "
               + ("StatefulDataLoader (torchdata), whose state checkpoints keep" if stateful_loader_class()
                  else "DataLoader (without torchdata a resumed run reads up to its position)")
               + f", {workers} workers")
    return (IterableBatches(loader, device=device, transform=transform, train=train, batch_size=batch_size,
                            describe=name, seed=seed),
            Placement("iterable", f"{name} was given: " + "; ".join(how)))


def _python_iterable(data: Any, *, device: torch.device, train: bool, rank: int, world_size: int,
                     transform: BatchTransform | None, collate_fn: Callable | None) -> tuple[Any, Placement]:
    name = type(data).__name__
    if collate_fn is not None:
        raise ConfigError(f"collate_fn was given with {name}, an iterable of batches: collate_fn makes batches "
                          "from samples of a Dataset; yield finished batches, or pass a Dataset")
    one_shot = isinstance(data, collections.abc.Iterator)
    shard = (rank, world_size) if train else (0, 1)
    if one_shot and not train:
        raise DataError(f"eval_data is a {name}, which can be read only once, but a run evaluates at every "
                        "evaluation point: pass a list of batches, a Dataset, or an object whose __iter__ starts over")
    if one_shot and world_size > 1:
        raise DataError(f"a {name} can be read only once, and under {world_size} processes each rank needs its own "
                        "part of a stream that every rank can read: pass a re-iterable (a list, an object whose "
                        "__iter__ starts over, an IterableDataset) or a Dataset")
    source = IterableBatches(data, device=device, transform=transform, train=train, shard=shard,
                             describe=f"the {name}")
    reason = (f"a {name} of batches was given: its batches are used as they are"
              + (" (read once: the run ends when it runs out)" if one_shot else ", a new pass when it runs out")
              + (f"; each of the {world_size} processes keeps one batch of every {world_size}" if world_size > 1
                 else ""))
    return source, Placement("iterable", reason)


def batch_size_used(source: Any, given: int, default: int) -> tuple[int | None, str | None]:
    """The per-process batch size the data give (a DataLoader's own; None: batches made by the data,
    an iterable's or those of a DataLoader with batch_size=None, whose size is known once they are
    read: `unused_batch_size_note`) and a warning when TrainConfig.batch_size was set (not left at
    `default`) and differs."""
    loader = getattr(source, "loader", None)
    if isinstance(source, UserLoaderBatches) and isinstance(loader, DataLoader) and loader.batch_size is None:
        return None, None  # the dataset makes the batches: their size is read from them (run_summary)
    size = getattr(source, "batch_size", given)
    if size is None or size == given or given == default:
        return size, None
    return size, _unused(source, given, f"makes batches of {size}")


def unused_batch_size_note(source: Any, given: int, default: int, mean: float) -> str | None:
    """The warning for data that make their own batches, from the batches read: `mean` samples a
    batch on average. None when TrainConfig.batch_size was left at `default` or matches."""
    if given == default or mean == given:
        return None
    return _unused(source, given, f"made batches of {mean:g} samples on average (read from the batches)")


def _unused(source: Any, given: int, what: str) -> str:
    return (f"TrainConfig.batch_size={given} is not used: {getattr(source, 'describe', 'the data')} {what} (set the "
            "batch size on the DataLoader, or pass its Dataset to use batch_size)")
