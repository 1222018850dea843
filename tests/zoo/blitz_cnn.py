"""The 60-minute blitz CIFAR-10 CNN and its training loop.

Origin: github.com/pytorch/tutorials, beginner_source/blitz/cifar10_tutorial.py ("Training a
Classifier"; the long-standing version flattens with `x.view(-1, 16 * 5 * 5)`): Net, CrossEntropyLoss,
SGD(lr=0.001, momentum=0.9), batches of 4 CIFAR-sized images (3 x 32 x 32).
"""

import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.optim as optim

from zoo import Case


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(3, 6, 5)
        self.pool = nn.MaxPool2d(2, 2)
        self.conv2 = nn.Conv2d(6, 16, 5)
        self.fc1 = nn.Linear(16 * 5 * 5, 120)
        self.fc2 = nn.Linear(120, 84)
        self.fc3 = nn.Linear(84, 10)

    def forward(self, x):
        x = self.pool(F.relu(self.conv1(x)))
        x = self.pool(F.relu(self.conv2(x)))
        x = x.view(-1, 16 * 5 * 5)
        x = F.relu(self.fc1(x))
        x = F.relu(self.fc2(x))
        x = self.fc3(x)
        return x


def batches():
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(4, 3, 32, 32, generator=g), torch.randint(0, 10, (4,), generator=g)) for _ in range(4)]


def optimizer(net):
    return optim.SGD(net.parameters(), lr=0.001, momentum=0.9)


def hand(net, data, amp):
    criterion = nn.CrossEntropyLoss()
    opt = optimizer(net)
    for inputs, labels in data:
        opt.zero_grad()
        with amp():
            outputs = net(inputs)
            loss = criterion(outputs, labels)
        loss.backward()
        opt.step()


CASE = Case("blitz CIFAR CNN (x.view)", Net, batches, hand,
            lambda net: {"loss_fn": nn.CrossEntropyLoss(), "optimizer": optimizer(net)})
