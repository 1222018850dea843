"""The step probe (diagnostics/probe.py) is the step fit runs: for the same config it has the Trainer's
optimizer (type, fused/foreach/capturable), the same speed switches, recompute and compile; it feeds
the step batches shaped as fit's loader makes them; and its lr 0 leaves the weights as they were."""

import pytest
import torch
from helpers import data, mlp, params, tiny_workload
from torch import nn

from gputrain.config import TrainConfig
from gputrain.diagnostics.probe import StepProbe, probe_batches
from gputrain.train import Trainer
from gputrain.train.step.loss import LossRule

FLAGS = ("fused", "foreach", "capturable", "weight_decay", "differentiable", "amsgrad", "betas", "eps")


class Blocks(nn.Module):
    """Repeated blocks: what recompute wraps when no names are given."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.stem = nn.Linear(6, 16)
        self.blocks = nn.Sequential(*[nn.Sequential(nn.Linear(16, 16), nn.ReLU()) for _ in range(3)])
        self.head = nn.Linear(16, 3)

    def forward(self, x):
        return self.head(self.blocks(self.stem(x)))


def _pair(make_model, train_data, config):
    """(the Trainer fit would build, the probe for the same model class and config)."""
    trainer = Trainer(make_model(), train_data, loss_fn=nn.CrossEntropyLoss(), config=config)
    probe = StepProbe(make_model(), LossRule(nn.CrossEntropyLoss()), config)
    return trainer, probe


CONFIGS = [
    ("conv net, defaults", dict()),
    ("conv net, no fused optimizer, weight decay", dict(fused_optimizer=False, weight_decay=0.1)),
    ("conv net, channels_last off, bf16", dict(channels_last=False, precision="bf16")),
    ("conv net, compiled", dict(compile=True, compile_mode="max-autotune-no-cudagraphs")),
    ("blocks, recompute", dict(recompute=True, max_grad_norm=1.0)),
    ("blocks, recompute named blocks", dict(recompute=["blocks.0", "blocks.2"])),
]


@pytest.mark.parametrize("name, changes", CONFIGS, ids=[c[0] for c in CONFIGS])
def test_the_probe_builds_the_trainers_step(name, changes):
    config = TrainConfig(device="cpu", batch_size=16, steps=1, **changes)
    if name.startswith("conv"):
        w = tiny_workload()
        trainer, probe = _pair(w.make_model, w.make_data(), config)
    else:
        trainer, probe = _pair(Blocks, data(64), config)
    try:
        assert type(probe.optimizer) is type(trainer.parts.optim.optimizer)
        assert ({k: v for k, v in probe.optimizer.defaults.items() if k in FLAGS}
                == {k: v for k, v in trainer.parts.optim.optimizer.defaults.items() if k in FLAGS})
        assert probe.optimizer_desc == trainer.parts.optim.optimizer_desc
        assert probe.optimizer.param_groups[0]["lr"] == 0.0  # the probe's only difference: lr 0
        assert probe.speed.decisions() == trainer.parts.speed.decisions()
        assert probe.precision.precision == trainer.parts.precision.precision
        assert probe.recomputed == trainer.parts.model.recomputed
        assert type(probe.model) is type(trainer.parts.model.model)  # compiled (OptimizedModule) or not
        layouts = [[p.is_contiguous(memory_format=torch.channels_last) for p in m.parameters() if p.dim() == 4]
                   for m in (probe.module, trainer.parts.model.module)]
        assert layouts[0] == layouts[1]
        assert probe.train_step.max_grad_norm == trainer.parts.step.body.max_grad_norm
        assert not probe.train_step.micro.oom_recovery  # an out-of-memory error is the probe's finding
    finally:
        probe.close()
        trainer.close()


def test_probe_batches_are_shaped_as_fits_batches():
    w = tiny_workload()
    config = TrainConfig(device="cpu", batch_size=32, steps=1)
    trainer = Trainer(w.make_model(), w.make_data(), loss_fn=w.loss_fn, config=config)
    with StepProbe(w.make_model(), LossRule(w.loss_fn), config) as probe:
        batches = probe_batches(w.make_data(), probe)
        assert batches is not None and batches.n == 256
        (x, y), = trainer.next_step_batches()
        px, py = batches(32)
        assert (px.shape, px.dtype, py.shape, py.dtype) == (x.shape, x.dtype, y.shape, y.dtype)
        assert px.is_contiguous(memory_format=torch.channels_last) == x.is_contiguous(memory_format=torch.channels_last)
        assert abs(float(px.mean())) < 0.5  # normalized as fit normalizes (uint8 -> about N(0, 1))
        assert batches(300)[0].shape[0] == 300  # a batch larger than the data set repeats it
    trainer.close()
    from gputrain.workloads.base import DataSplits

    class Samples(torch.utils.data.Dataset):  # a Dataset, not tensor columns: it cannot be cut to any size
        def __len__(self):
            return 8

        def __getitem__(self, i):
            return torch.zeros(6), 0

    with StepProbe(mlp(), LossRule(nn.CrossEntropyLoss()), config) as probe:
        assert probe_batches(DataSplits(train=Samples()), probe) is None


def test_the_probes_steps_leave_the_weights_and_measure_on_the_cpu():
    m = mlp()
    before = params(m).clone()
    with StepProbe(m, LossRule(nn.CrossEntropyLoss()), TrainConfig(device="cpu")) as probe:
        x, y = data(32)
        probe.step((x, y))
        small, big = probe.measure((x[:8], y[:8])), probe.measure((x, y))
    assert torch.equal(params(m), before)  # lr 0: AdamW's state is made, the weights stay
    assert not small["measured"] and small["batch_size"] == 8
    weights = before.numel() * 4
    assert weights * 4 <= small["peak_bytes"] < big["peak_bytes"]  # weights, gradients, 2 moments, activations


@pytest.mark.gpu
def test_on_cuda_the_probe_captures_the_step_as_fit_does():
    w = tiny_workload()
    config = TrainConfig(device="cuda", batch_size=32, steps=1)
    trainer = Trainer(w.make_model(), w.make_data(), loss_fn=w.loss_fn, config=config)
    with StepProbe(w.make_model().cuda(), LossRule(w.loss_fn), config) as probe:
        assert probe.speed.decisions() == trainer.parts.speed.decisions() and probe.speed.cuda_graphs
        assert probe.optimizer.defaults["capturable"] == trainer.parts.optim.optimizer.defaults["capturable"] is True
        batches = probe_batches(w.make_data(), probe)
        assert batches is not None
        probe.step(batches(32))
        assert probe._graphed is not None and probe._graphed.graphs  # warmed up and captured
        assert probe.measure(batches(32))["measured"]
    trainer.close()
