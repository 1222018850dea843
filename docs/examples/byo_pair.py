"""Bring your own model, way 2: batches are pairs (inputs, targets) and you give loss_fn."""

import torch
from torch import nn

import gputrain

g = torch.Generator().manual_seed(0)
x = torch.randn(1000, 10, generator=g)
y = (x[:, :3].sum(1) > 0).long()  # a learnable two-class task

torch.manual_seed(0)
model = nn.Sequential(nn.Linear(10, 32), nn.ReLU(), nn.Linear(32, 2))
history = gputrain.fit(model, (x[:800], y[:800]), loss_fn=nn.CrossEntropyLoss(), eval_data=(x[800:], y[800:]),
                       config=gputrain.TrainConfig(epochs=10, batch_size=64, lr=1e-2))
print(f"eval accuracy {history.summary['final_eval_accuracy']:.3f}")  # the built-in accuracy of a pair
