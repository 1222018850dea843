"""Stop mid-epoch and resume under torchrun, for a kind of user data; launched by tests/test_distributed_data.py.

usage: resume_data.py OUT_DIR KIND
KIND: "loader" (your DataLoader over a map-style Dataset, shuffle=True, 2 workers: rebuilt with a
sampler sharded by rank) or "iterable" (a DataLoader over an IterableDataset wrapped in
gputrain.data.Sharded: each rank reads its part, through a StatefulDataLoader).

In one process group per fit: an uninterrupted run, a run stopped at step STOP (mid-epoch, with a
checkpoint), and a run resumed from it. Rank 0 writes OUT_DIR/result.json: whether the resumed
parameters equal the uninterrupted ones, what each rank read, and the data's placement reason.
"""

import json
import os
import sys

import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset, IterableDataset

from gputrain import TrainConfig, fit
from gputrain.data import Sharded

out_dir, kind = sys.argv[1], sys.argv[2]
rank = int(os.environ.get("RANK", "0"))
STEPS, STOP = 14, 5

g = torch.Generator().manual_seed(0)
X = torch.randn(64, 6, generator=g)
Y = (X[:, :2].sum(1) > 0).long()


class Samples(Dataset):
    def __len__(self):
        return len(X)

    def __getitem__(self, i):
        return X[i], Y[i]


class Stream(IterableDataset):
    def __iter__(self):
        for i in range(len(X)):
            yield X[i], Y[i]


def make_data():
    if kind == "loader":
        return DataLoader(Samples(), batch_size=4, shuffle=True, num_workers=2)
    return DataLoader(Sharded(Stream()), batch_size=4)


def make_model(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Dropout(0.2), nn.Linear(16, 2))


def flat(m):
    return torch.cat([p.detach().flatten() for p in m.parameters()])


cfg = dict(device="cpu", steps=STEPS, log_every=2, seed=3)
full = make_model()
h = fit(full, make_data(), loss_fn=nn.CrossEntropyLoss(), config=TrainConfig(**cfg))
run_dir = os.path.join(out_dir, "run")
fit(make_model(), make_data(), loss_fn=nn.CrossEntropyLoss(),
    config=TrainConfig(**cfg, run_dir=run_dir, stop_at_step=STOP))
resumed = make_model(seed=9)
fit(resumed, make_data(), loss_fn=nn.CrossEntropyLoss(), config=TrainConfig(**cfg, run_dir=run_dir, resume=True))
if rank == 0:
    with open(os.path.join(out_dir, "result.json"), "w") as f:
        json.dump({"equal": bool(torch.equal(flat(full), flat(resumed))),
                   "max_diff": float((flat(full) - flat(resumed)).abs().max()),
                   "data_reason": h.summary["data_reason"], "samples": h.summary["samples"]}, f)
