"""pytorch/examples' MNIST CNN and its train().

Origin: github.com/pytorch/examples, mnist/main.py: Net (two convolutions, two dropouts, flatten,
log_softmax), F.nll_loss, Adadelta(lr=1.0); train() calls model.train() and steps every batch (the
StepLR it also builds steps once per epoch, after these few steps).
"""

import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.optim as optim

from zoo import Case


class Net(nn.Module):
    def __init__(self):
        super(Net, self).__init__()
        self.conv1 = nn.Conv2d(1, 32, 3, 1)
        self.conv2 = nn.Conv2d(32, 64, 3, 1)
        self.dropout1 = nn.Dropout(0.25)
        self.dropout2 = nn.Dropout(0.5)
        self.fc1 = nn.Linear(9216, 128)
        self.fc2 = nn.Linear(128, 10)

    def forward(self, x):
        x = self.conv1(x)
        x = F.relu(x)
        x = self.conv2(x)
        x = F.relu(x)
        x = F.max_pool2d(x, 2)
        x = self.dropout1(x)
        x = torch.flatten(x, 1)
        x = self.fc1(x)
        x = F.relu(x)
        x = self.dropout2(x)
        x = self.fc2(x)
        output = F.log_softmax(x, dim=1)
        return output


def batches():
    g = torch.Generator().manual_seed(2)
    return [(torch.randn(4, 1, 28, 28, generator=g), torch.randint(0, 10, (4,), generator=g)) for _ in range(3)]


def hand(model, data, amp):
    optimizer = optim.Adadelta(model.parameters(), lr=1.0)
    model.train()
    for batch_idx, (data_, target) in enumerate(data):
        optimizer.zero_grad()
        with amp():
            output = model(data_)
            loss = F.nll_loss(output, target)
        loss.backward()
        optimizer.step()


CASE = Case("pytorch/examples mnist", Net, batches, hand,
            lambda model: {"loss_fn": F.nll_loss, "optimizer": optim.Adadelta(model.parameters(), lr=1.0)})
