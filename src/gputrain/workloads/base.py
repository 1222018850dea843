"""What a workload is: data + model + loss + sensible defaults, under a name."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import torch
from torch import nn

TASKS = ("classification", "binary", "regression")


@dataclass
class DataSplits:
    """Host tensors of a data set, split into train and (optionally) test.

    Images stay uint8 (N, C, H, W) so they take a quarter of the memory on the device; `mean` and
    `std` (per channel, in the same 0..255 units) are applied per batch on the device. Other inputs
    are float32 and used as they are (mean/std None).
    """

    train: tuple[torch.Tensor, torch.Tensor]  # (inputs, targets)
    test: tuple[torch.Tensor, torch.Tensor] | None = None
    mean: tuple[float, ...] | None = None
    std: tuple[float, ...] | None = None
    augment: str | None = None  # "crop-flip": random crop (reflect pad 4) + horizontal flip, images only

    @property
    def num_train(self) -> int:
        return int(self.train[0].shape[0])

    def nbytes(self) -> int:
        """Bytes the tensors take as stored (what a device-resident copy costs)."""
        tensors = list(self.train) + (list(self.test) if self.test is not None else [])
        return sum(t.numel() * t.element_size() for t in tensors)


@dataclass
class Workload:
    name: str
    description: str
    make_data: Callable[[], DataSplits]
    make_model: Callable[[], nn.Module]
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    task: str = "classification"  # "classification" | "binary" | "regression"
    defaults: dict[str, Any] = field(default_factory=dict)  # TrainConfig overrides, e.g. {"epochs": 20}
    full_batch: bool = False  # batch_size defaults to the whole training set
    data_summary: str = ""  # e.g. "4000 train / 1000 test, 40 floats"

    def __post_init__(self) -> None:
        if self.task not in TASKS:
            raise ValueError(f"task must be one of {TASKS}, got {self.task!r}")
