"""pytorch/examples' word language model at a tiny size: its RNNModel as its authors wrote it
(origin: https://github.com/pytorch/examples, word_language_model/model.py, the RNN part; and
main.py's batchify, get_batch and repackage_hidden), over a made-up corpus. The hidden state is
carried from batch to batch (truncated backpropagation through time), detached at each batch."""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

NTOKEN, NINP, NHID, NLAYERS, BSZ, BPTT = 24, 16, 16, 2, 4, 6


class RNNModel(nn.Module):
    """Container module with an encoder, a recurrent module, and a decoder."""

    def __init__(self, rnn_type, ntoken, ninp, nhid, nlayers, dropout=0.5, tie_weights=False):
        super(RNNModel, self).__init__()
        self.ntoken = ntoken
        self.drop = nn.Dropout(dropout)
        self.encoder = nn.Embedding(ntoken, ninp)
        if rnn_type in ['LSTM', 'GRU']:
            self.rnn = getattr(nn, rnn_type)(ninp, nhid, nlayers, dropout=dropout)
        else:
            try:
                nonlinearity = {'RNN_TANH': 'tanh', 'RNN_RELU': 'relu'}[rnn_type]
            except KeyError as e:
                raise ValueError("""An invalid option for `--model` was supplied,
                                 options are ['LSTM', 'GRU', 'RNN_TANH' or 'RNN_RELU']""") from e
            self.rnn = nn.RNN(ninp, nhid, nlayers, nonlinearity=nonlinearity, dropout=dropout)
        self.decoder = nn.Linear(nhid, ntoken)
        if tie_weights:
            if nhid != ninp:
                raise ValueError('When using the tied flag, nhid must be equal to emsize')
            self.decoder.weight = self.encoder.weight
        self.init_weights()
        self.rnn_type = rnn_type
        self.nhid = nhid
        self.nlayers = nlayers

    def init_weights(self):
        initrange = 0.1
        nn.init.uniform_(self.encoder.weight, -initrange, initrange)
        nn.init.zeros_(self.decoder.bias)
        nn.init.uniform_(self.decoder.weight, -initrange, initrange)

    def forward(self, input, hidden):
        emb = self.drop(self.encoder(input))
        output, hidden = self.rnn(emb, hidden)
        output = self.drop(output)
        decoded = self.decoder(output)
        decoded = decoded.view(-1, self.ntoken)
        return F.log_softmax(decoded, dim=1), hidden

    def init_hidden(self, bsz):
        weight = next(self.parameters())
        if self.rnn_type == 'LSTM':
            return (weight.new_zeros(self.nlayers, bsz, self.nhid),
                    weight.new_zeros(self.nlayers, bsz, self.nhid))
        else:
            return weight.new_zeros(self.nlayers, bsz, self.nhid)


def repackage_hidden(h):
    """Wraps hidden states in new Tensors, to detach them from their history."""
    if isinstance(h, torch.Tensor):
        return h.detach()
    else:
        return tuple(repackage_hidden(v) for v in h)


def batchify(data, bsz):
    nbatch = data.size(0) // bsz
    data = data.narrow(0, 0, nbatch * bsz)
    return data.view(bsz, -1).t().contiguous()  # (nbatch, bsz): each column a stretch of the corpus


def get_batch(source, i):
    seq_len = min(BPTT, len(source) - 1 - i)
    data = source[i:i + seq_len]
    target = source[i + 1:i + 1 + seq_len].view(-1)
    return data, target


def corpus_batches(steps: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """`steps` batches of (BPTT, BSZ) tokens and their next tokens, in corpus order, from a fixed
    random Markov chain (each token is followed by one of three), so that context helps."""
    g = torch.Generator().manual_seed(0)
    follow = torch.randint(0, NTOKEN, (NTOKEN, 3), generator=g)
    tokens = [0]
    for _ in range((steps * BPTT + 1) * BSZ - 1):
        tokens.append(int(follow[tokens[-1], torch.randint(0, 3, (1,), generator=g)]))
    source = batchify(torch.tensor(tokens), BSZ)
    return [get_batch(source, i) for i in range(0, source.size(0) - 1, BPTT)]


def make_model() -> RNNModel:
    torch.manual_seed(0)
    return RNNModel("LSTM", NTOKEN, NINP, NHID, NLAYERS, dropout=0.2)


def lm_step(step, batch):
    """The example's training step as a step of your own: the hidden state in step.state."""
    data, targets = batch
    model = step.model
    hidden = step.state.get("hidden")
    if hidden is None:  # the first batch: a fresh state (the example's init_hidden at the epoch's start)
        hidden = model.init_hidden(data.size(1))
    output, hidden = model(data, hidden)
    step.state["hidden"] = repackage_hidden(hidden)  # detached: the next batch backpropagates to here only
    loss = F.nll_loss(output, targets)
    step.backward(loss)
    step.step()
    return loss


def lm_loss(carry: dict):
    """The same step through the built-in loss rule: compute_loss keeps the hidden state in `carry`
    (the dict given as fit's state=)."""

    def compute_loss(model, batch):
        data, targets = batch
        hidden = carry.get("hidden")
        if hidden is None:
            hidden = model.init_hidden(data.size(1))
        output, hidden = model(data, hidden)
        carry["hidden"] = repackage_hidden(hidden)
        return F.nll_loss(output, targets)

    return compute_loss
