"""The "What fit decides for you" rows (docs/explanations/decisions.md) whose choice changes numbers on the
CPU: fit's own AdamW (fused kernel, weight-decay groups) against the hand loop a user would write, within the
stated bound."""

import copy

import torch
import torch.nn.functional as F
from torch import nn

import gputrain

# Fused and for-loop AdamW compute the same update in another order: float32 rounding only.
ADAMW_RTOL, ADAMW_ATOL = 1e-5, 1e-7


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 16), nn.LayerNorm(16), nn.ReLU(), nn.Linear(16, 3))


def _batches():
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(8, 6, generator=g), torch.randint(0, 3, (8,), generator=g)) for _ in range(5)]


def _hand(model, optimizer):
    for x, y in _batches():
        optimizer.zero_grad()
        F.cross_entropy(model(x), y).backward()
        optimizer.step()


def _close(a: nn.Module, b: nn.Module) -> None:
    for (name, p), q in zip(a.named_parameters(), b.parameters()):
        torch.testing.assert_close(p, q, rtol=ADAMW_RTOL, atol=ADAMW_ATOL, msg=name)


def test_fits_fused_adamw_stays_within_rounding_of_a_hand_adamw():
    model = _model()
    mine = copy.deepcopy(model)
    # fit's AdamW takes TrainConfig.weight_decay, 0.0 by default (torch's AdamW defaults to 0.01)
    _hand(mine, torch.optim.AdamW(mine.parameters(), lr=1e-2, weight_decay=0.0, foreach=False))
    history = gputrain.fit(model, _batches(), loss_fn=F.cross_entropy, config=gputrain.TrainConfig(steps=5, lr=1e-2))
    assert {d["name"]: d for d in history.summary["decisions"]}["optimizer"]["value"].startswith("AdamW (fused")
    _close(model, mine)


def test_weight_decay_groups_are_the_hand_loop_with_biases_and_norm_weights_undecayed():
    model = _model()
    mine = copy.deepcopy(model)
    decay = [p for n, p in mine.named_parameters() if n in ("0.weight", "3.weight")]
    rest = [p for n, p in mine.named_parameters() if n not in ("0.weight", "3.weight")]
    _hand(mine, torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}],
                                  lr=1e-2, foreach=False))
    gputrain.fit(model, _batches(), loss_fn=F.cross_entropy,
                 config=gputrain.TrainConfig(steps=5, lr=1e-2, weight_decay=0.1))
    _close(model, mine)
    plain = copy.deepcopy(_model())  # the groups are a change: decaying every parameter ends elsewhere
    _hand(plain, torch.optim.AdamW(plain.parameters(), lr=1e-2, weight_decay=0.1, foreach=False))
    assert not torch.allclose(plain[1].weight, model[1].weight, rtol=ADAMW_RTOL, atol=ADAMW_ATOL)
