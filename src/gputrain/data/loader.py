"""Host-fed batches: a DataLoader driven epoch by epoch, its batches handed to the device feed.

Two kinds: `LoaderBatches` builds the DataLoader itself (pinned memory, workers from the CPU count,
an epoch batch sampler that can start at any batch, so a resumed run sees the same batches), also
for a user's DataLoader rebuilt with its own settings (data/user_loader.py); `UserLoaderBatches`
uses a user's DataLoader as is (a resume then reads up to its position). Batches may be any nesting
(dicts of tensors from a tokenizer, tuples, ...); the device feed (data/device_feed.py) copies every
tensor leaf of batch i+1 on a side stream while batch i computes (both kinds' positions are counts, so
they read ahead). Without workers and pinning the batches are fetched and collated in this process
directly, as the DataLoader would, without its per-batch bookkeeping.
"""

from __future__ import annotations

import collections.abc
import itertools
import logging
import os
from typing import Any, Callable, Iterator

import torch
from torch.utils.data import DataLoader, Dataset, default_collate, default_convert

from gputrain import batch as batches
from gputrain.data.device_feed import to_device
from gputrain.data.stream import epoch_seed
from gputrain.data.transforms import BatchTransform
from gputrain.errors import DataError

log = logging.getLogger("gputrain")


class EpochBatchSampler(torch.utils.data.Sampler):
    """Index lists for one epoch from a (seed, epoch) permutation, sharded by rank, from a start batch."""

    def __init__(self, n: int, batch_size: int, shuffle: bool, drop_last: bool, seed: int, rank: int, world_size: int):
        self.n, self.batch_size, self.shuffle, self.drop_last = n, batch_size, shuffle, drop_last
        self.seed, self.rank, self.world_size = seed, rank, world_size
        self.per_rank = n // world_size if world_size > 1 else n
        self.epoch, self.start_batch = 0, 0

    def set_epoch(self, epoch: int, start_batch: int = 0) -> None:
        self.epoch, self.start_batch = epoch, start_batch

    def __len__(self) -> int:
        if self.drop_last and self.per_rank:
            return max(1, self.per_rank // self.batch_size)
        return -(-self.per_rank // self.batch_size)

    def __iter__(self):
        if self.shuffle:
            g = torch.Generator().manual_seed(epoch_seed(self.seed, self.epoch))
            perm = torch.randperm(self.n, generator=g)
        else:
            perm = torch.arange(self.n)
        if self.world_size > 1:
            perm = perm[self.rank :: self.world_size][: self.per_rank]
        # Read once per epoch (a view of the host tensor, no copy), then sliced as numpy: a batch's
        # indices cost no torch op per step (and no host read for the sentinel of diagnostics/syncs.py).
        order = perm.numpy()
        B = self.batch_size
        stop = len(self) * B if self.drop_last else self.per_rank
        for lo in range(self.start_batch * B, stop, B):
            yield order[lo : min(lo + B, stop)].tolist()


class ColumnsByIndex(Dataset):
    """A dataset whose __getitem__ takes a whole index list: one gather per column per batch."""

    def __init__(self, columns: Any, n: int):
        self.columns, self.n = columns, n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, idx):
        idx = torch.as_tensor(idx)
        return batches.map_tensors(lambda t: t[idx], self.columns)


def default_workers() -> int:
    """DataLoader workers: leave a core for the main process, at most 8."""
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(0, min(8, cpus - 1))


class LoaderBatches:
    """A DataLoader driven epoch by epoch; batches land on the device (read ahead on CUDA).

    The DataLoader is gputrain's (pinned, workers from the CPU count), or a user's rebuilt with
    gputrain's sampler (`loader_settings`: its batch size, workers, collate_fn, pin_memory,
    drop_last, ...; data/user_loader.py). Either way the sampler shards by rank and starts at any
    batch of a (seed, epoch) permutation, as a DistributedSampler with set_epoch does, and the
    DataLoader's generator is seeded per epoch from the run's seed: the workers' seeds never draw
    from the global RNG, so a resumed run's dropout sees the same random numbers.

    draws_base_seed (a user's DataLoader without a generator of its own): each epoch's start draws one
    number from the global RNG, as that DataLoader's own iter() does (`draw_base_seed`), so that the
    model's random numbers (dropout) are those of the user's loop over it.
    """

    def __init__(self, dataset: Dataset, batch_size: int, *, device: torch.device, shuffle: bool,
                 drop_last: bool = False, seed: int = 0, rank: int = 0, world_size: int = 1,
                 num_workers: int | None = None, transform: BatchTransform | None = None,
                 batched_dataset: bool = False, collate_fn: Callable[[list], Any] | None = None,
                 loader_settings: dict[str, Any] | None = None, describe: str | None = None,
                 draws_base_seed: bool = False) -> None:
        if not isinstance(dataset, collections.abc.Sized):
            raise DataError(f"{type(dataset).__name__} has no len(): pass a map-style Dataset (with __len__ and "
                            "__getitem__), or a DataLoader of it")
        self.device = device
        self.transform = transform or BatchTransform()
        self.sampler = EpochBatchSampler(len(dataset), batch_size, shuffle, drop_last, seed, rank, world_size)
        if len(dataset) and not self.sampler.per_rank:
            raise DataError(f"{len(dataset)} samples cannot be shared by {world_size} processes: each needs at "
                            "least one; use fewer processes or more data")
        self.batch_size = batch_size
        self.train = shuffle
        self.seed = seed
        self.draws_base_seed = draws_base_seed
        self.describe = describe or type(dataset).__name__
        workers = default_workers() if num_workers is None else num_workers
        settings: dict[str, Any] = dict(num_workers=workers, pin_memory=device.type == "cuda",
                                        persistent_workers=workers > 0)
        settings.update(loader_settings or {})
        for name in ("batch_size", "drop_last", "shuffle", "sampler", "batch_sampler"):
            settings.pop(name, None)  # the sampler decides these
        if collate_fn is not None:
            settings["collate_fn"] = collate_fn
        self._loader_gen = torch.Generator()  # the workers' base seed, per epoch (not the global RNG)
        if batched_dataset:
            # The dataset takes an index list: the sampler's lists are the batches, no collation.
            settings.setdefault("collate_fn", None)
            self.loader = DataLoader(dataset, sampler=self.sampler, batch_size=None, generator=self._loader_gen,
                                     **settings)
        else:
            self.loader = DataLoader(dataset, batch_sampler=self.sampler, generator=self._loader_gen, **settings)
        self.num_workers = settings["num_workers"]
        self._gen = torch.Generator(device=device)
        # No workers and nothing to pin: the DataLoader's iterator would only add its per-batch
        # bookkeeping (~10 us: profiler annotations, fetcher objects) to what this loop does itself,
        # the same fetch and collate in the same order.
        self._dataset, self._batched = dataset, batched_dataset
        # A dataset's own batch read, which the DataLoader calls in place of one __getitem__ per
        # sample when the dataset has a truthy __getitems__ (torch's Subset and StackDataset pass
        # it on; a Hugging Face Dataset's is one Arrow read for the whole list).
        getitems = getattr(dataset, "__getitems__", None)
        self._getitems: Callable[[list[int]], Any] | None = getitems if getitems and callable(getitems) else None
        self._direct = self.num_workers == 0 and not settings.get("pin_memory")
        self._collate = settings.get("collate_fn") or (default_convert if batched_dataset else default_collate)

    @property
    def num_samples(self) -> int:
        return self.sampler.per_rank

    def __len__(self) -> int:
        return len(self.sampler)

    def iter_epoch(self, epoch: int, start_batch: int = 0) -> Iterator[Any]:
        self.sampler.set_epoch(epoch, start_batch)
        self._loader_gen.manual_seed(epoch_seed(self.seed, epoch, salt=2))
        if self.draws_base_seed and start_batch == 0:  # mid-epoch: drawn before the checkpoint's RNG state
            draw_base_seed()
        # The position is (epoch, batch), where the sampler starts: reading ahead leaves it as it is.
        batches_on_device = to_device(self._fetch() if self._direct else iter(self.loader), self.device,
                                      state_saved=False)
        if self.transform.is_identity:  # the batches as they come: no per-batch work here
            yield from batches_on_device
            return
        for i, batch in enumerate(batches_on_device):
            if self.train and self.transform.augment:
                self._gen.manual_seed(epoch_seed(self.seed, epoch, salt=1 + start_batch + i))
            yield self.transform(batch, self.train, self._gen)

    def _fetch(self) -> Iterator[Any]:
        """The batches of the sampler's epoch, fetched and collated here (no workers, no pinning),
        as the DataLoader's fetcher does: the index list to a batched dataset, to __getitems__ when
        the dataset has one, else one __getitem__ per index."""
        dataset, collate, getitems = self._dataset, self._collate, self._getitems
        for idx in self.sampler:
            if self._batched:
                yield collate(dataset[idx])
            elif getitems is not None:
                yield collate(getitems(idx))
            else:
                yield collate([dataset[i] for i in idx])

    def __iter__(self) -> Iterator[Any]:
        return self.iter_epoch(0)


class UserLoaderBatches:
    """A DataLoader the user built, used as is (its own batching, shuffling and sampler).

    A resumed run reaches its position by reading the batches before it again (a warning says how
    many); the order then matches only when the loader's sampler is seeded (shuffle=False, or a
    generator of its own). gputrain rebuilds most map-style loaders instead (data/user_loader.py).
    """

    def __init__(self, loader: DataLoader, device: torch.device, transform: BatchTransform | None = None,
                 train: bool = True, why: str = "", seed: int = 0):
        self.loader = loader
        self.device = device
        self.transform = transform or BatchTransform()
        self.train = train
        self.batch_size = loader.batch_size or 1
        self.describe = f"the DataLoader over {type(loader.dataset).__name__}"
        self.why = why  # why it is used as is (for the resume warning)
        self.seed = seed
        self._gen = torch.Generator(device=device)
        self._loader_gen = adopt_generator(loader) if train else None

    @property
    def num_samples(self) -> int:
        dataset = self.loader.dataset
        if isinstance(dataset, collections.abc.Sized):
            try:
                return len(dataset)
            except TypeError:  # a __len__ that says there is none
                pass
        return len(self) * self.batch_size

    def __len__(self) -> int:
        return len(self.loader)

    def iter_epoch(self, epoch: int, start_batch: int = 0) -> Iterator[Any]:
        set_epoch = getattr(getattr(self.loader, "sampler", None), "set_epoch", None)  # a DistributedSampler's
        if set_epoch is not None:
            set_epoch(epoch)
        if self._loader_gen is not None:  # the workers' seed from the run, not the global RNG
            self._loader_gen.manual_seed(epoch_seed(self.seed, epoch, salt=2))
            if start_batch == 0:  # the draw your loop's iter() makes (mid-epoch: made before the checkpoint)
                draw_base_seed()
        if start_batch and self.train:
            log.warning("resuming %s at batch %d of epoch %d by reading the %d batches before it again%s",
                        self.describe, start_batch, epoch, start_batch, f" ({self.why})" if self.why else "")
        it = iter(self.loader)
        for _ in itertools.islice(it, start_batch):
            pass  # a loader used as is can only be fast-forwarded by reading it (on the host)
        # The position is the count of batches read: reading ahead leaves it as it is.
        for batch in to_device(it, self.device, state_saved=False):
            yield self.transform(batch, self.train, self._gen)

    def __iter__(self) -> Iterator[Any]:
        return self.iter_epoch(0)


def draw_base_seed() -> None:
    """Advance the global CPU generator as a DataLoader without a generator does at every iter(): one
    int64 drawn for its workers' base seed (torch/utils/data/dataloader.py, _BaseDataLoaderIter.__init__),
    before its sampler's first draw. The number itself is not used (the workers take the run's seed for
    the epoch, which a resumed run finds again), so nothing is read to the host."""
    torch.empty((), dtype=torch.int64).random_()


def adopt_generator(loader: Any) -> torch.Generator | None:
    """The run's generator for a DataLoader that has none (None when it has its own, or is no
    DataLoader): seeded per epoch by the caller, it makes the workers' base seed (and an iterable's
    shared seed) without drawing from the global RNG, which a resumed run would otherwise draw at
    another moment than the uninterrupted one (dropout then differs). The caller draws the number
    your loop's iter() would take from the global RNG itself, at each epoch's start (`draw_base_seed`)."""
    if not isinstance(loader, DataLoader) or has_own_generator(loader):
        return None
    loader.generator = torch.Generator()
    loader._gputrain_generator = loader.generator  # pyright: ignore[reportAttributeAccessIssue]  (ours, not yours)
    return loader.generator


def has_own_generator(loader: DataLoader) -> bool:
    """Whether the user gave `loader` a generator (not one an earlier fit adopted for it): its iter()
    then draws from that generator, not from the global RNG."""
    return loader.generator is not None and loader.generator is not getattr(loader, "_gputrain_generator", None)
