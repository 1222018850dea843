"""A step of your own on one or several processes; launched by tests/test_own_step.py.

usage: own_step_ddp.py RUN_DIR BATCH STEPS [STOP_AT]

Two optimizers by name (a student and a "head" trained on the student's features), a fixed random
teacher, no randomness in the step: the gradients of two processes averaged by the step context
equal one process's on the same global batch. Rank 0 writes RUN_DIR/result.json (the parameters,
the logged records, the checkpoint format). Each rank carries a counter and its rank in step.state
and checks them every step (a resume must give each rank its own back).
"""

import json
import os
import sys

import torch
import torch.nn.functional as F
from torch import nn

from gputrain import Callback, TrainConfig, fit

run_dir, batch, steps = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
stop_at = int(sys.argv[4]) if len(sys.argv) > 4 else None
rank = int(os.environ.get("RANK", "0"))

g = torch.Generator().manual_seed(0)
x = torch.randn(256, 8, generator=g)
y = (x[:, :3].sum(1) > 0).long()


class Pair(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.teacher = nn.Linear(8, 2).requires_grad_(False)
        self.student = nn.Sequential(nn.Linear(8, 16), nn.ReLU())
        self.head = nn.Linear(16, 2)


def step_fn(step, batch):
    xb, yb = batch
    m = step.model
    # Carried state (step.state), each rank its own: after a resume each rank has its own back.
    if step.state.get("count", 0) != step.index or step.state.get("rank", rank) != rank:
        raise RuntimeError(f"rank {rank}: carried state {dict(step.state)} at step {step.index}")
    step.state["count"], step.state["rank"] = step.index + 1, rank
    kd = F.mse_loss(m.head(m.student(xb)), m.teacher(xb))
    step.backward(kd)
    step.step("student")
    ce = F.cross_entropy(m.head(m.student(xb).detach()), yb)
    step.backward(ce)
    step.step("head")
    return {"kd": kd, "ce": ce}


params: list = []


class Params(Callback):
    """The trained parameters, whole on every rank, read at the run's end while the processes are still
    a group (FSDP2's are sharded DTensors: gathering them is a collective)."""

    def on_run_end(self, run, history):
        params[:] = [(p.full_tensor() if hasattr(p, "full_tensor") else p).tolist() for p in model.state_dict().values()]


model = Pair()
optimizers = {"student": lambda m: torch.optim.SGD(m.student.parameters(), lr=0.1, momentum=0.9),
              "head": lambda m: torch.optim.SGD(m.head.parameters(), lr=0.05, momentum=0.9)}
# A resume finds a checkpoint or refuses: resume only a run that has one (a one-process start has no launcher
# to start it again).
resumable = os.path.isdir(os.path.join(run_dir, "checkpoints"))
cfg = TrainConfig(device="cpu", batch_size=batch, steps=steps, log_every=2, seed=1, run_dir=run_dir, resume=resumable,
                  checkpoint_every=2, stop_at_step=stop_at, loggers=("csv",),
                  shard=os.environ.get("SHARD") == "1")
h = fit(model, (x, y), step_fn=step_fn, optimizer=optimizers, config=cfg, callbacks=[Params()])
if rank == 0:
    with open(os.path.join(run_dir, "result.json"), "w") as f:
        json.dump({"params": params,
                   "records": [{k: r[k] for k in ("step", "loss", "kd", "ce")} for r in h.records],
                   "checkpoints": sorted(os.listdir(os.path.join(run_dir, "checkpoints")))}, f)
