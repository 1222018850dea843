"""Feeding the device: batches as slices of resident tensors, or a DataLoader with a prefetcher.

Three paths, chosen once by `make_loader`:
- device-resident (`TensorBatches` on a GPU): the whole data set is copied to the device once;
  images stay uint8 and are normalized (and augmented) on the device per batch; each epoch is a
  seeded `randperm`, batches are gathers. No per-batch host work, no host-to-device copy.
- host tensors on the CPU (`TensorBatches` on the CPU): the same slicing, without the per-sample
  collation a DataLoader over a TensorDataset would do.
- host-fed GPU (`LoaderBatches` + `CudaPrefetcher`): a DataLoader with pinned memory and workers,
  whose next batch is copied on a side CUDA stream while the current one computes.

Every loader yields batches `(inputs, targets)` already on the device and transformed, and can
start at any (epoch, batch) so that a resumed run sees exactly the batches it would have seen.
Shuffles depend only on (seed, epoch), so no shuffling state needs saving.
"""

from __future__ import annotations

import logging
import math
import os
from dataclasses import dataclass
from typing import Iterator, Sequence

import torch
from torch.utils.data import DataLoader, Dataset, TensorDataset

from gputrain.errors import ConfigError, DataError

log = logging.getLogger("gputrain")

Batch = tuple[torch.Tensor, torch.Tensor]


def epoch_seed(seed: int, epoch: int, salt: int = 0) -> int:
    """A distinct, reproducible seed per (run seed, epoch[, purpose])."""
    return (seed * 1_000_003 + epoch * 7_919 + salt * 104_729) % (2**63 - 1)


# ---------------------------------------------------------------- on-device transforms


@dataclass
class BatchTransform:
    """Per-batch work done on the device: uint8 -> normalized float, then augmentation.

    mean/std are per channel in the stored units (0..255 for uint8 images).
    """

    mean: tuple[float, ...] | None = None
    std: tuple[float, ...] | None = None
    augment: str | None = None  # "crop-flip"
    channels_last: bool = False

    def __post_init__(self) -> None:
        if self.augment not in (None, "crop-flip"):
            raise ConfigError(f"unknown augmentation {self.augment!r}: the built-in one is 'crop-flip'")
        self._scale: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}

    @property
    def is_identity(self) -> bool:
        return self.mean is None and self.augment is None and not self.channels_last

    def _affine(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # x*scale + shift == (x - mean) / std, with the constants cached on the device.
        if x.device not in self._scale:
            mean = torch.tensor(self.mean, dtype=torch.float32, device=x.device)
            std = torch.tensor(self.std, dtype=torch.float32, device=x.device)
            shape = (1, -1) + (1,) * (x.dim() - 2)
            self._scale[x.device] = ((1.0 / std).view(shape), (-mean / std).view(shape))
        return self._scale[x.device]

    def __call__(self, x: torch.Tensor, train: bool, generator: torch.Generator | None = None) -> torch.Tensor:
        if self.mean is not None:
            scale, shift = self._affine(x)
            x = torch.addcmul(shift, x.float(), scale)
        elif not torch.is_floating_point(x):
            x = x.float()
        if train and self.augment == "crop-flip":
            x = random_crop_flip(x, pad=4, generator=generator)
        if self.channels_last and x.dim() == 4:
            x = x.contiguous(memory_format=torch.channels_last)
        return x


def random_crop_flip(x: torch.Tensor, pad: int = 4, generator: torch.Generator | None = None) -> torch.Tensor:
    """Random crop with reflect padding and random horizontal flip, vectorized over the batch.

    x: (B, C, H, W) float on any device. Each sample gets its own offsets and flip; one gather.
    """
    B, C, H, W = x.shape
    dev = x.device
    padded = torch.nn.functional.pad(x, (pad, pad, pad, pad), mode="reflect")  # (B, C, H+2p, W+2p)
    dy = torch.randint(0, 2 * pad + 1, (B,), device=dev, generator=generator)
    dx = torch.randint(0, 2 * pad + 1, (B,), device=dev, generator=generator)
    flip = torch.rand(B, device=dev, generator=generator) < 0.5
    rows = dy[:, None] + torch.arange(H, device=dev)  # (B, H)
    cols = torch.arange(W, device=dev).expand(B, W)
    cols = torch.where(flip[:, None], cols.flip(1), cols) + dx[:, None]  # (B, W), flipped where asked
    b = torch.arange(B, device=dev)[:, None, None, None]
    c = torch.arange(C, device=dev)[None, :, None, None]
    return padded[b, c, rows[:, None, :, None], cols[:, None, None, :]]


# ---------------------------------------------------------------- batches from tensors


class TensorBatches:
    """Mini-batches as gathers from tensors (on the device, or on the host for the CPU).

    Rank r of `world_size` takes every world_size-th index of each epoch's permutation, cut to equal
    length, so every rank runs the same number of steps.
    """

    def __init__(
        self,
        inputs: torch.Tensor,
        targets: torch.Tensor,
        batch_size: int,
        *,
        device: torch.device,
        shuffle: bool = True,
        drop_last: bool = False,
        seed: int = 0,
        rank: int = 0,
        world_size: int = 1,
        transform: BatchTransform | None = None,
    ) -> None:
        if inputs.shape[0] != targets.shape[0]:
            raise DataError(f"inputs have {inputs.shape[0]} samples but targets have {targets.shape[0]}")
        self.device = device
        # One copy to the device for the whole run (a no-op when already there).
        self.inputs = inputs.to(device)
        self.targets = targets.to(device)
        self.batch_size = batch_size
        self.shuffle = shuffle
        self.drop_last = drop_last
        self.seed = seed
        self.rank = rank
        self.world_size = world_size
        self.transform = transform or BatchTransform()
        self.n = int(inputs.shape[0])
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

    def batch_sizes(self) -> list[int]:
        full, rest = divmod(self.per_rank, self.batch_size)
        sizes = [self.batch_size] * full
        if rest and not self.drop_last:
            sizes.append(rest)
        return sizes or [self.per_rank]

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

    def iter_epoch(self, epoch: int, start_batch: int = 0) -> Iterator[Batch]:
        """Batches of one epoch, from batch `start_batch` on (resume)."""
        perm = self._indices(epoch)
        train = self.shuffle
        B = self.batch_size
        stop = len(self) * B if self.drop_last else self.per_rank
        for i, lo in enumerate(range(start_batch * B, stop, B)):
            hi = min(lo + B, stop)
            if perm is None:
                x, y = self.inputs[lo:hi], self.targets[lo:hi]
            else:
                idx = perm[lo:hi]
                x, y = self.inputs.index_select(0, idx), self.targets.index_select(0, idx)
            if train and self.transform.augment:
                self._gen.manual_seed(epoch_seed(self.seed, epoch, salt=1 + start_batch + i))
            yield self.transform(x, train, self._gen), y

    def __iter__(self) -> Iterator[Batch]:
        return self.iter_epoch(0)


# ---------------------------------------------------------------- DataLoader path


class _EpochBatchSampler(torch.utils.data.Sampler):
    """Index lists for one epoch from a (seed, epoch) permutation, sharded by rank, from a start batch."""

    def __init__(self, n: int, batch_size: int, shuffle: bool, drop_last: bool, seed: int, rank: int, world_size: int):
        self.n, self.batch_size, self.shuffle, self.drop_last = n, batch_size, shuffle, drop_last
        self.seed, self.rank, self.world_size = seed, rank, world_size
        self.per_rank = n // world_size if world_size > 1 else n
        self.epoch, self.start_batch = 0, 0

    def set_epoch(self, epoch: int, start_batch: int = 0) -> None:
        self.epoch, self.start_batch = epoch, start_batch

    def __len__(self) -> int:
        if self.drop_last:
            return max(1, self.per_rank // self.batch_size)
        return math.ceil(self.per_rank / self.batch_size)

    def __iter__(self):
        if self.shuffle:
            g = torch.Generator().manual_seed(epoch_seed(self.seed, self.epoch))
            perm = torch.randperm(self.n, generator=g)
        else:
            perm = torch.arange(self.n)
        if self.world_size > 1:
            perm = perm[self.rank :: self.world_size][: self.per_rank]
        B = self.batch_size
        stop = len(self) * B if self.drop_last else self.per_rank
        for lo in range(self.start_batch * B, stop, B):
            yield perm[lo : min(lo + B, stop)].tolist()


class _TensorsByIndex(Dataset):
    """A dataset whose __getitem__ takes a whole index list: one gather per batch, not per sample."""

    def __init__(self, inputs: torch.Tensor, targets: torch.Tensor):
        self.inputs, self.targets = inputs, targets

    def __len__(self) -> int:
        return int(self.inputs.shape[0])

    def __getitem__(self, idx):
        idx = torch.as_tensor(idx)
        return self.inputs[idx], self.targets[idx]


def default_workers() -> int:
    """DataLoader workers: leave a core for the main process, at most 8."""
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(0, min(8, cpus - 1))


class LoaderBatches:
    """A DataLoader driven epoch by epoch; batches land on the device (prefetched on CUDA)."""

    def __init__(
        self,
        dataset: Dataset,
        batch_size: int,
        *,
        device: torch.device,
        shuffle: bool,
        drop_last: bool = False,
        seed: int = 0,
        rank: int = 0,
        world_size: int = 1,
        num_workers: int | None = None,
        transform: BatchTransform | None = None,
        batched_dataset: bool = False,
    ) -> None:
        self.device = device
        self.transform = transform or BatchTransform()
        self.sampler = _EpochBatchSampler(len(dataset), batch_size, shuffle, drop_last, seed, rank, world_size)
        self.batch_size = batch_size
        self.train = shuffle
        self.seed = seed
        workers = default_workers() if num_workers is None else num_workers
        pin = device.type == "cuda"
        if batched_dataset:
            # The dataset takes an index list: the sampler's lists are the batches, no collation.
            self.loader = DataLoader(dataset, sampler=self.sampler, batch_size=None, num_workers=workers,
                                     pin_memory=pin, persistent_workers=workers > 0)
        else:
            self.loader = DataLoader(dataset, batch_sampler=self.sampler, num_workers=workers,
                                     pin_memory=pin, persistent_workers=workers > 0)
        self.num_workers = workers
        self._gen = torch.Generator(device=device)

    @property
    def num_samples(self) -> int:
        return self.sampler.per_rank

    def __len__(self) -> int:
        return len(self.sampler)

    def batch_sizes(self) -> list[int]:
        full, rest = divmod(self.sampler.per_rank, self.batch_size)
        sizes = [self.batch_size] * full
        if rest and not self.sampler.drop_last:
            sizes.append(rest)
        return sizes or [self.sampler.per_rank]

    def iter_epoch(self, epoch: int, start_batch: int = 0) -> Iterator[Batch]:
        self.sampler.set_epoch(epoch, start_batch)
        source: Iterator = iter(self.loader)
        if self.device.type == "cuda":
            source = CudaPrefetcher(source, self.device)
        for i, batch in enumerate(source):
            x, y = _as_pair(batch)
            if self.device.type != "cuda":
                x, y = x.to(self.device), y.to(self.device)
            if self.train and self.transform.augment:
                self._gen.manual_seed(epoch_seed(self.seed, epoch, salt=1 + start_batch + i))
            yield self.transform(x, self.train, self._gen), y

    def __iter__(self) -> Iterator[Batch]:
        return self.iter_epoch(0)


class CudaPrefetcher:
    """Copies batch i+1 to the GPU on a side stream while batch i computes.

    The main stream waits for the copy before using a batch, and record_stream tells the caching
    allocator that the main stream uses the memory, so it is not reused too early.
    """

    def __init__(self, source: Iterator, device: torch.device):
        self.source = source
        self.device = device
        self.stream = torch.cuda.Stream(device)

    def _load(self):
        try:
            batch = next(self.source)
        except StopIteration:
            return None
        with torch.cuda.stream(self.stream):
            return tuple(t.to(self.device, non_blocking=True) if isinstance(t, torch.Tensor) else t
                         for t in _as_pair(batch))

    def __iter__(self):
        nxt = self._load()
        while nxt is not None:
            main = torch.cuda.current_stream(self.device)
            main.wait_stream(self.stream)
            batch = nxt
            for t in batch:
                if isinstance(t, torch.Tensor):
                    t.record_stream(main)
            nxt = self._load()
            yield batch


def _as_pair(batch) -> Batch:
    if isinstance(batch, (list, tuple)) and len(batch) == 2:
        return batch[0], batch[1]
    if isinstance(batch, dict) and {"inputs", "targets"} <= set(batch):
        return batch["inputs"], batch["targets"]
    raise DataError(
        "each batch must be a pair (inputs, targets) or a dict with 'inputs' and 'targets'; "
        f"got {type(batch).__name__}{f' of length {len(batch)}' if hasattr(batch, '__len__') else ''}"
    )


class UserLoaderBatches:
    """A DataLoader the user built: used as is (its own batching and shuffling)."""

    def __init__(self, loader: DataLoader, device: torch.device, transform: BatchTransform | None = None, train: bool = True):
        self.loader = loader
        self.device = device
        self.transform = transform or BatchTransform()
        self.train = train
        self.batch_size = loader.batch_size or 1
        self._gen = torch.Generator(device=device)

    @property
    def num_samples(self) -> int:
        try:
            return len(self.loader.dataset)
        except TypeError:
            return len(self) * self.batch_size

    def __len__(self) -> int:
        return len(self.loader)

    def batch_sizes(self) -> list[int]:
        return [self.batch_size] * len(self)

    def iter_epoch(self, epoch: int, start_batch: int = 0) -> Iterator[Batch]:
        sampler = getattr(self.loader, "sampler", None)
        if hasattr(sampler, "set_epoch"):
            sampler.set_epoch(epoch)
        source: Iterator = iter(self.loader)
        if self.device.type == "cuda":
            source = CudaPrefetcher(source, self.device)
        for i, batch in enumerate(source):
            if i < start_batch:
                continue  # a user loader can only be fast-forwarded by reading it
            x, y = _as_pair(batch)
            x, y = x.to(self.device), y.to(self.device)
            yield self.transform(x, self.train, self._gen), y

    def __iter__(self) -> Iterator[Batch]:
        return self.iter_epoch(0)


# ---------------------------------------------------------------- choosing a path


@dataclass
class Placement:
    """Where the data lives for this run, and why (for the run log)."""

    kind: str  # "device" | "host-slices" | "dataloader" | "user-dataloader"
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


def as_tensors(data) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The (inputs, targets) tensors behind `data`, when it is a pair or a TensorDataset."""
    if isinstance(data, (tuple, list)) and len(data) == 2 and all(isinstance(t, torch.Tensor) for t in data):
        return data[0], data[1]
    if isinstance(data, TensorDataset) and len(data.tensors) == 2:
        return data.tensors[0], data.tensors[1]
    return None


def make_loader(
    data,
    batch_size: int,
    *,
    device: torch.device,
    train: bool,
    seed: int = 0,
    rank: int = 0,
    world_size: int = 1,
    on_device: str | bool = "auto",
    memory_fraction: float = 0.5,
    num_workers: int | None = None,
    transform: BatchTransform | None = None,
    drop_last: bool = False,
) -> tuple[TensorBatches | LoaderBatches | UserLoaderBatches, Placement]:
    """Pick the fastest safe way to feed `data` to `device` and build it.

    data: (inputs, targets) tensors, a Dataset, or a DataLoader.
    """
    if isinstance(data, DataLoader):
        if world_size > 1:
            log.warning("a user DataLoader is not sharded across processes by gputrain; "
                        "pass tensors or a Dataset to get one shard per rank")
        return UserLoaderBatches(data, device, transform, train), Placement(
            "user-dataloader", "a DataLoader was given: using it as is")
    tensors = as_tensors(data)
    if tensors is not None:
        x, y = tensors
        nbytes = x.numel() * x.element_size() + y.numel() * y.element_size()
        if device.type == "cpu":
            return (TensorBatches(x, y, batch_size, device=device, shuffle=train, drop_last=drop_last, seed=seed,
                                  rank=rank, world_size=world_size, transform=transform),
                    Placement("host-slices", "CPU training: batches are slices of the tensors (no DataLoader)"))
        put, why = choose_device_resident(nbytes, device, on_device, memory_fraction)
        if put:
            return (TensorBatches(x, y, batch_size, device=device, shuffle=train, drop_last=drop_last, seed=seed,
                                  rank=rank, world_size=world_size, transform=transform),
                    Placement("device", f"data kept on the device: {why}"))
        # Host-fed: pinned batches gathered in one index op each, prefetched on a side stream.
        dataset = _TensorsByIndex(x, y)
        return (LoaderBatches(dataset, batch_size, device=device, shuffle=train, drop_last=drop_last, seed=seed,
                              rank=rank, world_size=world_size, num_workers=num_workers, transform=transform,
                              batched_dataset=True),
                Placement("dataloader", f"data streamed from the host (pinned, prefetched): {why}"))
    if isinstance(data, Dataset):
        if device.type == "cpu" and num_workers is None:
            num_workers = 0
        return (LoaderBatches(data, batch_size, device=device, shuffle=train, drop_last=drop_last, seed=seed,
                              rank=rank, world_size=world_size, num_workers=num_workers, transform=transform),
                Placement("dataloader", "a Dataset was given: DataLoader with "
                          + ("pinned memory and a side-stream prefetcher" if device.type == "cuda" else "no workers")))
    raise DataError(
        f"cannot train on {type(data).__name__}: pass (inputs, targets) tensors, a torch Dataset, or a DataLoader"
    )


class BatchStream:
    """An endless stream of (epoch, batch_in_epoch, batch) across epochs, resumable at any point."""

    def __init__(self, loader, epoch: int = 0, batch_in_epoch: int = 0):
        self.loader = loader
        self.epoch = epoch
        self.batch_in_epoch = batch_in_epoch  # the next batch to yield
        self._it: Iterator[Batch] | None = None

    def next(self) -> tuple[int, int, Batch]:
        while True:
            if self._it is None:
                if self.batch_in_epoch >= len(self.loader):
                    self.epoch, self.batch_in_epoch = self.epoch + 1, 0
                self._it = self.loader.iter_epoch(self.epoch, self.batch_in_epoch)
            try:
                batch = next(self._it)
            except StopIteration:
                self._it = None
                self.epoch, self.batch_in_epoch = self.epoch + 1, 0
                continue
            pos = (self.epoch, self.batch_in_epoch)
            self.batch_in_epoch += 1
            return pos[0], pos[1], batch


def iterate_all(loader) -> Iterator[Batch]:
    """Every batch of one pass (evaluation)."""
    return loader.iter_epoch(0, 0)


def split_batch(batch: Batch, parts: int) -> Sequence[Batch]:
    """Split a batch into `parts` micro-batches along dim 0 (OOM recovery)."""
    x, y = batch
    return list(zip(x.tensor_split(parts), y.tensor_split(parts)))
