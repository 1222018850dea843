"""The trainer's seams: checkpoint contents from named parts, a state_dict that reads and changes
nothing, and the loop's own body run by `run_steps` with a phase clock lent (what profile uses)."""

from __future__ import annotations

import copy

import torch
from torch import nn

from helpers import data, mlp, params

from gputrain import TrainConfig, fit
from gputrain.runtime.timing import NO_CLOCK
from gputrain.train import Trainer

PARTS = ["model", "optimizer", "scaler", "scheduler", "rng", "run", "data", "history", "callbacks", "carried"]


def _trainer(**overrides) -> Trainer:
    config = TrainConfig(**{"device": "cpu", "precision": "fp32", "batch_size": 16, "steps": 12, "log_every": 100,
                            "progress": False, "seed": 3, **overrides})
    return Trainer(mlp(), data(), loss_fn=nn.CrossEntropyLoss(), config=config)


def _unread(t: Trainer) -> float:
    """The loss of the steps since the last read: the accumulator plus the eager steps' kept losses."""
    return float(t.parts.step.body.totals.loss_sum) + sum(float(x) for x in t.parts.step.body.totals.pending)


class _RecordingClock:
    def __init__(self):
        self.marks: list[str] = []

    def start(self) -> None:
        self.marks.append("start")

    def mark(self, phase: str) -> None:
        self.marks.append(phase)


def test_state_dict_reads_no_accumulator_and_changes_nothing():
    t = _trainer()
    t.run_steps(3)  # no log point yet: the steps' loss is on the device
    on_device = _unread(t)
    assert on_device > 0 and t.parts.state.loss_since_log == 0.0

    first, second = t.state_dict(), t.state_dict()
    assert _unread(t) == on_device  # nothing drained
    assert t.parts.state.loss_since_log == 0.0 and first["run"] == second["run"]
    assert first["run"]["loss_since_log"] == 0.0 and first["step"] == 3

    t.collect_step_totals()  # the read is its own call
    assert _unread(t) == 0.0
    assert abs(t.parts.state.loss_since_log - on_device) < 1e-6
    assert t.state_dict()["run"]["loss_since_log"] == t.parts.state.loss_since_log


def test_the_checkpoint_is_built_from_named_parts_and_loads_them_back_in_place():
    t = _trainer()
    t.run_steps(5)
    t.collect_step_totals()
    assert list(t.parts.checkpoints.states.parts) == PARTS
    state = copy.deepcopy(t.state_dict())  # its tensors are the live ones, as Module.state_dict gives them
    assert set(PARTS) <= set(state)
    for key in ("step", "epoch", "batch_in_epoch", "samples_seen", "global_batch", "world_size", "config"):
        assert key in state  # for readers of the file
    assert (state["epoch"], state["batch_in_epoch"]) == (0, 5) and state["global_batch"] == 16

    saved_params = params(t.parts.model.module).clone()
    run_state = t.parts.state
    t.run_steps(4)  # moves every part on
    t.parts.step.body.micro.splits = 2
    assert not torch.equal(params(t.parts.model.module), saved_params)

    t.parts.checkpoints.states.load_state_dict(state)
    assert torch.equal(params(t.parts.model.module), saved_params)
    assert t.parts.state is run_state and t.parts.state.step == 5 and t.parts.state.samples_seen == 80
    assert (t.parts.data.stream.epoch, t.parts.data.stream.batch_in_epoch) == (0, 5)
    assert t.parts.step.body.micro.splits == 1
    assert t.parts.optim.scheduler.state_dict() == state["scheduler"]
    assert t.parts.optim.optimizer.state_dict()["state"][0]["step"] == 5


def test_a_checkpoint_older_than_the_run_and_data_keys_resumes_its_position():
    t = _trainer()
    t.run_steps(2)
    state = t.state_dict()
    run = state.pop("run")
    del state["data"]
    state.update(run)  # the flat layout of checkpoints written before RunState and the "data" key
    state["epoch"], state["batch_in_epoch"] = 1, 3

    fresh = _trainer()
    fresh.parts.checkpoints.states.load_state_dict(state)
    assert fresh.parts.state.step == 2 and fresh.parts.state.samples_seen == 32
    assert (fresh.parts.data.stream.epoch, fresh.parts.data.stream.batch_in_epoch) == (1, 3)


def test_run_steps_is_the_loop_fit_runs():
    """The loop's own body: the same weights and the same logged losses as `run`."""
    whole = _trainer(log_every=4)
    whole.run()
    stepped = _trainer(log_every=4)
    stepped.run_steps(12)
    assert torch.equal(params(whole.parts.model.module), params(stepped.parts.model.module))
    assert [r["loss"] for r in stepped.parts.history.records] == [r["loss"] for r in whole.parts.history.records]
    assert [r["step"] for r in stepped.parts.history.records] == [4, 8, 12]
    assert stepped.parts.state.steps_since_log == 0


def test_a_lent_phase_clock_sees_every_phase_of_the_loop_and_is_given_back():
    t = _trainer(log_every=2)
    eager = t.parts.step.run
    clock = _RecordingClock()
    with t.timed_phases(clock):
        t.run_steps(2)
    phases = ["start", "data", "forward", "backward", "optimizer", "logging"]
    assert clock.marks == phases * 2
    assert len(t.parts.history.records) == 1 and t.parts.state.steps_since_log == 0  # the loop's log point ran
    assert t.clock is NO_CLOCK and t.parts.step.body.clock is NO_CLOCK and t.parts.step.run is eager

    t.run_steps(1)  # the default clock: nothing is marked
    assert clock.marks == phases * 2


def test_accumulation_marks_forward_and_backward_per_micro_batch():
    t = _trainer(accumulate=2, batch_size=8)
    clock = _RecordingClock()
    with t.timed_phases(clock):
        t.run_steps(1)
    assert clock.marks == ["start", "data", "forward", "backward", "forward", "backward", "optimizer", "logging"]


def test_eager_losses_are_kept_then_folded_every_fold_every_steps(monkeypatch):
    """No op per step for the loss; the kept list stays bounded; the sum read is every step's loss."""
    from gputrain.train.step import totals as step_module

    monkeypatch.setattr(step_module, "FOLD_EVERY", 4)
    t = _trainer()
    t.parts.step.body.totals.keep = t.parts.step.body.totals.pending.append  # the eager CUDA step's way (the CPU adds in place)
    losses = []
    original = t.parts.step.body.totals.keep

    def spy(loss):
        losses.append(float(loss))
        original(loss)

    t.parts.step.body.totals.keep = spy
    lengths = []
    for _ in range(10):
        t.run_steps(1)
        lengths.append(len(t.parts.step.body.totals.pending))
    assert lengths == [1, 2, 3, 0, 1, 2, 3, 0, 1, 2]  # folded into the accumulator at 4
    t.collect_step_totals()
    assert abs(t.parts.state.loss_since_log - sum(losses)) < 1e-5 and t.parts.step.body.totals.pending == []


def test_a_graphed_step_adds_each_loss_in_place():
    """A captured step's replays write to the accumulator's address: the graph wrapper switches the
    step to in-place sums before anything runs (kept losses already there are folded in)."""
    import types

    from gputrain.train.step.graphs import GraphedStep

    t = _trainer()
    t.parts.step.body.totals.keep = t.parts.step.body.totals.pending.append  # the eager CUDA step's way (the CPU adds in place)
    t.run_steps(2)
    kept = sum(float(x) for x in t.parts.step.body.totals.pending)
    assert len(t.parts.step.body.totals.pending) == 2
    GraphedStep(t.parts.step.body, t.parts.device, backend=types.SimpleNamespace())  # the CUDA side is not used here
    assert t.parts.step.body.totals.pending == [] and abs(float(t.parts.step.body.totals.loss_sum) - kept) < 1e-6
    t.parts.step.body([next(iter(t.parts.data.stream.loader))])
    assert t.parts.step.body.totals.pending == [] and float(t.parts.step.body.totals.loss_sum) > kept


def test_checkpoints_fall_on_their_own_steps_between_log_points(tmp_path):
    """The steps between two log points run as one stretch; a checkpoint every 3 steps with a log
    point every 10 still lands on steps 3, 6 and 9 (and the run's end on 10)."""
    from gputrain.checkpoint.store import CheckpointStore

    x, y = data(96)
    cfg = TrainConfig(device="cpu", batch_size=16, steps=10, log_every=10, checkpoint_every=3, keep_last=10,
                      run_dir=str(tmp_path / "run"), progress=False)
    fit(mlp(), (x, y), loss_fn=nn.CrossEntropyLoss(), config=cfg)
    assert [p.name for p in CheckpointStore(tmp_path / "run").list()] == [
        "step-000003.pt", "step-000006.pt", "step-000009.pt", "step-000010.pt"]
