"""Bring your own model, way 1: compute_loss(model, batch) for a model with two inputs, fed a dict of
columns; it returns (loss, outputs) so that the callable metric sees the outputs."""

import torch
import torch.nn.functional as F
from torch import nn

import gputrain


class TwoTower(nn.Module):
    def __init__(self):
        super().__init__()
        self.image, self.meta = nn.Linear(16, 32), nn.Linear(4, 32)
        self.head = nn.Linear(32, 3)

    def forward(self, image, meta):
        return self.head(torch.relu(self.image(image) + self.meta(meta)))


def compute_loss(model, batch):
    logits = model(batch["image"], batch["meta"])
    return F.cross_entropy(logits, batch["target"]), logits


def accuracy(outputs, batch):  # (outputs, batch) -> dict of tensors, averaged over the eval set
    return {"accuracy": (outputs.argmax(1) == batch["target"]).float().mean()}


g = torch.Generator().manual_seed(0)
data = {"image": torch.randn(1200, 16, generator=g), "meta": torch.randn(1200, 4, generator=g)}
data["target"] = (data["image"][:, 0] + data["meta"][:, 0] > 0).long() + (data["meta"][:, 1] > 1).long()
train = {k: v[:1000] for k, v in data.items()}
test = {k: v[1000:] for k, v in data.items()}

torch.manual_seed(0)
history = gputrain.fit(TwoTower(), train, compute_loss=compute_loss, eval_data=test,
                       metrics={"accuracy": accuracy}, config=gputrain.TrainConfig(epochs=10, batch_size=50, lr=1e-2))
print(f"eval accuracy {history.summary['final_eval_accuracy']:.3f}")
