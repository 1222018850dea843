"""Messages that name what happened: the loss rule's call, the batch size the data really made, the
layer that produced the output, and a tuple output whose element is the loss."""

import logging

import pytest
import torch
import torch.nn.functional as F
from helpers import data, DictNet, mlp
from torch import nn
from torch.utils.data import DataLoader, Dataset

from gputrain import TrainConfig, fit
from gputrain.errors import DataError


class TokenModel(nn.Module):
    """A word-language-model in small: embedding, then a linear decoder; `model(x, y)` returns the loss."""

    def __init__(self, vocab: int = 50):
        super().__init__()
        self.input_emb = nn.Embedding(vocab, 16)
        self.decoder = nn.Linear(16, vocab)

    def forward(self, x, y=None):
        logits = self.decoder(self.input_emb(x))
        return F.cross_entropy(logits.flatten(0, 1), y.flatten()) if y is not None else logits


class Chunks(Dataset):
    """Each item is a whole batch: (20, 35) token ids and the next tokens (a DataLoader with batch_size=None)."""

    def __init__(self, n: int = 6):
        g = torch.Generator().manual_seed(0)
        self.tokens = torch.randint(0, 50, (n, 20, 36), generator=g)

    def __len__(self):
        return len(self.tokens)

    def __getitem__(self, i):
        return self.tokens[i, :, :-1], self.tokens[i, :, 1:]


def _info(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.getMessage().startswith("loss: ")]


def test_the_loss_line_names_the_call_made_on_a_tuple_batch(caplog):
    """model(x, y) on (x, y) batches without loss_fn: model(*batch), not model(**batch).loss."""
    with caplog.at_level(logging.INFO, logger="gputrain"):
        h = fit(TokenModel(), DataLoader(Chunks(), batch_size=None),
                config=TrainConfig(device="cpu", steps=3, log_every=1))
    made = "the model's own loss: model(*batch) with 2 elements, the loss: the scalar tensor it returned"
    assert _info(caplog) == [f"loss: {made}"]
    assert h.summary["loss"] == made and {"name": "loss", "value": made} .items() <= next(
        d for d in h.summary["decisions"] if d["name"] == "loss").items()


def test_the_loss_line_names_each_way(caplog):
    x, y = data(64)

    def compute_loss(model, batch):
        return F.cross_entropy(model(batch[0]), batch[1])

    with caplog.at_level(logging.INFO, logger="gputrain"):
        cfg = TrainConfig(device="cpu", steps=2, batch_size=16)
        fit(DictNet(), {"features": x, "labels": y}, config=cfg)
        fit(mlp(), (x, y), loss_fn=nn.CrossEntropyLoss(), config=cfg)
        fit(mlp(), (x, y), compute_loss=compute_loss, config=cfg)
    assert _info(caplog) == ["loss: the model's own loss: model(**batch) with features, labels, the loss: its ['loss']",
                             "loss: loss_fn(model(x), y) with CrossEntropyLoss",
                             "loss: compute_loss=compute_loss"]


class TupleGPT(nn.Module):
    """nanoGPT's contract: `model(idx, targets)` returns `(logits, loss)`."""

    def __init__(self, scalars: int = 1):
        super().__init__()
        self.inner, self.scalars = TokenModel(), scalars

    def forward(self, idx, targets):
        logits = self.inner(idx)
        loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten())
        return (logits, loss) if self.scalars == 1 else (logits, loss, loss.detach() * 0) if self.scalars == 2 \
            else (logits, logits.mean(-1))


def test_a_tuple_whose_element_is_the_scalar_loss_trains_and_is_named(caplog):
    with caplog.at_level(logging.INFO, logger="gputrain"):
        h = fit(TupleGPT(), DataLoader(Chunks(), batch_size=None), eval_data=DataLoader(Chunks(2), batch_size=None),
                config=TrainConfig(device="cpu", steps=4, log_every=2))
    assert h.summary["loss"].endswith("the loss: element [1] of the tuple it returned (its one scalar tensor)")
    assert len(_info(caplog)) == 1 and h.records[-1]["eval_loss"] > 0


def test_a_tuple_without_one_scalar_loss_is_named_precisely():
    with pytest.raises(DataError) as several:
        fit(TupleGPT(scalars=2), DataLoader(Chunks(), batch_size=None), config=TrainConfig(device="cpu", steps=1))
    assert ("model(*batch) with 2 elements returned tuple of 3: [0] (20, 35, 50) float32, [1] () float32, "
            "[2] () float32: elements [1], [2] are all scalar tensors") in str(several.value)
    with pytest.raises(DataError) as none:
        fit(TupleGPT(scalars=0), DataLoader(Chunks(), batch_size=None), config=TrainConfig(device="cpu", steps=1))
    assert "returned tuple of 2: [0] (20, 35, 50) float32, [1] (20, 35) float32: no element is a scalar" in str(
        none.value)


def test_the_batch_size_note_reads_the_batches_the_data_made(caplog):
    """A DataLoader with batch_size=None over a dataset of (20, 35) batches: TrainConfig.batch_size=20
    is what they hold (no note); 16 is not, and the note says 20, read from the batches."""
    with caplog.at_level(logging.WARNING, logger="gputrain"):
        h = fit(TokenModel(), DataLoader(Chunks(), batch_size=None), config=TrainConfig(device="cpu", steps=3,
                                                                                      batch_size=20))
    assert "is not used" not in caplog.text and not [w for w in h.summary["warnings"] if "is not used" in w]
    assert h.summary["batch_size"] is None and h.summary["batch_size_mean"] == 20  # the data's own, as read
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="gputrain"):
        h = fit(TokenModel(), DataLoader(Chunks(), batch_size=None), config=TrainConfig(device="cpu", steps=3,
                                                                                      batch_size=16))
    note = ("TrainConfig.batch_size=16 is not used: the DataLoader over Chunks made batches of 20 samples on average "
            "(read from the batches)")
    assert note in caplog.text and any(w.startswith(note) for w in h.summary["warnings"])


def test_the_error_note_names_the_layer_that_produced_the_output():
    """Registered decoder-first (as a subclass of nn.Transformer that replaces its `decoder` does), run
    embedding-first: the note's last layer is the decoder, which made the 50 outputs."""

    class Reordered(nn.Module):
        def __init__(self):
            super().__init__()
            self.decoder = nn.Linear(16, 50)
            self.input_emb = nn.Embedding(60, 16)

        def forward(self, x):
            return self.decoder(self.input_emb(x))

    x = torch.randint(0, 60, (32,))
    y = torch.full((32,), 55)  # labels past the 50 outputs
    with pytest.raises(IndexError) as info:
        fit(Reordered(), (x, y), loss_fn=nn.CrossEntropyLoss(), config=TrainConfig(device="cpu", steps=1,
                                                                                batch_size=8))
    note = info.value.__notes__[-1]
    assert ("first layer input_emb: Embedding(60, 16); last layer decoder: Linear(in_features=16, out_features=50, "
            "bias=True) (in the order the forward ran them") in note
