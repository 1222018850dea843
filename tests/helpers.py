"""What many tests train: a small classification task, an MLP for it, a tiny conv-net workload.

Import them as `from helpers import data, mlp, params, tiny_workload` (pytest puts tests/ on the
path). Each is seeded, so two calls with the same arguments give the same tensors and weights.
"""

from __future__ import annotations

import torch
from torch import nn

from gputrain.workloads.base import DataSplits, Workload


def data(n: int = 96, d: int = 6, classes: int = 3, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """(x, y): n samples of d standard-normal features, labelled by a random linear map (an MLP
    learns it). x (n, d) float32, y (n,) int64 in [0, classes)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, d, generator=g)
    w = torch.randn(d, classes, generator=g)
    return x, (x @ w).argmax(1)


def mlp(d: int = 6, classes: int = 3, hidden: int = 16, dropout: float | None = None, seed: int = 0) -> nn.Module:
    """d -> hidden (ReLU, then Dropout(dropout) when given) -> classes, with weights from `seed`."""
    torch.manual_seed(seed)
    middle = [nn.Dropout(dropout)] if dropout is not None else []
    return nn.Sequential(nn.Linear(d, hidden), nn.ReLU(), *middle, nn.Linear(hidden, classes))


class SignalAt(nn.Module):
    """Sends this process `sig` (SIGTERM by default) during the forward of training call `at`
    (mid-step, as a scheduler would); `at=-1`: never (the same module, for resuming its checkpoint)."""

    def __init__(self, inner: nn.Module, at: int, sig: int | None = None):
        import signal

        super().__init__()
        self.inner, self.at, self.sig, self.n = inner, at, signal.SIGTERM if sig is None else sig, 0

    def forward(self, x):
        import os

        if self.training:
            self.n += 1
            if self.n == self.at:
                os.kill(os.getpid(), self.sig)
        return self.inner(x)


def params(m: nn.Module) -> torch.Tensor:
    """All parameters of `m` as one flat tensor (to compare two models)."""
    return torch.cat([p.detach().flatten() for p in m.parameters()])


def tiny_workload() -> Workload:
    """uint8 (256, 1, 8, 8) 'images' normalized on the device, 4 classes, a small conv net: exercises
    the whole step (normalization, channels_last, a conv) in milliseconds."""

    def make_data():
        g = torch.Generator().manual_seed(0)
        x = torch.randint(0, 256, (256, 1, 8, 8), dtype=torch.uint8, generator=g)
        y = torch.randint(0, 4, (256,), generator=g)
        return DataSplits(train=(x, y), mean=(127.5,), std=(64.0,))

    def make_model():
        return nn.Sequential(nn.Conv2d(1, 8, 3, padding=1), nn.ReLU(), nn.Flatten(), nn.Linear(8 * 8 * 8, 4))

    return Workload(name="tiny", description="test", make_data=make_data, make_model=make_model,
                    loss_fn=nn.CrossEntropyLoss(), defaults={"batch_size": 32})


def cli(capsys, *argv: str) -> tuple[int, str, str]:
    """`gputrain ARGV...` in this process: (exit status, stdout, stderr); argparse's refusals included."""
    from gputrain.cli import main

    try:
        code = main(list(argv))
    except SystemExit as exc:
        code = int(exc.code or 0)
    out = capsys.readouterr()
    return code, out.out, out.err
