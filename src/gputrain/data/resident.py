"""Mini-batches as gathers from tensors that stay where they are (the device, or the host for CPU runs).

The data are columns: a tuple of tensors such as (inputs, targets), or a dict of equal-length
tensors such as {"input_ids", "attention_mask", "labels"}. The whole set is copied to the device
once; images stay uint8 there and are normalized (and augmented) per batch; each epoch is a seeded
`randperm` on the device and a batch is one `index_select` per column. No per-batch host work and no
per-batch host-to-device copy.
"""

from __future__ import annotations

import math
from typing import Any, Iterator

import torch

from gputrain import batch as batches
from gputrain.data.stream import epoch_seed
from gputrain.data.transforms import BatchTransform
from gputrain.errors import DataError


def column_length(columns: Any) -> int:
    """The common dim 0 of every tensor column; DataError naming the first one that differs."""
    leaves, _ = batches.flatten(columns)
    named = list(batches.iter_tensors(columns, "data"))
    if not named:
        raise DataError("the data hold no tensors: pass (inputs, targets) tensors or a dict of tensors")
    n = None
    for name, t in named:
        if t.dim() == 0:
            raise DataError(f"{name} is a scalar; every column needs a sample dimension (dim 0)")
        if n is None:
            n, first = int(t.shape[0]), name
        elif int(t.shape[0]) != n:
            raise DataError(f"{first} has {n} samples but {name} has {int(t.shape[0])}: every column needs the "
                            "same number of samples along dim 0")
    return n


class TensorBatches:
    """Mini-batches as gathers from columns (on the device, or on the host for the CPU).

    Rank r of `world_size` takes every world_size-th index of each epoch's permutation, cut to equal
    length, so every rank runs the same number of steps.
    """

    def __init__(self, columns: Any, batch_size: int, *, device: torch.device, shuffle: bool = True,
                 drop_last: bool = False, seed: int = 0, rank: int = 0, world_size: int = 1,
                 transform: BatchTransform | None = None) -> None:
        self.n = column_length(columns)
        self.device = device
        # One copy to the device for the whole run (a no-op when already there).
        self.columns = batches.map_tensors(lambda t: t.to(device), columns)
        self.batch_size = batch_size
        self.shuffle = shuffle
        self.drop_last = drop_last
        self.seed = seed
        self.rank = rank
        self.world_size = world_size
        self.transform = transform or BatchTransform()
        self.per_rank = self.n // world_size if world_size > 1 else self.n
        if self.per_rank == 0:
            raise DataError(f"{self.n} samples cannot be shared by {world_size} processes")
        # Generators live on the data's device so randperm and augmentation never touch the host.
        self._gen = torch.Generator(device=device)

    @property
    def num_samples(self) -> int:
        """Samples this rank sees per epoch."""
        return self.per_rank

    def __len__(self) -> int:
        if self.drop_last:
            return max(1, self.per_rank // self.batch_size)
        return math.ceil(self.per_rank / self.batch_size)

    def _indices(self, epoch: int) -> torch.Tensor | None:
        if self.world_size == 1 and (not self.shuffle or self.batch_size >= self.n):
            # Plain slices, no gather: also for full-batch training, where the order of the samples
            # inside the one batch does not change the mean loss (seed 003's iris run).
            return None
        if self.shuffle:
            self._gen.manual_seed(epoch_seed(self.seed, epoch))
            perm = torch.randperm(self.n, device=self.device, generator=self._gen)
        else:
            perm = torch.arange(self.n, device=self.device)
        if self.world_size > 1:
            perm = perm[self.rank :: self.world_size][: self.per_rank]
        return perm

    def iter_epoch(self, epoch: int, start_batch: int = 0) -> Iterator[Any]:
        """Batches of one epoch, from batch `start_batch` on (resume)."""
        perm = self._indices(epoch)
        train = self.shuffle
        B = self.batch_size
        stop = len(self) * B if self.drop_last else self.per_rank
        for i, lo in enumerate(range(start_batch * B, stop, B)):
            hi = min(lo + B, stop)
            if perm is None:
                batch = batches.map_tensors(lambda t: t[lo:hi], self.columns)
            else:
                idx = perm[lo:hi]
                batch = batches.map_tensors(lambda t: t.index_select(0, idx), self.columns)
            if train and self.transform.augment:
                self._gen.manual_seed(epoch_seed(self.seed, epoch, salt=1 + start_batch + i))
            yield self.transform(batch, train, self._gen)

    def __iter__(self) -> Iterator[Any]:
        return self.iter_epoch(0)
