"""Iterables of any kind: a torch IterableDataset, a DataLoader over one, any Python iterable of batches.

`IterableBatches` drives one pass per epoch and hands its batches to the device feed
(data/device_feed.py: read ahead on CUDA unless the loader's state is the saved position):

- a DataLoader over an IterableDataset. gputrain builds it (batch_size, collate_fn, num_workers from
  the config) for an IterableDataset given directly, and rebuilds a user's plain DataLoader the
  same way: as torchdata's `StatefulDataLoader` when torchdata is installed, so that a checkpoint
  holds the loader's state (and through it an `IterableDataset.state_dict()`, Hugging Face's
  included) and a resumed run starts where the stopped one was, workers and all;
- any other iterable, yielding batches as they are (a list of batches, an object whose __iter__
  starts over, or a generator, which can be read only once: the run ends when it runs out). A list
  or tuple resumes at its index; the others by reading the batches before the position again.

The contract for an IterableDataset (the same as PyTorch's, plus ranks): its `__iter__` must yield
only the part of the data that belongs to this process and this DataLoader worker; otherwise
every worker and every rank reads every sample. `my_part()` says which part that is, `take_part()`
keeps it from a stream every reader sees whole, and `Sharded(dataset)` wraps an IterableDataset
so that it does both. A dataset that shards itself says so with `sharded_by_rank = True`.
"""

from __future__ import annotations

import collections.abc
import itertools
import logging
import os
import warnings
from typing import Any, Iterable, Iterator, Sequence, cast

import torch
from torch.utils.data import DataLoader, IterableDataset, get_worker_info

from gputrain.data.device_feed import to_device
from gputrain.data.loader import adopt_generator, draw_base_seed
from gputrain.data.stream import epoch_seed
from gputrain.data.transforms import BatchTransform

log = logging.getLogger("gputrain")


# ---------------------------------------------------------------- the part of a stream each reader takes


def my_part() -> tuple[int, int]:
    """(index, count): which part of a stream this process and DataLoader worker reads.

    count = processes x workers per process; index = rank x workers + worker id. Outside a worker
    (num_workers=0) the worker is 0 of 1; outside torchrun the rank is 0 of 1.
    """
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        rank, world = dist.get_rank(), dist.get_world_size()
    else:
        rank, world = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
    info = get_worker_info()
    worker, workers = (info.id, info.num_workers) if info is not None else (0, 1)
    return rank * workers + worker, world * workers


def take_part(items: Iterable[Any], index: int | None = None, count: int | None = None) -> Iterator[Any]:
    """Item `index` of every `count` consecutive items (default: `my_part()`), in whole rounds.

    Every reader gets the same number of items: a last round shorter than `count` is dropped by
    all of them, so ranks run the same number of steps. Each reader still reads the whole stream;
    where the source can be split by files or rows cheaper, split it there instead.
    """
    if index is None or count is None:
        index, count = my_part()
    it = iter(items)
    if count == 1:
        yield from it
        return
    while True:
        group = list(itertools.islice(it, count))
        if len(group) < count:
            return
        yield group[index]


class Sharded(IterableDataset):
    """An IterableDataset (or any re-iterable of samples) read in parts: each rank and DataLoader
    worker keeps its own share of the samples (`take_part`). `len()` is the dataset's, when it has one."""

    sharded_by_rank = True

    def __init__(self, dataset: Iterable[Any]):
        self.dataset = dataset

    def __iter__(self) -> Iterator[Any]:
        return take_part(self.dataset)

    def set_epoch(self, epoch: int) -> None:
        set_epoch = getattr(self.dataset, "set_epoch", None)
        if callable(set_epoch):
            set_epoch(epoch)


# ---------------------------------------------------------------- building the DataLoader


def stateful_loader_class() -> type[DataLoader] | None:
    """torchdata's StatefulDataLoader when torchdata is installed (`pip install gputrain[data]`), else None."""
    try:
        from torchdata.stateful_dataloader import StatefulDataLoader
    except ImportError:
        return None
    return StatefulDataLoader


def is_stateful(loader: Any) -> bool:
    return callable(getattr(loader, "state_dict", None)) and callable(getattr(loader, "load_state_dict", None))


def loader_settings(loader: DataLoader) -> dict[str, Any]:
    """The DataLoader's own settings, to build another one like it (batch size, workers, collate, ...)."""
    settings: dict[str, Any] = dict(
        batch_size=loader.batch_size, drop_last=loader.drop_last, num_workers=loader.num_workers,
        collate_fn=loader.collate_fn, pin_memory=loader.pin_memory, timeout=loader.timeout,
        worker_init_fn=loader.worker_init_fn, multiprocessing_context=loader.multiprocessing_context,
        persistent_workers=loader.persistent_workers)
    if loader.num_workers > 0:
        settings["prefetch_factor"] = loader.prefetch_factor
    if hasattr(loader, "in_order"):
        settings["in_order"] = loader.in_order
    return settings


def build_iterable_loader(dataset: Any, settings: dict[str, Any]) -> DataLoader:
    """A StatefulDataLoader (torchdata) over `dataset`, or a plain DataLoader without torchdata."""
    cls = stateful_loader_class() or DataLoader
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*set_vital.*")  # torchdata 0.11 on torch >= 2.10
        return cls(dataset, **settings)


# ---------------------------------------------------------------- the source the stream drives


class IterableBatches:
    """Batches from an iterable, one pass per epoch, on the device (see the module docstring).

    source: a DataLoader (over an IterableDataset) or any iterable of batches. batch_size: the
    loader's, for the log (None: the batches are the iterable's). shard: (rank, world) to keep one
    batch of every `world` for a plain iterable of batches under several processes; a DataLoader's
    dataset shards itself.
    """

    def __init__(self, source: Iterable[Any], *, device: torch.device, transform: BatchTransform | None = None,
                 train: bool = True, batch_size: int | None = None, shard: tuple[int, int] = (0, 1),
                 describe: str | None = None, seed: int = 0, draws_base_seed: bool = False):
        self.source = source
        self.device = device
        self.transform = transform or BatchTransform()
        self.train = train
        self.batch_size = batch_size
        self.shard = shard
        self.describe = describe or type(source).__name__
        # An iterator (a generator) is read once; anything else starts over when iterated again.
        self.reiterable = not isinstance(source, collections.abc.Iterator)
        self.stateful = isinstance(source, DataLoader) and is_stateful(source)
        self._gen = torch.Generator(device=device)
        self._warned_skip = False
        self.seed = seed
        self._loader_gen = adopt_generator(source)
        # A user's DataLoader without a generator: each pass draws the number its iter() takes from the
        # global RNG (data/loader.py, draw_base_seed), so that dropout sees your loop's random numbers.
        self.draws_base_seed = draws_base_seed
        # A list or tuple of batches starts at any batch by its index: a resume reads nothing again.
        self.indexed = isinstance(source, collections.abc.Sequence)

    @property
    def num_samples(self) -> int | None:
        n = self._length()
        return None if n is None or self.batch_size is None else n * self.batch_size

    def _length(self) -> int | None:
        try:
            n = len(self.source)  # pyright: ignore[reportArgumentType]  (an iterable may have one)
        except TypeError:
            return None
        rank, world = self.shard
        return n // world if world > 1 else n

    def __len__(self) -> int:
        n = self._length()
        if n is None:
            raise TypeError(f"{self.describe} has no length")
        return n

    def state_dict(self) -> Any:
        """The loader's state (a StatefulDataLoader's), or None: the position is then the count."""
        return self.source.state_dict() if self.stateful else None  # pyright: ignore[reportAttributeAccessIssue]

    def load_state_dict(self, state: Any) -> None:
        if self.stateful and state is not None:
            self.source.load_state_dict(state)  # pyright: ignore[reportAttributeAccessIssue]

    def _pass(self, epoch: int, start_batch: int = 0) -> Iterator[Any]:
        dataset = getattr(self.source, "dataset", self.source)
        set_epoch = getattr(dataset, "set_epoch", None)  # a Hugging Face IterableDataset's shuffle
        if callable(set_epoch):
            set_epoch(epoch)
        if self._loader_gen is not None:
            self._loader_gen.manual_seed(epoch_seed(self.seed, epoch, salt=2))
        rank, world = self.shard
        if self.indexed:  # from its index: batch `start_batch` of this rank's is item start_batch x world + rank
            items = cast(Sequence[Any], self.source)
            it = (items[i] for i in range(start_batch * world, len(items)))
        else:
            it = iter(self.source)
        return take_part(it, rank, world) if world > 1 else it

    def iter_epoch(self, epoch: int, start_batch: int = 0, restored: bool = False) -> Iterator[Any]:
        """Batches of pass `epoch` from batch `start_batch` on: from the loader's restored state, a
        list's index, or by reading the batches before it again (with a warning naming how many)."""
        if self.draws_base_seed and start_batch == 0:  # mid-pass: drawn before the checkpoint's RNG state
            draw_base_seed()
        # set_epoch too when restored: HF applies a state only in its own epoch
        it = self._pass(epoch, start_batch if self.indexed else 0)
        if start_batch and not restored and not self.indexed:
            if not self._warned_skip:
                log.warning("resuming %s at batch %d of epoch %d: it has no saved state here, so the %d batches "
                            "before it are read again%s", self.describe, start_batch, epoch, start_batch,
                            self._resume_hint())
                self._warned_skip = True
            for _ in itertools.islice(it, start_batch):
                pass
        # A StatefulDataLoader's state is the position a checkpoint saves: nothing may be read past the
        # batches consumed. Any other iterable's position is the count, which reading ahead leaves alone.
        on_device = to_device(it, self.device, state_saved=self.stateful)
        if self.transform.is_identity:
            yield from on_device
            return
        for batch in on_device:
            yield self.transform(batch, self.train, self._gen)

    def _resume_hint(self) -> str:
        """What would let a resume start where it stopped: torchdata, for a DataLoader (over an
        IterableDataset) when it is not installed; a list or a re-iterable that keeps state otherwise."""
        if isinstance(self.source, DataLoader):
            return " (install torchdata: pip install gputrain[data])" if stateful_loader_class() is None else ""
        return " (a list of batches resumes at its index)"

    def __iter__(self) -> Iterator[Any]:
        return self.iter_epoch(0)
