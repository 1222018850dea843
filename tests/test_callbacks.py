"""Callbacks (issue 23): hooks at log points that keep the fast path, EarlyStopping, EMA, your scheduler.

Each test checks a behaviour a user relies on and fails without it: the hooks' calls and order, a
callback's state through a checkpoint, the same host reads and CUDA-graph decision with a log-point
callback, the cost of a per-step one, a requested stop that a resume honours, a learning-rate change
that survives a resume, EMA computed on the device inside the (stand-in) graph, EarlyStopping and EMA
on the digits-cnn workload, and a user scheduler resumed bit-equal.
"""

import json

import pytest
import torch
from torch import nn

import gputrain
from gputrain import TrainConfig, fit
from gputrain.errors import ConfigError
from gputrain.train.loop.callbacks import Callback, CallbackList
from helpers import data, mlp, params


CPU = torch.device("cpu")


class Recorder(Callback):
    """Records every hook call; keeps a counter in the checkpoint."""

    def __init__(self):
        self.calls: list[tuple] = []
        self.logged = 0

    def on_run_start(self, run):
        self.calls.append(("start", run.step))

    def on_evaluate(self, run, metrics):
        self.calls.append(("evaluate", run.step, sorted(metrics)))
        return {"eval_twice_loss": 2 * metrics["eval_loss"]}

    def on_log(self, run, record):
        self.logged += 1
        self.calls.append(("log", record["step"], "eval_twice_loss" in record))

    def on_checkpoint_save(self, run):
        return {"logged": self.logged}

    def on_checkpoint_load(self, run, state):
        self.calls.append(("load", state["logged"]))
        self.logged = state["logged"]

    def on_run_end(self, run, history):
        self.calls.append(("end", run.step, len(history.records)))


# ---------------------------------------------------------------- the hooks


def test_hooks_run_at_log_points_in_order_and_their_state_comes_back_on_resume(tmp_path):
    x, y = data()
    rec = Recorder()
    cfg = TrainConfig(device="cpu", batch_size=16, steps=12, log_every=4, eval_every=4, run_dir=str(tmp_path),
                      loggers=("csv",))  # an evaluation at every log point (the default: at epoch ends)
    history = fit(mlp(), (x, y), loss_fn=nn.CrossEntropyLoss(), eval_data=(x, y), callbacks=[rec],
                  config=cfg.replace(stop_at_step=8))
    assert rec.calls == [("start", 0),
                         ("evaluate", 4, ["eval_accuracy", "eval_loss"]), ("log", 4, True),
                         ("evaluate", 8, ["eval_accuracy", "eval_loss"]), ("log", 8, True),
                         ("end", 8, 2)]
    # what on_evaluate returned is in the record, the files and the summary
    assert history.records[-1]["eval_twice_loss"] == pytest.approx(2 * history.records[-1]["eval_loss"])
    assert "eval_twice_loss" in (tmp_path / "metrics.jsonl").read_text()
    assert history.summary["callbacks"] == "Recorder (at log points)"
    rec2 = Recorder()
    fit(mlp(), (x, y), loss_fn=nn.CrossEntropyLoss(), eval_data=(x, y), callbacks=[rec2],
        config=cfg.replace(resume=True))
    assert rec2.calls[0] == ("load", 2)  # the counter saved at step 8
    assert rec2.calls[1] == ("start", 8) and rec2.logged == 3


@pytest.mark.parametrize("fmt, async_save", [("file", False), ("dcp", True)])
def test_on_checkpoint_tells_each_committed_checkpoint_once(tmp_path, fmt, async_save):
    """The hook report/ray_report.py hands Ray its checkpoints by: each checkpoint of the run's store,
    once it is whole (an asynchronous one once committed), never a save to a path of your own."""
    from gputrain.checkpoint.store import CheckpointStore
    from gputrain.checkpoint.digests import verify

    class Told(Callback):
        def __init__(self):
            self.told: list[tuple[int, str, bool]] = []

        def on_checkpoint(self, run, path):
            self.told.append((run.step, path.name, verify(path) is True))

    x, y = data()
    told = Told()
    cfg = TrainConfig(device="cpu", batch_size=16, steps=10, log_every=2, checkpoint_every=4, run_dir=str(tmp_path),
                      checkpoint_format=fmt, async_checkpoint=async_save, keep_last=5, loggers=())
    fit(mlp(), (x, y), loss_fn=nn.CrossEntropyLoss(), callbacks=[told], config=cfg)
    suffix = ".dcp" if fmt == "dcp" else ".pt"
    names = [f"step-{s:06d}{suffix}" for s in (4, 8, 10)]
    assert [name for _, name, _ in told.told] == names and all(ok for _, _, ok in told.told), told.told
    assert [p.name for p in CheckpointStore(tmp_path).list()] == names
    if not async_save:  # told right after each save, at its step
        assert [step for step, _, _ in told.told] == [4, 8, 10]


def test_ray_report_outside_a_ray_train_worker_is_refused_with_a_message(tmp_path):
    from gputrain.report.ray_report import RayReport

    x, y = data()
    with pytest.raises(ConfigError, match=r"RayReport reports to Ray Train: give it to fit inside the training "
                                          r"function a TorchTrainer runs"):
        fit(mlp(), (x, y), loss_fn=nn.CrossEntropyLoss(), callbacks=[RayReport()],
            config=TrainConfig(device="cpu", batch_size=16, steps=2, run_dir=str(tmp_path / "r"), loggers=()))


def test_callbacks_are_checked_with_a_message():
    with pytest.raises(ConfigError, match="instances"):
        CallbackList([Recorder])
    with pytest.raises(ConfigError, match="none of the callback hooks"):
        CallbackList([object()])
    assert CallbackList(Recorder()).keys == ["Recorder"]  # one callback without a list
    assert CallbackList([Recorder(), Recorder()]).keys == ["Recorder", "Recorder#2"]


def test_a_log_point_callback_keeps_the_host_reads_and_the_graph_decision():
    """The same reads per log point with and without a callback that reads every record, and the
    same CUDA-graph decision (runtime/speed.py); a per-step callback turns graphs off and says why."""
    from gputrain.diagnostics.syncs import count_host_reads
    from gputrain.runtime.speed import decide_speed

    x, y = data(64)

    class Watch(Callback):
        def __init__(self):
            self.best = float("inf")

        def on_log(self, run, record):
            self.best = min(self.best, record["loss"])  # a host float: no read
            if record["loss"] > 1e9:
                run.request_stop("diverged")

    def run(steps, callbacks):
        fit(mlp(), (x, y), loss_fn=nn.CrossEntropyLoss(), callbacks=callbacks,
            config=TrainConfig(device="cpu", batch_size=4, steps=steps, log_every=10))

    without = count_host_reads(lambda: run(60, []), steps=1)
    with_cb = count_host_reads(lambda: run(60, [Watch()]), steps=1)
    assert without["total"] == with_cb["total"] == 6, (without["sites"], with_cb["sites"])  # one per log point

    cuda = torch.device("cuda")  # the decision is a pure function of the device type: no GPU needed
    cfg, net = TrainConfig(), mlp()
    plain = decide_speed(cfg, net, cuda)
    logged = decide_speed(cfg, net, cuda, step_hooks=CallbackList([Watch()]).per_step)
    assert plain.cuda_graphs and logged.cuda_graphs and plain.reasons == logged.reasons

    class EveryStep(Callback):
        every_step = True

        def on_step(self, run):
            pass

    stepped = decide_speed(cfg, net, cuda, step_hooks=CallbackList([EveryStep()]).per_step)
    assert not stepped.cuda_graphs and "EveryStep" in stepped.reasons["cuda_graphs"]


def test_a_per_step_callback_runs_every_step_and_the_run_log_says_what_it_costs(caplog):
    x, y = data()
    steps = []

    class EveryStep(Callback):
        every_step = True

        def on_step(self, run):
            steps.append(run.step)

    with caplog.at_level("INFO", logger="gputrain"):
        history = fit(mlp(), (x, y), loss_fn=nn.CrossEntropyLoss(), callbacks=[EveryStep()],
                      config=TrainConfig(device="cpu", batch_size=16, steps=5, log_every=5))
    assert steps == [1, 2, 3, 4, 5]
    cost = [r.getMessage() for r in caplog.records if "every step" in r.getMessage() and "host sync" in r.getMessage()]
    assert cost and "no CUDA graph" in cost[0], [r.getMessage() for r in caplog.records]
    row = next(d for d in history.summary["decisions"] if d["name"] == "callbacks")
    assert row["value"] == "EveryStep (every step)" and "no CUDA graph" in row["reason"]


def test_a_stop_requested_from_a_per_step_hook_ends_the_run_after_that_step():
    """Steps between log points run in a tight stretch: a stop asked for in on_step ends it there."""
    x, y = data()
    seen = []

    class StopAtSeven(Callback):
        every_step = True

        def on_step(self, run):
            seen.append(run.step)
            if run.step == 7:
                run.request_stop("seven")

    history = fit(mlp(), (x, y), loss_fn=nn.CrossEntropyLoss(), callbacks=[StopAtSeven()],
                  config=TrainConfig(device="cpu", batch_size=16, steps=30, log_every=5, progress=False))
    assert seen == list(range(1, 8))
    assert history.summary["steps"] == 7 and history.summary["stopped_by"] == "seven"


# ---------------------------------------------------------------- what a callback may change


class StopAt(Callback):
    def __init__(self, step):
        self.step = step

    def on_log(self, run, record):
        if run.step >= self.step:
            run.request_stop(f"enough at {run.step}")


def test_a_requested_stop_checkpoints_and_a_resume_trains_no_further(tmp_path):
    x, y = data()
    cfg = TrainConfig(device="cpu", batch_size=16, steps=30, log_every=5, run_dir=str(tmp_path), loggers=("csv",))
    model = mlp()
    history = fit(model, (x, y), loss_fn=nn.CrossEntropyLoss(), callbacks=[StopAt(10)], config=cfg)
    s = history.summary
    assert s["steps"] == 10 and s["stopped_early"] and s["stopped_by"] == "enough at 10"
    stopped = params(model)
    again = mlp(seed=1)
    h2 = fit(again, (x, y), loss_fn=nn.CrossEntropyLoss(), config=cfg.replace(resume=True))  # no callbacks now
    assert h2.summary["steps"] == 10 and h2.summary["stopped_by"] == "enough at 10"
    assert torch.equal(params(again), stopped)  # the checkpoint's weights, not one step more


class HalveLr(Callback):
    def __init__(self, at):
        self.at = at

    def on_log(self, run, record):
        if run.step == self.at:
            run.scale_lr(0.5)


@pytest.mark.parametrize("scheduler", [None, lambda opt: torch.optim.lr_scheduler.StepLR(opt, 4, gamma=0.9)])
def test_a_callback_changes_the_learning_rate_and_a_resume_keeps_it(tmp_path, scheduler):
    x, y = data()
    cfg = TrainConfig(device="cpu", batch_size=16, steps=16, log_every=4, lr=0.01, loggers=("csv",))
    base = fit(mlp(), (x, y), loss_fn=nn.CrossEntropyLoss(), scheduler=scheduler, config=cfg)
    full_model = mlp()
    full = fit(full_model, (x, y), loss_fn=nn.CrossEntropyLoss(), callbacks=[HalveLr(4)], scheduler=scheduler,
               config=cfg.replace(run_dir=str(tmp_path / "full")))
    lrs = [r["lr"] for r in full.records]
    assert lrs[1] == pytest.approx(base.records[1]["lr"] * 0.5) and lrs[3] == pytest.approx(base.records[3]["lr"] * 0.5)
    part = cfg.replace(run_dir=str(tmp_path / "part"))
    fit(mlp(), (x, y), loss_fn=nn.CrossEntropyLoss(), callbacks=[HalveLr(4)], scheduler=scheduler,
        config=part.replace(stop_at_step=8))
    resumed_model = mlp()
    resumed = fit(resumed_model, (x, y), loss_fn=nn.CrossEntropyLoss(), callbacks=[HalveLr(4)], scheduler=scheduler,
                  config=part.replace(resume=True))
    assert [r["lr"] for r in resumed.records] == lrs
    assert torch.equal(params(resumed_model), params(full_model))


def test_a_failing_run_tells_every_callback_and_raises_its_own_error(caplog):
    """on_exception reaches each callback (the base class's no-op too) with the run's error; a hook
    that fails itself is logged, and the run's first error is the one raised."""
    from gputrain.train.loop.guards import NonFiniteError

    x, y = data()
    seen = []

    class Notes(Callback):
        def on_exception(self, run, exc):
            seen.append((run.step, type(exc).__name__))

    class Broken(Callback):
        def on_exception(self, run, exc):
            raise RuntimeError("the hook itself failed")

    class Quiet(Callback):  # only the base class's hooks
        def on_log(self, run, record):
            pass

    cfg = TrainConfig(device="cpu", batch_size=16, steps=8, log_every=4, lr=1e30, loggers=("csv",))
    with caplog.at_level("WARNING", logger="gputrain"), pytest.raises(NonFiniteError, match="non-finite"):
        fit(mlp(), (x, y), loss_fn=nn.CrossEntropyLoss(), callbacks=[Quiet(), Broken(), Notes()], config=cfg)
    assert seen == [(4, "NonFiniteError")]
    assert "Broken.on_exception failed: RuntimeError: the hook itself failed" in caplog.text


def test_a_callback_sees_where_the_run_is_and_sets_the_learning_rate():
    """RunControl as a callback reads it at each log point: steps done and planned, fractional
    epochs, the config, model, optimizer, device, history so far, rank, eval data, the lr in force,
    no stop requested (the history holds this log point's record already); set_lr(x) makes x the rate in force from then on."""
    x, y = data()  # 96 samples, batch 16: 6 steps an epoch

    class Watch(Callback):
        def __init__(self):
            self.seen = []

        def on_log(self, run, record):
            self.seen.append({"step": run.step, "total": run.total_steps, "epoch": run.epoch,
                              "batch": run.config.batch_size, "model": run.model, "optimizer": run.optimizer,
                              "device": run.device, "records": len(run.history.records), "main": run.is_main,
                              "eval": run.has_eval_data, "lr": run.lr, "stop": run.stop_reason})
            if run.step == 4:
                run.set_lr(0.003)

    watch, model = Watch(), mlp()
    cfg = TrainConfig(device="cpu", batch_size=16, steps=12, log_every=4, lr=0.01, schedule="constant",
                      loggers=("csv",))
    history = fit(model, (x, y), loss_fn=nn.CrossEntropyLoss(), callbacks=[watch], config=cfg)
    assert [(s["step"], s["total"], s["records"]) for s in watch.seen] == [(4, 12, 1), (8, 12, 2), (12, 12, 3)]
    assert [s["epoch"] for s in watch.seen] == pytest.approx([4 / 6, 8 / 6, 2.0], abs=1e-4)  # rounded to 4 places
    first = watch.seen[0]
    assert first["batch"] == 16 and first["model"] is model and first["device"] == CPU
    assert first["main"] and not first["eval"] and first["stop"] == ""
    assert [p for g in first["optimizer"].param_groups for p in g["params"]] == list(model.parameters())
    assert [s["lr"] for s in watch.seen] == pytest.approx([0.01, 0.003, 0.003])
    assert [r["lr"] for r in history.records][1:] == pytest.approx([0.003, 0.003])
    assert first["optimizer"].param_groups[0]["lr"] == pytest.approx(0.003)


# ---------------------------------------------------------------- your scheduler


def test_a_user_scheduler_steps_per_optimizer_step_and_resumes_bit_equal(tmp_path):
    x, y = data()

    def sched(opt):
        return torch.optim.lr_scheduler.MultiStepLR(opt, milestones=[3, 7, 11], gamma=0.5)

    cfg = TrainConfig(device="cpu", batch_size=16, steps=14, log_every=2, lr=0.02, accumulate=2, loggers=("csv",))
    full_model = mlp()
    full = fit(full_model, (x, y), loss_fn=nn.CrossEntropyLoss(), scheduler=sched,
               config=cfg.replace(run_dir=str(tmp_path / "full")))
    lrs = {r["step"]: r["lr"] for r in full.records}
    assert lrs[2] == pytest.approx(0.02) and lrs[4] == pytest.approx(0.01) and lrs[8] == pytest.approx(0.005)
    assert lrs[12] == pytest.approx(0.0025)  # per optimizer step (accumulate=2 micro-batches each)
    assert full.summary["schedule"].startswith("MultiStepLR (given)")
    part = cfg.replace(run_dir=str(tmp_path / "part"))
    fit(mlp(), (x, y), loss_fn=nn.CrossEntropyLoss(), scheduler=sched, config=part.replace(stop_at_step=5))
    resumed_model = mlp(seed=3)  # other initial weights: everything must come from the checkpoint
    resumed = fit(resumed_model, (x, y), loss_fn=nn.CrossEntropyLoss(), scheduler=sched,
                  config=part.replace(resume=True))
    assert torch.equal(params(resumed_model), params(full_model))
    assert [r["lr"] for r in resumed.records] == [r["lr"] for r in full.records]


def test_a_bad_scheduler_is_refused_with_a_message():
    x, y = data()
    with pytest.raises(ConfigError, match="lacks"):
        fit(mlp(), (x, y), loss_fn=nn.CrossEntropyLoss(), scheduler=lambda opt: object(),
            config=TrainConfig(device="cpu", steps=1))


def test_the_linear_schedule_decays_to_zero_after_its_warmup():
    from gputrain.train.optim.build import make_schedule

    f = make_schedule("linear", total_steps=10, warmup_steps=2)
    assert [round(f(s), 3) for s in range(10)] == [0.5, 1.0, 1.0, 0.875, 0.75, 0.625, 0.5, 0.375, 0.25, 0.125]


# ---------------------------------------------------------------- EarlyStopping


def test_early_stopping_counts_evaluations_without_improvement():
    from gputrain.train.loop.early_stopping import EarlyStopping

    class Run:
        step = 0
        stopped = None

        def request_stop(self, reason):
            self.stopped = reason

    es, run = EarlyStopping("eval_loss", patience=2, min_delta=0.01), Run()
    for step, value in [(1, 1.0), (2, 0.5), (3, 0.495), (4, None), (5, 0.3), (6, 0.31)]:
        run.step = step
        es.on_log(run, {"step": step} if value is None else {"step": step, "eval_loss": value})
        assert run.stopped is None, step  # 0.495: within min_delta (1 of 2); step 4: not evaluated
    run.step = 7
    es.on_log(run, {"eval_loss": 0.295})  # better, but by less than min_delta: the second in a row
    assert run.stopped and "eval_loss" in run.stopped and "best 0.3 at step 5" in run.stopped
    assert EarlyStopping("eval_accuracy").mode == "max" and EarlyStopping("eval_loss").mode == "min"
    with pytest.raises(ConfigError, match="patience"):
        EarlyStopping(patience=0)


def test_early_stopping_needs_eval_data():
    from gputrain.train.loop.early_stopping import EarlyStopping

    x, y = data()
    with pytest.raises(ConfigError, match="no eval data"):
        fit(mlp(), (x, y), loss_fn=nn.CrossEntropyLoss(), callbacks=[EarlyStopping()],
            config=TrainConfig(device="cpu", steps=2))


# ---------------------------------------------------------------- EMA


def test_ema_is_the_average_of_the_weights_after_each_step():
    """The update the step runs equals ema = decay_t * ema + (1 - decay_t) * w, step after step."""
    from gputrain.train.loop.ema import EMA

    x, y = data()
    seen = []

    class Snap(Callback):
        every_step = True

        def on_step(self, run):
            seen.append(params(run.model).clone())

    ema = EMA(0.9)
    model = mlp()
    start = params(model).clone()
    fit(model, (x, y), loss_fn=nn.CrossEntropyLoss(), callbacks=[Snap(), ema],
        config=TrainConfig(device="cpu", batch_size=16, steps=6, log_every=6))
    expected = start
    for n, w in enumerate(seen, start=1):
        d = min(0.9, n / (n + 9))  # the warm-up: (1 + m) / (10 + m) for the m-th update counted from 0
        expected = d * expected + (1 - d) * w
    assert ema.model is not None
    assert torch.allclose(params(ema.model), expected, atol=1e-6)
    assert not torch.allclose(params(ema.model), seen[-1], atol=1e-4)  # an average, not the last weights


def test_ema_average_comes_back_from_the_checkpoint_on_resume(tmp_path):
    """A run stopped at step 8 and resumed ends with the same average (and update count) as the run
    that went through: the resume loads the saved average, it does not restart it from the weights."""
    x, y = data()
    cfg = TrainConfig(device="cpu", batch_size=16, steps=12, log_every=4, checkpoint_every=4, loggers=("csv",))
    whole = gputrain.EMA(decay=0.9)
    fit(mlp(), (x, y), loss_fn=nn.CrossEntropyLoss(), callbacks=[whole],
        config=cfg.replace(run_dir=str(tmp_path / "whole")))
    part = cfg.replace(run_dir=str(tmp_path / "part"))
    fit(mlp(), (x, y), loss_fn=nn.CrossEntropyLoss(), callbacks=[gputrain.EMA(decay=0.9)],
        config=part.replace(stop_at_step=8))
    resumed = gputrain.EMA(decay=0.9)
    fit(mlp(), (x, y), loss_fn=nn.CrossEntropyLoss(), callbacks=[resumed], config=part.replace(resume=True))
    assert whole.updates is not None and resumed.updates is not None
    assert whole.updates.item() == resumed.updates.item() == 12
    expected, got = whole.state_dict(), resumed.state_dict()
    assert list(got) == list(expected) and all(torch.equal(got[k], expected[k]) for k in expected)


def test_ema_runs_inside_the_captured_step():
    """With the step captured (the stand-in with CUDA's capture semantics, tests/graph_capture.py),
    the EMA update is part of every replay: the host runs no tensor op for it between replays, and
    the average equals the eager run's."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from graph_capture import CaptureGraphs

    from gputrain.runtime.precision import RunPrecision, resolve_precision
    from gputrain.train.loop.ema import EMA
    from gputrain.train.step.graphs import GraphedStep
    from gputrain.train.step.loss import LossRule
    from gputrain.train.optim.build import make_optimizer
    from gputrain.train.step.train_step import TrainStep

    x, y = data(32)

    class HostOps(TorchDispatchMode):
        def __init__(self, backend):
            super().__init__()
            self.backend, self.n = backend, 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if self.backend is not None and not self.backend.replaying:
                self.n += 1
            return func(*args, **(kwargs or {}))

    def train(graphed, with_ema):
        model = mlp()
        opt, _ = make_optimizer(None, model.parameters(), lr=0.05, weight_decay=0.0, device=CPU, capturable=True)
        ema = EMA(0.8)
        updates = [ema.step_update(model)] if with_ema else []
        step = TrainStep(model, LossRule(nn.CrossEntropyLoss()), opt,
                         RunPrecision(resolve_precision("fp32", CPU), CPU), device=CPU, after_step=updates)
        backend = CaptureGraphs() if graphed else None
        runner = GraphedStep(step, CPU, backend=backend) if graphed else step
        for _ in range(5):  # 3 eager warm-up steps, the capture (and its replay), one replay
            runner([(x, y)])
        counter = HostOps(backend)
        with counter:
            for _ in range(3):
                runner([(x, y)])
        return ema, counter.n

    graphed_ema, host_ops = train(True, True)
    _, host_ops_without = train(True, False)
    eager_ema, _ = train(False, True)
    assert host_ops == host_ops_without  # nothing of EMA's runs on the host between replays
    assert graphed_ema.model is not None and eager_ema.model is not None
    assert torch.equal(params(graphed_ema.model), params(eager_ema.model))
    assert float(graphed_ema.updates) == 8.0


@pytest.mark.gpu
def test_ema_inside_a_real_cuda_graph_equals_the_eager_average():
    """On a GPU: the EMA update captured with the step (CUDA graphs on) gives the eager run's average."""
    from gputrain.train.loop.ema import EMA

    x, y = data(512)

    def run(graphs):
        ema = EMA(0.9)
        history = fit(mlp(), (x, y), loss_fn=nn.CrossEntropyLoss(), callbacks=[ema],
                      config=TrainConfig(device="cuda", precision="fp32", batch_size=64, steps=40, log_every=20,
                                         cuda_graphs=graphs, data_on_device=True))
        assert ema.model is not None
        return params(ema.model).cpu(), history.summary["cuda_graphs"]

    graphed, status = run(True)
    eager, _ = run(False)
    assert status.startswith("on")
    assert torch.allclose(graphed, eager, atol=1e-5)

# ---------------------------------------------------------------- on the digits-cnn workload


def _digits(tmp_path, capsys, name, *flags):
    from gputrain import cli

    d = tmp_path / name
    args = ["fit", "digits-cnn", "--run-dir", str(d), "--device", "cpu", "--precision", "fp32", "--progress", "off",
            "--json", "--no-tensorboard", *flags]
    assert cli.main(args) == 0
    summary = json.loads(capsys.readouterr().out)["summary"]
    return summary, json.loads((d / "history.json").read_text())["records"], args


@pytest.mark.slow
def test_digits_cnn_early_stopping_stops_before_the_last_epoch_and_stays_stopped(tmp_path, capsys):
    """`gputrain fit digits-cnn --early-stop eval_loss --patience 2 --min-delta 1e-4`, evaluated every epoch
    (--log-every 23): stops before the last of its 20 epochs; a resume after the stop trains no further.
    (min_delta: epochs 15 and 16 reach the same eval loss to 1e-5, and which is lower by a hair is noise.)"""
    from gputrain import cli

    s, records, args = _digits(tmp_path, capsys, "es", "--early-stop", "eval_loss", "--patience", "2",
                               "--min-delta", "1e-4", "--log-every", "23")
    epochs = [r["epoch"] for r in records]
    with capsys.disabled():
        print(f"\ndigits-cnn EarlyStopping(eval_loss, patience=2): stopped after step {s['steps']} of "
              f"{s['total_steps']} (epoch {epochs[-1]:g} of 20); eval accuracy {s['final_eval_accuracy']:.4f}")
    assert s["stopped_early"] and s["steps"] < s["total_steps"] and epochs[-1] <= 19, (s["steps"], epochs)
    assert s["stopped_by"].startswith("EarlyStopping: eval_loss did not improve by more than 0.0001 in 2")
    losses = [r["eval_loss"] for r in records]
    assert min(losses[-2:]) >= min(losses[:-2]) - 1e-4  # two evaluations in a row without a new best
    assert cli.main(args + ["--resume", str(tmp_path / "es")]) == 0
    again = json.loads(capsys.readouterr().out)["summary"]
    assert again["steps"] == s["steps"] and again["final_eval_accuracy"] == s["final_eval_accuracy"]


@pytest.mark.slow
def test_digits_cnn_ema_is_no_worse_than_the_raw_weights(tmp_path, capsys):
    """`gputrain fit digits-cnn --ema 0.99` (its 20 epochs): the average's eval accuracy at the end is
    at least the raw weights'."""
    s, records, _ = _digits(tmp_path, capsys, "ema", "--ema", "0.99")
    with capsys.disabled():
        print(f"\ndigits-cnn EMA(0.99): eval accuracy raw {s['final_eval_accuracy']:.4f}, EMA "
              f"{s['final_eval_ema_accuracy']:.4f}; eval loss raw {s['final_eval_loss']:.4f}, EMA "
              f"{s['final_eval_ema_loss']:.4f}; per evaluation "
              f"{[(r['step'], round(r['eval_accuracy'], 4), round(r['eval_ema_accuracy'], 4)) for r in records if 'eval_accuracy' in r]}")
    assert s["steps"] == s["total_steps"] == 460
    assert s["final_eval_ema_accuracy"] >= s["final_eval_accuracy"] >= 0.97, s
    # The best EMA loss is the lowest one (the summary once showed the first, and highest, as best).
    assert s["best_eval_ema_loss"] == min(r["eval_ema_loss"] for r in records if "eval_ema_loss" in r)


def test_public_names():
    for name in ("Callback", "EarlyStopping", "EMA", "evaluate", "predict", "RunControl"):
        assert name in gputrain.__all__ and getattr(gputrain, name) is not None


def test_the_base_hooks_are_no_ops_a_subclass_may_leave_alone(tmp_path):
    """A callback that saves state but defines no loader, and one that opts in to every step without
    an on_step of its own, run to the end: the base class's hooks do nothing and say nothing."""
    from gputrain.train.loop.callbacks import Callback

    class SavesOnly(Callback):
        def on_checkpoint_save(self, run):
            return {"seen": run.step}

    class EveryStep(Callback):
        every_step = True

    x, y = data(64)
    config = TrainConfig(device="cpu", batch_size=16, steps=6, log_every=3, run_dir=str(tmp_path / "run"),
                         progress=False, checkpoint_every=3, stop_at_step=3)
    fit(mlp(), (x, y), loss_fn=nn.CrossEntropyLoss(), callbacks=[SavesOnly(), EveryStep()], config=config)
    resumed = fit(mlp(), (x, y), loss_fn=nn.CrossEntropyLoss(), callbacks=[SavesOnly(), EveryStep()],
                  config=config.replace(resume=True, stop_at_step=None))
    assert resumed.summary["steps"] == 6
    assert Callback().on_step(None) is None and Callback().on_checkpoint_load(None, {"seen": 3}) is None
