"""The one training step and the run around it: what fit promises, each checked so that it can fail.

Covers the public names, host reads per step, clipping, evaluation cadence, the interrupted-step
checkpoint, resume refusals and resume from a file, OOM settings, compile and bf16 on the CPU,
every graph blocker, the binary task's accuracy, schedules, TF32 given back, DataParallel's one
warning, and a golden run (accumulation + OOM split + stop + resume == the uninterrupted run).
"""

import math
import warnings

import pytest
import torch
from torch import nn

import gputrain
from gputrain import TrainConfig, fit
from gputrain.errors import CheckpointError
from helpers import data, mlp, OOMAbove, params, sgd


CPU = torch.device("cpu")


def _latest(run_dir):
    from gputrain.checkpoint.store import CheckpointStore

    return CheckpointStore(run_dir).latest_path()


# ---------------------------------------------------------------- the public API

def test_star_import_and_every_name_in_all():
    namespace: dict = {}
    exec("from gputrain import *", namespace)
    for name in gputrain.__all__:
        assert name in namespace, name
        assert getattr(gputrain, name) is namespace[name]
    for name in ("fit", "TrainConfig", "pick_device", "move", "Trainer", "History"):
        assert name in gputrain.__all__


def test_config_to_dict_holds_every_field_and_copies_lists():
    import dataclasses

    config = TrainConfig(device="cpu", recompute=["blocks.0"], loggers=("csv",))
    out = config.to_dict()
    assert out == dataclasses.asdict(config)
    out["recompute"].append("head")
    assert config.recompute == ["blocks.0"]


# ---------------------------------------------------------------- host reads

def test_host_reads_happen_only_at_log_points():
    """Every read of a device value (.item, .tolist, bool(), formatting...) during a run is counted."""
    from gputrain.diagnostics.syncs import count_host_reads

    x, y = data(64)

    def run(steps):
        fit(mlp(), (x, y), loss_fn=nn.CrossEntropyLoss(),
            config=TrainConfig(device="cpu", batch_size=4, steps=steps, log_every=10))

    few, many = count_host_reads(lambda: run(20), steps=1), count_host_reads(lambda: run(60), steps=1)
    assert few["total"] == 2 and many["total"] == 6, (few["sites"], many["sites"])  # one read per log point
    assert {s["file"].rsplit("/", 1)[-1] for s in many["sites"]} == {"train_step.py"}  # TrainStep.read_totals


# ---------------------------------------------------------------- the update

def test_unequal_micro_batches_weigh_by_samples():
    """40 samples as micro-batches of 24 and 16 make the update of one batch of 40."""
    x, y = data(40)
    a, b = mlp(), mlp()
    fit(a, (x, y), loss_fn=nn.CrossEntropyLoss(), optimizer=sgd(),
        config=TrainConfig(device="cpu", batch_size=24, accumulate=2, steps=1, seed=1))
    fit(b, (x, y), loss_fn=nn.CrossEntropyLoss(), optimizer=sgd(),
        config=TrainConfig(device="cpu", batch_size=40, steps=1, seed=1))
    assert torch.allclose(params(a), params(b), atol=1e-6)
    assert not torch.allclose(params(a), params(mlp()), atol=1e-4)


def test_the_steps_bookkeeping_adds_a_few_device_ops():
    """Inside a CUDA graph each op is a kernel of a microsecond or two, a fifth of a tiny model's
    step. With on_nan="stop" (the default) the step adds one op to a bare forward-backward-AdamW
    step: the loss sum (the non-finite checks happen where the sum is read). With on_nan="skip" it
    decides every step: 7 ops (zero the flag, one GradScaler-style check of the gradients and the
    loss, the mask, the masked loss, two accumulators, and the fused AdamW's step-count correction).
    Before: 8 (stop) and 11 (skip), a gradient norm (foreach_norm, stack, norm) and a probe every step."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from gputrain.runtime.precision import RunPrecision, resolve_precision
    from gputrain.train.step.loss import LossRule
    from gputrain.train.optim.build import make_optimizer
    from gputrain.train.step.train_step import TrainStep

    class Ops(TorchDispatchMode):
        VIEWS = ("aten.t.", "aten.detach.", "aten.view.", "aten.slice.", "aten.expand.", "aten.alias.", "profiler.")

        def __init__(self):
            super().__init__()
            self.n = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.n += not str(func).startswith(self.VIEWS)  # views launch no kernel
            return func(*args, **(kwargs or {}))

    cpu = torch.device("cpu")
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(32, 4, generator=g), torch.randint(0, 3, (32,), generator=g)

    def parts():
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(4, 10), nn.ReLU(), nn.Linear(10, 3))
        opt, _ = make_optimizer(None, model.parameters(), lr=1e-2, weight_decay=0.0, device=cpu)
        return model, opt

    model, opt = parts()

    def bare():
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    def step(**kwargs):
        step_model, step_opt = parts()
        s = TrainStep(step_model, LossRule(nn.CrossEntropyLoss()), step_opt,
                      RunPrecision(resolve_precision("fp32", cpu), cpu), device=cpu, **kwargs)
        return lambda: s.run([(x, y)])

    counts = {}
    # loss_list=True: the eager CUDA step's way (its losses kept in a list); the CPU's default adds
    # each loss in place.
    for name, fn in (("bare", bare), ("stop", step(loss_list=True)), ("skip", step(skip_nonfinite=True, loss_list=True)),
                     ("stop-cpu", step())):
        fn()  # the optimizer's state is made on the first step
        with Ops() as ops:
            fn()
        counts[name] = ops.n
    assert counts["stop"] == counts["bare"], counts  # the loss is kept, not added: no op of its own
    assert counts["skip"] - counts["bare"] <= 7, counts
    assert counts["stop-cpu"] == counts["bare"] + 1, counts  # the in-place add


def _one_step(model, opt):
    from gputrain.runtime.precision import RunPrecision, resolve_precision
    from gputrain.train.step.loss import LossRule
    from gputrain.train.step.train_step import TrainStep

    return TrainStep(model, LossRule(nn.CrossEntropyLoss()), opt, RunPrecision(resolve_precision("fp32", CPU), CPU),
                     device=CPU)


def test_the_step_clears_every_gradient_of_the_optimizer_as_it_is_at_each_step():
    """The step sets the gradients to None itself (torch's zero_grad opens a profiler range each
    call): every parameter the optimizer holds at that step, a group added after the step was built
    included; gradients accumulate into the next step otherwise."""
    x, y = data(16)
    model, extra = mlp(), nn.Linear(6, 3)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    step = _one_step(model, opt)
    opt.add_param_group({"params": list(extra.parameters())})
    extra_loss = lambda: extra(x).square().mean().backward()  # noqa: E731
    extra_loss()
    step.run([(x, y)])
    assert all(p.grad is None for p in [*model.parameters(), *extra.parameters()])
    # the update is one step's gradient, not two steps' summed
    ref = mlp()
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    for _ in range(2):
        nn.CrossEntropyLoss()(ref(x), y).backward()
        ref_opt.step()
        ref_opt.zero_grad(set_to_none=True)
    step.run([(x, y)])
    assert torch.equal(params(model), params(ref))


def test_a_cpu_step_adds_its_loss_in_place_and_keeps_no_tensor_per_step():
    """Kept 0-dim tensors between the step's activations made glibc's heap grow ~2 MB a step on the
    CPU: there every loss goes into the sum at once; the list (no op per step) is CUDA's."""
    from gputrain.train.step.totals import keeps_losses_in_a_list

    x, y = data(16)
    model = mlp()
    step = _one_step(model, torch.optim.SGD(model.parameters(), lr=0.1))
    ref, losses = mlp(), []
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    for _ in range(3):
        step.run([(x, y)])
        assert step.totals.pending == []
        loss = nn.CrossEntropyLoss()(ref(x), y)
        losses.append(float(loss))
        loss.backward()
        ref_opt.step()
        ref_opt.zero_grad(set_to_none=True)
    assert abs(float(step.totals.loss_sum) - sum(losses)) < 1e-5
    assert keeps_losses_in_a_list(torch.device("cuda", 0)) and not keeps_losses_in_a_list(CPU)


def test_an_optimizer_with_its_own_zero_grad_has_it_called_every_step():
    class Counting(torch.optim.SGD):
        calls = 0

        def zero_grad(self, set_to_none: bool = True) -> None:
            type(self).calls += 1
            assert set_to_none
            super().zero_grad(set_to_none=set_to_none)

    x, y = data(16)
    model = mlp()
    step = _one_step(model, Counting(model.parameters(), lr=0.1))
    for _ in range(3):
        step.run([(x, y)])
    assert Counting.calls == 3


def test_the_step_leaves_out_torchs_step_wrapper_only_while_nothing_would_see_it():
    """torch's wrapper around every optimizer step opens a profiler range (a dispatcher op per call,
    ~35 us in a CPU run here): the step calls the wrapped step directly, with the same update, and
    goes through the wrapper whenever it matters: hooks (the optimizer's or global, registered
    mid-run), a running profiler, an LR scheduler's step counter set on the instance."""
    import torch.optim.optimizer as torch_optimizer

    x, y = data(16)
    model, ref = mlp(), mlp()
    opt, ref_opt = torch.optim.SGD(model.parameters(), lr=0.1), torch.optim.SGD(ref.parameters(), lr=0.1)
    wrapper_calls = []
    opt._optimizer_step_code = lambda: wrapper_calls.append(1)  # the wrapper calls it after each step
    step = _one_step(model, opt)

    def both(n=1):
        for _ in range(n):
            step.run([(x, y)])
            nn.CrossEntropyLoss()(ref(x), y).backward()
            ref_opt.step()
            ref_opt.zero_grad(set_to_none=True)

    both(3)
    assert wrapper_calls == [] and torch.equal(params(model), params(ref))
    seen = []
    own = opt.register_step_pre_hook(lambda o, args, kwargs: seen.append("pre"))
    both(2)
    assert seen == ["pre", "pre"] and len(wrapper_calls) == 2
    own.remove()
    glob = torch_optimizer.register_optimizer_step_post_hook(lambda o, args, kwargs: seen.append("post"))
    try:
        both()
    finally:
        glob.remove()
    assert seen[-1] == "post" and len(wrapper_calls) == 3
    both()
    assert len(wrapper_calls) == 3 and torch.equal(params(model), params(ref))
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        step.run([(x, y)])
    names = {e.name for e in prof.events()}
    assert "Optimizer.step#SGD.step" in names and "Optimizer.zero_grad#SGD.zero_grad" in names
    # A scheduler made after the step wraps the instance's step to count it; stepping it after the
    # optimizer step must not warn that the optimizer did not step.
    scheduler = torch.optim.lr_scheduler.StepLR(opt, step_size=1)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        step.run([(x, y)])
        scheduler.step()


def test_an_optimizer_whose_class_decorates_its_step_has_it_called_as_written():
    import functools

    calls = []

    def counted(fn):
        @functools.wraps(fn)
        def wrapper(*args, **kwargs):
            calls.append(1)
            return fn(*args, **kwargs)
        return wrapper

    class Decorated(torch.optim.SGD):
        @counted
        def step(self, closure=None):
            return super().step(closure)

    x, y = data(16)
    model = mlp()
    step = _one_step(model, Decorated(model.parameters(), lr=0.1))
    before = params(model).clone()
    for _ in range(3):
        step.run([(x, y)])
    assert len(calls) == 3 and not torch.equal(params(model), before)


def test_the_run_seed_decides_dropout_whatever_the_global_rng_was():
    """fit seeds the generator the run draws from (on the CPU, the CPU's): the same seed gives the
    same weights after a dropout model trains, a different one different weights."""
    x, y = data(64)

    def trained(seed, draws):
        model = mlp(dropout=0.5)  # seeds the global RNG for its weights
        torch.rand(draws)  # then the caller moves it
        fit(model, (x, y), loss_fn=nn.CrossEntropyLoss(),
            config=TrainConfig(device="cpu", batch_size=16, steps=4, seed=seed, progress=False))
        return params(model)

    assert torch.equal(trained(3, draws=1), trained(3, draws=50))
    assert not torch.equal(trained(3, draws=1), trained(4, draws=1))


def test_max_grad_norm_clips_the_gradient():
    x, y = data(32)
    ref = mlp()
    loss = nn.CrossEntropyLoss()(ref(x), y)
    loss.backward()
    grads = [p.grad.clone() for p in ref.parameters()]
    norm = torch.sqrt(sum((g ** 2).sum() for g in grads))
    max_norm = float(norm) / 10
    expected = [p.detach() - 1.0 * g * (max_norm / (float(norm) + 1e-6)) for p, g in zip(ref.parameters(), grads)]
    clipped = mlp()
    fit(clipped, (x, y), loss_fn=nn.CrossEntropyLoss(), optimizer=sgd(1.0),
        config=TrainConfig(device="cpu", batch_size=32, steps=1, max_grad_norm=max_norm))
    assert torch.allclose(params(clipped), torch.cat([e.flatten() for e in expected]), atol=1e-6)


def test_eval_every_sets_the_evaluation_cadence():
    x, y = data(64)
    h = fit(mlp(), (x, y), loss_fn=nn.CrossEntropyLoss(), eval_data=(x, y),
            config=TrainConfig(device="cpu", batch_size=8, steps=30, log_every=5, eval_every=10))
    evaluated = [r["step"] for r in h.records if "eval_loss" in r]
    assert evaluated == [10, 20, 30]
    assert [r["step"] for r in h.records] == [5, 10, 15, 20, 25, 30]


def test_binary_task_accuracy_is_the_share_of_right_signs():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(200, 4, generator=g)
    y = (x[:, 0] > 0).float()[:, None]
    torch.manual_seed(0)
    model = nn.Linear(4, 1)
    h = fit(model, (x, y), loss_fn=nn.BCEWithLogitsLoss(), eval_data=(x, y),
            config=TrainConfig(device="cpu", batch_size=50, steps=60, lr=0.05, log_every=60))
    with torch.no_grad():
        manual = ((model(x) > 0).float() == y).float().mean().item()
    assert h.summary["task"] == "binary"
    assert h.records[-1]["eval_accuracy"] == pytest.approx(manual) and manual > 0.9


# ---------------------------------------------------------------- precision and compile on the CPU

def test_bf16_autocast_through_fit_on_the_cpu():
    x, y = data(128)
    h = fit(mlp(), (x, y), loss_fn=nn.CrossEntropyLoss(), eval_data=(x, y),
            config=TrainConfig(device="cpu", precision="bf16", batch_size=32, epochs=8, lr=1e-2, log_every=8))
    assert h.summary["precision"] == "bf16"
    assert h.records[-1]["loss"] < h.records[0]["loss"]
    assert h.summary["final_eval_accuracy"] > 0.7


@pytest.mark.processes
def test_compile_trains_on_the_cpu_and_reports_a_planted_recompilation():
    x, y = data(40)  # batches of 16, 16 and a last partial one of 8: dim 0 changes under compile
    torch._dynamo.reset()  # dynamo remembers shapes per code object across tests (automatic dynamic)
    h = fit(mlp(), (x, y), loss_fn=nn.CrossEntropyLoss(), eval_data=(x, y),
            config=TrainConfig(device="cpu", batch_size=16, steps=8, lr=1e-2, log_every=4, compile=True))
    assert h.summary["compile"] is True
    assert h.records[-1]["loss"] < h.records[0]["loss"]
    rec = h.summary["recompilations"]
    assert rec["recompilations"] >= 1 and "16 -> 8 (last partial batch)" in rec["summary"]
    assert "drop_last" in rec["summary"] and any("recompiled" in w for w in h.summary["warnings"])
    assert h.records[-1]["recompilations"] == rec["recompilations"]


def test_fit_gives_back_the_matmul_settings(monkeypatch):
    """The run's TF32 setting is process-wide; fit gives back what was there (forced on the CPU here)."""
    from gputrain.runtime import precision as P

    monkeypatch.setattr(P, "apply_matmul_settings",
                        lambda prec, device: torch.set_float32_matmul_precision("high"))
    before = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("medium")
    try:
        seen = []
        model = mlp()
        model.register_forward_pre_hook(lambda m, a: seen.append(torch.get_float32_matmul_precision()))
        fit(model, data(), loss_fn=nn.CrossEntropyLoss(), config=TrainConfig(device="cpu", steps=1))
        assert seen and seen[0] == "high"  # applied during the run
        assert torch.get_float32_matmul_precision() == "medium"  # given back after it
    finally:
        torch.set_float32_matmul_precision(before)


def test_run_precision_applies_and_restores_tf32_for_cuda():
    from gputrain.runtime.precision import Precision, RunPrecision

    before = torch.get_float32_matmul_precision()
    cudnn_before = torch.backends.cudnn.allow_tf32
    try:
        torch.set_float32_matmul_precision("highest")
        torch.backends.cudnn.allow_tf32 = False
        rp = RunPrecision.__new__(RunPrecision)  # no GradScaler: there is no CUDA here
        rp.precision, rp.device, rp._saved = Precision("tf32", None, False, True, "test"), torch.device("cuda"), None
        rp.apply()
        assert torch.get_float32_matmul_precision() == "high" and torch.backends.cudnn.allow_tf32 is True
        rp.restore()
        assert torch.get_float32_matmul_precision() == "highest" and torch.backends.cudnn.allow_tf32 is False
    finally:
        torch.set_float32_matmul_precision(before)
        torch.backends.cudnn.allow_tf32 = cudnn_before


# ---------------------------------------------------------------- graphs: every blocker has its reason

class _Hooked(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 2)
        self.lin.register_forward_hook(lambda m, a, o: None)

    def forward(self, x):
        return self.lin(x)


@pytest.mark.parametrize("changes,model,optimizer,needle", [
    ({}, None, None, None),
    ({"accumulate": 2}, None, None, "gradient accumulation"),
    ({"compile": True}, None, None, None),  # inductor kernels inside gputrain's whole-step graph
    ({"compile": True, "compile_mode": "reduce-overhead"}, None, None, "captures its own CUDA graphs"),
    ({"recompute": True}, None, None, "recompute runs forward passes again"),
    ({}, "hooked", None, "module hooks on lin"),
    ({}, None, "plain", "was not created with capturable=True"),
    ({}, None, "factory", "comes from a factory"),
])
def test_graph_blockers_each_say_why(changes, model, optimizer, needle):
    from gputrain.runtime.speed import decide_speed

    net = _Hooked() if model == "hooked" else nn.Linear(4, 2)
    opt = {"plain": torch.optim.SGD(net.parameters(), lr=0.1), "factory": sgd(), None: None}[optimizer]
    speed = decide_speed(TrainConfig(**changes), net, torch.device("cuda"), optimizer=opt)
    if needle is None:
        assert speed.cuda_graphs is True
    else:
        assert speed.cuda_graphs is False and needle in speed.reasons["cuda_graphs"]


def test_graph_blockers_for_processes_fp16_global_hooks_and_the_cpu():
    from torch.nn.modules.module import register_module_forward_hook

    from gputrain.runtime.speed import decide_speed

    net = nn.Linear(4, 2)
    cuda = torch.device("cuda")
    assert "distributed gradient sync" in decide_speed(TrainConfig(), net, cuda, world_size=2).reasons["cuda_graphs"]
    assert "fp16 loss scaling" in decide_speed(TrainConfig(), net, cuda, use_scaler=True).reasons["cuda_graphs"]
    assert "need a CUDA device" in decide_speed(TrainConfig(), net, CPU).reasons["cuda_graphs"]
    handle = register_module_forward_hook(lambda m, a, o: None)
    try:
        assert "global module hooks" in decide_speed(TrainConfig(), net, cuda).reasons["cuda_graphs"]
    finally:
        handle.remove()
    assert decide_speed(TrainConfig(), net, cuda).cuda_graphs is True


# ---------------------------------------------------------------- schedules

def test_schedule_values():
    from gputrain.train.optim.build import make_schedule

    const = make_schedule("constant", 100, 10)
    assert [const(s) for s in (0, 4, 9, 10, 99)] == pytest.approx([0.1, 0.5, 1.0, 1.0, 1.0])
    cos = make_schedule("cosine", 110, 10)
    assert cos(9) == pytest.approx(1.0) and cos(10) == pytest.approx(1.0)
    assert cos(60) == pytest.approx(0.5) and cos(110) == pytest.approx(0.0, abs=1e-12)
    assert cos(35) == pytest.approx(0.5 * (1 + math.cos(math.pi * 0.25)))
    one = make_schedule("onecycle", 100, 0)  # up over the first 30 steps, then linear to 0
    assert one(0) == pytest.approx(0.1 + 0.9 / 30) and one(29) == pytest.approx(1.0)
    assert one(30) == pytest.approx(1.0) and one(65) == pytest.approx(0.5) and one(100) == pytest.approx(0.0)


def test_the_schedule_drives_the_optimizer_lr():
    x, y = data(64)
    h = fit(mlp(), (x, y), loss_fn=nn.CrossEntropyLoss(),
            config=TrainConfig(device="cpu", batch_size=8, steps=20, lr=0.1, schedule="cosine", warmup_steps=4,
                               log_every=1))
    from gputrain.train.optim.build import make_schedule

    fn = make_schedule("cosine", 20, 4)
    assert [r["lr"] for r in h.records] == pytest.approx([0.1 * fn(s) for s in range(1, 21)])


# ---------------------------------------------------------------- out of memory settings

def test_oom_recovery_off_lets_the_error_through():
    with pytest.raises(torch.OutOfMemoryError):
        fit(OOMAbove(mlp(), limit=4), data(32), loss_fn=nn.CrossEntropyLoss(),
            config=TrainConfig(device="cpu", batch_size=16, steps=1, oom_recovery=False))


# ---------------------------------------------------------------- checkpoints and resume

def test_resume_refuses_another_seed_or_global_batch(tmp_path):
    run_dir = str(tmp_path / "run")
    fit(mlp(), data(), loss_fn=nn.CrossEntropyLoss(),
        config=TrainConfig(device="cpu", batch_size=8, steps=3, run_dir=run_dir, seed=1))
    with pytest.raises(CheckpointError, match="seed=1 but this run has seed=2"):
        fit(mlp(), data(), loss_fn=nn.CrossEntropyLoss(),
            config=TrainConfig(device="cpu", batch_size=8, steps=6, run_dir=run_dir, seed=2, resume=True))
    with pytest.raises(CheckpointError, match="global batch of 8 .* this run has 16"):
        fit(mlp(), data(), loss_fn=nn.CrossEntropyLoss(),
            config=TrainConfig(device="cpu", batch_size=8, accumulate=2, steps=6, run_dir=run_dir, seed=1,
                               resume=True))


def test_resume_from_a_checkpoint_file(tmp_path):
    x, y = data(64)
    cfg = dict(device="cpu", batch_size=8, steps=12, log_every=4, seed=5)
    full = mlp()
    fit(full, (x, y), loss_fn=nn.CrossEntropyLoss(), config=TrainConfig(**cfg))
    first = mlp()
    fit(first, (x, y), loss_fn=nn.CrossEntropyLoss(),
        config=TrainConfig(**cfg, run_dir=str(tmp_path / "a"), stop_at_step=5))
    resumed = mlp(seed=7)
    h = fit(resumed, (x, y), loss_fn=nn.CrossEntropyLoss(),
            config=TrainConfig(**cfg, resume=str(_latest(tmp_path / "a"))))
    assert h.summary["steps"] == 12
    assert torch.equal(params(resumed), params(full))


class _InterruptAt(nn.Module):
    """Raises KeyboardInterrupt in the forward of the n-th call (as Ctrl-C mid-step would)."""

    def __init__(self, inner, at):
        super().__init__()
        self.inner, self.at, self.calls = inner, at, 0

    def forward(self, x):
        self.calls += 1
        if self.calls == self.at:
            raise KeyboardInterrupt
        return self.inner(x)


def test_ctrl_c_mid_step_writes_a_checkpoint_that_resumes_exactly(tmp_path):
    x, y = data(80)
    cfg = dict(device="cpu", batch_size=8, steps=20, log_every=5, seed=4)
    full = mlp()
    h_full = fit(full, (x, y), loss_fn=nn.CrossEntropyLoss(), config=TrainConfig(**cfg))
    run_dir = str(tmp_path / "run")
    interrupted = _InterruptAt(mlp(), at=12)  # steps 1..11 done, step 12 interrupted in its forward
    with pytest.raises(KeyboardInterrupt):
        fit(interrupted, (x, y), loss_fn=nn.CrossEntropyLoss(), config=TrainConfig(**cfg, run_dir=run_dir))
    from gputrain.checkpoint.format import load_checkpoint

    assert load_checkpoint(_latest(tmp_path / "run"))["step"] == 11
    resumed = _InterruptAt(mlp(seed=3), at=-1)
    h = fit(resumed, (x, y), loss_fn=nn.CrossEntropyLoss(), config=TrainConfig(**cfg, run_dir=run_dir, resume=True))
    assert torch.equal(params(resumed.inner), params(full))
    assert [r["loss"] for r in h.records] == pytest.approx([r["loss"] for r in h_full.records], rel=1e-6)


def test_golden_run_accumulation_oom_split_stop_and_resume(tmp_path):
    """A seeded run with accumulation, an OOM split and a stop + resume ends exactly where the
    uninterrupted run without OOM ends: the same loss history and the same parameters."""
    x, y = data(120)
    cfg = dict(device="cpu", batch_size=12, accumulate=2, steps=16, log_every=4, seed=9, schedule="cosine",
               warmup_steps=2, eval_every=8)
    ref = mlp()
    h_ref = fit(ref, (x, y), loss_fn=nn.CrossEntropyLoss(), optimizer=sgd(0.2), eval_data=(x, y),
                config=TrainConfig(**cfg))
    run_dir = str(tmp_path / "run")
    first = OOMAbove(mlp(), limit=8)  # micro-batches of 12 do not fit: cut in 2 (6 + 6)
    h1 = fit(first, (x, y), loss_fn=nn.CrossEntropyLoss(), optimizer=sgd(0.2), eval_data=(x, y),
             config=TrainConfig(**cfg, run_dir=run_dir, stop_at_step=7))
    assert h1.summary["oom_splits"] == 2 and h1.summary["steps"] == 7
    second = OOMAbove(mlp(seed=1), limit=8)
    h2 = fit(second, (x, y), loss_fn=nn.CrossEntropyLoss(), optimizer=sgd(0.2), eval_data=(x, y),
             config=TrainConfig(**cfg, run_dir=run_dir, resume=True))
    assert torch.allclose(params(second.inner), params(ref), atol=1e-6)
    for a, b in zip(h2.records, h_ref.records, strict=True):
        assert a["step"] == b["step"]
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-5)
        # Only eval points carry eval_loss (every 8 steps): the same records have it, with equal values.
        assert (a.get("eval_loss") is None) == (b.get("eval_loss") is None)
        if b.get("eval_loss") is not None:
            assert a["eval_loss"] == pytest.approx(b["eval_loss"], rel=1e-5)
    assert sum(r.get("eval_loss") is not None for r in h_ref.records) == 2


# ---------------------------------------------------------------- wrappers

def test_data_parallel_is_unwrapped_with_one_warning():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fit(nn.DataParallel(mlp()), data(), loss_fn=nn.CrossEntropyLoss(),
            config=TrainConfig(device="cpu", steps=1))
    assert sum("nn.DataParallel" in str(w.message) for w in caught) == 1


@pytest.mark.parametrize("pieces", [1, 2])
def test_a_loss_scaler_scales_the_backward_and_unscales_before_the_update(pieces):
    """fp16's path through the step on the CPU (torch's GradScaler runs there too): the backward is
    of the scaled loss and the update of the unscaled gradient, so one step equals the fp32 step.
    Without the scale in the backward the update is 1/scale of it; without the unscale, scale times."""
    from gputrain.runtime.precision import Precision, RunPrecision
    from gputrain.train.step.loss import LossRule
    from gputrain.train.step.train_step import TrainStep

    x, y = data(32)
    after = []
    for scaled in (False, True):
        model = mlp()
        opt = torch.optim.SGD(model.parameters(), lr=0.5)
        precision = RunPrecision(Precision("fp16" if scaled else "fp32", None, scaled, False, "test"), CPU)
        if scaled:
            precision.scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 10)
        step = TrainStep(model, LossRule(loss_fn=nn.CrossEntropyLoss()), opt, precision, device=CPU)
        step([(x[:16], y[:16]), (x[16:], y[16:])] if pieces == 2 else [(x, y)])
        after.append(params(model))
    assert torch.allclose(after[0], after[1], rtol=1e-5, atol=1e-6)
