"""Trains a model on dict batches with a torchmetrics metric; launched by tests/test_any_model_ddp.py.

usage: dict_batches.py OUT_DIR BATCH STEPS
Run under torchrun (2 processes, BATCH per process) or as one plain process (the global BATCH).
The model computes its own loss from model(**batch) (a dict with "loss" and "logits"); the data are
a dict of equal-length tensor columns. Rank 0 writes OUT_DIR/params.pt and OUT_DIR/result.json
(the last record: eval_loss and the synced eval_acc; the world size).
"""

import json
import os
import sys

import torch
import torch.nn.functional as F
from torch import nn
from torchmetrics.classification import MulticlassAccuracy

from gputrain import TrainConfig, fit

out_dir, batch, steps = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
os.makedirs(out_dir, exist_ok=True)


class OwnLoss(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(20, 8)
        self.head = nn.Linear(8, 3)

    def forward(self, input_ids, mask, labels):
        h = (self.emb(input_ids) * mask.unsqueeze(-1)).sum(1) / mask.sum(1, keepdim=True)
        logits = self.head(h)
        return {"loss": F.cross_entropy(logits, labels), "logits": logits}


def data(n, seed):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 20, (n, 6), generator=g)
    mask = (torch.rand(n, 6, generator=g) > 0.2).float()
    mask[:, 0] = 1.0
    return {"input_ids": ids, "mask": mask, "labels": ids[:, 0] % 3}


torch.manual_seed(0)  # the same initial weights in every process
model = OwnLoss()
cfg = TrainConfig(device="cpu", batch_size=batch, steps=steps, log_every=steps, seed=1, progress=False)
h = fit(model, data(256, 0), eval_data=data(120, 1), optimizer=lambda p: torch.optim.SGD(p, lr=0.5),
        metrics={"acc": MulticlassAccuracy(num_classes=3, average="micro")}, config=cfg)
if int(os.environ.get("RANK", "0")) == 0:
    torch.save(model.state_dict(), os.path.join(out_dir, "params.pt"))
    with open(os.path.join(out_dir, "result.json"), "w") as f:
        json.dump({"last": h.records[-1], "world_size": h.summary["world_size"]}, f)
