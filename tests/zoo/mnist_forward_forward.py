"""pytorch/examples' forward-forward MNIST: layers kept in a plain Python list, each with its own Adam.

Origin: github.com/pytorch/examples, mnist_forward_forward/main.py (commit 77f55b9): get_y_neg,
overlay_y_on_x, Net (`self.layers = self.layers + [Layer(...).to(device)]`: a Python list, so Net
registers no parameter; `Net.train(x_pos, x_neg)` is its training routine, not nn.Module.train(mode))
and Layer (an nn.Linear whose __init__ builds `self.opt = Adam(self.parameters(), lr=args.lr)` and
whose `train(x_pos, x_neg)` steps it on the log1p(exp(...)) goodness loss). The script reads `args`
and `device` as module globals set in its __main__; here they hold its parser's defaults and the CPU.

Handed to fit as a user would, the authors' own per-layer optimizers by name and a step of one
goodness update per layer: refused at the start, in one line (train/optim/build.py), because the
optimizers would update 4 tensors that the model does not register, which no checkpoint would hold.
"""

import argparse

import torch
import torch.nn as nn
from torch.optim import Adam

from zoo import Refusal

args = argparse.Namespace(epochs=1000, lr=0.03, threshold=2.0, log_interval=10)  # main.py's parser defaults
device = torch.device("cpu")


def get_y_neg(y):
    y_neg = y.clone()
    for idx, y_samp in enumerate(y):
        allowed_indices = list(range(10))
        allowed_indices.remove(y_samp.item())
        y_neg[idx] = torch.tensor(allowed_indices)[
            torch.randint(len(allowed_indices), size=(1,))
        ].item()
    return y_neg.to(device)


def overlay_y_on_x(x, y, classes=10):
    x_ = x.clone()
    x_[:, :classes] *= 0.0
    x_[range(x.shape[0]), y] = x.max()
    return x_


class Net(torch.nn.Module):
    def __init__(self, dims):

        super().__init__()
        self.layers = []
        for d in range(len(dims) - 1):
            self.layers = self.layers + [Layer(dims[d], dims[d + 1]).to(device)]

    def predict(self, x):
        goodness_per_label = []
        for label in range(10):
            h = overlay_y_on_x(x, label)
            goodness = []
            for layer in self.layers:
                h = layer(h)
                goodness = goodness + [h.pow(2).mean(1)]
            goodness_per_label += [sum(goodness).unsqueeze(1)]
        goodness_per_label = torch.cat(goodness_per_label, 1)
        return goodness_per_label.argmax(1)

    def train(self, x_pos, x_neg):
        h_pos, h_neg = x_pos, x_neg
        for i, layer in enumerate(self.layers):
            print("training layer: ", i)
            h_pos, h_neg = layer.train(h_pos, h_neg)


class Layer(nn.Linear):
    def __init__(self, in_features, out_features, bias=True, device=None, dtype=None):
        super().__init__(in_features, out_features, bias, device, dtype)
        self.relu = torch.nn.ReLU()
        self.opt = Adam(self.parameters(), lr=args.lr)
        self.threshold = args.threshold
        self.num_epochs = args.epochs

    def forward(self, x):
        x_direction = x / (x.norm(2, 1, keepdim=True) + 1e-4)
        return self.relu(torch.mm(x_direction, self.weight.T) + self.bias.unsqueeze(0))

    def train(self, x_pos, x_neg):
        for i in range(self.num_epochs):
            g_pos = self.forward(x_pos).pow(2).mean(1)
            g_neg = self.forward(x_neg).pow(2).mean(1)
            loss = torch.log1p(
                torch.exp(
                    torch.cat([-g_pos + self.threshold, g_neg - self.threshold])
                )
            ).mean()
            self.opt.zero_grad()
            loss.backward()
            self.opt.step()
            if i % args.log_interval == 0:
                print("Loss: ", loss.item())
        return self.forward(x_pos).detach(), self.forward(x_neg).detach()


def make():
    return Net([784, 500, 500])


def batches():
    g = torch.Generator().manual_seed(3)
    return [(torch.randn(8, 784, generator=g), torch.randint(0, 10, (8,), generator=g)) for _ in range(2)]


def step(step, batch):
    """One update of Layer.train's loop per layer, each by the layer's own optimizer (named layer<i>)."""
    x, y = batch
    h_pos, h_neg = overlay_y_on_x(x, y), overlay_y_on_x(x, get_y_neg(y))
    losses = {}
    for i, layer in enumerate(step.model.layers):
        g_pos = layer(h_pos).pow(2).mean(1)
        g_neg = layer(h_neg).pow(2).mean(1)
        loss = torch.log1p(torch.exp(torch.cat([-g_pos + layer.threshold, g_neg - layer.threshold]))).mean()
        step.backward(loss)
        step.step(f"layer{i}")
        losses[f"layer{i}"] = loss
        h_pos, h_neg = layer(h_pos).detach(), layer(h_neg).detach()
    return losses


CASE = Refusal("pytorch/examples mnist_forward_forward", make, batches,
               lambda model: {"step_fn": step, "optimizer": {f"layer{i}": layer.opt
                                                             for i, layer in enumerate(model.layers)}},
               says=r"^optimizer 'layer0' and optimizer 'layer1' update 4 parameter tensors that the model does not "
                    r"register \(it registers none\), of shapes \[500, 784\], \[500\], \[500, 500\], \[500\]: .*"
                    r"nn\.ModuleList")
