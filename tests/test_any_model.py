"""Any model trains unmodified (issue 12): nested batches, the loss rule, num_items, metrics.

Hugging Face models are built from tiny configs (random weights, nothing downloaded): hidden 32,
2 layers, 2 heads, a vocabulary of 50, sequences of 8 tokens. transformers and torchmetrics are
test extras (`pip install -e .[test]`).
"""

import collections
import copy
import csv
import dataclasses
import json
import re
import runpy
import textwrap
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader
from helpers import assert_same_tensors, docs_page, sgd

transformers = pytest.importorskip("transformers")
torchmetrics = pytest.importorskip("torchmetrics")

from gputrain import TrainConfig, fit  # noqa: E402
from gputrain import batch as batches  # noqa: E402
from gputrain.cli import main  # noqa: E402
from gputrain.errors import DataError  # noqa: E402
from gputrain.runtime.speed import decide_speed  # noqa: E402
from torchmetrics.classification import MulticlassAccuracy  # noqa: E402

transformers.logging.set_verbosity_error()
V, T = 50, 8  # vocabulary, sequence length


def _cfg(**kw):
    base = dict(device="cpu", progress=False, log_every=1000, seed=0)
    base.update(kw)
    return TrainConfig(**base)


def _params(model):
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


# ---------------------------------------------------------------- Hugging Face models

def _token_task(n, seed):
    """Label = whether token 1 is 3 (else 4); the rest is noise. Returns a dict of columns."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(5, V, (n, T), generator=g)
    labels = torch.randint(0, 2, (n,), generator=g)
    ids[:, 0] = 2  # [CLS]-like
    ids[:, 1] = torch.where(labels == 1, 3, 4)
    return {"input_ids": ids, "attention_mask": torch.ones(n, T, dtype=torch.long), "labels": labels}


def _tiny_bert():
    cfg = transformers.BertConfig(vocab_size=V, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                                  intermediate_size=64, max_position_embeddings=T, num_labels=2,
                                  hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    return transformers.BertForSequenceClassification(cfg)


def test_bert_on_dict_batches_with_no_loss_fn_and_a_torchmetrics_accuracy():
    torch.manual_seed(0)
    train, test = _token_task(512, 1), _token_task(200, 2)
    majority = max(test["labels"].float().mean().item(), 1 - test["labels"].float().mean().item())
    h = fit(_tiny_bert(), train, eval_data=test, metrics={"acc": MulticlassAccuracy(num_classes=2, average="micro")},
            config=_cfg(batch_size=32, epochs=4, lr=3e-3))
    acc = h.summary["final_eval_acc"]
    assert acc >= 0.95 and acc > majority + 0.3, (acc, majority)
    assert "eval_accuracy" not in h.records[-1]  # no built-in accuracy without a pair
    assert h.summary["loss"].startswith("the model's own loss")


def test_gpt2_lm_head_trains_from_dict_batches_with_labels():
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(0)
    start = torch.randint(0, V, (256, 1), generator=g)
    ids = (start + torch.arange(T)) % V  # each next token is the previous + 1: learnable
    cfg = transformers.GPT2Config(vocab_size=V, n_positions=T, n_embd=32, n_layer=2, n_head=2,
                                  bos_token_id=0, eos_token_id=0, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    model = transformers.GPT2LMHeadModel(cfg)
    h = fit(model, {"input_ids": ids, "labels": ids.clone()}, config=_cfg(batch_size=32, steps=60, lr=3e-3, log_every=10))
    losses = h.column("loss")
    assert losses[-1] < 0.5 * losses[0], losses


# ---------------------------------------------------------------- the loss rule

class TwoInputs(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(4, 16), nn.Linear(3, 16)
        self.head = nn.Linear(16, 2)

    def forward(self, a, b):
        return self.head(torch.relu(self.a(a) + self.b(b)))


def _two_input_data(n, seed):
    g = torch.Generator().manual_seed(seed)
    a, b = torch.randn(n, 4, generator=g), torch.randn(n, 3, generator=g)
    return {"a": a, "b": b, "y": ((a[:, 0] + b[:, 0]) > 0).long()}


def _two_input_loss(model, batch):
    out = model(batch["a"], batch["b"])
    return F.cross_entropy(out, batch["y"]), out


def test_two_input_model_through_compute_loss_and_a_callable_metric_averaged_over_the_eval_set():
    torch.manual_seed(0)
    train, test = _two_input_data(400, 0), _two_input_data(300, 1)  # eval batches of 256 and 44

    def hits(outputs, batch):  # sees compute_loss's outputs
        return {"hits": (outputs.argmax(1) == batch["y"]).float().mean()}

    model = TwoInputs()
    h = fit(model, train, compute_loss=_two_input_loss, eval_data=test, metrics={"hits": hits},
            config=_cfg(batch_size=40, epochs=5, lr=1e-2))
    with torch.no_grad():
        by_hand = (model(test["a"], test["b"]).argmax(1) == test["y"]).float().mean().item()
    assert h.records[-1]["eval_hits"] == pytest.approx(by_hand, abs=1e-6)  # a sample-weighted mean, not per batch
    assert by_hand > 0.9
    assert h.summary["loss"] == "compute_loss=_two_input_loss"


def test_compute_loss_returning_only_the_loss():
    torch.manual_seed(0)
    h = fit(TwoInputs(), _two_input_data(64, 0), compute_loss=lambda m, b: _two_input_loss(m, b)[0],
            config=_cfg(batch_size=16, steps=3, log_every=1))
    assert len(h.records) == 3 and all(r["loss"] > 0 for r in h.records)


class DictOfLosses(nn.Module):
    """Returns {"loss": total, "ce": ..., "l2": ...}: the total is what trains."""

    def __init__(self):
        super().__init__()
        self.net = nn.Linear(4, 2)

    def forward(self, x, y):
        ce = F.cross_entropy(self.net(x), y)
        l2 = 1e-3 * self.net.weight.pow(2).sum()
        return {"loss": ce + l2, "ce": ce, "l2": l2}


def test_a_model_returning_a_dict_of_losses():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 4, generator=g)
    data = {"x": x, "y": (x[:, 0] > 0).long()}
    torch.manual_seed(0)
    model = DictOfLosses()
    ref = copy.deepcopy(model)
    fit(model, data, optimizer=sgd(0.5), config=_cfg(batch_size=64, steps=1))
    out = ref(**data)
    out["loss"].backward()  # the total, not the first or any other entry
    with torch.no_grad():
        for p in ref.parameters():
            p -= 0.5 * p.grad
    assert_same_tensors(_params(model), _params(ref))


@dataclasses.dataclass
class Output:  # not a Mapping: only .loss and .logits
    loss: torch.Tensor
    logits: torch.Tensor


class ObjectOutput(nn.Module):
    def __init__(self):
        super().__init__()
        self.net = nn.Linear(4, 3)

    def forward(self, x, labels):
        logits = self.net(x)
        return Output(F.cross_entropy(logits, labels), logits)


def test_a_model_returning_an_object_with_loss_and_logits():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(300, 4, generator=g)
    data = {"x": x, "labels": (x[:, 0] > 0).long() + (x[:, 1] > 0.5).long()}
    torch.manual_seed(0)
    model = ObjectOutput()
    h = fit(model, data, eval_data=data, metrics={"acc": MulticlassAccuracy(num_classes=3, average="micro")},
            optimizer=sgd(0.5), config=_cfg(batch_size=50, steps=3, log_every=1))
    assert h.records[0]["loss"] > h.records[-1]["loss"]
    with torch.no_grad():
        by_hand = (model.net(x).argmax(1) == data["labels"]).float().mean().item()
    assert h.records[-1]["eval_acc"] == pytest.approx(by_hand, abs=1e-6)


def test_no_loss_names_the_three_ways():
    model = nn.Linear(4, 2)  # returns logits: no loss of its own
    with pytest.raises(DataError) as e:
        fit(model, {"input": torch.randn(8, 4)}, config=_cfg(batch_size=4, steps=1))
    msg = str(e.value)
    assert "dict with keys input" in msg
    for way in ("compute_loss=", "loss_fn=", ".loss", "'loss'"):
        assert way in msg, (way, msg)
    with pytest.raises(DataError, match="must be a pair .*compute_loss="):
        fit(DictOfLosses(), {"x": torch.randn(8, 4), "y": torch.zeros(8, dtype=torch.long)},
            loss_fn=nn.CrossEntropyLoss(), config=_cfg(batch_size=4, steps=1))


# ---------------------------------------------------------------- batch containers

Sample = collections.namedtuple("Sample", "x y")


@dataclasses.dataclass
class Batch:
    x: torch.Tensor
    y: torch.Tensor
    note: str = "kept"


class TakesContainer(nn.Module):
    """model(batch) for a namedtuple or dataclass batch; returns its own loss."""

    def __init__(self):
        super().__init__()
        self.net = nn.Linear(4, 2)
        self.seen = set()

    def forward(self, batch):
        self.seen.add(type(batch).__name__)
        if isinstance(batch, Batch):
            assert batch.note == "kept"
        return F.cross_entropy(self.net(batch.x), batch.y)


def _pair_data(n=48, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 4, generator=g)
    return x, (x[:, 0] > 0).long()


def test_namedtuple_and_dataclass_batches_train_like_pairs():
    x, y = _pair_data()
    torch.manual_seed(0)
    ref = TakesContainer()
    start = copy.deepcopy(ref)
    fit(ref.net, (x, y), loss_fn=nn.CrossEntropyLoss(), optimizer=sgd(), config=_cfg(batch_size=48, steps=2))

    as_namedtuples = [Sample(x[i], y[i]) for i in range(len(x))]  # a Dataset (list) of namedtuples
    m1 = copy.deepcopy(start)
    fit(m1, DataLoader(as_namedtuples, batch_size=48), optimizer=sgd(), config=_cfg(batch_size=48, steps=2))
    m2 = copy.deepcopy(start)
    loader = DataLoader(list(range(len(x))), batch_size=48, collate_fn=lambda idx: Batch(x[idx], y[idx]))
    fit(m2, loader, optimizer=sgd(), config=_cfg(batch_size=48, steps=2))
    assert m1.seen == {"Sample"} and m2.seen == {"Batch"}
    assert_same_tensors(_params(m1.net), _params(ref.net))
    assert_same_tensors(_params(m2.net), _params(ref.net))


class SeesBatchType(nn.Module):
    def __init__(self):
        super().__init__()
        self.net = nn.Linear(4, 2)

    def forward(self, x, labels):
        return {"loss": F.cross_entropy(self.net(x), labels)}


def test_batch_encoding_columns_and_loader_batches():
    x, y = _pair_data()
    torch.manual_seed(0)
    start = SeesBatchType()
    seen = []

    def recording(model, batch):
        seen.append(type(batch).__name__)
        return model(**batch)["loss"]

    ref = copy.deepcopy(start)
    fit(ref, {"x": x, "labels": y}, optimizer=sgd(), config=_cfg(batch_size=48, steps=2))
    m1 = copy.deepcopy(start)  # columns given as a BatchEncoding, kept whole and sliced
    fit(m1, transformers.BatchEncoding({"x": x, "labels": y}), compute_loss=recording, optimizer=sgd(),
        config=_cfg(batch_size=48, steps=2))
    m2 = copy.deepcopy(start)  # a DataLoader whose collate returns a BatchEncoding, as HF collators do
    loader = DataLoader(list(range(len(x))), batch_size=48,
                        collate_fn=lambda idx: transformers.BatchEncoding({"x": x[idx], "labels": y[idx]}))
    fit(m2, loader, compute_loss=recording, optimizer=sgd(), config=_cfg(batch_size=48, steps=2))
    assert seen == ["BatchEncoding"] * 4
    assert_same_tensors(_params(m1), _params(ref))
    assert_same_tensors(_params(m2), _params(ref))


# ---------------------------------------------------------------- weighting: accumulation, num_items, OOM

def test_accumulation_24_plus_16_equals_one_batch_of_40():
    x, y = _pair_data(40)
    torch.manual_seed(0)
    start = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))
    whole, accumulated = copy.deepcopy(start), copy.deepcopy(start)
    fit(whole, (x, y), loss_fn=nn.CrossEntropyLoss(), optimizer=sgd(1.0), config=_cfg(batch_size=40, steps=1))
    h = fit(accumulated, (x, y), loss_fn=nn.CrossEntropyLoss(), optimizer=sgd(1.0),
            config=_cfg(batch_size=24, accumulate=2, steps=1))
    assert h.summary["samples"] == 40  # micro-batches of 24 and 16
    assert_same_tensors(_params(accumulated), _params(whole))


class TokenModel(nn.Module):
    """A per-token classifier whose loss is the mean over non-padding tokens (labels -100)."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(V, 16)
        self.out = nn.Linear(16, V)

    def forward(self, input_ids, labels):
        logits = self.out(torch.tanh(self.emb(input_ids)))
        return {"loss": F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=-100), "logits": logits}


def _padded_tokens(n, seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, V, (n, T), generator=g)
    lengths = torch.randint(1, T + 1, (n,), generator=g)
    pad = torch.arange(T)[None, :] >= lengths[:, None]
    ids[pad] = 0
    labels = torch.roll(ids, -1, dims=1).masked_fill(pad | torch.roll(pad, -1, dims=1), -100)
    return {"input_ids": ids, "labels": labels}


def _step_by_hand(model, data, lr):
    """One SGD step on the mean loss over every non-padding token of `data`."""
    out = model.out(torch.tanh(model.emb(data["input_ids"])))
    loss = F.cross_entropy(out.flatten(0, 1), data["labels"].flatten(), ignore_index=-100, reduction="sum")
    (loss / (data["labels"] != -100).sum()).backward()
    with torch.no_grad():
        for p in model.parameters():
            p -= lr * p.grad


def test_num_items_weights_the_step_by_non_padding_tokens():
    data = _padded_tokens(40)
    torch.manual_seed(0)
    start = TokenModel()
    ref = copy.deepcopy(start)
    _step_by_hand(ref, data, lr=1.0)
    model = copy.deepcopy(start)
    fit(model, data, num_items=lambda b: (b["labels"] != -100).sum(), optimizer=sgd(1.0),
        config=_cfg(batch_size=24, accumulate=2, steps=1))
    assert_same_tensors(_params(model), _params(ref))
    by_samples = copy.deepcopy(start)  # without num_items the micro-batches weigh by samples: not the same
    fit(by_samples, data, optimizer=sgd(1.0), config=_cfg(batch_size=24, accumulate=2, steps=1))
    assert not torch.allclose(_params(by_samples)["emb.weight"], _params(ref)["emb.weight"], atol=1e-6)


class OOMAbove(nn.Module):
    """Raises the allocator's OOM error for batches larger than `limit` (a fake memory limit)."""

    def __init__(self, inner, limit):
        super().__init__()
        self.inner, self.limit, self.ooms, self.sizes = inner, limit, 0, []

    def forward(self, input_ids, labels, temperature, note):
        assert note == "kept" and temperature.dim() == 0  # leaves without the batch dimension are shared
        if input_ids.shape[0] > self.limit:
            self.ooms += 1
            raise torch.OutOfMemoryError(f"CUDA out of memory. Tried to allocate {input_ids.shape[0]} samples")
        self.sizes.append(input_ids.shape[0])
        return self.inner(input_ids, labels)


def test_oom_split_of_dict_batches_equals_no_split():
    data = _padded_tokens(32, seed=3)

    def loader():
        return DataLoader(list(range(32)), batch_size=32, collate_fn=lambda idx: {
            "input_ids": data["input_ids"][idx], "labels": data["labels"][idx],
            "temperature": torch.tensor(1.0), "note": "kept"})

    torch.manual_seed(0)
    start = TokenModel()
    items = lambda b: (b["labels"] != -100).sum()  # noqa: E731
    ref, small = OOMAbove(copy.deepcopy(start), 1000), OOMAbove(copy.deepcopy(start), 10)
    fit(ref, loader(), num_items=items, optimizer=sgd(1.0), config=_cfg(batch_size=32, steps=2))
    h = fit(small, loader(), num_items=items, optimizer=sgd(1.0), config=_cfg(batch_size=32, steps=2))
    assert small.ooms >= 2 and max(small.sizes) <= 8 and h.summary["oom_splits"] == 4
    assert_same_tensors(_params(small.inner), _params(ref.inner))


# ---------------------------------------------------------------- metrics in every report

def test_eval_metrics_reach_history_metrics_files_and_summary(tmp_path):
    torch.manual_seed(0)
    train, test = _two_input_data(200, 0), _two_input_data(100, 1)
    test["labels"] = test.pop("y")
    train["labels"] = train.pop("y")

    def loss(model, batch):
        out = model(batch["a"], batch["b"])
        return F.cross_entropy(out, batch["labels"]), out

    def margin(outputs, batch):
        return {"mean": outputs.max(1).values.mean(), "min": outputs.max(1).values.min()}

    run_dir = tmp_path / "run"
    h = fit(TwoInputs(), train, compute_loss=loss, eval_data=test,
            metrics={"acc": MulticlassAccuracy(num_classes=2, average="micro"), "margin": margin},
            config=_cfg(batch_size=50, epochs=2, log_every=2, run_dir=str(run_dir)))
    keys = {"eval_loss", "eval_acc", "eval_margin_mean", "eval_margin_min"}
    last = h.records[-1]
    assert keys <= last.keys() and 0 <= last["eval_acc"] <= 1
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert keys <= rows[-1].keys() and rows[-1]["eval_acc"] == pytest.approx(last["eval_acc"])
    with open(run_dir / "metrics.csv") as f:
        assert keys <= set(next(csv.reader(f)))
    assert h.summary["final_eval_acc"] == pytest.approx(last["eval_acc"])
    assert "best_eval_margin_mean" in h.summary
    saved = json.loads((run_dir / "history.json").read_text())
    assert saved["summary"]["final_eval_acc"] == pytest.approx(last["eval_acc"])


def test_torchmetrics_see_logits_and_labels():
    """The torchmetric gets .logits of a HF-style output and batch['labels']; equal to computing by hand."""
    torch.manual_seed(0)
    train, test = _token_task(64, 1), _token_task(300, 2)
    model = _tiny_bert()
    h = fit(model, train, eval_data=test, metrics={"acc": MulticlassAccuracy(num_classes=2, average="micro")},
            config=_cfg(batch_size=32, steps=1))
    model.eval()
    with torch.no_grad():
        pred = model(**test).logits.argmax(1)
    assert h.records[-1]["eval_acc"] == pytest.approx((pred == test["labels"]).float().mean().item(), abs=1e-6)


# ---------------------------------------------------------------- CUDA graphs and user code

def test_hooks_switch_cuda_graphs_off_with_the_reason():
    cuda = torch.device("cuda")
    plain = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2))
    assert decide_speed(_cfg(), plain, cuda).cuda_graphs  # the control: graphs on without hooks

    hooked = copy.deepcopy(plain)
    handle = hooked[2].register_forward_hook(lambda m, i, o: None)
    s = decide_speed(_cfg(), hooked, cuda)
    assert not s.cuda_graphs and "module hooks on 2" in s.reasons["cuda_graphs"]
    assert "replay" in s.reasons["cuda_graphs"]
    handle.remove()

    back = copy.deepcopy(plain)
    back.register_full_backward_hook(lambda m, gi, go: None)
    s = decide_speed(_cfg(), back, cuda)
    assert not s.cuda_graphs and "(the model)" in s.reasons["cuda_graphs"]

    handle = torch.nn.modules.module.register_module_forward_hook(lambda m, i, o: None)
    try:
        s = decide_speed(_cfg(), plain, cuda)
        assert not s.cuda_graphs and "global module hooks" in s.reasons["cuda_graphs"]
    finally:
        handle.remove()
    assert decide_speed(_cfg(), plain, cuda).cuda_graphs


def test_the_graph_key_changes_with_structure_shape_dtype_and_plain_values():
    """What graphs.py keys captured graphs by: a change of any of these runs the batch anew."""
    base = {"ids": torch.zeros(4, 8, dtype=torch.long), "mask": torch.ones(4, 8), "mode": "train"}
    key = batches.signature(base)
    assert batches.signature({**base, "ids": torch.ones(4, 8, dtype=torch.long)}) == key  # values of tensors: same
    assert batches.signature({**base, "ids": torch.zeros(4, 9, dtype=torch.long)}) != key  # shape
    assert batches.signature({**base, "mask": torch.ones(4, 8, dtype=torch.bool)}) != key  # dtype
    assert batches.signature({**base, "mode": "eval"}) != key  # a non-tensor leaf
    assert batches.signature({**base, "extra": torch.zeros(4)}) != key  # structure
    assert batches.signature(transformers.BatchEncoding(base)) != key  # container type


# ---------------------------------------------------------------- user workloads on the command line

def test_user_workload_with_compute_loss_and_metrics_through_gputrain_fit(tmp_path, monkeypatch, capsys):
    (tmp_path / "byo_wl.py").write_text(textwrap.dedent("""
        import torch
        import torch.nn.functional as F
        from torch import nn
        from torchmetrics.classification import MulticlassAccuracy
        import gputrain
        from gputrain.workloads import DataSplits

        class TwoInputs(nn.Module):
            def __init__(self):
                super().__init__()
                self.a, self.b, self.head = nn.Linear(4, 16), nn.Linear(3, 16), nn.Linear(16, 2)

            def forward(self, a, b):
                return self.head(torch.relu(self.a(a) + self.b(b)))

        def data(n, seed):
            g = torch.Generator().manual_seed(seed)
            a, b = torch.randn(n, 4, generator=g), torch.randn(n, 3, generator=g)
            return {"a": a, "b": b, "labels": ((a[:, 0] + b[:, 0]) > 0).long()}

        def loss(model, batch):
            out = model(batch["a"], batch["b"])
            return F.cross_entropy(out, batch["labels"]), out

        def make():
            return gputrain.Workload(
                name="two-inputs", description="two inputs through compute_loss",
                make_data=lambda: DataSplits(train=data(300, 0), test=data(100, 1)),
                make_model=TwoInputs, loss_fn=None, task=None, compute_loss=loss,
                metrics={"acc": MulticlassAccuracy(num_classes=2, average="micro"),
                         "conf": lambda out, batch: {"conf": out.softmax(1).max(1).values.mean()}},
                defaults={"batch_size": 30, "epochs": 6, "lr": 0.01})
    """))
    monkeypatch.syspath_prepend(str(tmp_path))
    code = main(["fit", "byo_wl:make", "--device", "cpu", "--no-save", "--json"])
    summary = json.loads(capsys.readouterr().out)["summary"]
    assert code == 0 and summary["workload"] == "two-inputs"
    assert summary["loss"] == "compute_loss=loss"
    assert summary["final_eval_acc"] > 0.9 and 0.5 < summary["final_eval_conf"] <= 1


# ---------------------------------------------------------------- the docs' "Bring your own model"

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("name,floor", [("byo_pair", 0.9), ("byo_huggingface", 0.95), ("byo_two_inputs", 0.8)])
def test_the_own_model_examples_run_and_are_the_ones_the_docs_show(name, floor, capsys):
    path = ROOT / "docs" / "examples" / f"{name}.py"
    source = path.read_text().strip()
    page = docs_page("how-to/own-model.md")
    assert f"```python\n{source}\n```" in page, f"docs/how-to/own-model.md does not show {path}"
    runpy.run_path(str(path), run_name="__main__")
    printed = capsys.readouterr().out
    accuracy = float(re.search(r"eval accuracy ([0-9.]+)", printed).group(1))
    assert accuracy >= floor, printed
