"""A forward that reads `self.training`: stochastic depth in residual blocks.

Origin: github.com/pytorch/vision, torchvision/ops/stochastic_depth.py (stochastic_depth(input, p,
mode, training): identity unless training; mode "row" draws one Bernoulli survival per sample and
divides by the survival rate; the StochasticDepth module passes self.training), used in residual
MLP blocks; AdamW(lr=1e-3), cross entropy.
"""

import torch
import torch.nn as nn
import torch.nn.functional as F

from zoo import Case


def stochastic_depth(input, p, mode, training=True):
    if p < 0.0 or p > 1.0:
        raise ValueError(f"drop probability has to be between 0 and 1, but got {p}")
    if mode not in ["batch", "row"]:
        raise ValueError(f"mode has to be either 'batch' or 'row', but got {mode}")
    if not training or p == 0.0:
        return input

    survival_rate = 1.0 - p
    if mode == "row":
        size = [input.shape[0]] + [1] * (input.ndim - 1)
    else:
        size = [1] * input.ndim
    noise = torch.empty(size, dtype=input.dtype, device=input.device)
    noise = noise.bernoulli_(survival_rate)
    if survival_rate > 0.0:
        noise.div_(survival_rate)
    return input * noise


class StochasticDepth(nn.Module):
    def __init__(self, p, mode):
        super().__init__()
        self.p = p
        self.mode = mode

    def forward(self, input):
        return stochastic_depth(input, self.p, self.mode, self.training)


class Block(nn.Module):
    def __init__(self, dim, p):
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.fc = nn.Linear(dim, dim)
        self.drop_path = StochasticDepth(p, "row")

    def forward(self, x):
        return x + self.drop_path(self.fc(F.gelu(self.norm(x))))


class ResMLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.stem = nn.Linear(12, 16)
        self.blocks = nn.Sequential(Block(16, 0.2), Block(16, 0.3))
        self.head = nn.Linear(16, 4)

    def forward(self, x):
        return self.head(self.blocks(self.stem(x)))


def batches():
    g = torch.Generator().manual_seed(10)
    return [(torch.randn(8, 12, generator=g), torch.randint(0, 4, (8,), generator=g)) for _ in range(4)]


def hand(model, data, amp):
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model.train()
    for x, y in data:
        optimizer.zero_grad()
        with amp():
            loss = F.cross_entropy(model(x), y)
        loss.backward()
        optimizer.step()


CASE = Case("forward reading self.training (stochastic depth)", ResMLP, batches, hand,
            lambda model: {"loss_fn": F.cross_entropy, "optimizer": torch.optim.AdamW(model.parameters(), lr=1e-3)})
