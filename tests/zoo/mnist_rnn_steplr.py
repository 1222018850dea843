"""pytorch/examples' MNIST RNN with its per-epoch StepLR, as written.

Origin: github.com/pytorch/examples, mnist_rnn/main.py (Net: LSTM(28, 64, batch_first) over the image's
rows, the last output through BatchNorm1d, Dropout2d(0.25), fc1, relu, Dropout2d(0.5), fc2,
log_softmax; F.nll_loss; Adadelta(lr=0.1); StepLR(step_size=1, gamma=0.7), stepped once after each
epoch: `for epoch ...: train(...); test(...); scheduler.step()`). fit keeps the scheduler as written,
with scheduler_interval="epoch". Three epochs of three batches of four images (the author's test()
changes nothing it trains: eval mode, no gradients, no random draws).
"""

import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.optim as optim
from torch.optim.lr_scheduler import StepLR

from zoo import Case

EPOCHS, BATCHES = 3, 3


class Net(nn.Module):
    def __init__(self):
        super(Net, self).__init__()
        self.rnn = nn.LSTM(input_size=28, hidden_size=64, batch_first=True)
        self.batchnorm = nn.BatchNorm1d(64)
        self.dropout1 = nn.Dropout2d(0.25)
        self.dropout2 = nn.Dropout2d(0.5)
        self.fc1 = nn.Linear(64, 32)
        self.fc2 = nn.Linear(32, 10)

    def forward(self, input):
        # Shape of input is (batch_size,1, 28, 28)
        # converting shape of input to (batch_size, 28, 28)
        # as required by RNN when batch_first is set True
        input = input.reshape(-1, 28, 28)
        output, hidden = self.rnn(input)

        # RNN output shape is (seq_len, batch, input_size)
        # Get last output of RNN
        output = output[:, -1, :]
        output = self.batchnorm(output)
        output = self.dropout1(output)
        output = self.fc1(output)
        output = F.relu(output)
        output = self.dropout2(output)
        output = self.fc2(output)
        output = F.log_softmax(output, dim=1)
        return output


def batches():
    g = torch.Generator().manual_seed(7)
    return [(torch.randn(4, 1, 28, 28, generator=g), torch.randint(0, 10, (4,), generator=g))
            for _ in range(BATCHES)]


def train(model, train_loader, optimizer, amp):
    model.train()
    for batch_idx, (data, target) in enumerate(train_loader):
        optimizer.zero_grad()
        with amp():
            output = model(data)
            loss = F.nll_loss(output, target)
        loss.backward()
        optimizer.step()


def hand(model, data, amp):
    optimizer = optim.Adadelta(model.parameters(), lr=0.1)
    scheduler = StepLR(optimizer, step_size=1, gamma=0.7)
    for epoch in range(1, EPOCHS + 1):
        train(model, data, optimizer, amp)
        scheduler.step()


CASE = Case("pytorch/examples mnist_rnn (StepLR per epoch)", Net, batches, hand,
            lambda model: {"loss_fn": F.nll_loss, "optimizer": optim.Adadelta(model.parameters(), lr=0.1),
                           "scheduler": lambda opt: StepLR(opt, step_size=1, gamma=0.7)},
            config={"steps": EPOCHS * BATCHES, "scheduler_interval": "epoch"})
