"""`gputrain memory` (and the estimate under it) on any workload: dict batches whose model computes
its own loss, compute_loss workloads with several inputs, nested batches sliced and tiled leaf by leaf."""

from __future__ import annotations

import json
import textwrap

import pytest
import torch
from torch import nn

from gputrain.diagnostics.batch_search import batch_trial, find_max_batch
from gputrain.diagnostics.estimate import estimate_memory
from gputrain.diagnostics.probe import StepProbe, measure_step_memory
from gputrain.train.step.loss import LossRule

DICT_WL = textwrap.dedent("""
    import torch
    from torch import nn
    import gputrain
    from gputrain.workloads import DataSplits

    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.l1 = nn.Linear(4, 64)
            self.l2 = nn.Linear(64, 2)

        def forward(self, x, labels):
            return {'loss': nn.functional.cross_entropy(self.l2(torch.relu(self.l1(x))), labels)}

    def make():
        g = torch.Generator().manual_seed(0)
        x = torch.randn(32, 4, generator=g); y = torch.randint(0, 2, (32,), generator=g)
        return gputrain.Workload(name='dicts', description='t',
            make_data=lambda: DataSplits(train={'x': x, 'labels': y}),
            make_model=M, loss_fn=None, task=None, defaults={'batch_size': 8})
""")

TWO_INPUT_WL = textwrap.dedent("""
    import torch
    from torch import nn
    import gputrain
    from gputrain.workloads import DataSplits

    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.a = nn.Linear(4, 32)
            self.b = nn.Linear(6, 32)
            self.head = nn.Linear(32, 1)

        def forward(self, a, b):
            return self.head(torch.tanh(self.a(a) + self.b(b))).squeeze(-1)

    def compute_loss(model, batch):
        a, b, y = batch
        out = model(a, b)
        return nn.functional.mse_loss(out, y), out

    def make():
        g = torch.Generator().manual_seed(0)
        a = torch.randn(40, 4, generator=g); b = torch.randn(40, 6, generator=g); y = torch.randn(40, generator=g)
        return gputrain.Workload(name='two-inputs', description='t',
            make_data=lambda: DataSplits(train=(a, b, y)),
            make_model=M, loss_fn=None, compute_loss=compute_loss, task=None, defaults={'batch_size': 10})
""")


@pytest.fixture
def workloads(tmp_path, monkeypatch):
    (tmp_path / "dictwl_anyb.py").write_text(DICT_WL)
    (tmp_path / "twowl_anyb.py").write_text(TWO_INPUT_WL)
    monkeypatch.syspath_prepend(str(tmp_path))
    return tmp_path


def _memory(argv, capsys) -> dict:
    from gputrain.cli import main

    code = main(["memory", *argv, "--device", "cpu", "--json"])
    out = capsys.readouterr().out
    assert code == 0, out
    return json.loads(out)


@pytest.mark.parametrize("spec, name", [("dictwl_anyb:make", "dicts"), ("twowl_anyb:make", "two-inputs")])
def test_memory_command_estimates_workloads_of_any_batch(workloads, capsys, spec, name):
    report = _memory([spec], capsys)
    est = report["estimate"]
    assert report["workload"] == name
    assert est["activation_bytes"] > 0 and est["activation_bytes_per_sample"] > 0
    assert report["measured"]["peak_bytes"] > est["parameter_bytes"]
    # the activations grow with the batch: the two measured points and the estimate at a larger batch
    small, half = est["measured_activation_bytes"]
    assert small > half > 0
    big = _memory([spec, "--batch-size", "64"], capsys)["estimate"]
    assert big["activation_bytes"] > est["activation_bytes"]
    assert big["activation_bytes"] == pytest.approx(
        est["activation_bytes_fixed"] + est["activation_bytes_per_sample"] * 64, rel=0.01)


@pytest.mark.parametrize("spec", ["dictwl_anyb:make", "twowl_anyb:make"])
def test_find_max_with_a_limit_is_finite_for_any_batch(workloads, capsys, spec):
    search = _memory([spec, "--find-max", "--limit", "2MiB"], capsys)["max_batch"]
    assert 1 <= search["result"] < search["limit"]
    assert search["predicted_from_estimate"] > 0


def test_memory_command_says_which_workloads_it_estimates(tmp_path, monkeypatch, capsys):
    """Moved from test_reporting.py: the dict workload it refused is now estimated; data that are not
    tensor columns (a Dataset) are still refused in one line."""
    from gputrain.cli import main

    (tmp_path / "dictwl.py").write_text(
        "import torch\nfrom torch import nn\nimport gputrain\nfrom gputrain.workloads import DataSplits\n"
        "class M(nn.Module):\n"
        "    def __init__(self):\n        super().__init__(); self.l = nn.Linear(4, 2)\n"
        "    def forward(self, x, labels):\n        return {'loss': nn.functional.cross_entropy(self.l(x), labels)}\n"
        "def make():\n"
        "    x = torch.randn(32, 4); y = torch.randint(0, 2, (32,))\n"
        "    return gputrain.Workload(name='dicts', description='t', make_data=lambda: DataSplits(train={'x': x, 'labels': y}),\n"
        "        make_model=M, loss_fn=None, task=None)\n")
    (tmp_path / "dswl_anyb.py").write_text(
        "import torch\nfrom torch import nn\nimport gputrain\nfrom gputrain.workloads import DataSplits\n"
        "class DS(torch.utils.data.Dataset):\n"
        "    def __len__(self):\n        return 8\n"
        "    def __getitem__(self, i):\n        return {'x': torch.randn(4), 'labels': torch.tensor(0)}\n"
        "def make():\n"
        "    return gputrain.Workload(name='ds', description='t', make_data=lambda: DataSplits(train=DS()),\n"
        "        make_model=lambda: nn.Linear(4, 2), loss_fn=None, task=None)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert main(["memory", "dictwl:make", "--device", "cpu", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["workload"] == "dicts" and report["estimate"]["activation_bytes"] > 0
    assert main(["memory", "dswl_anyb:make", "--device", "cpu"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "gputrain profile" in err


def test_the_estimate_takes_a_loss_rule_or_a_callable_and_halves_every_leaf():
    torch.manual_seed(0)

    class Own(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Linear(8, 128), nn.Linear(8, 128)

        def forward(self, a, b, labels):
            h = torch.relu(self.a(a)) * torch.relu(self.b(b))
            return {"loss": nn.functional.cross_entropy(h, labels)}

    model = Own()
    batch = {"a": torch.randn(16, 8), "b": torch.randn(16, 8), "labels": torch.randint(0, 128, (16,))}
    rule = estimate_memory(model, batch, loss=LossRule())
    call = estimate_memory(model, batch, loss=lambda m, b: m(**b)["loss"])
    assert rule["activation_bytes"] == call["activation_bytes"] > 0
    # every leaf of the half batch is halved (a leaf left whole would not grow with the batch)
    assert rule["measured_batches"] == [16, 8]
    full, half = rule["measured_activation_bytes"]
    assert full == pytest.approx(2 * half, rel=0.05)
    # the real step and the search run on dict batches too
    step = measure_step_memory(model, batch, loss=LossRule())
    assert step["batch_size"] == 16 and step["peak_bytes"] > rule["parameter_bytes"]
    make = lambda b: {k: v[torch.arange(b) % 16] for k, v in batch.items()}  # noqa: E731
    limit = measure_step_memory(model, make(40), loss=LossRule())["peak_bytes"]
    with StepProbe(model, LossRule(), precision="fp32") as probe:
        found = find_max_batch(batch_trial(probe, make, limit_bytes=limit), start=4, limit=1000)
    assert 40 <= found < 1000
