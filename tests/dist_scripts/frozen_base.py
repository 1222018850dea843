"""A frozen base under torchrun (DDP, 2 processes); launched by tests/test_frozen_and_adapters.py.

usage: frozen_base.py OUT_DIR

In one process group per fit: an uninterrupted run and a run stopped at step STOP and resumed, both
writing one-file checkpoints (checkpoint_format="file": trainable-only, rank 0 writes); a run in the
sharded format (DCP: full, each rank its share); a resume on another base (refused) and one under
FSDP (refused: the frozen tensors are sharded there). Rank 0 writes OUT_DIR/result.json.
"""

import json
import os
import sys

import torch
from torch import nn

from gputrain import TrainConfig, fit
from gputrain.errors import CheckpointError
from gputrain.checkpoint import sharded
from gputrain.checkpoint.format import load_checkpoint
from gputrain.checkpoint.names import is_dcp
from gputrain.checkpoint.store import CheckpointStore

out_dir = sys.argv[1]
rank = int(os.environ.get("RANK", "0"))
STEPS, STOP = 8, 4

g = torch.Generator().manual_seed(0)
X = torch.randn(64, 6, generator=g)
Y = (X[:, :2].sum(1) > 0).long()


def make_model(base_seed=0, head_seed=0):
    """A frozen first layer (the base: from base_seed) under a trainable head. (No dropout: the one-file
    format restores rank 0's random-number state on every rank, so a rank's dropout would differ.)"""
    torch.manual_seed(base_seed)
    base = nn.Linear(6, 16).requires_grad_(False)
    torch.manual_seed(head_seed)
    return nn.Sequential(base, nn.ReLU(), nn.Identity(), nn.Linear(16, 2))


def flat(m):
    return torch.cat([p.detach().flatten() for p in m.parameters()])


def train(model, **kw):
    return fit(model, (X, Y), loss_fn=nn.CrossEntropyLoss(),
               config=TrainConfig(**{"device": "cpu", "batch_size": 4, "steps": STEPS, "log_every": 2, "seed": 3,
                                     "weight_decay": 0.1, "loggers": ("csv",), **kw}))


result = {}
full = make_model()
train(full, run_dir=os.path.join(out_dir, "full"), checkpoint_format="file")
run_dir = os.path.join(out_dir, "run")
history = train(make_model(), run_dir=run_dir, checkpoint_format="file", stop_at_step=STOP)
stopped = str(CheckpointStore(run_dir).latest_path())
resumed = make_model(head_seed=9)
train(resumed, run_dir=run_dir, checkpoint_format="file", resume=True)
result.update(equal=bool(torch.equal(flat(full), flat(resumed))), contents=history.summary["checkpoint_contents"],
              keys=sorted(load_checkpoint(stopped)["model"]), has_frozen="frozen" in load_checkpoint(stopped))
dcp_run = train(make_model(), run_dir=os.path.join(out_dir, "dcp"), steps=2)
dcp_path = CheckpointStore(os.path.join(out_dir, "dcp")).latest_path()
result.update(dcp=is_dcp(dcp_path), dcp_contents=dcp_run.summary["checkpoint_contents"],
              dcp_keys=sorted(sharded.saved_model_shapes(dcp_path)))
for name, model, kw in (("another_base", make_model(base_seed=1), {}), ("fsdp", make_model(), {"shard": True})):
    try:
        train(model, resume=stopped, run_dir=os.path.join(out_dir, name), checkpoint_format="file", **kw)
        result[name] = None
    except CheckpointError as exc:
        result[name] = str(exc)
if rank == 0:
    with open(os.path.join(out_dir, "result.json"), "w") as f:
        json.dump(result, f)
