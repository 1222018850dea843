"""Resident batches assembled inside the step's CUDA graph (data/deferred.py, train/step/graphs.py).

On the CPU the stand-in for CudaGraphs with CUDA's capture semantics (tests/graph_capture.py: the
ops recorded once, re-issued on replay, no Python) checks what every replay reads: the start position the host wrote, this epoch's order and
augmentation draws, the right graph per batch size; and counts the operations the host still runs
outside the graph per step.
"""

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from gputrain.data import BatchStream, BatchTransform
from gputrain.data.deferred import DeferredBatch, materialize, num_samples
from gputrain.data.resident import ResidentRows, TensorBatches
from gputrain.runtime.precision import RunPrecision, resolve_precision
from gputrain.train.step.graphs import WARMUP_STEPS, GraphedStep
from gputrain.train.step.loss import LossRule
from gputrain.train.optim.build import make_optimizer
from gputrain.train.step.train_step import TrainStep

from graph_capture import CaptureGraphs

CPU = torch.device("cpu")
MEAN, STD = (120.0, 115.0, 100.0), (60.0, 61.0, 62.0)


def _images(n=100, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(0, 256, (n, 3, 8, 8), dtype=torch.uint8, generator=g)
    y = (x.float().mean((1, 2, 3)) > 127.5).long()
    return x, y


def _transform(augment="crop-flip", channels_last=True, key=None):
    return BatchTransform(mean=MEAN, std=STD, augment=augment, channels_last=channels_last, key=key)


def _equal(a, b) -> bool:
    la, _ = torch.utils._pytree.tree_flatten(a)
    lb, _ = torch.utils._pytree.tree_flatten(b)
    return len(la) == len(lb) and all(torch.equal(p, q) for p, q in zip(la, lb))


def _epoch(loader, epoch, deferred):
    loader.defer = deferred
    return list(loader.iter_epoch(epoch))


# ---------------------------------------------------------------- the data side


@pytest.mark.parametrize("case", ["shuffled-augmented", "dict-columns", "whole-epoch", "unshuffled", "drop-last",
                                  "rank-1-of-2"])
def test_deferred_batches_equal_the_eager_ones(case):
    x, y = _images()
    columns, kw, transform = (x, y), {}, _transform()
    if case == "dict-columns":
        columns, transform = {"pixels": x, "labels": y, "ids": torch.arange(100)}, _transform(key="pixels")
    elif case == "whole-epoch":
        kw = {"batch_size": 100}
    elif case == "unshuffled":
        kw, transform = {"shuffle": False}, _transform(augment=None)
    elif case == "drop-last":
        kw = {"drop_last": True}
    elif case == "rank-1-of-2":
        kw = {"rank": 1, "world_size": 2}
    loader = TensorBatches(columns, kw.pop("batch_size", 32), device=CPU, seed=3, transform=transform, **kw)
    for epoch in (0, 1):
        eager = _epoch(loader, epoch, deferred=False)
        deferred = _epoch(loader, epoch, deferred=True)
        assert all(isinstance(b, ResidentRows) for b in deferred)
        assert [num_samples(b) for b in deferred] == [num_samples(b) for b in eager]
        loader._plan(epoch)  # the buffers hold the last planned epoch: this one again
        for e, d in zip(eager, deferred):
            assert _equal(d.materialize(), e)
            inputs = d.new_inputs()
            d.load(inputs)
            assert _equal(d.build(inputs), e)  # what a replay assembles, from the start the host wrote
    if case == "shuffled-augmented":
        assert not _equal(_epoch(loader, 0, False)[0], _epoch(loader, 1, False)[0])  # a new order and new draws


def test_each_epoch_is_planned_into_the_same_buffers():
    """A captured graph reads the order and the draws at fixed addresses: a new epoch refills them."""
    loader = TensorBatches(_images(), 32, device=CPU, seed=0, transform=_transform())
    list(loader.iter_epoch(0))
    ptrs = (loader._order.data_ptr(), loader._aug.dy.data_ptr(), loader._aug.dx.data_ptr(), loader._aug.flip.data_ptr())
    order0, dy0 = loader._order.clone(), loader._aug.dy.clone()
    list(loader.iter_epoch(1))
    assert (loader._order.data_ptr(), loader._aug.dy.data_ptr(), loader._aug.dx.data_ptr(),
            loader._aug.flip.data_ptr()) == ptrs
    assert not torch.equal(loader._order, order0) and not torch.equal(loader._aug.dy, dy0)


def test_a_whole_epoch_batch_needs_no_input_and_reads_the_columns_as_they_are():
    x, y = _images()
    loader = TensorBatches((x, y), 100, device=CPU, shuffle=True, transform=BatchTransform())
    loader.defer = True
    (batch,) = list(loader.iter_epoch(0))
    assert batch.new_inputs() == []
    xb, yb = batch.build([])
    assert xb.data_ptr() == loader.columns[0].data_ptr() and yb.data_ptr() == loader.columns[1].data_ptr()


def test_materialize_passes_plain_batches_through():
    pair = (torch.ones(2, 3), torch.zeros(2))
    assert materialize(pair) is pair and num_samples(pair) == 2


# ---------------------------------------------------------------- the graph side, with a stand-in


class HostOps(TorchDispatchMode):
    """Counts the tensor operations run outside graph replays (on a GPU: kernel launches by the host)."""

    def __init__(self, backend):
        super().__init__()
        self.backend, self.n, self.counting = backend, 0, False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if self.counting and not self.backend.replaying:
            self.n += 1
        return func(*args, **(kwargs or {}))


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(),
                         nn.Linear(4, 2))


def _train(batch_size, steps, *, graphed, deferred, count_from=None, transform=None):
    """Train `steps` steps; returns the parameters, the GraphedStep and host ops per counted step."""
    model = _model()
    opt, _ = make_optimizer(None, model.parameters(), lr=0.05, weight_decay=0.0, device=CPU, capturable=True)
    step = TrainStep(model, LossRule(nn.CrossEntropyLoss()), opt, RunPrecision(resolve_precision("fp32", CPU), CPU),
                     device=CPU)
    backend = CaptureGraphs()
    runner = GraphedStep(step, CPU, backend=backend) if graphed else step
    loader = TensorBatches(_images(), batch_size, device=CPU, seed=5, transform=transform or _transform())
    loader.defer = deferred
    stream = BatchStream(loader)
    counter = HostOps(backend)
    with counter:
        for i in range(steps):
            counter.counting = count_from is not None and i >= count_from
            runner([stream.next()[2]])
    per_step = counter.n / (steps - count_from) if count_from is not None else None
    return torch.cat([p.detach().flatten() for p in model.parameters()]), runner, per_step


def test_graphed_deferred_steps_train_exactly_like_eager_steps():
    """3 epochs of batches 32, 32, 32, 4: two graphs, every replay on its own batch of its own epoch."""
    eager, _, _ = _train(32, 12, graphed=False, deferred=False)
    graphed, runner, _ = _train(32, 12, graphed=True, deferred=True)
    assert sorted(k[-1] for k in runner.graphs) == [4, 32] and all(k[0] == "deferred" for k in runner.graphs)
    # 3 warm-up steps; the first size-4 batch runs eagerly once, the next one is captured.
    assert runner.replays == 12 - WARMUP_STEPS - 1 and runner.eager_fallbacks == 1
    assert torch.allclose(graphed, eager, atol=1e-6)


def test_a_replay_that_ignored_the_start_position_would_train_differently(monkeypatch):
    """The check above can fail: replays that all assemble the captured batch end elsewhere."""
    eager, _, _ = _train(32, 12, graphed=False, deferred=False)
    monkeypatch.setattr(ResidentRows, "load", lambda self, inputs: None)
    stale, _, _ = _train(32, 12, graphed=True, deferred=True)
    assert not torch.allclose(stale, eager, atol=1e-4)


def test_per_step_host_work_is_one_scalar_write_when_the_graph_assembles_the_batch():
    """Graphed steps with the batch made outside the graph launch the gather, normalization,
    augmentation, layout and copies per step; deferred ones write one scalar."""
    # Batches of 25 of 100 samples; steps 5-7 are after the capture and inside epoch 1 (an epoch's
    # start plans its order and draws: a few operations per epoch, not per step).
    steps, warm = 8, WARMUP_STEPS + 2
    _, runner, deferred_ops = _train(25, steps, graphed=True, deferred=True, count_from=warm)
    _, plain_runner, plain_ops = _train(25, steps, graphed=True, deferred=False, count_from=warm)
    assert runner.replays == steps - WARMUP_STEPS and plain_runner.replays == steps - WARMUP_STEPS
    assert deferred_ops == 1  # fill_ of the start position
    assert plain_ops >= 15  # index_select x2, the float conversion, the affine, crop-flip's ops, 2 copies
    # A whole-epoch batch (full-batch training): replay only; with augmentation, each step is an
    # epoch and draws its crops and flips (randint x2, rand, lt, copy_).
    _, _, whole_ops = _train(100, steps, graphed=True, deferred=True, count_from=warm,
                             transform=_transform(augment=None))
    assert whole_ops == 0
    _, _, whole_augmented_ops = _train(100, steps, graphed=True, deferred=True, count_from=warm)
    assert whole_augmented_ops == 5


def test_eager_fallback_assembles_a_deferred_batch(caplog):
    """A capture that fails leaves the run eager; deferred batches are then assembled before the step."""
    eager, _, _ = _train(32, 8, graphed=False, deferred=False)

    class Failing(CaptureGraphs):
        def capture(self, fn, share_pool_with=None):
            raise RuntimeError("operation not permitted when stream is capturing")

    model = _model()
    opt, _ = make_optimizer(None, model.parameters(), lr=0.05, weight_decay=0.0, device=CPU, capturable=True)
    step = TrainStep(model, LossRule(nn.CrossEntropyLoss()), opt, RunPrecision(resolve_precision("fp32", CPU), CPU),
                     device=CPU)
    runner = GraphedStep(step, CPU, backend=Failing())
    loader = TensorBatches(_images(), 32, device=CPU, seed=5, transform=_transform())
    loader.defer = True
    stream = BatchStream(loader)
    for _ in range(8):
        runner([stream.next()[2]])
    assert runner.failed.startswith("capture failed (RuntimeError: operation not permitted")
    assert torch.allclose(torch.cat([p.detach().flatten() for p in model.parameters()]), eager, atol=1e-6)


def test_deferred_batch_contract_is_abstract():
    with pytest.raises(NotImplementedError):
        DeferredBatch().materialize()


def test_the_trainer_defers_only_when_a_graph_runs_the_step():
    from gputrain import TrainConfig
    from gputrain.train.loop.trainer import Trainer

    trainer = Trainer(_model(), _images(), loss_fn=nn.CrossEntropyLoss(),
                      config=TrainConfig(device="cpu", batch_size=32, steps=2, cuda_graphs=True))
    assert trainer.parts.step.graphed is None and trainer.parts.data.train.defer is False


def test_a_deferred_batch_missing_part_of_the_interface_fails_loudly():
    """A DeferredBatch subclass must give new_inputs, load and build for the graph (and materialize
    for eager steps); one that leaves any out raises at the first use, never a silent no-op."""

    class OnlyEager(DeferredBatch):
        key, num_samples = ("only-eager",), 2

        def materialize(self):
            return torch.zeros(2, 3)

    b = OnlyEager()
    assert materialize(b).shape == (2, 3) and num_samples(b) == 2
    for use in (b.new_inputs, lambda: b.load([]), lambda: b.build([])):
        with pytest.raises(NotImplementedError):
            use()
