"""What a GPU does with the step, proven on the CPU: the feature matrix through the host-read
sentinel and the capture stand-in.

Every combination a user can turn on while CUDA graphs are eligible is trained twice on the CPU
through `fit`: once with the step captured and replayed with CUDA's semantics (tests/graph_capture.py:
the Python runs at capture only, Python numbers stay as captured), once with the same GraphedStep,
optimizer and data run eagerly every step (EagerGraphs). For each cell:

(a) the steady step reads nothing on the host: `watch_host_reads` (the dispatcher's view and the
    Python calls') counts 0 reads over 4 steps of the loop after the capture (the data, the step or
    its replay, the scheduler);
(b) the replayed run ends bit for bit where the eager one ends (weights, EMA weights, logged losses
    and learning rates), with the step replayed from its graph; or the run refuses graphs and names
    the reason in its log and summary.
"""

from __future__ import annotations

import logging

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import gputrain
from gputrain import TrainConfig, fit
from gputrain.data.splits import DataSplits
from torch.utils.data import DataLoader, Dataset
from gputrain.diagnostics.syncs import watch_host_reads
from gputrain.train.loop.trainer import Trainer

from graph_capture import CaptureGraphs, EagerGraphs
from helpers import data, DictNet, mlp, params

STEPS = 24  # 3 eager warm-up steps, the capture, 20 replays; log points at 8, 16, 24


class SetLrAt(gputrain.Callback):
    """Halves the learning rate at the first log point (a callback that changes the lr)."""

    def on_log(self, run, record):
        if record["step"] == 8:
            run.set_lr(run.lr / 2)


class StopAt(gputrain.Callback):
    def on_log(self, run, record):
        if record["step"] == 16:
            run.request_stop("enough")


class BatchNormNet(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.body = nn.Sequential(nn.Linear(6, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Dropout(0.3), nn.Linear(16, 3))

    def forward(self, x):
        return self.body(x)


class Rows(Dataset):
    """Samples one by one (no columns gputrain could keep on the device): batches arrive from the host."""

    def __init__(self, x, y):
        self.x, self.y = x, y

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        return self.x[i], self.y[i]


def _images():
    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, 256, (96, 1, 8, 8), dtype=torch.uint8, generator=g)
    y = torch.randint(0, 4, (96,), generator=g)
    return DataSplits(train=(x, y), mean=(127.5,), std=(64.0,), augment="crop-flip")


def _convnet():
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(1, 4, 3, padding=1), nn.ReLU(), nn.Flatten(), nn.Linear(4 * 8 * 8, 4))


def _capturable_adamw(lr):
    # a user's own capturable optimizer (fused, so that the CPU kernel reads its step counter itself)
    return lambda params: torch.optim.AdamW(params, lr=lr() if callable(lr) else lr, fused=True, capturable=True)


def _pairs():
    return {"model": mlp, "data": data, "loss_fn": nn.CrossEntropyLoss()}


def _step_lr(opt):
    return torch.optim.lr_scheduler.StepLR(opt, 5, gamma=0.5)


# name -> (fit arguments, expected): "on", or ("off", words of the reason)
CELLS = {
    "default step": ({}, "on"),
    "EMA (warm-up)": ({"callbacks": lambda: [gputrain.EMA(0.9)]}, "on"),
    "EMA (no warm-up)": ({"callbacks": lambda: [gputrain.EMA(0.9, warmup=False)]}, "on"),
    "StepLR": ({"scheduler": _step_lr}, "on"),
    "LambdaLR": ({"scheduler": lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1 / (1 + s))}, "on"),
    "OneCycleLR without momentum": ({"scheduler": lambda opt: torch.optim.lr_scheduler.OneCycleLR(
        opt, 0.05, total_steps=STEPS, cycle_momentum=False)}, "on"),
    "OneCycleLR with momentum": ({"scheduler": lambda opt: torch.optim.lr_scheduler.OneCycleLR(
        opt, 0.05, total_steps=STEPS)}, ("off", "cycle_momentum=True")),
    "CyclicLR with momentum": ({"scheduler": lambda opt: torch.optim.lr_scheduler.CyclicLR(
        opt, 0.001, 0.05, step_size_up=5)}, ("off", "cycle_momentum=True")),
    "CyclicLR without momentum": ({"scheduler": lambda opt: torch.optim.lr_scheduler.CyclicLR(
        opt, 0.001, 0.05, step_size_up=5, cycle_momentum=False)}, "on"),
    "cosine with warm-up": ({"config": {"schedule": "cosine", "warmup_steps": 6}}, "on"),
    "linear with warm-up": ({"config": {"schedule": "linear", "warmup_steps": 6}}, "on"),
    "onecycle (built-in)": ({"config": {"schedule": "onecycle"}}, "on"),
    "callback sets the lr": ({"callbacks": lambda: [SetLrAt()]}, "on"),
    "callback stops": ({"callbacks": lambda: [StopAt()]}, "on"),
    "EarlyStopping": ({"callbacks": lambda: [gputrain.EarlyStopping("eval_loss", patience=1)],
                       "eval": True, "config": {"eval_every": 4, "log_every": 4}}, "on"),
    "on_nan skip": ({"config": {"on_nan": "skip"}}, "on"),
    "clipping": ({"config": {"max_grad_norm": 0.5}}, "on"),
    "clipping and on_nan skip": ({"config": {"max_grad_norm": 0.5, "on_nan": "skip"}}, "on"),
    "dropout and batch norm": ({"model": BatchNormNet}, "on"),
    "resident images, assembled and augmented in the graph": (
        {"model": _convnet, "data": _images, "loss_fn": nn.CrossEntropyLoss()}, "on"),
    "a user's DataLoader, batches copied into the graph's buffers": (
        {"data": lambda: DataLoader(Rows(*data(256)), batch_size=16, shuffle=True)}, "on"),
    "dict batches, the model's own loss": (
        {"model": DictNet, "data": lambda: dict(zip(("features", "labels"), data())), "loss_fn": None}, "on"),
    "dict batches with a text leaf": (
        {"model": DictNet, "loss_fn": None,
         "compute_loss": lambda model, batch: model(batch["features"], batch["labels"])["loss"],
         "data": lambda: [{"features": x, "labels": y, "source": "a"} for x, y in zip(*(t.split(16) for t in data()))]},
        "on"),
    "bf16 autocast": ({"config": {"precision": "bf16"}}, "on"),
    "compute_loss": ({"compute_loss": lambda model, batch: (F.cross_entropy(model(batch[0]), batch[1]), None),
                      "loss_fn": None}, "on"),
    "num_items": ({"num_items": lambda batch: (batch[1] > 0).sum()}, "on"),
    "your capturable optimizer (tensor lr)": (
        {"optimizer": _capturable_adamw(lambda: torch.tensor(0.01)), "scheduler": _step_lr}, "on"),
    "your capturable optimizer (float lr) with a schedule": (
        {"optimizer": _capturable_adamw(0.01), "scheduler": _step_lr},
        ("off", "'lr' (group 0) changed")),
}


def _fit_kwargs(spec: dict) -> tuple[nn.Module, object, dict, dict]:
    spec = {**_pairs(), **spec}
    model, train = spec["model"](), spec["data"]()
    kwargs = {k: spec[k] for k in ("loss_fn", "compute_loss", "num_items", "scheduler") if k in spec}
    if "optimizer" in spec:
        kwargs["optimizer"] = spec["optimizer"](model.parameters())  # an instance: a factory is never captured
    if "callbacks" in spec:
        kwargs["callbacks"] = spec["callbacks"]()
    if spec.get("eval"):
        kwargs["eval_data"] = data(48, seed=1)
    config = {"device": "cpu", "batch_size": 16, "steps": STEPS, "log_every": 8, "loggers": ("csv",), "seed": 3,
              "cuda_graphs": "auto", **spec.get("config", {})}
    return model, train, kwargs, config


def _train(spec: dict):
    model, train, kwargs, config = _fit_kwargs(spec)
    history = fit(model, train, config=TrainConfig(**config), **kwargs)
    emas = [cb for cb in kwargs.get("callbacks", []) if isinstance(cb, gputrain.EMA)]
    ema = params(emas[0].model) if emas and emas[0].model is not None else None
    curve = [(r["step"], r["loss"], r["lr"]) for r in history.records]
    return params(model), ema, curve, history.summary


def _steady_host_reads(spec: dict) -> int:
    """Host reads of 4 steps after the capture (the loop's own step: data, step, scheduler)."""
    model, train, kwargs, config = _fit_kwargs(spec)
    # No log point is reached: callbacks take part through the step only (EMA's update)
    trainer = Trainer(model, train, config=TrainConfig(**{**config, "log_every": 100, "steps": 100}), **kwargs)
    try:
        trainer.run_steps(6)
        with watch_host_reads() as reads:
            for _ in range(4):
                trainer.train_one_step()
        return reads.total
    finally:
        trainer.close()


@pytest.mark.parametrize("cell", list(CELLS))
def test_every_feature_replays_like_eager_or_names_its_blocker(cell, capture_graphs, caplog):
    spec, expected = CELLS[cell]
    caplog.set_level(logging.INFO, logger="gputrain")
    if expected == "on":
        assert _steady_host_reads(spec) == 0, f"{cell}: the steady step reads the host"
        CaptureGraphs.instances.clear()
    graphed = _train(spec)
    backends = list(CaptureGraphs.instances)
    capture_graphs(EagerGraphs)
    eager = _train(spec)
    status = graphed[3]["cuda_graphs"]
    if expected == "on":
        assert status.startswith("on"), status
        replays = sum(g.replays for b in backends for g in b.graphs)
        assert replays >= 3, f"{cell}: the step was replayed {replays} times"
        assert torch.equal(graphed[0], eager[0]), f"{cell}: the replayed weights differ from the eager ones"
        if graphed[1] is not None:
            assert eager[1] is not None and torch.equal(graphed[1], eager[1]), f"{cell}: EMA weights differ"
        assert graphed[2] == eager[2], f"{cell}: logged loss/lr differ: {graphed[2]} vs {eager[2]}"
    else:
        words = expected[1]
        assert status.startswith("off") and words in status, status
        assert any(words in r.getMessage() for r in caplog.records), f"{cell}: the log does not name the reason"
        assert torch.equal(graphed[0], eager[0])  # refused graphs: the run is the eager one


def test_the_stand_in_graph_freezes_python_numbers_as_a_gpu_does(capture_graphs, monkeypatch):
    """The check above can fail: without the graph's check of the optimizer's Python numbers and the
    scheduler rule, OneCycleLR's momentum stays at its capture value on replay and the run ends
    elsewhere than the eager one."""
    import gputrain.runtime.speed as speed
    import gputrain.train.step.graphs as graphs

    spec = CELLS["OneCycleLR with momentum"][0]
    monkeypatch.setattr(speed, "scheduler_blocker", lambda scheduler: None)
    monkeypatch.setattr(graphs._PythonValues, "changed", lambda self: None)
    import gputrain.train.loop.build as trainer_module

    monkeypatch.setattr(trainer_module, "scheduler_blocker", lambda scheduler: None)
    frozen = _train(spec)
    capture_graphs(EagerGraphs)
    eager = _train(spec)
    assert frozen[3]["cuda_graphs"].startswith("on")
    assert not torch.equal(frozen[0], eager[0])


def test_the_graph_switches_itself_off_when_a_python_number_changes(capture_graphs, monkeypatch, caplog):
    """With the scheduler rule left out, the graph's own check still catches the momentum written
    after capture: the run continues eagerly, says why, and ends where the eager run ends."""
    import gputrain.train.loop.build as trainer_module

    monkeypatch.setattr(trainer_module, "scheduler_blocker", lambda scheduler: None)
    spec = CELLS["OneCycleLR with momentum"][0]
    caught = _train(spec)
    capture_graphs(EagerGraphs)
    eager = _train(spec)
    assert caught[3]["cuda_graphs"].startswith("off: the optimizer's 'betas' (group 0) changed")
    assert any("'betas'" in r.getMessage() for r in caplog.records)
    assert torch.equal(caught[0], eager[0])
