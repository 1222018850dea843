"""batch.py: move() over nested containers and modules; optimizer state; check_devices naming the tensors;
head() and tile() cutting every leaf that carries the batch dimension."""

import collections
import dataclasses

import pytest
import torch
from torch import nn

from gputrain import DeviceError, check_devices, move, move_optimizer_state
from gputrain.batch import head, tile

META = torch.device("meta")
Pair = collections.namedtuple("Pair", "inputs targets")


@dataclasses.dataclass
class Batch:
    x: torch.Tensor
    extra: dict
    tag: str = "keep"


def test_move_nested_structures_to_another_device():
    x, y = torch.randn(2, 3), torch.arange(2)
    obj = {"pair": Pair(x, y), "list": [x, (y, "text", 3)], "dc": Batch(x, {"y": y}),
           "od": collections.OrderedDict(a=x), "dd": collections.defaultdict(list, b=[y])}
    out = move(obj, META)
    assert out["pair"].inputs.device == META and isinstance(out["pair"], Pair)
    assert out["list"][0].device == META and out["list"][1][1:] == ("text", 3)
    assert isinstance(out["dc"], Batch) and out["dc"].x.device == META and out["dc"].extra["y"].device == META
    assert out["dc"].tag == "keep"
    assert isinstance(out["od"], collections.OrderedDict) and out["od"]["a"].device == META
    assert isinstance(out["dd"], collections.defaultdict) and out["dd"]["b"][0].device == META
    assert x.device.type == "cpu"  # the originals are untouched


def test_move_module_in_place_and_returns_it():
    m = nn.Linear(3, 2)
    assert move(m, META) is m
    assert m.weight.device == META


def test_move_to_the_device_it_is_on_keeps_the_objects():
    x, m = torch.randn(2), nn.Linear(3, 2)
    out = move({"x": x, "model": m, "pair": Pair(x, [x])}, "cpu")
    assert out["x"] is x and out["model"] is m and out["pair"].targets[0] is x  # .to is a no-op: no copies
    assert m.weight.device.type == "cpu"


def test_move_optimizer_state_follows_the_model():
    m = nn.Linear(3, 2)
    opt = torch.optim.AdamW(m.parameters())
    m(torch.randn(4, 3)).sum().backward()
    opt.step()
    move_optimizer_state(opt, META)
    state = opt.state[m.weight]
    assert state["exp_avg"].device == META and state["exp_avg_sq"].device == META
    assert state["step"].device.type == "cpu"  # scalar step counters stay on the host for non-fused Adam


def test_check_devices_passes_and_returns_the_device():
    m = nn.Linear(3, 2)
    assert check_devices(m, {"x": torch.randn(1, 3)}) == torch.device("cpu")


def test_check_devices_names_parameter_and_input():
    m = nn.Sequential(nn.Linear(3, 2))
    batch = {"image": torch.randn(1, 3, device=META), "label": torch.zeros(1)}
    with pytest.raises(DeviceError) as e:
        check_devices(m, batch)
    msg = str(e.value)
    assert "parameter 0.weight is on cpu" in msg and "input batch['image'] is on meta" in msg
    assert "gputrain.move(batch, 'cpu')" in msg


def test_check_devices_names_a_split_model():
    m = nn.Sequential(nn.Linear(3, 2), nn.BatchNorm1d(2))
    m[1].to(META)
    with pytest.raises(DeviceError, match="parameter 0.weight is on cpu but parameter 1.weight is on meta"):
        check_devices(m, torch.randn(1, 3))


def test_move_modules_inside_containers_and_keeps_other_values():
    m = nn.Linear(3, 2)
    out = move({"model": m, "steps": 3, "name": None, "xs": (torch.zeros(1),)}, "meta")
    assert out["model"] is m and m.weight.device == META
    assert out["steps"] == 3 and out["name"] is None and isinstance(out["xs"], tuple) and out["xs"][0].device == META


def test_check_devices_names_inputs_on_two_devices_for_a_parameterless_model():
    batch = [torch.zeros(1), Pair(torch.zeros(1, device=META), 0)]
    with pytest.raises(DeviceError) as e:
        check_devices(nn.ReLU(), batch)
    assert str(e.value) == "the inputs are on different devices: batch[0] is on cpu but batch[1].inputs is on meta"


def test_check_devices_with_no_tensors_returns_none():
    assert check_devices(nn.ReLU(), {"n": 3}) is None


def test_head_and_tile_cut_every_leaf_with_the_batch_dimension():
    a, b, labels = torch.randn(16, 8), torch.randn(16, 8), torch.arange(16)
    cut = head({"p": (a, [b]), "labels": labels, "k": torch.tensor(3.0)}, 5)
    assert cut["p"][0].shape[0] == cut["p"][1][0].shape[0] == cut["labels"].shape[0] == 5
    assert cut["k"].dim() == 0  # no batch dimension: passed through
    tiled = tile({"a": a[:3], "labels": labels[:3], "table": torch.ones(4, 2)}, 7)
    assert tiled["a"].shape[0] == tiled["labels"].shape[0] == 7
    assert torch.equal(tiled["a"][3:6], a[:3]) and torch.equal(tiled["labels"], torch.tensor([0, 1, 2, 0, 1, 2, 0]))
    assert tiled["table"].shape == (4, 2)  # dim 0 is not the batch's: shared, not tiled


def test_split_and_map_keep_a_dataclass_batch_a_dataclass():
    """A dataclass batch goes through the pytree walk (split for accumulation and OOM halving,
    map_tensors): each part is the same dataclass, its tensors cut along dim 0, plain fields shared."""
    from gputrain.batch import map_tensors, split

    b = Batch(torch.arange(6.0).unsqueeze(1), {"y": torch.arange(6), "scale": torch.tensor(2.0)}, tag="t")
    parts = split(b, 3)
    assert [type(p) for p in parts] == [Batch] * 3
    assert [p.x.squeeze(1).tolist() for p in parts] == [[0.0, 1.0], [2.0, 3.0], [4.0, 5.0]]
    assert [p.extra["y"].tolist() for p in parts] == [[0, 1], [2, 3], [4, 5]]
    assert all(p.extra["scale"] is b.extra["scale"] and p.tag == "t" for p in parts)  # no batch dim: shared
    doubled = map_tensors(lambda t: t * 2, b)
    assert isinstance(doubled, Batch) and doubled.x[-1].item() == 10.0 and doubled.tag == "t"
