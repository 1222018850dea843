"""The GAN of own_step.py as a workload: `gputrain fit docs/examples/gan_workload.py:make_workload`.

A workload carries its step (step_fn), its optimizers by name and the part of the model that eval,
predict and export use by default (the generator). Each optimizer's settings can be given by name
without touching this file: `[optimizers.generator] lr = 1e-3` in a config file, or searched by a
sweep as `optimizers.generator.lr`; the values below hold where none is given.
"""

from __future__ import annotations

import torch
from own_step import GAN, digits, gan_step

from gputrain.data.splits import DataSplits
from gputrain.workloads.base import Workload


def gan_optimizers(model: GAN) -> dict[str, torch.optim.Optimizer]:
    return {"generator": torch.optim.Adam(model.generator.parameters(), lr=2e-3, betas=(0.5, 0.999)),
            "discriminator": torch.optim.Adam(model.discriminator.parameters(), lr=2e-3, betas=(0.5, 0.999))}


def make_workload(n: str | int = 0) -> Workload:
    """n: the first n digits only (0: all 1797)."""
    return Workload(name="digits-gan", description="a GAN on the 8x8 digits: generator and discriminator MLPs",
                    make_data=lambda: DataSplits(train=digits(int(n) or None)), make_model=GAN, loss_fn=None,
                    task=None, defaults={"batch_size": 64, "epochs": 5, "log_every": 10},
                    step_fn=gan_step, optimizers=gan_optimizers, eval_part="generator")
