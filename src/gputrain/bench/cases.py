"""The models and data the precision and memory benchmarks train: the CIFAR CNN and a wide MLP.

"cifar-cnn": the synthetic-cifar workload (cifar10-cnn's CifarCNN on random CIFAR-shaped uint8 images,
normalized on the device). "wide-mlp": 3072 -> width -> width -> 10 (ReLU) on random 3072-float
inputs whose labels come from a fixed random linear teacher, so the loss has something to learn.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
from torch import nn

from gputrain.errors import ConfigError

CASES = ("cifar-cnn", "wide-mlp")
MLP_FEATURES, MLP_CLASSES = 3072, 10


@dataclass
class Case:
    name: str
    description: str
    make_model: Callable[[], nn.Module]
    make_data: Callable[[int, torch.device], tuple[torch.Tensor, torch.Tensor]]  # (n, device) -> float x, y
    input_shape: tuple[int, ...]  # one sample's shape


def _cifar_cnn() -> Case:
    from gputrain.workloads import get_workload

    w = get_workload("synthetic-cifar", n=1, n_test=1)
    probe = w.make_data()  # per-channel mean/std in 0..255 units
    mean = torch.tensor(probe.mean or (0.0, 0.0, 0.0)).view(1, 3, 1, 1)
    std = torch.tensor(probe.std or (1.0, 1.0, 1.0)).view(1, 3, 1, 1)

    def data(n: int, device: torch.device):
        splits = get_workload("synthetic-cifar", n=n, n_test=1).make_data()
        x, y = splits.train  # (n, 3, 32, 32) uint8, (n,) int64
        x = (x.to(device).float() - mean.to(device)) / std.to(device)
        return x, y.to(device)

    return Case("cifar-cnn", "synthetic-cifar: cifar10-cnn's CifarCNN on random CIFAR-shaped images",
                w.make_model, data, (3, 32, 32))


def _wide_mlp(width: int) -> Case:
    def model() -> nn.Module:
        return nn.Sequential(nn.Linear(MLP_FEATURES, width), nn.ReLU(), nn.Linear(width, width), nn.ReLU(),
                             nn.Linear(width, MLP_CLASSES))

    def data(n: int, device: torch.device):
        g = torch.Generator().manual_seed(0)
        teacher = torch.randn(MLP_FEATURES, MLP_CLASSES, generator=g)
        x = torch.randn(n, MLP_FEATURES, generator=g)
        return x.to(device), (x @ teacher).argmax(1).to(device)

    return Case("wide-mlp", f"MLP {MLP_FEATURES}-{width}-{width}-{MLP_CLASSES} (ReLU), teacher-labelled random data",
                model, data, (MLP_FEATURES,))


def get_case(name: str, mlp_width: int = 4096) -> Case:
    """A benchmark case by name (see CASES). Raises ConfigError for an unknown name."""
    if name == "cifar-cnn":
        return _cifar_cnn()
    if name == "wide-mlp":
        return _wide_mlp(mlp_width)
    raise ConfigError(f"unknown benchmark workload {name!r}: choose from {', '.join(CASES)}")
