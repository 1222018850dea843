"""Non-finite losses and loss spikes: stop (naming the steps and the last good checkpoint) or skip on
the device; never a checkpoint from a non-finite state; spikes reported at log points."""

import logging

import pytest
import torch
from torch import nn

from gputrain import TrainConfig, fit
from gputrain.errors import ConfigError, GputrainError
from gputrain.train.loop.guards import NonFiniteError, SpikeDetector
from helpers import data, mlp, params, sgd


class _PoisonAt(nn.Module):
    """Makes the loss NaN on chosen training calls (as an inf in the data would)."""

    def __init__(self, inner, calls):
        super().__init__()
        self.inner, self.calls, self.n = inner, set(calls), 0

    def forward(self, x):
        if self.training:
            self.n += 1
            if self.n in self.calls:
                x = x * float("nan")
        return self.inner(x)


def test_a_nan_stops_the_run_naming_the_steps_and_the_last_good_checkpoint(tmp_path):
    run_dir = tmp_path / "run"
    model = _PoisonAt(mlp(), calls={7})
    with pytest.raises(NonFiniteError, match=r"between steps 7 and 8.*last good checkpoint is .*step-0+6\.pt"):
        fit(model, data(64), loss_fn=nn.CrossEntropyLoss(),
            config=TrainConfig(device="cpu", batch_size=8, steps=20, log_every=4, checkpoint_every=2,
                               run_dir=str(run_dir)))
    from gputrain.checkpoint.format import load_checkpoint

    from gputrain.checkpoint.store import CheckpointStore

    state = load_checkpoint(CheckpointStore(run_dir).latest_path())
    assert state["step"] == 6  # the last checkpoint before the NaN; step 8's was refused
    assert all(torch.isfinite(v).all() for v in state["model"].values())


def test_a_huge_learning_rate_is_stopped_not_reported_as_a_result():
    x, y = data(256)
    with pytest.raises(NonFiniteError, match="non-finite"):
        fit(mlp(), (x * 1e3, y), loss_fn=nn.CrossEntropyLoss(), optimizer=lambda p: torch.optim.SGD(p, lr=1e30),
            config=TrainConfig(device="cpu", batch_size=32, steps=40, log_every=10))


def test_skip_leaves_parameters_and_optimizer_state_as_they_were():
    x, y = data(64)
    ref = mlp()
    fit(ref, (x, y), loss_fn=nn.CrossEntropyLoss(), config=TrainConfig(device="cpu", batch_size=8, steps=8, seed=3))
    poisoned = _PoisonAt(mlp(), calls={1, 2, 3})  # the first three steps are NaN and skipped
    h = fit(poisoned, (x, y), loss_fn=nn.CrossEntropyLoss(),
            config=TrainConfig(device="cpu", batch_size=8, steps=11, seed=3, on_nan="skip", log_every=11))
    assert h.summary["nonfinite_steps"] == 3 and "skipped" in h.summary["warnings"][0]
    # Skipped steps changed nothing, not even AdamW's step count: 3 skipped + 8 real == 8 real. (The
    # data order differs by three batches, so compare with a reference fed the same batches.)
    ref2 = mlp()
    fit(_PoisonAt(ref2, calls=set()), (x, y), loss_fn=nn.CrossEntropyLoss(),
        config=TrainConfig(device="cpu", batch_size=8, steps=11, seed=3, log_every=11), optimizer=None)
    assert torch.isfinite(params(poisoned.inner)).all()
    assert not torch.equal(params(poisoned.inner), params(ref2))  # the three skipped steps did not train


def test_skip_of_an_all_nan_step_is_an_exact_no_op():
    x, y = data(16)
    model = _PoisonAt(mlp(), calls={1})
    before = params(model.inner).clone()
    h = fit(model, (x, y), loss_fn=nn.CrossEntropyLoss(),
            config=TrainConfig(device="cpu", batch_size=16, steps=1, on_nan="skip"))
    assert torch.equal(params(model.inner), before)
    assert h.summary["nonfinite_steps"] == 1 and h.records[-1]["loss"] == 0.0


def test_skip_needs_a_fused_optimizer():
    with pytest.raises(ConfigError, match="on_nan='skip'.*fused"):
        fit(mlp(), data(64), loss_fn=nn.CrossEntropyLoss(), optimizer=sgd(),
            config=TrainConfig(device="cpu", steps=1, on_nan="skip"))


def test_spike_detector_warns_then_stops_after_patience():
    d = SpikeDetector(ratio=3.0, window=6, patience=2, action="stop")
    for step, loss in enumerate([1.0, 0.9, 0.8, 0.85, 0.8], start=1):
        d.update(10 * step, loss)  # log points 10 steps apart: each judged as it comes
    d.update(60, 5.0)  # one spike: warned, recorded
    assert [s["step"] for s in d.spikes] == [60]
    d.update(70, 0.8)  # back to normal: the streak resets
    d.update(80, 4.0)
    with pytest.raises(GputrainError, match="loss spike at step 90: .*2 in a row"):
        d.update(90, 4.5)


def test_one_batch_noise_at_log_every_1_is_no_spike_but_a_real_one_is(caplog):
    """At log_every=1 a log point is one batch, whose loss scatters several times around the median once
    the model fits: judged over 10 steps, the noise below gives no warning; a jump of the loss does."""
    caplog.set_level(logging.WARNING, "gputrain")
    d = SpikeDetector(ratio=4.0, window=10, patience=3, action="warn")
    noisy = [0.01 if i % 9 else 0.08 for i in range(300)]  # one batch in 9 at 8x the others (one hard sample)
    for step, loss in enumerate(noisy, start=1):
        d.update(step, loss)
    assert d.spikes == [] and "loss spike" not in caplog.text
    for step in range(301, 311):
        d.update(step, 0.01 if step < 305 else 1.0)  # the loss jumps 100x at step 305
    assert [s["step"] for s in d.spikes] == [310]
    assert "loss spike at steps 301-310 (their mean): 0.604 is" in caplog.text


def test_spikes_reach_the_summary():
    x, y = data(128)

    class Spiky(nn.Module):
        def __init__(self):
            super().__init__()
            self.inner, self.n = mlp(), 0

        def forward(self, x):
            self.n += self.training
            out = self.inner(x)
            return out * 500 if self.training and self.n in (61, 62, 63) else out  # logits blow up briefly

    h = fit(Spiky(), (x, y), loss_fn=nn.CrossEntropyLoss(),
            config=TrainConfig(device="cpu", batch_size=8, steps=80, log_every=1, lr=1e-3))
    assert [s["step"] for s in h.summary["loss_spikes"]] == [70]  # the mean of steps 61-70 (log_every=1: pooled)
    assert any("loss spike at step 70" in w for w in h.summary["warnings"])


class _InfThroughTanh(nn.Module):
    """An inf input gives a finite loss (tanh saturates) but NaN gradients (0 x inf in backward)."""

    def __init__(self, at):
        super().__init__()
        torch.manual_seed(0)
        self.l1, self.l2, self.at, self.n = nn.Linear(6, 8), nn.Linear(8, 3), at, 0

    def forward(self, x):
        if self.training:
            self.n += 1
            if self.n == self.at:
                x = x.clone()
                x[0, 0] = float("inf")
        return self.l2(torch.tanh(self.l1(x)))


def test_nan_gradients_under_a_finite_loss_are_caught_too():
    with pytest.raises(NonFiniteError, match="between steps 5 and 8"):
        fit(_InfThroughTanh(at=6), data(64), loss_fn=nn.CrossEntropyLoss(),
            config=TrainConfig(device="cpu", batch_size=8, steps=16, log_every=4))
    model = _InfThroughTanh(at=6)
    h = fit(model, data(64), loss_fn=nn.CrossEntropyLoss(),
            config=TrainConfig(device="cpu", batch_size=8, steps=16, log_every=4, on_nan="skip"))
    assert h.summary["nonfinite_steps"] == 1
    assert all(torch.isfinite(p).all() for p in model.parameters())


def test_a_full_disk_keeps_the_previous_checkpoint_and_says_so(tmp_path, monkeypatch):
    import errno

    from gputrain.errors import CheckpointError
    from gputrain.checkpoint.store import CheckpointStore

    real_save = CheckpointStore.save
    calls = []

    def save(self, state, step, metrics=None):
        calls.append(step)
        if len(calls) == 2:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_save(self, state, step, metrics)

    monkeypatch.setattr(CheckpointStore, "save", save)
    run_dir = tmp_path / "run"
    with pytest.raises(CheckpointError, match=r"checkpoint of step 10 .*No space left on device; the previous "
                                              r"checkpoint .*step-000005\.pt is intact.*--resume"):
        fit(mlp(), data(64), loss_fn=nn.CrossEntropyLoss(),
            config=TrainConfig(device="cpu", batch_size=8, steps=20, checkpoint_every=5, run_dir=str(run_dir)))
    assert CheckpointStore(run_dir).latest_path().name == "step-000005.pt"


def test_a_resumed_run_whose_first_save_fails_names_the_checkpoint_it_resumed_from(tmp_path, monkeypatch):
    """The run has saved nothing yet itself: the intact previous checkpoint is the newest in its store."""
    import errno

    from gputrain.errors import CheckpointError
    from gputrain.checkpoint.store import CheckpointStore

    run_dir = tmp_path / "run"
    cfg = TrainConfig(device="cpu", batch_size=8, steps=20, checkpoint_every=5, run_dir=str(run_dir))
    fit(mlp(), data(64), loss_fn=nn.CrossEntropyLoss(), config=cfg.replace(stop_at_step=5))

    def full(self, state, step, metrics=None):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(CheckpointStore, "save", full)
    with pytest.raises(CheckpointError, match=r"checkpoint of step 10 .*No space left on device; the previous "
                                              r"checkpoint .*step-000005\.pt is intact.*--resume"):
        fit(mlp(), data(64), loss_fn=nn.CrossEntropyLoss(), config=cfg.replace(resume=True))
    assert CheckpointStore(run_dir).latest_path().name == "step-000005.pt"


# ---------------------------------------------------------------- on_nan="stop" checks where the loss is read

def test_a_nan_gradient_in_the_step_before_a_checkpoint_never_reaches_it(tmp_path):
    """The step counts nothing per step with on_nan="stop": a NaN gradient in the very step before a
    checkpoint (the loss still finite) is found in the parameters the optimizer then wrote."""
    from gputrain.checkpoint.format import load_checkpoint
    from gputrain.checkpoint.store import CheckpointStore

    run_dir = tmp_path / "run"
    with pytest.raises(NonFiniteError, match=r"between steps 6 and 6.*last good checkpoint is .*step-0+5\.pt"):
        fit(_InfThroughTanh(at=6), data(64), loss_fn=nn.CrossEntropyLoss(),
            config=TrainConfig(device="cpu", batch_size=8, steps=16, log_every=4, checkpoint_every=1,
                               run_dir=str(run_dir)))
    state = load_checkpoint(CheckpointStore(run_dir).latest_path())
    assert state["step"] == 5
    assert all(torch.isfinite(v).all() for v in state["model"].values())
    assert all(torch.isfinite(v).all() for s in state["optimizer"]["state"].values() for v in s.values()
               if torch.is_tensor(v))


def test_a_nan_gradient_of_a_parameter_outside_the_optimizer_stops_the_run():
    """Gradients the optimizer never reads (nor clears) are checked too: the run's state includes them."""
    model = _InfThroughTanh(at=6)
    with pytest.raises(NonFiniteError, match="between steps 5 and 8"):
        fit(model, data(64), loss_fn=nn.CrossEntropyLoss(),
            optimizer=lambda params: torch.optim.AdamW(model.l2.parameters(), fused=True),
            config=TrainConfig(device="cpu", batch_size=8, steps=16, log_every=4))


def test_a_non_finite_loss_with_finite_gradients_stops_or_is_skipped():
    """An inf added to the loss as a constant leaves the gradients finite: the loss alone decides."""
    def loss_at(n):
        calls = []

        def compute_loss(model, batch):
            x, y = batch
            calls.append(1)
            loss = nn.functional.cross_entropy(model(x), y)
            return loss + float("inf") if len(calls) == n and model.training else loss
        return compute_loss

    with pytest.raises(NonFiniteError, match="between steps 1 and 4"):
        fit(mlp(), data(64), compute_loss=loss_at(3), config=TrainConfig(device="cpu", batch_size=8, steps=8,
                                                                           log_every=4))
    model = mlp()
    h = fit(model, data(64), compute_loss=loss_at(3),
            config=TrainConfig(device="cpu", batch_size=8, steps=8, log_every=4, on_nan="skip"))
    assert h.summary["nonfinite_steps"] == 1 and all(r["loss"] == r["loss"] for r in h.records)  # no NaN mean
    assert all(torch.isfinite(p).all() for p in model.parameters())


def test_huge_but_finite_parameters_are_not_called_non_finite():
    """The state probe is a 2-norm, which overflows past ~1e19 in fp32; the exact check behind it
    keeps a run with such (finite) values going. (An integer parameter is left out of the probe.)"""
    model = mlp()
    model.register_parameter("big", nn.Parameter(torch.full((4,), 1e30), requires_grad=False))
    model.register_parameter("index", nn.Parameter(torch.arange(3), requires_grad=False))
    h = fit(model, data(64), loss_fn=nn.CrossEntropyLoss(),
            config=TrainConfig(device="cpu", batch_size=8, steps=8, log_every=4))
    assert h.records[-1]["step"] == 8 and h.summary["nonfinite_steps"] == 0


class _SignMomentum(torch.optim.Optimizer):
    """p -= lr * sign(m), m = 0.9 m + g: an inf gradient leaves the parameters finite, the state inf."""

    def __init__(self, params, lr=1e-2):
        super().__init__(params, {"lr": lr})

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                m = self.state[p].setdefault("m", torch.zeros_like(p))
                m.mul_(0.9).add_(p.grad)
                p.sub_(group["lr"] * torch.sign(m))


def test_an_inf_gradient_that_only_the_optimizer_state_keeps_stops_the_run(tmp_path):
    model = mlp()
    calls = []

    def spoil(grad):
        calls.append(1)
        return grad + float("inf") if len(calls) == 6 else grad

    model[0].bias.register_hook(spoil)  # step 6's gradient is inf; the loss stays finite
    run_dir = tmp_path / "run"
    with pytest.raises(NonFiniteError, match=r"between steps 6 and 6.*step-0+5\.pt"):
        fit(model, data(64), loss_fn=nn.CrossEntropyLoss(), optimizer=lambda p: _SignMomentum(p),
            config=TrainConfig(device="cpu", batch_size=8, steps=16, log_every=4, checkpoint_every=1,
                               run_dir=str(run_dir)))
    assert all(torch.isfinite(p).all() for p in model.parameters())  # only the state went inf
