"""A data set as a workload hands it over: train and test tensor columns, plus how to transform them."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass
class DataSplits:
    """Host tensors of a data set, split into train and (optionally) test.

    Images stay uint8 (N, C, H, W) so they take a quarter of the memory on the device; `mean` and
    `std` (per channel, in the same 0..255 units) are applied per batch on the device. Other inputs
    are float32 and used as they are (mean/std None).
    """

    train: Any  # tensor columns: (inputs, targets), or a dict of equal-length tensors
    test: Any | None = None
    mean: tuple[float, ...] | None = None
    std: tuple[float, ...] | None = None
    augment: str | None = None  # "crop-flip": random crop (reflect pad 4) + horizontal flip, images only
    transform_key: str | int | None = None  # the leaf normalization/augmentation apply to (None: the inputs)

    @property
    def num_train(self) -> int:
        from gputrain.data.resident import column_length

        return column_length(self.train)

    def nbytes(self) -> int:
        """Bytes the tensors take as stored (what a device-resident copy costs)."""
        from gputrain.batch import tensor_leaves

        tensors = tensor_leaves(self.train) + (tensor_leaves(self.test) if self.test is not None else [])
        return sum(t.numel() * t.element_size() for t in tensors)


def unpack_splits(train_data: Any, eval_data: Any, transform):
    """(transform, train data, eval data) for the trainer: data given as DataSplits carry their own
    normalization and augmentation (a BatchTransform made from them unless one is given) and their
    test split (unless eval data are given); other data get `transform` or the identity."""
    from gputrain.data.transforms import BatchTransform

    if isinstance(train_data, DataSplits):
        splits = train_data
        transform = transform or BatchTransform(splits.mean, splits.std, splits.augment, key=splits.transform_key)
        if eval_data is None:
            eval_data = splits.test
        train_data = splits.train
    return transform or BatchTransform(), train_data, eval_data
