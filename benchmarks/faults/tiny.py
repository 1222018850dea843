"""A tiny deterministic workload for the fault-injection runs (tests/test_faults.py,
benchmarks/fault_injection.py): `gputrain fit benchmarks/faults/tiny.py:workload ...`.

Options (--option key=value): n (samples), inf_at (a training sample whose first input is made
+inf: a non-finite loss at the step that draws it), sleep_ms (a pause in every training forward,
so that a run lasts long enough to be hit at random moments), pad_kb (a constant buffer of that
many KiB in the model: bigger checkpoints, whose writes last long enough to be hit), act (relu, the
default, or tanh: a tanh saturated by an inf input gives a finite loss and a NaN gradient).

Environment, read in the training process (no patching from outside):
  GPUTRAIN_FAULT_ENOSPC_AT=K  from the K-th checkpoint file written on, its fsync fails with
                              OSError(ENOSPC), as on a full disk (writes that stay in the page
                              cache only fail when they reach the disk).
"""

from __future__ import annotations

import errno
import os
import re
import time

import torch
from torch import nn

from gputrain.workloads import Workload
from gputrain.workloads.base import DataSplits

_CHECKPOINT_TEMP = re.compile(r"^\.step-\d+\.pt\.[^.]+(\.[^.]+)?\.tmp$")  # atomic_file's temp of a checkpoint


class TinyNet(nn.Module):
    def __init__(self, sleep_ms: float = 0.0, pad_kb: int = 0, act: str = "relu"):
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(8, 16), nn.Tanh() if act == "tanh" else nn.ReLU(), nn.Linear(16, 2))
        self.sleep_s = sleep_ms / 1000.0
        # A constant buffer that only makes checkpoints bigger (longer writes, to be hit by a kill).
        self.register_buffer("pad", torch.arange(pad_kb * 256, dtype=torch.float32))

    def forward(self, x):
        if self.training and self.sleep_s:
            time.sleep(self.sleep_s)
        return self.net(x)


def _data(n: int, inf_at: int | None) -> DataSplits:
    g = torch.Generator().manual_seed(1234)
    x = torch.randn(n, 8, generator=g)
    y = (x[:, 0] + 0.5 * x[:, 1] > 0).long()
    x_test = torch.randn(64, 8, generator=g)
    y_test = (x_test[:, 0] + 0.5 * x_test[:, 1] > 0).long()
    if inf_at is not None:
        x[inf_at, 0] = float("inf")
    return DataSplits(train=(x, y), test=(x_test, y_test))


def _install_enospc(at: int) -> None:
    real_fsync = os.fsync
    seen = {"n": 0}

    def fsync(fd):
        try:
            name = os.path.basename(os.readlink(f"/proc/self/fd/{fd}"))
        except OSError:
            name = ""
        if _CHECKPOINT_TEMP.match(name):
            seen["n"] += 1
            if seen["n"] >= at:
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real_fsync(fd)

    os.fsync = fsync


def workload(n: int | str = 256, inf_at: int | str | None = None, sleep_ms: float | str = 0.0,
             pad_kb: int | str = 0, act: str = "relu") -> Workload:
    n, pad_kb = int(n), int(pad_kb)
    inf_at = None if inf_at in (None, "", "none") else int(inf_at)
    sleep_ms = float(sleep_ms)
    at = os.environ.get("GPUTRAIN_FAULT_ENOSPC_AT")
    if at:
        _install_enospc(int(at))
    return Workload(
        name="fault-tiny",
        description="8-16-2 MLP (ReLU or tanh) on a seeded linear rule (fault-injection runs)",
        make_data=lambda: _data(n, inf_at),
        make_model=lambda: TinyNet(sleep_ms, pad_kb, act),
        loss_fn=nn.CrossEntropyLoss(),
        defaults={"batch_size": 16, "steps": 200, "lr": 1e-2, "log_every": 10, "seed": 0, "device": "cpu",
                  "loggers": ("csv",)},
    )
