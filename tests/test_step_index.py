"""step.index and step.micro_index in a step of your own (train/step/own_step.py), and named losses returned
on some steps only: an n_critic WGAN-GP that branches on step.index resumes bit-equal from a stop at
any step, its generator loss is logged as the mean over the steps that returned it (and how many),
nothing is read on the host per step, and a CUDA graph (the CPU stand-in) does not capture a step
that reads step.index, with the reason in the decisions."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from gputrain import TrainConfig, fit

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "docs" / "examples"))
import own_step as examples  # noqa: E402

from helpers import params, records_without_timings  # noqa: E402
from test_own_step import _capturable_gan  # noqa: E402

CFG = dict(device="cpu", batch_size=64, log_every=8, loggers=("csv",), seed=5)
STEPS = 30


def _wgan(step_fn=examples.wgan_gp_step):
    model = examples.GAN()
    return model, {"step_fn": step_fn, "optimizer": examples.gan_optimizers(model)}


STRAIGHT: list = []


def _straight():
    if not STRAIGHT:
        model, kw = _wgan()
        history = fit(model, examples.digits(), config=TrainConfig(**CFG, steps=STEPS), **kw)
        STRAIGHT.extend([params(model), records_without_timings(history)])
    return STRAIGHT


@pytest.mark.parametrize("stop", [1, 7, 23])
def test_an_n_critic_wgan_gp_stopped_at_any_step_resumes_bit_equal(stop, tmp_path):
    """The generator steps on step.index % 5 == 4: after a resume step.index goes on from the stop, so
    the generator steps on the same steps as in the straight run, and the run ends on its weights."""
    weights, records = _straight()
    cfg = TrainConfig(**CFG, steps=STEPS, run_dir=str(tmp_path / "run"))
    model, kw = _wgan()
    fit(model, examples.digits(), config=cfg.replace(stop_at_step=stop), **kw)
    resumed, kw = _wgan()
    history = fit(resumed, examples.digits(), config=cfg.replace(resume=True), **kw)
    assert torch.equal(params(resumed), weights), f"stopped at {stop}: resumed weights differ"
    got = records_without_timings(history)
    assert [sorted(r) for r in got] == [sorted(r) for r in records]
    for a, b in zip(got, records):  # the stop's checkpoint read the device sums: other float groupings
        assert a == pytest.approx(b, rel=1e-5)


def test_the_generator_loss_is_the_mean_over_the_steps_that_returned_it():
    """critic every step, g_loss on the steps of index 4, 9, 14, ... (the 5th of each 5): each log point
    of 8 steps has g_loss over its generator steps only, and g_loss_steps says how many."""
    _, records = _straight()
    # indices 0-7: 4; 8-15: 9, 14; 16-23: 19; 24-29: 24, 29
    assert [r["g_loss_steps"] for r in records] == [1, 2, 1, 2] and all("g_loss" in r for r in records)
    assert all("critic_steps" not in r and "penalty_steps" not in r for r in records)


def test_named_losses_on_some_steps_are_averaged_over_those_steps_across_a_resume(tmp_path):
    """A step returns a = index every step and b = 10 * index on every third step: with log points
    every 6 steps, a is the mean of 6 indices, b the mean over its 2 steps; stopped mid-interval and
    resumed (the counts in the checkpoint), the records are the same."""
    x = torch.randn(64, 4, generator=torch.Generator().manual_seed(0))

    def step_fn(step, batch):
        loss = step.model(batch[0]).pow(2).mean()
        step.backward(loss)
        step.step()
        out = {"a": torch.tensor(float(step.index))}
        if step.index % 3 == 0:
            out["b"] = torch.tensor(10.0 * step.index)
        return out

    def run(**config):
        torch.manual_seed(0)
        cfg = TrainConfig(**{**CFG, "batch_size": 64, "log_every": 6, "steps": 12, **config})
        return fit(nn.Linear(4, 1), (x,), step_fn=step_fn, config=cfg)

    want = [{"a": 2.5, "b": 15.0, "b_steps": 2}, {"a": 8.5, "b": 75.0, "b_steps": 2}]
    got = [{k: r[k] for k in ("a", "b", "b_steps")} for r in run().records]
    assert got == want
    cfg = dict(run_dir=str(tmp_path / "run"))
    run(**cfg, stop_at_step=4)
    history = run(**cfg, resume=True)
    assert [{k: r[k] for k in ("a", "b", "b_steps")} for r in history.records] == want


def test_step_index_and_micro_index_count_the_runs_steps_and_micro_batches(tmp_path):
    seen = []
    x = torch.randn(64, 4, generator=torch.Generator().manual_seed(0))

    def step_fn(step, batch):
        seen.append((step.index, step.micro_index))
        loss = step.model(batch[0]).pow(2).mean()
        step.backward(loss)
        step.step()
        return loss

    cfg = TrainConfig(**{**CFG, "batch_size": 16, "accumulate": 2, "steps": 5, "run_dir": str(tmp_path / "run")})
    fit(nn.Linear(4, 1), (x,), step_fn=step_fn, config=cfg.replace(stop_at_step=3))
    fit(nn.Linear(4, 1), (x,), step_fn=step_fn, config=cfg.replace(resume=True))
    assert seen == [(i, m) for i in range(5) for m in (0, 1)]


def test_a_step_that_reads_step_index_reads_nothing_on_the_host_per_step():
    """Ten steps of the n_critic WGAN-GP, the generator's first step (its loss's first sums) among
    them: no host read; the log point reads them all."""
    from gputrain.diagnostics.syncs import watch_host_reads
    from gputrain.train.loop.trainer import Trainer

    model, kw = _wgan()
    trainer = Trainer(model, examples.digits(), config=TrainConfig(**{**CFG, "steps": 40, "log_every": 40}), **kw)
    try:
        trainer.run_steps(2)
        with watch_host_reads() as reads:
            for _ in range(10):  # indices 2..11: the generator steps on 4 and 9
                trainer.train_one_step()
        assert reads.total == 0, reads.result(10)["sites"]
        trainer.run_steps(28)
        record = trainer.parts.history.records[-1]
        assert record["step"] == 40 and record["g_loss_steps"] == 8 and "critic_steps" not in record
    finally:
        trainer.close()


def test_cuda_graphs_do_not_capture_a_step_that_reads_step_index_and_say_why(capture_graphs):
    """Asked for graphs (cuda_graphs=True), the n_critic step is not captured: a replay would take the
    branch as it went at capture. It trains as the eager reference does, and the summary's graph
    status and decision say why."""
    from graph_capture import CaptureGraphs, EagerGraphs

    def run():
        model, kw = _capturable_gan(examples.wgan_gp_step)
        history = fit(model, examples.digits(), config=TrainConfig(**{**CFG, "steps": 16, "cuda_graphs": True}), **kw)
        return params(model), history.summary

    graphed, summary = run()
    assert not [g for b in CaptureGraphs.instances for g in b.graphs]  # nothing captured
    capture_graphs(EagerGraphs)
    eager, _ = run()
    assert torch.equal(graphed, eager)
    why = "your step_fn (wgan_gp_step) reads step.index"
    assert summary["cuda_graphs"].startswith(f"off: {why}")
    row = next(d for d in summary["decisions"] if d["name"] == "cuda_graphs")
    assert row["value"] == "off" and row["reason"].startswith(why)
