"""pytorch/examples' time sequence prediction: two float64 LSTMCells trained with LBFGS and a closure.

Origin: github.com/pytorch/examples, time_sequence_prediction/train.py (Sequence: LSTMCell(1, 51),
LSTMCell(51, 51), Linear(51, 1), float64 hidden states; `seq.double()`; nn.MSELoss; optim.LBFGS(lr=0.8);
each step `optimizer.step(closure)`, the closure calling zero_grad, the forward, the loss and its backward
and returning the loss) and generate_sine_wave.py (shifted sine waves, float64), at 10 waves of 60 points
(100 of 1000 there) so that three LBFGS steps run in seconds on a CPU. The author's `print` of
`loss.item()` in the closure is left out: it reads the loss, it does not change it.
"""

import numpy as np
import torch
import torch.nn as nn
import torch.optim as optim

from zoo import Case

STEPS = 3  # the author's --steps (15 there): each one LBFGS step of up to 20 closure evaluations


class Sequence(nn.Module):
    def __init__(self):
        super(Sequence, self).__init__()
        self.lstm1 = nn.LSTMCell(1, 51)
        self.lstm2 = nn.LSTMCell(51, 51)
        self.linear = nn.Linear(51, 1)

    def forward(self, input, future = 0):
        outputs = []
        h_t = torch.zeros(input.size(0), 51, dtype=torch.double)
        c_t = torch.zeros(input.size(0), 51, dtype=torch.double)
        h_t2 = torch.zeros(input.size(0), 51, dtype=torch.double)
        c_t2 = torch.zeros(input.size(0), 51, dtype=torch.double)

        for input_t in input.split(1, dim=1):
            h_t, c_t = self.lstm1(input_t, (h_t, c_t))
            h_t2, c_t2 = self.lstm2(h_t, (h_t2, c_t2))
            output = self.linear(h_t2)
            outputs += [output]
        for i in range(future):# if we should predict the future
            h_t, c_t = self.lstm1(output, (h_t, c_t))
            h_t2, c_t2 = self.lstm2(h_t, (h_t2, c_t2))
            output = self.linear(h_t2)
            outputs += [output]
        outputs = torch.cat(outputs, dim=1)
        return outputs


def make():
    seq = Sequence()
    seq.double()
    return seq


def batches():
    """The training set of train.py (waves 3 and on; 0..2 are its test set): one full batch."""
    rng = np.random.RandomState(2)
    T, L, N = 20, 60, 10
    x = np.empty((N, L), 'int64')
    x[:] = np.array(range(L)) + rng.randint(-4 * T, 4 * T, N).reshape(N, 1)
    data = np.sin(x / 1.0 / T).astype('float64')
    return [(torch.from_numpy(data[3:, :-1]), torch.from_numpy(data[3:, 1:]))]


criterion = nn.MSELoss()


def hand(seq, data, amp):
    optimizer = optim.LBFGS(seq.parameters(), lr=0.8)
    for i in range(STEPS):
        input, target = data[i % len(data)]

        def closure():
            optimizer.zero_grad()
            with amp():
                out = seq(input)
                loss = criterion(out, target)
            loss.backward()
            return loss
        optimizer.step(closure)


CASE = Case("pytorch/examples time sequence prediction (LBFGS, closure)", make, batches, hand,
            lambda seq: {"loss_fn": criterion, "optimizer": optim.LBFGS(seq.parameters(), lr=0.8)},
            config={"steps": STEPS})
