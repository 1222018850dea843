"""Your own DataLoader: rebuilt so that it shards across processes and resumes exactly, or used as is.

A DataLoader over a map-style dataset whose sampler is the usual one (shuffle=True or False, or a
DistributedSampler) is rebuilt as Lightning's `use_distributed_sampler` does: the same dataset,
batch size, workers, collate_fn, pin_memory, drop_last and worker settings, with gputrain's
sampler in place of the loader's: a (seed, epoch) permutation sharded by rank (a DistributedSampler
with set_epoch every epoch) that starts at any batch. So a stopped run resumes mid-epoch without
reading the skipped batches, and its order no longer depends on the global RNG. The global RNG still
gives the one number per epoch that your DataLoader's iter() takes from it (when the loader has no
generator of its own): with shuffle=False fit then trains exactly as your loop over the same loader
after the same torch.manual_seed (dropout included); with shuffle=True the order is fit's own.

A DataLoader over an IterableDataset becomes torchdata's StatefulDataLoader with the same settings
(when torchdata is installed), whose state the checkpoint keeps. Under several processes its
dataset must read this rank's part: a Hugging Face IterableDataset is split with
`split_dataset_by_node`, a dataset marked `sharded_by_rank` (or wrapped in `Sharded`) is trusted,
and any other is refused with the reason, since every rank would read every sample.

`TrainConfig(rebuild_loader=False)` keeps the loader as is (a resumed run then reads up to its
position; under several processes every rank sees every batch, with a warning).
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from torch.utils.data import (BatchSampler, DataLoader, DistributedSampler, IterableDataset, RandomSampler,
                              SequentialSampler)

from gputrain.data.hf import is_hf_iterable, split_by_node
from gputrain.data.iterable import (IterableBatches, build_iterable_loader, is_stateful, loader_settings,
                                    stateful_loader_class)
from gputrain.data.loader import LoaderBatches, UserLoaderBatches, has_own_generator
from gputrain.data.placement import Placement
from gputrain.data.transforms import BatchTransform
from gputrain.errors import DataError

log = logging.getLogger("gputrain")

KEEP_AS_IS = "TrainConfig(rebuild_loader=False) keeps it as is"


def _plain_shuffle(loader: DataLoader) -> bool | None:
    """True/False: the loader's sampler is plain shuffle/sequential (or a DistributedSampler) over the
    whole dataset, so gputrain's sampler can take its place; None: a custom sampler."""
    if loader.batch_size is None or type(loader.batch_sampler) is not BatchSampler:
        return None
    sampler = loader.sampler
    if type(sampler) is SequentialSampler:
        return False
    if type(sampler) is RandomSampler and not sampler.replacement and sampler.num_samples == len(sampler.data_source):
        return True
    if type(sampler) is DistributedSampler:
        return bool(sampler.shuffle)
    return None


def adopt_loader(loader: DataLoader, *, device: torch.device, train: bool, seed: int, rank: int, world_size: int,
                 transform: BatchTransform | None, rebuild: bool = True) -> tuple[Any, Placement]:
    """The source for a user's DataLoader (see the module docstring), and why."""
    if not train:  # evaluation: every batch once, in the loader's order
        return UserLoaderBatches(loader, device, transform, train), Placement(
            "user-dataloader", "a DataLoader was given: used as is")
    if isinstance(loader.dataset, IterableDataset):
        return _adopt_iterable(loader, device=device, seed=seed, rank=rank, world_size=world_size,
                               transform=transform, rebuild=rebuild)
    batch = loader.batch_size
    if not rebuild:
        if world_size > 1:
            log.warning("rebuild_loader=False: your DataLoader is used as is under %d processes, so every rank "
                        "sees every batch; give it a DistributedSampler yourself to shard it", world_size)
        return UserLoaderBatches(loader, device, transform, train, why="rebuild_loader=False", seed=seed), Placement(
            "user-dataloader", f"a DataLoader was given (batch {batch}): used as is (rebuild_loader=False)")
    shuffle = _plain_shuffle(loader)
    if shuffle is None:
        what = (f"its sampler {type(loader.sampler).__name__}" if loader.batch_size is not None
                else "batch_size=None (the dataset makes the batches)")
        if type(loader.batch_sampler) is not BatchSampler and loader.batch_size is not None:
            what = f"its batch_sampler {type(loader.batch_sampler).__name__}"
        if world_size > 1:
            raise DataError(f"cannot shard your DataLoader across {world_size} processes: {what} is not one gputrain "
                            "can replace with a distributed sampler, and used as is every rank would see every "
                            "batch. Give the DataLoader a sampler that yields this rank's part (a "
                            f"DistributedSampler, or your own), and then {KEEP_AS_IS}; or pass the Dataset itself")
        return UserLoaderBatches(loader, device, transform, train, why=f"{what} cannot start at a batch",
                                 seed=seed), Placement(
            "user-dataloader", f"a DataLoader was given (batch {batch}): used as is ({what} is its own)")
    assert batch is not None  # _plain_shuffle checked it
    source = LoaderBatches(loader.dataset, batch, device=device, shuffle=shuffle, drop_last=loader.drop_last,
                           seed=seed, rank=rank, world_size=world_size, transform=transform,
                           loader_settings=loader_settings(loader),
                           describe=f"the DataLoader over {type(loader.dataset).__name__}",
                           draws_base_seed=not has_own_generator(loader))
    shard = f", sharded across {world_size} processes" if world_size > 1 else ""
    return source, Placement("user-dataloader", f"a DataLoader was given (batch {batch}, shuffle={shuffle}, "
                             f"{loader.num_workers} workers): rebuilt with gputrain's sampler, seeded by the run"
                             f"{shard}, resumable mid-epoch ({KEEP_AS_IS})")


def _adopt_iterable(loader: DataLoader, *, device: torch.device, seed: int, rank: int, world_size: int,
                    transform: BatchTransform | None, rebuild: bool) -> tuple[Any, Placement]:
    dataset = loader.dataset
    name = type(dataset).__name__
    settings = loader_settings(loader)
    own_draw = not has_own_generator(loader)  # its iter() draws from the global RNG: so does each pass
    if not rebuild:
        if world_size > 1:
            log.warning("rebuild_loader=False: the DataLoader over %s is used as is under %d processes; unless "
                        "the dataset reads its own part per rank, every rank sees every batch", name, world_size)
        return (IterableBatches(loader, device=device, transform=transform, batch_size=loader.batch_size,
                                describe=f"the DataLoader over {name}", seed=seed, draws_base_seed=own_draw),
                Placement("iterable", f"a DataLoader over {name} was given: used as is (rebuild_loader=False)"))
    how = []
    if world_size > 1:
        if is_hf_iterable(dataset):
            dataset, split = split_by_node(dataset, rank, world_size)
            if split:
                how.append(f"split across {world_size} processes (split_dataset_by_node)")
        elif not getattr(dataset, "sharded_by_rank", False):
            raise DataError(
                f"cannot shard the DataLoader over {name} across {world_size} processes: it is an IterableDataset, "
                "which gputrain cannot split, so every rank would read every sample. Make its __iter__ yield this "
                "rank's and this worker's part (gputrain.data.my_part() / take_part(), or wrap it: "
                "gputrain.data.Sharded(dataset)) and set sharded_by_rank = True on it; or "
                f"{KEEP_AS_IS}")
    if dataset is loader.dataset and is_stateful(loader):
        source = loader  # a StatefulDataLoader already
        how.append("its state is saved in checkpoints")
    elif stateful_loader_class() is not None:
        source = build_iterable_loader(dataset, settings)
        how.append("rebuilt as torchdata's StatefulDataLoader (same settings), whose state checkpoints keep")
    else:
        source = DataLoader(dataset, **settings) if dataset is not loader.dataset else loader
        how.append("without torchdata a resumed run reads up to its position (pip install gputrain[data])")
    return (IterableBatches(source, device=device, transform=transform, batch_size=loader.batch_size,
                            describe=f"the DataLoader over {name}", seed=seed, draws_base_seed=own_draw),
            Placement("iterable", f"a DataLoader over the IterableDataset {name} was given (batch "
                      f"{loader.batch_size}, {loader.num_workers} workers): " + "; ".join(how)))
