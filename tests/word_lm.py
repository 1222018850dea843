"""pytorch/examples' word language model at a tiny size (origin: https://github.com/pytorch/examples,
word_language_model/model.py's RNNModel and main.py's batchify, get_batch and repackage_hidden;
the same model and training step, written here), over a made-up corpus. The hidden state is
carried from batch to batch (truncated backpropagation through time), detached at each batch."""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

NTOKEN, NINP, NHID, NLAYERS, BSZ, BPTT = 24, 16, 16, 2, 4, 6


class RNNModel(nn.Module):
    """The example's model: embedding, dropout, a stacked LSTM or GRU, dropout, a linear decoder to
    log-probabilities over the vocabulary; its initialization and its zero hidden state."""

    def __init__(self, rnn_type: str, ntoken: int, ninp: int, nhid: int, nlayers: int, dropout: float = 0.5):
        super().__init__()
        self.ntoken, self.rnn_type, self.nhid, self.nlayers = ntoken, rnn_type, nhid, nlayers
        self.drop = nn.Dropout(dropout)
        self.encoder = nn.Embedding(ntoken, ninp)
        self.rnn = {"LSTM": nn.LSTM, "GRU": nn.GRU}[rnn_type](ninp, nhid, nlayers, dropout=dropout)
        self.decoder = nn.Linear(nhid, ntoken)
        nn.init.uniform_(self.encoder.weight, -0.1, 0.1)
        nn.init.zeros_(self.decoder.bias)
        nn.init.uniform_(self.decoder.weight, -0.1, 0.1)

    def forward(self, tokens, hidden):  # tokens (T, B): time first, as the example's batches
        output, hidden = self.rnn(self.drop(self.encoder(tokens)), hidden)
        logits = self.decoder(self.drop(output)).view(-1, self.ntoken)  # (T * B, ntoken)
        return F.log_softmax(logits, dim=1), hidden

    def init_hidden(self, bsz: int):
        zeros = next(self.parameters()).new_zeros(self.nlayers, bsz, self.nhid)
        return (zeros, zeros.clone()) if self.rnn_type == "LSTM" else zeros


def repackage_hidden(h):
    """The hidden state detached from the batch that made it (a tensor, or a tuple of them)."""
    return h.detach() if isinstance(h, torch.Tensor) else tuple(repackage_hidden(v) for v in h)


def batchify(data, bsz):
    """The corpus as BSZ columns, each a contiguous stretch: (nbatch, bsz)."""
    nbatch = data.size(0) // bsz
    data = data.narrow(0, 0, nbatch * bsz)
    return data.view(bsz, -1).t().contiguous()  # (nbatch, bsz): each column a stretch of the corpus


def get_batch(source, i):
    """BPTT rows from row i, and the tokens that follow them, flattened."""
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
