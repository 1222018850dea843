"""The models of the built-in workloads.

Every model takes float input that is already normalized (the trainer turns uint8 images into
normalized float on the device before the forward pass) and returns logits (or, for regression,
the prediction). Shapes are given as (batch, ...).
"""

from __future__ import annotations

import torch
from torch import nn


class CifarCNN(nn.Module):
    """The CIFAR-10 tutorial's `Prayer` net: (B, 3, 32, 32) -> (B, 10) logits.

    Exactly the tutorial's layers: three 5x5 convolutions (32, 32, 64 channels, padding 2 keeps the
    size) each followed by a 2x2 max-pool (32 -> 16 -> 8 -> 4), then Linear(64*4*4=1024, 64) and
    Linear(64, 10). The tutorial has no ReLU anywhere, and neither has this model: max-pooling is its
    only non-linearity. That keeps the tutorial's speed figures comparable (same FLOPs, same kernels);
    it also caps accuracy (roughly 60-65% on CIFAR-10) below that of the same net with activations.
    """

    def __init__(self, num_classes: int = 10):
        super().__init__()
        self.net = nn.Sequential(
            nn.Conv2d(3, 32, 5, padding=2),  # (B, 32, 32, 32)
            nn.MaxPool2d(2),  # (B, 32, 16, 16)
            nn.Conv2d(32, 32, 5, padding=2),
            nn.MaxPool2d(2),  # (B, 32, 8, 8)
            nn.Conv2d(32, 64, 5, padding=2),
            nn.MaxPool2d(2),  # (B, 64, 4, 4)
            nn.Flatten(),  # (B, 1024)
            nn.Linear(1024, 64),
            nn.Linear(64, num_classes),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


class MNIST1DMLP(nn.Module):
    """The MNIST-1D paper's MLP: 40 -> 100 -> 100 -> 10 with ReLU; (B, 40) -> (B, 10).

    As in the paper's code, the second hidden layer is residual (h + relu(W2 h)).
    """

    def __init__(self, input_size: int = 40, hidden: int = 100, num_classes: int = 10):
        super().__init__()
        self.fc1 = nn.Linear(input_size, hidden)
        self.fc2 = nn.Linear(hidden, hidden)
        self.fc3 = nn.Linear(hidden, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.fc1(x.flatten(1)))
        h = h + torch.relu(self.fc2(h))
        return self.fc3(h)


class MNIST1DCNN(nn.Module):
    """The MNIST-1D paper's ConvBase: (B, 40) -> (B, 10).

    Three Conv1d layers of 25 channels (kernels 5, 3, 3; stride 2; padding 1; ReLU) shrink the
    length 40 -> 19 -> 10 -> 5; the 25*5 = 125 features go to a linear classifier.
    """

    def __init__(self, length: int = 40, channels: int = 25, num_classes: int = 10):
        super().__init__()
        self.conv1 = nn.Conv1d(1, channels, 5, stride=2, padding=1)
        self.conv2 = nn.Conv1d(channels, channels, 3, stride=2, padding=1)
        self.conv3 = nn.Conv1d(channels, channels, 3, stride=2, padding=1)
        out_len = length
        for k in (5, 3, 3):
            out_len = (out_len + 2 - k) // 2 + 1
        self.linear = nn.Linear(channels * out_len, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.reshape(x.shape[0], 1, -1)  # (B, 1, L)
        h = torch.relu(self.conv1(h))
        h = torch.relu(self.conv2(h))
        h = torch.relu(self.conv3(h))
        return self.linear(h.flatten(1))


class MNIST1DGRU(nn.Module):
    """The MNIST-1D paper's GRU: a bidirectional GRU (hidden 6) reads the 40 values one at a
    time; all 40 x 2 x 6 outputs go to a linear classifier. (B, 40) -> (B, 10)."""

    def __init__(self, length: int = 40, hidden: int = 6, num_classes: int = 10, bidirectional: bool = True):
        super().__init__()
        self.gru = nn.GRU(1, hidden, batch_first=True, bidirectional=bidirectional)
        self.linear = nn.Linear(length * hidden * (2 if bidirectional else 1), num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out, _ = self.gru(x.reshape(x.shape[0], -1, 1))  # (B, L, 2*hidden); h0 = zeros
        return self.linear(out.flatten(1))


class IrisMLP(nn.Module):
    """The iris classifier (iris-mlp): 4 -> hidden (ReLU) -> 3; (B, 4) -> (B, 3)."""

    def __init__(self, hidden: int = 10):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(4, hidden), nn.ReLU(), nn.Linear(hidden, 3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


class DigitsCNN(nn.Module):
    """A small CNN for sklearn's 8x8 digits: (B, 1, 8, 8) -> (B, 10).

    Two 3x3 conv + BatchNorm + ReLU layers (32, 64 channels), a 2x2 max-pool, dropout and a linear
    classifier: about 99% test accuracy in seconds (without BatchNorm and dropout, about 97.5%).
    """

    def __init__(self, num_classes: int = 10, dropout: float = 0.3):
        super().__init__()
        self.net = nn.Sequential(
            nn.Conv2d(1, 32, 3, padding=1, bias=False), nn.BatchNorm2d(32), nn.ReLU(),  # (B, 32, 8, 8)
            nn.Conv2d(32, 64, 3, padding=1, bias=False), nn.BatchNorm2d(64), nn.ReLU(),
            nn.MaxPool2d(2),  # (B, 64, 4, 4)
            nn.Flatten(),
            nn.Dropout(dropout),
            nn.Linear(64 * 4 * 4, num_classes),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


class MNISTCNN(nn.Module):
    """A small CNN for MNIST: (B, 1, 28, 28) -> (B, 10); about 99% test accuracy in a few epochs."""

    def __init__(self, num_classes: int = 10):
        super().__init__()
        self.net = nn.Sequential(
            nn.Conv2d(1, 32, 3, padding=1), nn.ReLU(),
            nn.MaxPool2d(2),  # (B, 32, 14, 14)
            nn.Conv2d(32, 64, 3, padding=1), nn.ReLU(),
            nn.MaxPool2d(2),  # (B, 64, 7, 7)
            nn.Flatten(),
            nn.Linear(64 * 7 * 7, 128), nn.ReLU(),
            nn.Linear(128, num_classes),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


class LinearRegression(nn.Module):
    """The linear-regression workload's model: Linear(10, 1); (B, 10) -> (B, 1)."""

    def __init__(self, in_features: int = 10):
        super().__init__()
        self.fc = nn.Linear(in_features, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x)


class BinaryMLP(nn.Module):
    """The mlp-binary workload's model 20 -> 64 -> 32 -> 1 (ReLU); (B, 20) -> (B, 1) logits.

    The tutorial's model ends in nn.Sigmoid() and trains with nn.BCELoss. This model returns the logit and is
    trained with nn.BCEWithLogitsLoss instead: the same loss mathematically, but computed with the
    log-sum-exp trick, so it neither saturates to log(0) for confident predictions nor fails under
    autocast (PyTorch refuses BCELoss inside a float16 autocast region because it is unsafe there).
    Apply torch.sigmoid to the output for a probability; logit > 0 means class 1.
    """

    def __init__(self, in_features: int = 20):
        super().__init__()
        self.net = nn.Sequential(
            nn.Linear(in_features, 64), nn.ReLU(),
            nn.Linear(64, 32), nn.ReLU(),
            nn.Linear(32, 1),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


def count_parameters(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())
