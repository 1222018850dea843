"""A batch not yet assembled: the recipe for it, so a CUDA graph can assemble it inside the replay.

Resident data (data/resident.py) make each batch from tensors already on the device: a gather by
the epoch's shuffled order, uint8 -> float normalization, augmentation, the memory layout. Done
eagerly that is a dozen small kernel launches per step, then a copy into the graph's static
buffers, all host work outside the graph (on an H100 three quarters of a graphed small-CNN step).
A `DeferredBatch` carries only where its samples are (e.g. the first position in the epoch); the
graph captures `build` together with the training step, so a replayed step reads the data where
they lie and the host writes one scalar (or nothing) per step.

The contract, for the graph wrapper (train/step/graphs.py):
  key            hashable; batches with the same key have the same structure and shapes
  num_samples    the batch size (host metadata)
  new_inputs()   fresh tensors the graph will read each step (may be empty)
  load(inputs)   write this batch's position into those tensors, in place, without host reads
  build(inputs)  the batch, from the inputs, by device work only (capturable)
  materialize()  the same batch, eagerly (equal to build(inputs) after load(inputs))
"""

from __future__ import annotations

from typing import Any

import torch

from gputrain import batch as batches


class DeferredBatch:
    key: tuple
    num_samples: int

    def new_inputs(self) -> list[torch.Tensor]:
        raise NotImplementedError

    def load(self, inputs: list[torch.Tensor]) -> None:
        raise NotImplementedError

    def build(self, inputs: list[torch.Tensor]) -> Any:
        raise NotImplementedError

    def materialize(self) -> Any:
        raise NotImplementedError


def materialize(batch: Any) -> Any:
    """The batch itself, assembled when it is deferred."""
    return batch.materialize() if isinstance(batch, DeferredBatch) else batch


def num_samples(batch: Any) -> int:
    """Samples in a batch, deferred or not (host metadata, no sync)."""
    if type(batch) is tuple:  # the usual (inputs, targets): no isinstance against the class tree
        return batches.batch_size(batch)
    return batch.num_samples if isinstance(batch, DeferredBatch) else batches.batch_size(batch)
