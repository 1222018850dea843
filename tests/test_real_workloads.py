"""resnet18-cifar and gpt-mini: the full-size models' sizes, the token data, and short training runs
through gputrain.fit with tiny options (the loss must fall)."""

from __future__ import annotations

import math

import pytest
import torch

import gputrain
from gputrain.config import TrainConfig
from gputrain.errors import ConfigError, DataError
from gputrain.workloads import get_workload, list_workloads
from gputrain.workloads import text as textdata
from gputrain.workloads.real_models import GPTMini, ResNet18Cifar, next_token_loss


def count(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())  # a tied weight is one parameter: counted once


# ---------------------------------------------------------------- full-size models


def test_resnet18_cifar_has_resnet18s_parameters_and_shapes():
    model = ResNet18Cifar()
    # kuangliu/pytorch-cifar's ResNet18 (the usual CIFAR ResNet-18) has 11,173,962 parameters.
    assert count(model) == 11_173_962
    assert isinstance(model.stem[0], torch.nn.Conv2d) and model.stem[0].kernel_size == (3, 3)
    assert model.stem[0].stride == (1, 1)
    assert not any(isinstance(m, torch.nn.MaxPool2d) for m in model.modules())
    assert sum(1 for m in model.modules() if type(m).__name__ == "BasicBlock") == 8
    with torch.no_grad():
        assert model.eval()(torch.randn(2, 3, 32, 32)).shape == (2, 10)


def test_gpt_mini_parameter_count():
    V, T, L, C = 65, 256, 6, 384
    model = GPTMini(V, block_size=T, n_layer=L, n_embd=C, n_head=6)
    # Per block: qkv C*3C + 3C, proj C*C + C, fc C*4C + 4C, proj 4C*C + C, two LayerNorms 4C.
    per_block = 12 * C * C + 13 * C
    assert per_block == 1_774_464
    body = L * per_block + 2 * C  # + the final LayerNorm
    embeddings = V * C + T * C  # tokens (shared with the output layer) + positions
    assert count(model) == body + embeddings == 10_770_816
    assert model.head.weight is model.tok_emb.weight  # tied: the output layer adds nothing
    with torch.no_grad():
        logits = model.eval()(torch.randint(0, V, (2, 16)))
    assert logits.shape == (2, 16, V)


def test_gpt_is_causal():
    torch.manual_seed(0)
    model = GPTMini(11, block_size=8, n_layer=2, n_embd=16, n_head=2, dropout=0.0).eval()
    x = torch.randint(0, 11, (1, 8))
    y = x.clone()
    y[0, 5] = (x[0, 5] + 1) % 11  # change token 5: outputs before it must not move
    with torch.no_grad():
        a, b = model(x), model(y)
    assert torch.allclose(a[0, :5], b[0, :5], atol=1e-6)
    assert not torch.allclose(a[0, 5:], b[0, 5:], atol=1e-4)


def test_listed_with_their_sizes():
    rows = {r["name"]: r for r in list_workloads()}
    assert rows["resnet18-cifar"]["parameters"] == 11_173_962
    assert rows["resnet18-cifar"]["defaults"]["batch_size"] == 256
    assert rows["gpt-mini"]["parameters"] == 10_770_816
    assert rows["gpt-mini"]["defaults"]["batch_size"] == 64
    assert rows["gpt-mini"]["task"] is None  # loss only
    assert "text" in rows["gpt-mini"]["options"] and "data_dir" in rows["resnet18-cifar"]["options"]


# ---------------------------------------------------------------- token data


def test_windows_are_inputs_and_targets_shifted_by_one():
    tokens = torch.arange(50)
    x, y = textdata.windows(tokens, 8)
    assert x.shape == y.shape == (6, 8) and x.dtype == y.dtype == torch.int64
    assert torch.equal(y, x + 1)  # targets are the next token
    assert torch.equal(x[1], torch.arange(8, 16))  # non-overlapping
    assert textdata.windows(torch.arange(8), 8) is None  # 8 tokens give no target for the 8th


def test_synthetic_chain_is_learnable_with_a_known_floor():
    corpus, floor = textdata.synthetic_corpus(20_000, seed=3)
    assert corpus.tokens.shape == (20_000,) and corpus.vocab_size == 65
    assert 0.5 < floor < math.log(4)  # at most 4 successors each, far below log(65) = 4.17
    # The empirical conditional entropy of the sample is close to the chain's entropy rate.
    pairs = torch.zeros(65, 65)
    pairs.index_put_((corpus.tokens[:-1], corpus.tokens[1:]), torch.ones(19_999), accumulate=True)
    p = pairs / pairs.sum(1, keepdim=True).clamp_min(1)
    h = -(pairs * torch.where(p > 0, p.log(), torch.zeros_like(p))).sum() / pairs.sum()
    assert abs(float(h) - floor) < 0.05


def test_text_file_vocabulary_and_split(tmp_path):
    path = tmp_path / "t.txt"
    path.write_text("abcab" * 100)  # 500 characters
    corpus = textdata.load_char_corpus(path, block_size=16)
    assert corpus.chars == ["a", "b", "c"]
    assert corpus.decode(corpus.tokens[:5]) == "abcab"
    splits = textdata.corpus_splits(corpus, 16)
    assert splits.train[0].shape == ((450 - 1) // 16, 16)  # the first 90%
    assert splits.test[0].shape == ((50 - 1) // 16, 16)  # the last 10%


@pytest.mark.parametrize("content, words", [(None, "does not exist"), ("", "is empty"),
                                            ("short", "fewer than one context")])
def test_text_file_errors_name_the_path(tmp_path, content, words):
    path = tmp_path / "corpus.txt"
    if content is not None:
        path.write_text(content)
    w = get_workload("gpt-mini", text=str(path), block_size="16")
    with pytest.raises(DataError, match=words) as info:
        w.make_data()
    assert str(path) in str(info.value)


def test_folder_without_input_txt(tmp_path):
    with pytest.raises(DataError, match="no input.txt"):
        get_workload("gpt-mini", data_dir=str(tmp_path)).make_data()


def test_bad_options():
    with pytest.raises(ConfigError, match="multiple of n_head"):
        get_workload("gpt-mini", n_embd="30", n_head="4")
    with pytest.raises(ConfigError, match="width"):
        get_workload("resnet18-cifar", width="zero")


def test_next_token_loss_is_cross_entropy_over_all_tokens():
    logits = torch.randn(2, 3, 5)
    targets = torch.randint(0, 5, (2, 3))
    expected = sum(torch.nn.functional.cross_entropy(logits[b, t][None], targets[b, t][None])
                   for b in range(2) for t in range(3)) / 6
    assert torch.allclose(next_token_loss(logits, targets), expected)


# ---------------------------------------------------------------- training through gputrain.fit


def _fit(workload, **config):
    torch.manual_seed(0)
    data, model = workload.make_data(), workload.make_model()
    cfg = TrainConfig(device="cpu", precision="fp32", **config)
    history = gputrain.fit(model, data, loss_fn=workload.loss_fn, config=cfg, task=workload.task)
    return [r["loss"] for r in history.records], history


def test_resnet18_cifar_trains():
    # Noise images with random labels: a width-8 ResNet-18 (width 4 in channels_last crashes
    # torch 2.13 on the CPU: "double free") can only memorize 32 of them, which
    # makes the training loss fall from log(10) = 2.30.
    w = get_workload("resnet18-cifar", n="32", n_test="8", width="8")
    losses, history = _fit(w, batch_size=16, steps=30, lr=1e-2, log_every=5)
    assert losses[0] > 1.0  # the mean over the first 5 steps
    assert losses[-1] < 0.2 * losses[0], losses
    assert "eval_accuracy" in history.records[-1]
    # A conv net on the CPU: the user's layout by rule, never a timing (train/step/layout.py).
    assert history.summary["channels_last"] is False
    assert "a timing must not decide" in {d["name"]: d for d in history.summary["decisions"]}[
        "channels_last"]["reason"]


def _tiny_gpt(**options):
    return get_workload("gpt-mini", n_layer="1", n_embd="32", n_head="2", block_size="32", dropout="0", **options)


def test_gpt_mini_learns_the_synthetic_chain():
    w = _tiny_gpt(n_tokens="40000")
    floor = textdata.entropy_rate(textdata.markov_chain(65, textdata.SYNTHETIC_BRANCHING, 0))
    losses, history = _fit(w, batch_size=32, steps=150, lr=1e-2, log_every=25)
    assert losses[0] > floor + 1.0  # the mean over the first 25 steps, from log(65) = 4.17 down
    assert losses[-1] < floor + 0.25, (losses, floor)  # close to the best any model can do
    last = history.records[-1]
    assert last["eval_loss"] < floor + 0.25 and "eval_accuracy" not in last  # loss only


def test_gpt_mini_learns_a_text_file(tmp_path):
    path = tmp_path / "input.txt"
    path.write_text("the quick brown fox jumps over the lazy dog. " * 120)
    w = _tiny_gpt(data_dir=str(tmp_path))  # a folder holding input.txt
    assert w.make_model().tok_emb.num_embeddings == len(set(path.read_text()))
    losses, _ = _fit(w, batch_size=16, steps=100, lr=1e-2, log_every=20)
    assert losses[-1] < 0.3 * losses[0], losses
    assert losses[-1] < 0.5, losses  # the text repeats: almost every next character is certain
