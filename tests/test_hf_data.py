"""Hugging Face datasets passed straight to fit: map-style (with or without set_format("torch")) and
streaming (local JSON lines, Parquet, CSV), columns as dict batches, padding by a collate_fn, and
split across ranks. Everything is built from local files: nothing is downloaded."""

import json

import pytest
import torch
import torch.nn.functional as F
from helpers import data, mlp, params
from torch import nn

from gputrain import TrainConfig, fit
from gputrain.data import make_loader
from gputrain.errors import DataError

datasets = pytest.importorskip("datasets")

CPU = torch.device("cpu")
CFG = dict(device="cpu", batch_size=16, seed=2, log_every=5)


def loss(model, batch):
    return F.cross_entropy(model(batch["x"]), batch["y"])


def columns(n=96):
    x, y = data(n)
    return {"x": x, "y": y}


def test_a_map_style_dataset_trains_like_the_same_tensors():
    cols = columns()
    ref, a, b = mlp(), mlp(), mlp()
    fit(ref, cols, compute_loss=loss, config=TrainConfig(**CFG, epochs=2))
    plain = datasets.Dataset.from_dict({"x": cols["x"].numpy(), "y": cols["y"].numpy(),
                                        "id": [f"row{i}" for i in range(96)]})  # a string column rides along
    h = fit(a, plain, compute_loss=loss, config=TrainConfig(**CFG, epochs=2))
    torch_format = datasets.Dataset.from_dict({"x": cols["x"].numpy(), "y": cols["y"].numpy()})
    torch_format.set_format("torch")
    fit(b, torch_format, compute_loss=loss, config=TrainConfig(**CFG, epochs=2))
    # The same (seed, epoch) permutation as tensors get: bit-equal.
    assert torch.equal(params(a), params(ref)) and torch.equal(params(b), params(ref))
    assert h.summary["steps"] == 12 and "Hugging Face Dataset of 96 rows" in h.summary["data_reason"]


def test_columns_become_a_dict_batch_of_tensors_and_lists():
    ds = datasets.Dataset.from_dict({"x": [[1.0, 2.0], [3.0, 4.0], [5.0, 6.0]], "y": [0, 1, 0],
                                     "text": ["a", "b", "c"]})
    loader, _ = make_loader(ds, 3, device=CPU, train=False)
    batch = next(iter(loader.iter_epoch(0)))
    assert batch["x"].shape == (3, 2) and batch["y"].dtype == torch.int64 and batch["text"] == ["a", "b", "c"]


def test_rows_of_different_lengths_need_a_collate_fn_that_pads():
    ds = datasets.Dataset.from_dict({"input_ids": [[1, 2, 3], [4, 5], [6]], "labels": [0, 1, 0]})
    with pytest.raises(DataError, match="'input_ids' has rows of different lengths.*DataCollatorWithPadding"):
        fit(mlp(), ds, compute_loss=loss, config=TrainConfig(device="cpu", batch_size=3, steps=1))


def test_rows_for_a_collate_fn_are_read_a_batch_at_a_time(monkeypatch):
    """With a collate_fn the rows of a batch come from one Arrow read (the Dataset's __getitems__),
    not one read per row: the same batches, ~5x less reading."""
    calls = []
    getitems = datasets.Dataset.__getitems__
    monkeypatch.setattr(datasets.Dataset, "__getitems__", lambda self, keys: calls.append(len(keys)) or getitems(self, keys))
    ds = datasets.Dataset.from_dict({"input_ids": [[i, i + 1] for i in range(10)], "labels": list(range(10))})

    def collate(rows):
        return {"input_ids": torch.tensor([r["input_ids"] for r in rows]), "labels": torch.tensor([r["labels"] for r in rows])}

    loader, _ = make_loader(ds, 4, device=CPU, train=True, seed=1, num_workers=0, collate_fn=collate)
    batches = list(loader.iter_epoch(0))
    assert calls == [4, 4, 2]
    assert all(torch.equal(b["input_ids"][:, 0], b["labels"]) for b in batches)
    assert sorted(i for b in batches for i in b["labels"].tolist()) == list(range(10))


def _tokenizer():
    transformers = pytest.importorskip("transformers")
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import Whitespace

    vocab = {"[PAD]": 0, "[UNK]": 1, **{w: i + 2 for i, w in enumerate("good bad movie film very not".split())}}
    tok = Tokenizer(WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = Whitespace()
    return transformers, transformers.PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="[PAD]",
                                                              unk_token="[UNK]")


def test_a_tokenizers_data_collator_pads_the_batches():
    transformers, tokenizer = _tokenizer()
    texts = ["good movie", "very good film", "bad", "not good movie at all", "bad film", "very bad"] * 8
    ds = datasets.Dataset.from_dict({"text": texts, "label": [int("good" in t and "not" not in t) for t in texts]})
    ds = ds.map(lambda row: tokenizer(row["text"]), remove_columns=["text"])  # ragged input_ids
    seen = []

    class Bag(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb, self.head = nn.EmbeddingBag(8, 8, mode="sum"), nn.Linear(8, 2)

        def forward(self, input_ids, attention_mask, labels, **_):
            seen.append(tuple(input_ids.shape))
            logits = self.head(self.emb(input_ids, per_sample_weights=attention_mask.float()))
            return {"loss": F.cross_entropy(logits, labels), "logits": logits}

    collator = transformers.DataCollatorWithPadding(tokenizer)
    h = fit(Bag(), ds, collate_fn=collator, config=TrainConfig(device="cpu", batch_size=8, steps=6))
    assert h.summary["steps"] == 6 and "DataCollatorWithPadding" in h.summary["data_reason"]
    assert len({s[1] for s in seen}) > 1  # padded to each batch's longest row, not one fixed length


def _write(tmp_path, fmt, n=96):
    x, y = data(n)
    if fmt == "json":
        path = tmp_path / "train.jsonl"
        path.write_text("".join(json.dumps({"x": x[i].tolist(), "y": int(y[i])}) + "\n" for i in range(n)))
    elif fmt == "parquet":
        import pyarrow as pa
        import pyarrow.parquet as pq

        path = tmp_path / "train.parquet"
        pq.write_table(pa.table({"x": [r.tolist() for r in x], "y": y.tolist()}), path)
    else:
        path = tmp_path / "train.csv"
        rows = [",".join([f"x{j}" for j in range(6)] + ["y"])]
        rows += [",".join([repr(float(v)) for v in x[i]] + [str(int(y[i]))]) for i in range(n)]
        path.write_text("\n".join(rows) + "\n")
    return str(path)


def csv_loss(model, batch):
    x = torch.stack([batch[f"x{j}"] for j in range(6)], 1).float()
    return F.cross_entropy(model(x), batch["y"])


@pytest.mark.parametrize("fmt", ["json", "parquet", "csv"])
def test_a_streaming_dataset_from_local_files_trains_for_its_steps(tmp_path, fmt):
    ds = datasets.load_dataset(fmt, data_files=_write(tmp_path, fmt), split="train", streaming=True)
    model = mlp()
    before = params(model).clone()
    h = fit(model, ds, compute_loss=csv_loss if fmt == "csv" else loss,
            config=TrainConfig(device="cpu", batch_size=16, steps=9))
    assert h.summary["steps"] == 9 and h.summary["samples"] == 9 * 16 and h.summary["data"] == "iterable"
    assert not torch.equal(params(model), before)


@pytest.mark.parametrize("torch_format", [False, True])
def test_streamed_rows_as_lists_or_as_tensors_become_stacked_columns(tmp_path, torch_format):
    ds = datasets.load_dataset("json", data_files=_write(tmp_path, "json"), split="train", streaming=True)
    if torch_format:
        ds = ds.with_format("torch")  # rows of tensors instead of Python lists
    loader, _ = make_loader(ds, 8, device=CPU, train=True)
    batch = next(iter(loader.iter_epoch(0)))
    x, y = data(96)
    assert isinstance(batch["x"], torch.Tensor) and batch["x"].shape == (8, 6) and batch["y"].dtype == torch.int64
    assert torch.allclose(batch["x"], x[:8]) and torch.equal(batch["y"], y[:8])


def test_streamed_rows_of_different_lengths_need_a_collate_fn_that_pads(tmp_path):
    path = tmp_path / "ragged.jsonl"
    path.write_text("".join(json.dumps({"input_ids": list(range(n)), "labels": 0}) + "\n" for n in (3, 5, 2, 4)))
    ds = datasets.load_dataset("json", data_files=str(path), split="train", streaming=True)
    with pytest.raises(DataError, match="'input_ids' has rows of different lengths in one batch \\(5 and 2\\)"):
        fit(mlp(), ds, compute_loss=loss, config=TrainConfig(device="cpu", batch_size=4, steps=1))


def test_a_streaming_dataset_needs_steps(tmp_path):
    ds = datasets.load_dataset("json", data_files=_write(tmp_path, "json"), split="train", streaming=True)
    with pytest.raises(Exception, match="steps"):
        fit(mlp(), ds, compute_loss=loss, config=TrainConfig(device="cpu", epochs=1))


def test_a_streaming_dataset_is_split_across_ranks(tmp_path):
    ds = datasets.load_dataset("json", data_files=_write(tmp_path, "json"), split="train", streaming=True)
    seen = []
    for rank in (0, 1):
        loader, placement = make_loader(ds, 8, device=CPU, train=True, rank=rank, world_size=2)
        assert "split_dataset_by_node" in placement.reason
        seen.append([round(float(v), 5) for b in loader.iter_epoch(0) for v in b["x"][:, 0]])
    x, _ = data(96)
    assert len(seen[0]) == len(seen[1]) == 48 and not set(seen[0]) & set(seen[1])
    assert sorted(seen[0] + seen[1]) == sorted(round(float(v), 5) for v in x[:, 0])


def test_the_streaming_example_runs_and_is_the_one_the_docs_show(capsys):
    import re
    import runpy
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    path = root / "docs" / "examples" / "byo_streaming.py"
    from helpers import docs_page

    assert f"```python\n{path.read_text().strip()}\n```" in docs_page("how-to/own-data.md"), \
        f"docs/how-to/own-data.md does not show {path}"
    runpy.run_path(str(path), run_name="__main__")
    printed = capsys.readouterr().out
    assert "steps 60" in printed  # 25 steps, stopped, then resumed to 60
    assert float(re.search(r"next-token accuracy ([0-9.]+)", printed).group(1)) >= 0.9, printed


def test_hf_rows_read_one_row_or_a_batch_of_rows_by_any_integer_index():
    """HFRows, the Dataset a collate_fn run reads: one row by a tensor or numpy index (a sampler's,
    which a datasets.Dataset refuses as such), and a batch of rows in one read, the same rows."""
    import numpy as np

    from gputrain.data.hf import HFRows

    ds = datasets.Dataset.from_dict({"ids": [[1, 2], [3], [4, 5, 6]], "label": [0, 1, 0]})
    rows = HFRows(ds)
    assert len(rows) == 3
    assert rows[torch.tensor(2)] == rows[np.int64(2)] == {"ids": [4, 5, 6], "label": 0}
    assert rows.__getitems__([torch.tensor(1), 0]) == [rows[1], rows[0]] == [{"ids": [3], "label": 1},
                                                                            {"ids": [1, 2], "label": 0}]
