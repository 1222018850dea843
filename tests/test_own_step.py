"""A step of your own (train/step/own_step.py): the GAN, distillation and gradient-penalty examples of
docs/examples/own_step.py train, resume bit-equal, read nothing on the host per step, replay from a
CUDA graph (the CPU stand-in) like eager steps, and every misuse is one clear line."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import gputrain
from gputrain import TrainConfig, fit
from gputrain.errors import ConfigError, DataError

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "docs" / "examples"))
import own_step as examples  # noqa: E402

from helpers import docs_page, params, records_without_timings, run_python, subprocess_env, torchrun  # noqa: E402

CFG = dict(device="cpu", batch_size=64, log_every=8, loggers=("csv",), seed=5)


def _teacher() -> nn.Module:
    torch.manual_seed(2)
    teacher = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 10))
    fit(teacher, examples.digits(), loss_fn=nn.CrossEntropyLoss(), config=TrainConfig(**{**CFG, "steps": 100, "lr": 3e-3}))
    return teacher


TEACHER: list[nn.Module] = []


def _case(name: str):
    """(model, fit keyword arguments) of one example, fresh each call."""
    if name == "gan":
        model = examples.GAN()
        return model, {"step_fn": examples.gan_step, "optimizer": examples.gan_optimizers(model)}
    if name == "penalty":
        model = examples.GAN()
        return model, {"step_fn": examples.penalty_step, "optimizer": examples.gan_optimizers(model)}
    if not TEACHER:
        TEACHER.append(_teacher())
    import copy

    model = examples.Distill(copy.deepcopy(TEACHER[0]))
    return model, {"step_fn": examples.distill_step, "loss_fn": nn.CrossEntropyLoss(),
                   "optimizer": {"student": lambda m: torch.optim.AdamW(m.student.parameters(), lr=3e-3)},
                   "scheduler": {"student": lambda opt: torch.optim.lr_scheduler.StepLR(opt, 40, 0.5)}}


@pytest.mark.parametrize("name", ["gan", "distill", "penalty"])
def test_the_examples_train_and_resume_bit_equal(name, tmp_path):
    """Each example trains 40 steps straight, and stopped at step 20 and resumed: the same weights
    and the same logged losses (every optimizer, scheduler and random generator came back)."""
    # The same checkpoints in both runs: a checkpoint reads the device sums, which decides their rounding.
    model, kw = _case(name)
    history = fit(model, examples.digits(), config=TrainConfig(**CFG, steps=40, run_dir=str(tmp_path / "whole"),
                                                               checkpoint_every=10), **kw)
    whole = (params(model), records_without_timings(history))
    first, kw = _case(name)
    part = TrainConfig(**CFG, steps=40, run_dir=str(tmp_path / "part"), checkpoint_every=10)
    fit(first, examples.digits(), config=part.replace(stop_at_step=20), **kw)
    resumed, kw = _case(name)
    history = fit(resumed, examples.digits(), config=part.replace(resume=True), **kw)
    assert torch.equal(params(resumed), whole[0]), f"{name}: resumed weights differ"
    assert records_without_timings(history) == whole[1]
    record = history.records[-1]
    named = {"gan": ("d_loss", "g_loss"), "distill": ("kd_loss", "ce_loss"), "penalty": ("critic", "penalty", "g_loss")}
    assert all(k in record for k in named[name]) and torch.isfinite(torch.tensor(record["loss"]))
    if name == "gan":
        assert record["lr_generator"] == record["lr_discriminator"] == 2e-3
    if name == "distill":
        assert history.final("eval_accuracy") is None or history.final("eval_accuracy") > 0.5


def test_distillation_learns_from_the_teacher_and_leaves_it_frozen():
    model, kw = _case("distill")
    teacher_before = params(model.teacher).clone()
    history = fit(model, examples.digits(), eval_data=examples.digits(300), config=TrainConfig(**CFG, steps=80), **kw)
    assert torch.equal(params(model.teacher), teacher_before)
    assert history.final("eval_accuracy") > 0.75, history.records[-1]  # 10 classes, 80 steps of a 64-16-10 student
    assert history.records[-1]["kd_loss"] < 0.5 * history.records[0]["kd_loss"]  # it follows the teacher
    assert history.records[-1]["lr"] == pytest.approx(3e-3 * 0.5 ** 2)  # StepLR(40, 0.5), 80 student steps


def test_the_gan_learns_the_digits_marginals():
    """After training, generated digits have pixel means near the data's (a sanity bar, not a FID)."""
    model, kw = _case("gan")
    fit(model, examples.digits(), config=TrainConfig(**CFG, epochs=15), **kw)
    real = examples.digits()[0]
    with torch.no_grad():
        fake = model.generator(torch.randn(2000, examples.NOISE))
    untrained = examples.GAN().generator(torch.randn(2000, examples.NOISE)).detach()
    gap, gap_before = (fake.mean(0) - real.mean(0)).abs().mean(), (untrained.mean(0) - real.mean(0)).abs().mean()
    assert gap < 0.5 * gap_before, (gap, gap_before)


def test_a_step_of_your_own_reads_nothing_on_the_host_per_step():
    from gputrain.diagnostics.syncs import watch_host_reads
    from gputrain.train.loop.trainer import Trainer

    model, kw = _case("gan")
    trainer = Trainer(model, examples.digits(), config=TrainConfig(**{**CFG, "steps": 100, "log_every": 100}), **kw)
    try:
        trainer.run_steps(2)
        with watch_host_reads() as reads:
            for _ in range(5):
                trainer.train_one_step()
        assert reads.total == 0, reads.result(5)["sites"]
        trainer.run_steps(93)  # to the log point: one read of every sum
        assert trainer.parts.history.records[-1]["step"] == 100 and "d_loss" in trainer.parts.history.records[-1]
    finally:
        trainer.close()


def _capturable_gan(step_fn=examples.gan_step):
    """A GAN with capturable optimizers (their lr a tensor), and `step_fn`."""
    model = examples.GAN()
    make = lambda ps: torch.optim.AdamW(ps, lr=torch.tensor(2e-3), betas=(0.5, 0.999), fused=True, capturable=True)  # noqa: E731
    return model, {"step_fn": step_fn,
                   "optimizer": {"generator": make(model.generator.parameters()),
                                 "discriminator": make(model.discriminator.parameters())}}


def test_cuda_graphs_capture_the_step_when_asked_and_replay_it_like_eager_steps(capture_graphs):
    from graph_capture import CaptureGraphs, EagerGraphs

    def run(**config):
        model, kw = _capturable_gan()
        history = fit(model, examples.digits(), config=TrainConfig(**{**CFG, "steps": 24, **config}), **kw)
        return params(model), [(r["d_loss"], r["g_loss"]) for r in history.records], history.summary["cuda_graphs"]

    graphed = run(cuda_graphs=True)
    replays = sum(g.replays for b in CaptureGraphs.instances for g in b.graphs)
    capture_graphs(EagerGraphs)
    eager = run(cuda_graphs=True)
    assert graphed[2].startswith("on") and replays >= 15
    assert torch.equal(graphed[0], eager[0]) and graphed[1] == eager[1]
    auto = run()  # not asked: the reason names the step
    assert auto[2].startswith("off: a step of your own (gan_step) is captured only when asked")


def test_accumulated_micro_batches_make_the_step_of_one_batch():
    """Distillation has no randomness: 2 micro-batches of 32 step like one batch of 64."""
    a, kw = _case("distill")
    fit(a, examples.digits(), config=TrainConfig(**{**CFG, "batch_size": 32, "accumulate": 2, "steps": 5}), **kw)
    b, kw = _case("distill")
    fit(b, examples.digits(), config=TrainConfig(**{**CFG, "steps": 5}), **kw)
    assert torch.allclose(params(a.student), params(b.student), atol=1e-5)


def _fit_step(step_fn, optimizer=None, **config):
    model = examples.GAN()
    return fit(model, examples.digits(), step_fn=step_fn, optimizer=optimizer or examples.gan_optimizers(model),
               config=TrainConfig(**{**CFG, "steps": 2, **config}))


def test_each_misuse_is_one_clear_line():
    def no_backward(step, batch):
        return step.model.discriminator(batch[0]).mean()

    def no_step(step, batch):
        loss = step.model.discriminator(batch[0]).mean()
        step.backward(loss)
        return loss

    def wrong_name(step, batch):
        step.backward(step.model.discriminator(batch[0]).mean())
        step.step("critic")
        return torch.zeros(())

    def not_a_loss(step, batch):
        out = step.model.discriminator(batch[0])
        step.backward(out.mean())
        step.step("discriminator")
        return out

    with pytest.raises(ConfigError, match=r"without calling step\.backward\(loss\)"):
        _fit_step(no_backward)
    with pytest.raises(ConfigError, match=r"never called step\.step\(name\)"):
        _fit_step(no_step)
    with pytest.raises(ConfigError, match=r"no optimizer named 'critic': this run has \['discriminator', 'generator'\]"):
        _fit_step(wrong_name)
    with pytest.raises(DataError, match="return the loss .* or a dict of named scalar losses"):
        _fit_step(not_a_loss)
    frozen = examples.GAN()
    frozen.generator.requires_grad_(False)
    with pytest.raises(ConfigError, match="optimizer 'generator' holds no parameter that trains"):
        fit(frozen, examples.digits(), step_fn=examples.gan_step, optimizer=examples.gan_optimizers(frozen),
            config=TrainConfig(**CFG, steps=1))
    shared = examples.GAN()
    with pytest.raises(ConfigError, match="a parameter is in both optimizer"):
        fit(shared, examples.digits(), step_fn=examples.gan_step, config=TrainConfig(**CFG, steps=1),
            optimizer={"generator": torch.optim.Adam(shared.parameters()),
                       "discriminator": torch.optim.Adam(shared.discriminator.parameters())})
    with pytest.raises(ConfigError, match="on_nan='skip'"):
        _fit_step(examples.gan_step, on_nan="skip")
    with pytest.raises(ConfigError, match="compile the parts inside your step"):
        _fit_step(examples.gan_step, compile=True)
    with pytest.raises(ConfigError, match=r"scheduler names \['critic'\] are not optimizers of this run"):
        model = examples.GAN()
        fit(model, examples.digits(), step_fn=examples.gan_step, optimizer=examples.gan_optimizers(model),
            scheduler={"critic": lambda opt: torch.optim.lr_scheduler.StepLR(opt, 5)}, config=TrainConfig(**CFG, steps=1))


def test_one_optimizer_may_be_the_default_and_the_loss_a_tensor():
    """With one optimizer, step.step() needs no name; optimizer=None is the default AdamW."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 10))

    def step_fn(step, batch):
        loss = F.cross_entropy(step.model(batch[0]), batch[1])
        step.backward(loss)
        step.step()
        return loss

    history = fit(model, examples.digits(), step_fn=step_fn, config=TrainConfig(**CFG, steps=40))
    assert history.records[0]["loss"] > history.records[-1]["loss"]
    assert history.summary["optimizer"] == "AdamW (fused), stepped by step_fn" and "step_fn=step_fn" in history.summary["loss"]
    reason = next(d["reason"] for d in history.summary["decisions"] if d["name"] == "optimizer")
    assert reason == "the default: AdamW, stepped by your step_fn"


def test_a_callback_changes_every_optimizers_learning_rate():
    class Halve(gputrain.Callback):
        def on_log(self, run, record):
            if record["step"] == 8:
                run.scale_lr(0.5)

    model, kw = _case("gan")
    history = fit(model, examples.digits(), callbacks=[Halve()], config=TrainConfig(**CFG, steps=16), **kw)
    assert history.records[-1]["lr_generator"] == history.records[-1]["lr_discriminator"] == 1e-3


@pytest.mark.slow
@pytest.mark.processes
@pytest.mark.parametrize("sharding", ["ddp", "fsdp2"])
def test_two_processes_average_each_optimizers_gradients_and_resume_exactly(sharding, tmp_path):
    """Two processes (gloo, torchrun) with a step of your own and two optimizers: the step context
    averages each optimizer's gradients (ddp), or FSDP2's hooks reduce-scatter them in backward and
    the context leaves them be (fsdp2: shard=True, the parameters sharded DTensors), so 2 x 32
    samples step like one process's 64; stopped at step 4 (sharded checkpoints, every optimizer by
    name) and resumed, the run ends where the uninterrupted one does.

    Slow: 85-88 s each on this machine (the serial suite, 2026-11-28, load 5-14): three torchrun starts
    (uninterrupted, stopped, resumed), each three interpreters."""
    import json


    env = subprocess_env(SHARD="1" if sharding == "fsdp2" else "0")

    script = str(Path(__file__).parent / "dist_scripts" / "own_step_ddp.py")

    def result(run_dir):
        return json.loads((run_dir / "result.json").read_text())

    run_python([script, str(tmp_path / "one"), "64", "8"])
    torchrun([script, str(tmp_path / "two"), "32", "8"], env=env)
    torchrun([script, str(tmp_path / "resumed"), "32", "8", "4"], env=env)
    torchrun([script, str(tmp_path / "resumed"), "32", "8"], env=env)
    one, two, resumed = result(tmp_path / "one"), result(tmp_path / "two"), result(tmp_path / "resumed")
    assert any(name.endswith(".dcp") for name in two["checkpoints"])  # several processes: the sharded format
    for a, b in zip(one["params"], two["params"]):
        assert torch.allclose(torch.tensor(a), torch.tensor(b), atol=1e-6)
    assert [r["kd"] for r in one["records"]] == pytest.approx([r["kd"] for r in two["records"]], rel=1e-5)
    assert resumed["params"] == two["params"] and resumed["records"] == two["records"]


def test_the_gan_step_is_the_hand_written_loop():
    """Full-batch GAN steps through fit equal a hand-written loop of the same step: zero_grad,
    backward, optimizer step for D, then for G (the context adds nothing of its own, and clears
    every gradient between steps as the loop's zero_grad does)."""
    x = examples.digits(256)
    model, kw = _case("gan")
    fit(model, x, config=TrainConfig(**{**CFG, "batch_size": 256, "steps": 6}), **kw)

    ref = examples.GAN()
    opts = examples.gan_optimizers(ref)
    torch.manual_seed(CFG["seed"])
    real = x[0]
    for _ in range(6):
        for opt in opts.values():
            opt.zero_grad(set_to_none=True)
        fake = ref.generator(torch.randn(256, examples.NOISE))
        ones = torch.ones(256, 1)
        d_loss = F.binary_cross_entropy_with_logits(ref.discriminator(real), ones) + \
            F.binary_cross_entropy_with_logits(ref.discriminator(fake.detach()), 1 - ones)
        d_loss.backward()
        opts["discriminator"].step()
        opts["generator"].zero_grad(set_to_none=True)
        opts["discriminator"].zero_grad(set_to_none=True)
        F.binary_cross_entropy_with_logits(ref.discriminator(fake), ones).backward()
        opts["generator"].step()
    assert torch.allclose(params(model), params(ref), atol=1e-5), (params(model) - params(ref)).abs().max()


def test_bf16_autocast_runs_your_step_and_its_backward_outside_autocast(monkeypatch):
    """Under bf16 the step_fn's forward runs in autocast; step.backward leaves autocast for the backward."""
    seen = []
    real_backward = torch.Tensor.backward

    def watch(self, *args, **kwargs):
        seen.append(torch.is_autocast_enabled("cpu"))
        return real_backward(self, *args, **kwargs)

    monkeypatch.setattr(torch.Tensor, "backward", watch)
    model, kw = _case("distill")
    dtypes = []
    inner = kw["step_fn"]

    def step_fn(step, batch):
        dtypes.append(step.model.student(batch[0]).dtype)
        return inner(step, batch)

    history = fit(model, examples.digits(), config=TrainConfig(**{**CFG, "steps": 20, "precision": "bf16"}),
                  **{**kw, "step_fn": step_fn})
    assert set(dtypes) == {torch.bfloat16} and seen and not any(seen)
    assert history.records[-1]["kd_loss"] < history.records[0]["kd_loss"]


def test_the_docs_show_the_examples_gan_step():
    import inspect

    assert inspect.getsource(examples.gan_step).strip() in docs_page("how-to/own-step.md")


def test_zero_grad_clears_the_named_optimizers_gradients_only():
    """step.zero_grad(name) drops what earlier backwards left on that optimizer's parameters: a step
    that backwards a throw-away loss, clears, then backwards the real one trains exactly as a step
    of the real loss alone; the other optimizer's gradients are kept."""
    x = torch.randn(64, 4, generator=torch.Generator().manual_seed(0))

    def run(clear: bool):
        torch.manual_seed(0)
        model = nn.ModuleDict({"a": nn.Linear(4, 1), "b": nn.Linear(4, 1)})
        kept = {}

        def step_fn(step, batch):
            (xb,) = batch
            if clear:
                step.backward(step.model["a"](xb).pow(3).mean() + step.model["b"](xb).mean())  # thrown away for "a"
                step.zero_grad("a")
                kept["b"] = step.model["b"].weight.grad is not None
            loss = step.model["a"](xb).pow(2).mean()
            step.backward(loss)
            step.step("a")
            return loss

        optimizers = {"a": lambda m: torch.optim.SGD(m["a"].parameters(), lr=0.1),
                      "b": lambda m: torch.optim.SGD(m["b"].parameters(), lr=0.1)}
        fit(model, (x,), step_fn=step_fn, optimizer=optimizers, config=TrainConfig(**{**CFG, "steps": 3}))
        return params(model["a"]), kept

    cleared, kept = run(True)
    alone, _ = run(False)
    assert torch.equal(cleared, alone) and kept == {"b": True}


def test_in_fp16_your_step_unscales_clips_and_steps_through_the_scaler_as_the_built_in_step():
    """Your step's optimizers step through the built-in step's own code (TrainStep.clip and
    step_optimizer_): in fp16 each optimizer's gradients are unscaled and clipped, each steps through
    the GradScaler, and the scale is updated once, after both. Equal to torch's AMP recipe written by
    hand (fp16 autocast and GradScaler on the CPU: gputrain refuses fp16 there for speed, not for
    correctness, so the step is built directly)."""
    from gputrain.runtime.precision import Precision, RunPrecision
    from gputrain.train.optim.by_name import OptimizerSet
    from gputrain.train.step.own_step import OwnStep

    cpu = torch.device("cpu")
    fp16 = Precision("fp16", torch.float16, True, False, "fp16 for the test")
    torch.manual_seed(0)
    model = examples.GAN()
    ref = examples.GAN()
    ref.load_state_dict(model.state_dict())
    noise = [torch.randn(32, examples.NOISE) for _ in range(4)]
    real = examples.digits(32)[0]

    def losses(net, z):
        fake = net.generator(z)
        ones = torch.ones(32, 1)
        d = F.binary_cross_entropy_with_logits(net.discriminator(real), ones) + \
            F.binary_cross_entropy_with_logits(net.discriminator(fake.detach()), 1 - ones)
        return d, lambda: F.binary_cross_entropy_with_logits(net.discriminator(fake), ones)

    calls = iter(noise)

    def step_fn(step, batch):
        d, g = losses(step.model, next(calls))
        step.backward(d)
        step.step("discriminator")
        g_loss = g()
        step.backward(g_loss)
        step.step("generator")
        return {"d": d, "g": g_loss}

    precision = RunPrecision(fp16, cpu)
    own = OwnStep(step_fn, model, model, OptimizerSet(examples.gan_optimizers(model)), None, precision,
                  device=cpu, max_grad_norm=0.5)
    for _ in noise:
        own([real])

    opts = examples.gan_optimizers(ref)
    scaler = torch.amp.GradScaler("cpu")
    for z in noise:
        with torch.autocast("cpu", dtype=torch.float16, cache_enabled=False):
            d, g = losses(ref, z)
        scaler.scale(d.float()).backward()
        for name in ("discriminator",):
            scaler.unscale_(opts[name])
            nn.utils.clip_grad_norm_(getattr(ref, name).parameters(), 0.5)
            scaler.step(opts[name])
        for p in ref.discriminator.parameters():
            p.grad = None
        with torch.autocast("cpu", dtype=torch.float16, cache_enabled=False):
            g_loss = g()
        scaler.scale(g_loss.float()).backward()
        scaler.unscale_(opts["generator"])
        nn.utils.clip_grad_norm_(ref.generator.parameters(), 0.5)
        scaler.step(opts["generator"])
        scaler.update()
        for p in ref.parameters():
            p.grad = None
    assert precision.scaler.get_scale() == scaler.get_scale()
    assert torch.equal(params(model), params(ref)), (params(model) - params(ref)).abs().max()
