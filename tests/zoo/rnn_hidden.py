"""A character-level RNN carrying its hidden state through a name, letter by letter.

Origin: github.com/pytorch/tutorials, intermediate_source/char_rnn_classification_tutorial.py
(RNN: i2h and i2o over cat(input, hidden), LogSoftmax; initHidden; train(category_tensor,
line_tensor): hidden = rnn.initHidden(), rnn.zero_grad(), one step per letter, NLLLoss on the last
output, then `p.data.add_(p.grad.data, alpha=-learning_rate)` with learning_rate = 0.005).
"""

import torch
import torch.nn as nn

from zoo import Case

n_letters, n_hidden, n_categories, learning_rate = 10, 16, 4, 0.005


class RNN(nn.Module):
    def __init__(self, input_size, hidden_size, output_size):
        super(RNN, self).__init__()

        self.hidden_size = hidden_size

        self.i2h = nn.Linear(input_size + hidden_size, hidden_size)
        self.i2o = nn.Linear(input_size + hidden_size, output_size)
        self.softmax = nn.LogSoftmax(dim=1)

    def forward(self, input, hidden):
        combined = torch.cat((input, hidden), 1)
        hidden = self.i2h(combined)
        output = self.i2o(combined)
        output = self.softmax(output)
        return output, hidden

    def initHidden(self):
        return torch.zeros(1, self.hidden_size)


def make():
    return RNN(n_letters, n_hidden, n_categories)


def batches():
    """(category_tensor, line_tensor) pairs: a name is (letters, 1, n_letters) one-hot."""
    g = torch.Generator().manual_seed(12)
    out = []
    for length in (5, 3, 6, 4):
        letters = torch.randint(0, n_letters, (length,), generator=g)
        line = torch.zeros(length, 1, n_letters)
        line[torch.arange(length), 0, letters] = 1
        out.append((torch.randint(0, n_categories, (1,), generator=g), line))
    return out


criterion = nn.NLLLoss()


def name_loss(rnn, category_tensor, line_tensor):
    hidden = rnn.initHidden().to(line_tensor.device)
    for i in range(line_tensor.size()[0]):
        output, hidden = rnn(line_tensor[i], hidden)
    return criterion(output, category_tensor)


def hand(rnn, data, amp):
    for category_tensor, line_tensor in data:
        rnn.zero_grad()
        with amp():
            loss = name_loss(rnn, category_tensor, line_tensor)
        loss.backward()
        for p in rnn.parameters():
            p.data.add_(p.grad.data, alpha=-learning_rate)


CASE = Case("RNN carrying hidden state (char RNN)", make, batches, hand,
            lambda rnn: {"compute_loss": lambda m, b: name_loss(m, *b),
                         "optimizer": torch.optim.SGD(rnn.parameters(), lr=learning_rate)})
