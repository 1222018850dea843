"""pytorch/examples' word language model (LSTM) and its train(): truncated BPTT carrying the hidden state.

Origin: github.com/pytorch/examples, word_language_model/model.py (RNNModel: dropout, Embedding,
nn.LSTM, Linear decoder, init_weights, init_hidden, log_softmax output) and main.py (train():
repackage_hidden, model.zero_grad(), NLLLoss, clip_grad_norm_(0.25), `p.data.add_(p.grad, alpha=-lr)`).
Sizes made tiny: 30 tokens, 8-wide embedding and hidden state, 2 layers, bptt 5, batch 4.
"""

import torch
import torch.nn as nn
import torch.nn.functional as F

from zoo import Case

ntokens, emsize, nhid, nlayers, bptt, bsz, lr, clip = 30, 8, 8, 2, 5, 4, 20.0, 0.25


class RNNModel(nn.Module):
    """Container module with an encoder, a recurrent module, and a decoder."""

    def __init__(self, rnn_type, ntoken, ninp, nhid, nlayers, dropout=0.5, tie_weights=False):
        super(RNNModel, self).__init__()
        self.ntoken = ntoken
        self.drop = nn.Dropout(dropout)
        self.encoder = nn.Embedding(ntoken, ninp)
        self.rnn = getattr(nn, rnn_type)(ninp, nhid, nlayers, dropout=dropout)
        self.decoder = nn.Linear(nhid, ntoken)
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


def make():
    return RNNModel('LSTM', ntokens, emsize, nhid, nlayers, 0.2)


def batches():
    """(data, targets) windows of one stream batchified into `bsz` columns, in order (get_batch)."""
    g = torch.Generator().manual_seed(5)
    source = torch.randint(0, ntokens, (4 * bptt + 1, bsz), generator=g)
    return [(source[i:i + bptt], source[i + 1:i + 1 + bptt].reshape(-1)) for i in range(0, 4 * bptt, bptt)]


criterion = nn.NLLLoss()


def hand(model, data, amp):
    model.train()
    hidden = model.init_hidden(bsz)
    for batch, (data_, targets) in enumerate(data):
        hidden = repackage_hidden(hidden)
        model.zero_grad()
        with amp():
            output, hidden = model(data_, hidden)
            loss = criterion(output, targets)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        for p in model.parameters():
            p.data.add_(p.grad, alpha=-lr)


def fit_kwargs(model):
    """The same step through compute_loss, the hidden state carried in a closure; the manual update
    `p.data.add_(p.grad, alpha=-lr)` is SGD(lr) and clip_grad_norm_ is max_grad_norm."""
    state = {"hidden": model.init_hidden(bsz)}

    def compute_loss(m, batch):
        data_, targets = batch
        hidden = repackage_hidden(state["hidden"])
        output, state["hidden"] = m(data_, hidden)
        return criterion(output, targets)

    return {"compute_loss": compute_loss, "optimizer": torch.optim.SGD(model.parameters(), lr=lr)}


CASE = Case("word language model (LSTM)", make, batches, hand, fit_kwargs, config={"max_grad_norm": clip})
