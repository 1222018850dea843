"""channels_last decided by rule and checked on the model's own first step (train/step/layout.py): refused
with the op and the file:line that refused it, kept only where it runs and agrees, never decided by a
timing (a seeded run reproduces whatever the machine's load), a later NHWC failure retried once in the
user's layout, and the user's memory format given back."""

import logging

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import gputrain
from gputrain.data.checks import first_step_note
from gputrain.runtime import speed as speed_mod
from gputrain.runtime.speed import SpeedSwitches, choices_made
from gputrain.train.step import layout

VIEW_LINE = "x = x.view(-1, 4 * 2 * 2)"


class ViewNet(nn.Module):
    """The blitz tutorial's shape: `.view` of a convolution's output (fails in NHWC)."""

    def __init__(self, p: float = 0.0):
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3)
        self.drop = nn.Dropout(p)
        self.fc = nn.Linear(4 * 2 * 2, 3)

    def forward(self, x):
        x = F.max_pool2d(F.relu(self.conv(x)), 3)
        x = x.view(-1, 4 * 2 * 2)
        return self.fc(self.drop(x))


class ReshapeNet(ViewNet):
    def forward(self, x):
        x = self.drop(F.max_pool2d(F.relu(self.conv(x)), 3))  # dropout on the NHWC activations
        return self.fc(x.reshape(x.shape[0], -1))


def _data(n=32):
    g = torch.Generator().manual_seed(0)
    return torch.randn(n, 3, 8, 8, generator=g), torch.randint(0, 3, (n,), generator=g)


def _fit(model, eval_data=None, callbacks=None, **cfg):
    cfg = {"steps": 4, "batch_size": 8, **cfg}
    return gputrain.fit(model, _data(), loss_fn=nn.CrossEntropyLoss(), eval_data=eval_data, callbacks=callbacks,
                        config=gputrain.TrainConfig(**cfg))


def _decision(history, name="channels_last"):
    return {d["name"]: d for d in history.summary["decisions"]}[name]


@pytest.fixture
def cuda_rule(monkeypatch):
    """The CUDA rule on the CPU: the first step checks NHWC (no error, same loss), as on one CUDA GPU."""
    real = speed_mod._layout

    def check(value, conv, device, world_size, probe_layout, reasons):
        on, probe = real(value, conv, device, world_size, probe_layout, reasons)
        if value == "auto" and conv and probe_layout and world_size == 1:
            reasons["channels_last"] = "decided on the first batch: NHWC kept where it runs and gives the same loss"
            return False, "check"
        return on, probe

    monkeypatch.setattr(speed_mod, "_layout", check)


def test_the_cpu_keeps_the_users_layout_by_rule_and_names_autotune():
    history = _fit(ReshapeNet())
    d = _decision(history)
    assert d["value"] == "off" and "a timing must not decide" in d["reason"] and "--autotune" in d["reason"], d


def test_no_timing_decides_a_seeded_runs_numbers(monkeypatch):
    """The same seeded run of a conv net ends with the same weights and decisions whatever the machine's
    clock says: one run under a clock whose every interval is longer than the one before (what comes
    later looks slower: a machine that got loaded), one under a clock whose intervals shrink (what comes
    later looks faster). A layout chosen by timing NCHW against NHWC would differ between the two."""
    import itertools
    import time as time_mod

    real = time_mod.perf_counter

    def run(sign: float):
        calls = itertools.count()
        monkeypatch.setattr(time_mod, "perf_counter", lambda: real() + sign * 1e-3 * next(calls) ** 2)
        torch.manual_seed(0)
        model = ReshapeNet(p=0.3)
        history = _fit(model, steps=220, log_every=55)
        monkeypatch.setattr(time_mod, "perf_counter", real)
        return model.state_dict(), _decision(history)

    (slower, d1), (faster, d2) = run(+1.0), run(-1.0)
    assert d1 == d2, (d1, d2)
    assert all(torch.equal(slower[k], faster[k]) for k in slower)


def test_view_after_conv_refuses_nhwc_naming_the_line_and_trains_as_without_the_probe(cuda_rule):
    torch.manual_seed(0)
    probed_model = ViewNet(p=0.3)
    history = _fit(probed_model)
    d = _decision(history)
    assert d["value"] == "off" and d["reason"].startswith("NHWC refused by your code: "), d  # by the probe
    assert f"`{VIEW_LINE}` at {__file__}:" in d["reason"] and "view size is not compatible" in d["reason"]
    torch.manual_seed(0)
    plain = ViewNet(p=0.3)
    _fit(plain, channels_last=False)
    # The probe ran on copies from a forked RNG: the run is bit-equal to one that never probed.
    for a, b in zip(probed_model.state_dict().values(), plain.state_dict().values()):
        assert torch.equal(a, b)


def test_cuda_rule_keeps_nhwc_that_agrees_and_refuses_a_view(cuda_rule, caplog):
    model = ReshapeNet(p=0.3)  # dropout on NHWC draws other masks: compared again in eval mode
    history = _fit(model)
    d = _decision(history)
    assert d["value"] == "on" and "CUDA rule keeps NHWC" in d["reason"], d
    assert model.conv.weight.is_contiguous()  # back in the user's layout after fit
    assert _decision(_fit(ViewNet()))["value"] == "off"


def test_a_later_nhwc_failure_is_retried_once_in_the_users_layout(caplog):
    model = ViewNet()
    with caplog.at_level(logging.WARNING, logger="gputrain"):
        history = _fit(model, channels_last=True, eval_data=_data(16))  # forced: no probe
    lines = [r.getMessage() for r in caplog.records if "runs again in your layout" in r.getMessage()]
    assert len(lines) == 1 and VIEW_LINE in lines[0]
    assert history.summary["final_eval_loss"] == history.summary["final_eval_loss"]  # evaluation ran (NCHW inputs)
    d = _decision(history)
    assert d["value"] == "off" and d["reason"].startswith("switched off during the run")
    assert model.conv.weight.is_contiguous()


def test_user_memory_format_is_given_back_after_fit_evaluate_and_predict():
    model = ReshapeNet().to(memory_format=torch.channels_last)
    _fit(model, channels_last=False)
    assert model.conv.weight.is_contiguous(memory_format=torch.channels_last)
    plain = ReshapeNet()
    _fit(plain, channels_last=True)
    assert plain.conv.weight.is_contiguous()
    x, y = _data(8)
    gputrain.evaluate(plain, (x, y), loss_fn=nn.CrossEntropyLoss())
    gputrain.predict(plain, x)
    assert plain.conv.weight.is_contiguous()


def test_wgan_gp_grad_view_in_a_step_of_your_own_refuses_nhwc(cuda_rule):
    model = nn.ModuleDict({"critic": nn.Sequential(nn.Conv2d(3, 4, 3), nn.Flatten(), nn.Linear(4 * 6 * 6, 1))})

    def step_fn(step, batch):
        real, _ = batch
        real = real.requires_grad_(True)
        out = step.model["critic"](real)
        grad = torch.autograd.grad(out.sum(), real, create_graph=True)[0]
        grad = grad.view(grad.size(0), -1)
        penalty = ((grad.norm(2, dim=1) - 1) ** 2).mean()
        loss = -out.mean() + 10 * penalty
        step.backward(loss)
        step.step("critic")
        return loss

    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    history = gputrain.fit(model, _data(), step_fn=step_fn, optimizer={"critic": opt},
                           config=gputrain.TrainConfig(steps=2, batch_size=8))
    reason = _decision(history)["reason"]
    assert "`grad = grad.view(grad.size(0), -1)` at" in reason and __file__ in reason


def test_a_step_of_your_own_that_zeroes_its_gradients_first_is_probed_and_trains_as_unprobed(cuda_rule):
    """The usual order, zero_grad -> backward -> step, in your own step: the probe runs it (its
    zero_grad included: one that raises turns NHWC off) on its copy of the model, keeps NHWC, and the
    run's own weights end as those of a run that no probe ran before."""

    def step_fn(step, batch):
        x, y = batch
        step.zero_grad()
        loss = F.cross_entropy(step.model(x), y)
        step.backward(loss)
        step.step()
        return loss

    def run(channels_last):
        torch.manual_seed(0)
        model = ReshapeNet()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        cfg = gputrain.TrainConfig(steps=4, batch_size=8, channels_last=channels_last)
        return model, gputrain.fit(model, _data(), step_fn=step_fn, optimizer=opt, config=cfg)

    probed_model, history = run("auto")
    d = _decision(history)
    assert d["value"] == "on" and "CUDA rule keeps NHWC" in d["reason"], d
    plain, _ = run(False)
    for a, b in zip(probed_model.parameters(), plain.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_first_step_note_names_gputrains_choices_before_the_shapes(monkeypatch):
    def unprobed_rule(value, conv, device, world_size, probe_layout, reasons):  # as with several CUDA processes
        reasons["channels_last"] = "the CUDA rule, not probed"
        return True, None

    monkeypatch.setattr(speed_mod, "_layout", unprobed_rule)
    model = ReshapeNet()
    x, _ = _data()
    with pytest.raises(IndexError) as info:  # labels out of range: a failure of the user's data
        gputrain.fit(model, (x, torch.full((32,), 7)), loss_fn=nn.CrossEntropyLoss(),
                     config=gputrain.TrainConfig(steps=2, batch_size=8))
    note = [n for n in info.value.__notes__ if "first training step failed" in n][0]
    assert "choices gputrain made for you" in note and "channels_last=False" in note
    assert note.index("channels_last") < note.index("the batch:")


def test_choices_made_lists_what_gputrain_chose_and_a_requested_autocast():
    s = SpeedSwitches(True, False, True, False, {"channels_last": "probed", "cuda_graphs": "requested"})
    made = choices_made(s, "bf16", torch.bfloat16)
    assert made[0].startswith("channels_last") and "precision='fp32'" in made[1] and len(made) == 2
    asked = choices_made(s, "bf16", torch.bfloat16, precision_asked="bf16")  # named, as the user's
    assert asked[0] == made[0] and asked[1].startswith("bf16 autocast, as you requested (off: precision='fp32'")
    note = first_step_note((torch.zeros(2, 3), torch.zeros(2)), nn.Linear(3, 1), choices=made)
    assert note.index("channels_last") < note.index("the batch:")


def test_autotune_never_picks_a_channels_last_set_whose_step_fell_back():
    from gputrain.diagnostics.autotune import run_trial

    class Workload:
        task = "classification"

        def make_model(self):
            return ViewNet()

        def make_data(self):
            return _data()

        def loss_kwargs(self):
            return {"loss_fn": nn.CrossEntropyLoss()}

    config = gputrain.TrainConfig(batch_size=8, device="cpu")
    assert run_trial(Workload(), config, {"channels_last": False}, steps=1, warmup=1)["status"] == "ok"
    row = run_trial(Workload(), config, {"channels_last": True}, steps=1, warmup=1)
    assert row["status"].startswith("error: channels_last refused: switched off during the run") and VIEW_LINE in row["status"]


class PartialBatchView(ViewNet):
    """NHWC runs until the last partial batch (4 samples) takes a `.view`: a data-dependent failure."""

    def forward(self, x):
        x = F.max_pool2d(F.relu(self.conv(x)), 3)
        x = x.view(4, -1) if x.shape[0] == 4 else x.reshape(x.shape[0], -1)
        return self.fc(x)


def test_a_fall_back_after_graphs_were_captured_trains_on_the_new_tensors(capture_graphs, caplog):
    """The captured graphs hold the NHWC tensors' memory: after the fall-back they are captured again,
    so the run ends bit-equal to the same run stepped eagerly (a stale graph would update old memory)."""
    from graph_capture import EagerGraphs

    def run():
        torch.manual_seed(0)
        model = PartialBatchView()
        history = gputrain.fit(model, _data(36), loss_fn=nn.CrossEntropyLoss(),
                               config=gputrain.TrainConfig(steps=10, batch_size=8, channels_last=True, log_every=5))
        return model, history

    with caplog.at_level(logging.WARNING, logger="gputrain"):
        graphed, history = run()
    assert history.summary["cuda_graphs"].startswith("on"), history.summary["cuda_graphs"]
    assert sum("runs again in your layout" in r.getMessage() for r in caplog.records) == 1
    capture_graphs(EagerGraphs)
    eager, _ = run()
    for a, b in zip(graphed.state_dict().values(), eager.state_dict().values()):
        assert torch.equal(a, b)


class BatchNormNet(nn.Module):
    """A conv net with BatchNorm: 4-D weights and running statistics that NHWC re-lays out."""

    def __init__(self):
        super().__init__()
        self.conv, self.bn, self.fc = nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.Linear(4 * 6 * 6, 3)
        self.register_buffer("seen", torch.zeros(1, 3, 2, 2))  # a 4-D buffer the forward updates

    def forward(self, x):
        if self.training:
            with torch.no_grad():
                self.seen.mul_(0.9).add_(F.adaptive_avg_pool2d(x, 2).mean(0, keepdim=True), alpha=0.1)
        return self.fc(F.relu(self.bn(self.conv(x))).reshape(x.shape[0], -1))


@pytest.mark.parametrize("forced", [False, True], ids=["nhwc-from-the-first-step", "nhwc-then-a-fall-back"])
def test_ema_follows_the_weights_when_the_layout_changes_during_the_run(cuda_rule, forced, monkeypatch):
    """The layout is changed at the first step (NHWC kept by the probe) or back mid-run (a fall-back):
    the EMA's average must go on following the live weights and buffers, not the tensors they were
    before the change (an average of stale tensors stays near the initial weights)."""
    if forced:  # NHWC from the start, then a step that fails in NHWC once: the fall-back re-lays out mid-run
        calls = {"n": 0}
        real = BatchNormNet.forward

        def flaky(self, x):
            calls["n"] += 1
            if calls["n"] == 3 and x.is_contiguous(memory_format=torch.channels_last) and not x.is_contiguous():
                raise RuntimeError("view size is not compatible with input tensor's size and stride")
            return real(self, x)

        monkeypatch.setattr(BatchNormNet, "forward", flaky)
    runs = {}
    for nhwc in (True, False):
        torch.manual_seed(0)
        model, ema = BatchNormNet(), gputrain.EMA(0.5, warmup=False)
        cfg = {"channels_last": True} if (nhwc and forced) else {} if nhwc else {"channels_last": False}
        # SGD: Adam's normalized steps would magnify NHWC's last-bit differences in near-zero gradients
        gputrain.fit(model, _data(), loss_fn=nn.CrossEntropyLoss(), callbacks=[ema],
                     optimizer=lambda params: torch.optim.SGD(params, lr=0.1),
                     config=gputrain.TrainConfig(steps=8, batch_size=8, **cfg))
        runs[nhwc] = ({k: v.clone() for k, v in ema.state_dict().items()}, model)
    (nhwc_ema, nhwc_model), (plain_ema, plain_model) = runs[True], runs[False]
    for name, value in plain_ema.items():
        assert torch.allclose(nhwc_ema[name].float(), value.float(), atol=1e-4), name
    # And the average really moved with training (it is not the initial weights).
    torch.manual_seed(0)
    initial = BatchNormNet().state_dict()
    assert not torch.allclose(plain_ema["conv.weight"], initial["conv.weight"], atol=1e-3)
