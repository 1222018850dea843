"""Trains a small classifier with gputrain.fit; launched by tests/test_distributed.py.

usage: train_small.py RUN_DIR BATCH ACCUMULATE SHARD STEPS [FAIL_MODE]
FAIL_MODE: "raise" (rank 1 raises at its 3rd forward), "kill-once" (rank 1 exits hard at its 7th
forward, inside step 7, on torchrun's first attempt only), or absent.

Rank 0 writes RUN_DIR/result.json: the summary, torchrun's restart count, the wrapper class the
trainer used, and how many gradient all-reduces DDP ran (one bucket per synchronized step).
"""

import json
import logging
import os
import sys

import torch
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

from gputrain import TrainConfig, fit
from gputrain.runtime import distributed

run_dir, batch, accumulate, shard, steps = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4] == "1", int(sys.argv[5])
fail = sys.argv[6] if len(sys.argv) > 6 else ""
rank = int(os.environ.get("RANK", "0"))
logging.basicConfig(level=logging.INFO, format=f"rank{rank} %(message)s")


class Planted(nn.Module):
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 2))
        self.calls = 0

    def forward(self, x):
        if self.training:
            self.calls += 1
            if fail == "raise" and rank == 1 and self.calls == 3:
                raise ValueError("planted failure on rank 1")
            if fail == "kill-once" and rank == 1 and self.calls == 7 and os.environ.get("TORCHELASTIC_RESTART_COUNT") == "0":
                os._exit(3)
        return self.net(x)


# Watch the trainer's wrapping: which wrapper, and every gradient all-reduce DDP issues.
seen = {"wrapper": None, "grad_allreduces": 0}
_wrap_model = distributed.wrap_model


def _count(process_group, bucket):
    seen["grad_allreduces"] += 1
    return default_hooks.allreduce_hook(process_group, bucket)


def wrap_and_watch(model, info, device, shard=False):
    wrapped = _wrap_model(model, info, device, shard=shard)
    seen["wrapper"] = type(wrapped).__name__
    if isinstance(wrapped, nn.parallel.DistributedDataParallel):
        wrapped.register_comm_hook(None, _count)  # None: the default process group
    return wrapped


distributed.wrap_model = wrap_and_watch

g = torch.Generator().manual_seed(0)
x = torch.randn(256, 8, generator=g)
y = (x[:, :3].sum(1) > 0).long()
torch.manual_seed(0)  # the same initial weights in every process and every run
# SGD with momentum: optimizer state that a resume must carry over exactly.
model = Planted()
# A resume finds a checkpoint or refuses: resume a run that has one, or the start of a launched job (torchrun's
# workers, which a restart starts again).
resume = os.path.isdir(os.path.join(run_dir, "checkpoints")) or "TORCHELASTIC_RUN_ID" in os.environ
cfg = TrainConfig(device="cpu", batch_size=batch, accumulate=accumulate, steps=steps, log_every=2, seed=1,
                  shard=shard, run_dir=run_dir, resume=resume, checkpoint_every=2 if fail == "kill-once" else None)
h = fit(model, (x, y), loss_fn=nn.CrossEntropyLoss(), optimizer=lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9), config=cfg)
if rank == 0:
    with open(os.path.join(run_dir, "result.json"), "w") as f:
        json.dump({"summary": h.summary, "restart": os.environ.get("TORCHELASTIC_RESTART_COUNT"), **seen}, f,
                  default=str)
