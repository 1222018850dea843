"""Trains a small classifier with gputrain's Trainer and sharded (DCP) checkpoints; launched by
tests/test_checkpoint_dcp_distributed.py under torchrun (or as one plain process).

usage: train_dcp.py RUN_DIR --batch B --steps S [--accumulate A] [--shard] [--every E] [--stop-at K]
                    [--format auto|dcp|file] [--async] [--resume auto|PATH] [--full-copy PATH]
                    [--dropout P] [--slow-write S] [--sleep-ms MS]

--full-copy PATH: after the run, also write the same state as one file (the one-file format, full
tensors gathered to rank 0), the reference a sharded resume is compared with. --slow-write S: every
DCP file write sleeps S seconds first (a slow file system: an asynchronous save must not make the
loop wait for it). Rank 0 writes RUN_DIR/result-W.json (W: the world size): the summary, the
wrapper class, and the checkpoint path it resumed from.
"""

import argparse
import json
import logging
import os
import time
from pathlib import Path

import torch
from torch import nn

from gputrain import TrainConfig
from gputrain.runtime import distributed
from gputrain.train.loop.trainer import Trainer

ap = argparse.ArgumentParser()
ap.add_argument("run_dir")
ap.add_argument("--batch", type=int, required=True)
ap.add_argument("--steps", type=int, required=True)
ap.add_argument("--accumulate", type=int, default=1)
ap.add_argument("--shard", action="store_true")
ap.add_argument("--every", type=int, default=None)
ap.add_argument("--stop-at", type=int, default=None)
ap.add_argument("--format", default="auto")
ap.add_argument("--async", dest="async_save", action="store_true")
ap.add_argument("--resume", default=None)
ap.add_argument("--full-copy", default=None)
ap.add_argument("--dropout", type=float, default=0.0)
ap.add_argument("--slow-write", type=float, default=0.0)
ap.add_argument("--sleep-ms", type=float, default=0.0)
args = ap.parse_args()
rank = int(os.environ.get("RANK", "0"))
logging.basicConfig(level=logging.INFO, format=f"rank{rank} %(message)s")

if args.slow_write:
    from torch.distributed.checkpoint import filesystem

    real_write = filesystem._write_item

    def slow_write(*a, **k):
        time.sleep(args.slow_write)
        return real_write(*a, **k)

    filesystem._write_item = slow_write


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Dropout(args.dropout))
        self.head = nn.Linear(32, 2)

    def forward(self, x):
        if args.sleep_ms:
            time.sleep(args.sleep_ms / 1000)
        return self.head(self.body(x))


g = torch.Generator().manual_seed(0)
x = torch.randn(512, 8, generator=g)
y = (x[:, :3].sum(1) > 0).long()
torch.manual_seed(0)  # the same initial weights in every process and every run
resume = True if args.resume == "auto" else (args.resume or False)
cfg = TrainConfig(device="cpu", batch_size=args.batch, accumulate=args.accumulate, steps=args.steps, log_every=2,
                  seed=1, lr=1e-2, shard=args.shard, run_dir=args.run_dir, resume=resume,
                  checkpoint_every=args.every, stop_at_step=args.stop_at, checkpoint_format=args.format,
                  async_checkpoint=args.async_save, loggers=("csv",))
trainer = Trainer(Net(), (x, y), loss_fn=nn.CrossEntropyLoss(), config=cfg)
info = trainer.parts.dist
try:
    history = trainer.run()
    if args.full_copy:
        trainer.save_checkpoint(Path(args.full_copy))  # one file: every rank takes part, rank 0 writes
    result = {"summary": history.summary, "wrapper": type(trainer.parts.model.model).__name__,
              "last_checkpoint": trainer.parts.checkpoints.last}
finally:
    trainer.close()
    del trainer
    distributed.cleanup(info)
if rank == 0:
    with open(os.path.join(args.run_dir, f"result-{info.world_size}.json"), "w") as f:
        json.dump(result, f, default=str)
