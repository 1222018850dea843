"""Mini-batches as gathers from tensors that stay where they are (the device, or the host for CPU runs).

The data are columns: a tuple of tensors such as (inputs, targets), or a dict of equal-length
tensors such as {"input_ids", "attention_mask", "labels"}. The whole set is copied to the device
once; images stay uint8 there and are normalized (and augmented) per batch; each epoch is a seeded
`randperm` on the device and a batch is one `index_select` per column. No per-batch host work and no
per-batch host-to-device copy.

Each epoch's order and augmentation draws (crop offsets, flips) are made once, at the epoch's start,
into buffers that keep their addresses; a batch is rows [lo, hi) of them. So a batch can also be
handed out deferred (`defer`, data/deferred.py): the CUDA graph of the training step then
assembles it itself (gather, normalize, augment, layout) from one scalar the host writes per step.
"""

from __future__ import annotations

import math
from typing import Any, Iterator

import torch

from gputrain import batch as batches
from gputrain.data.deferred import DeferredBatch
from gputrain.data.stream import epoch_seed
from gputrain.data.transforms import BatchTransform, CropFlip
from gputrain.errors import DataError


def column_length(columns: Any) -> int:
    """The common dim 0 of every tensor column; DataError naming the first one that differs."""
    leaves, _ = batches.flatten(columns)
    named = list(batches.iter_tensors(columns, "data"))
    if not named:
        raise DataError("the data hold no tensors: pass (inputs, targets) tensors or a dict of tensors")
    first, head = named[0]
    for name, t in named:
        if t.dim() == 0:
            raise DataError(f"{name} is a scalar; every column needs a sample dimension (dim 0)")
        if int(t.shape[0]) != int(head.shape[0]):
            raise DataError(f"{first} has {int(head.shape[0])} samples but {name} has {int(t.shape[0])}: every "
                            "column needs the same number of samples along dim 0")
    return int(head.shape[0])


class TensorBatches:
    """Mini-batches as gathers from columns (on the device, or on the host for the CPU).

    Rank r of `world_size` takes every world_size-th index of each epoch's permutation, cut to equal
    length, so every rank runs the same number of steps.
    """

    uniform_batches = True  # slices of the same columns: the stream need not check their structure

    def __init__(self, columns: Any, batch_size: int, *, device: torch.device, shuffle: bool = True,
                 drop_last: bool = False, seed: int = 0, rank: int = 0, world_size: int = 1,
                 transform: BatchTransform | None = None) -> None:
        self.n = column_length(columns)
        self.device = device
        # One copy to the device for the whole run (a no-op when already there).
        self.columns = batches.map_tensors(lambda t: t.to(device), columns)
        # The usual (inputs, targets): a flat tuple of tensors, gathered without the pytree walk.
        self._flat_tuple = type(self.columns) is tuple and all(isinstance(c, torch.Tensor) for c in self.columns)
        self.batch_size = batch_size
        self.shuffle = shuffle
        self.drop_last = drop_last
        self.seed = seed
        self.rank = rank
        self.world_size = world_size
        self.transform = transform or BatchTransform()
        self.per_rank = self.n // world_size if world_size > 1 else self.n
        if self.n == 0:
            raise DataError("the data have 0 samples (tensors with an empty dim 0): check the data you "
                            "pass (a filter or a split that removed everything)")
        if self.per_rank == 0:
            raise DataError(f"{self.n} samples cannot be shared by {world_size} processes: each needs at least one; "
                            "use fewer processes or more data")
        # Generators live on the data's device so randperm and augmentation never touch the host.
        self._gen = torch.Generator(device=device)
        # Hand out DeferredBatch (assembled by the graph that runs the step): set by the trainer only
        # when a CUDA graph runs one micro-batch per step, which assembles each batch before the next
        # is asked for (the next epoch's plan overwrites the buffers in place).
        self.defer = False
        self._order: torch.Tensor | None = None  # (per_rank,) int64: this epoch's sample order; None: plain slices
        self._aug: CropFlip | None = None  # this epoch's augmentation draws, by position in the epoch

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
            # inside the one batch does not change the mean loss (iris's full-batch run).
            return None
        if self.shuffle:
            self._gen.manual_seed(epoch_seed(self.seed, epoch))
            perm = torch.randperm(self.n, device=self.device, generator=self._gen)
        else:
            perm = torch.arange(self.n, device=self.device)
        if self.world_size > 1:
            perm = perm[self.rank :: self.world_size][: self.per_rank]
        return perm

    @property
    def _augments(self) -> bool:
        return self.shuffle and self.transform.augment is not None  # shuffle: the training split

    def _plan(self, epoch: int) -> None:
        """The epoch's order and augmentation draws, written in place (a captured graph reads them)."""
        perm = self._indices(epoch)
        if perm is not None:
            if self._order is None:
                self._order = torch.empty(self.per_rank, dtype=torch.int64, device=self.device)
            self._order.copy_(perm)
        if self._augments:
            if self._aug is None:
                self._aug = CropFlip.empty(self.per_rank, self.device)
            self._gen.manual_seed(epoch_seed(self.seed, epoch, salt=1))
            self._aug.draw_(self._gen)

    def _assemble(self, rows, idx: torch.Tensor | None, aug: CropFlip | None) -> Any:
        if idx is not None and aug is None and self._flat_tuple and self.transform.is_identity:
            return tuple([t.index_select(0, idx) for t in self.columns])  # per step: one gather a column
        if idx is None:
            # A new container either way (the step may change a dict batch it is given).
            batch = batches.map_tensors((lambda t: t) if rows is None else (lambda t: t[rows]), self.columns)
        else:
            batch = batches.map_tensors(lambda t: t.index_select(0, idx), self.columns)
        return self.transform(batch, self.shuffle, params=aug)

    def rows(self, lo: int, hi: int) -> Any:
        """Positions [lo, hi) of the planned epoch, assembled eagerly (slices of the plan: views)."""
        rows = slice(lo, hi)
        aug = None if self._aug is None else self._aug[rows]
        if self._order is None and lo == 0 and hi == self.n:  # the whole data set, in order: no slicing
            if aug is None and type(self.columns) is tuple and self.transform.is_identity:
                return self.columns  # a tuple of the columns themselves (nothing to copy: it cannot change)
            return self._assemble(None, None, aug)
        return self._assemble(rows, None if self._order is None else self._order[rows], aug)

    def rows_at(self, start: torch.Tensor | None, size: int) -> Any:
        """Positions [start, start + size) of the planned epoch, with `start` a device scalar: device
        work only, so a CUDA graph can capture it. Equal to `rows(start, start + size)`.
        start: None only for the whole epoch (size == per_rank)."""
        if size == self.per_rank:  # the whole epoch in one batch: start is 0, read the plan as it is
            return self._assemble(None, self._order, self._aug)
        if start is None:
            raise ValueError(f"rows_at needs a start position for {size} of {self.per_rank} samples")
        pos = start + torch.arange(size, device=self.device)
        idx = pos if self._order is None else self._order.index_select(0, pos)
        return self._assemble(None, idx, None if self._aug is None else self._aug[pos])

    def iter_epoch(self, epoch: int, start_batch: int = 0) -> Iterator[Any]:
        """Batches of one epoch, from batch `start_batch` on (resume)."""
        self._plan(epoch)
        B = self.batch_size
        stop = len(self) * B if self.drop_last else self.per_rank
        if not self.defer and self._aug is None and self._flat_tuple and self.transform.is_identity:
            # The usual (inputs, targets) in a shuffled order: one gather a column, nothing else per batch.
            columns, order = self.columns, self._order
            if order is not None:
                for lo in range(start_batch * B, stop, B):
                    idx = order[lo:lo + B]  # a view of the plan; a slice stops at the end by itself
                    yield tuple([t.index_select(0, idx) for t in columns])
                return
        for lo in range(start_batch * B, stop, B):
            hi = min(lo + B, stop)
            yield ResidentRows(self, lo, hi - lo) if self.defer else self.rows(lo, hi)

    def iter_from(self, epoch: int, start_batch: int = 0) -> Iterator[Any]:
        """Batches from (epoch, start_batch) on, epoch after epoch without end: `BatchStream` counts
        the position (len(self) batches an epoch), so no epoch ends in a StopIteration and a new
        generator. Full-batch training in order (iris) hands out the columns themselves every step."""
        if (not self.defer and len(self) == 1 and self._indices(epoch) is None and not self._augments
                and type(self.columns) is tuple and self.transform.is_identity):
            whole = self.rows(0, self.per_rank)  # the columns tuple: nothing is drawn, nothing changes
            while True:
                yield whole
        while True:
            yield from self.iter_epoch(epoch, start_batch)
            epoch, start_batch = epoch + 1, 0

    def __iter__(self) -> Iterator[Any]:
        return self.iter_epoch(0)


class ResidentRows(DeferredBatch):
    """Positions [start, start + size) of a TensorBatches epoch, not yet assembled.

    The graph reads one int64 scalar, the start; a batch that is the whole epoch reads nothing.
    """

    def __init__(self, source: TensorBatches, start: int, size: int):
        self.source, self.start, self.num_samples = source, start, size
        self.key = ("resident", id(source), size)
        self._whole = size == source.per_rank

    def new_inputs(self) -> list[torch.Tensor]:
        return [] if self._whole else [torch.zeros((), dtype=torch.int64, device=self.source.device)]

    def load(self, inputs: list[torch.Tensor]) -> None:
        if inputs:
            inputs[0].fill_(self.start)  # one small kernel with a host scalar: no copy, no read

    def build(self, inputs: list[torch.Tensor]) -> Any:
        return self.source.rows_at(inputs[0] if inputs else None, self.num_samples)

    def materialize(self) -> Any:
        return self.source.rows(self.start, self.start + self.num_samples)

    def __repr__(self) -> str:
        return f"ResidentRows(start={self.start}, size={self.num_samples})"
