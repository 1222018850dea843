"""`gpu` tests for CUDA-only branches that no other `gpu` test or smoke line takes (docs/gpu_checklist.md,
"CUDA-only branches", names each branch beside its test). Each runs a branch that the CPU suite cannot
and asserts what it does there. All skip without CUDA (tests/conftest.py); `make test-gpu` runs them."""

from __future__ import annotations

import copy
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers import data, mlp, params
from torch import nn

from gputrain import TrainConfig, fit


@pytest.mark.gpu
def test_tf32_precision_turns_tf32_matmuls_on_for_the_run_and_gives_the_setting_back():
    """resolve_precision("tf32") on CUDA (refused on the CPU) and apply_matmul_settings' CUDA side."""
    from gputrain.runtime.precision import RunPrecision, resolve_precision

    dev = torch.device("cuda")
    p = resolve_precision("tf32", dev)
    assert (p.name, p.autocast_dtype, p.use_scaler, p.tf32) == ("tf32", None, False, True)
    g = torch.Generator(device=dev).manual_seed(0)
    a, b = torch.randn(512, 4096, device=dev, generator=g), torch.randn(4096, 256, device=dev, generator=g)
    exact = a.double() @ b.double()

    def error() -> float:
        return ((a @ b).double() - exact).abs().max().item()

    caller = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("highest")
    try:
        run = RunPrecision(p, dev).apply()
        try:
            assert torch.get_float32_matmul_precision() == "high"
            tf32_error = error()
        finally:
            run.restore()
        assert torch.get_float32_matmul_precision() == "highest"
        assert tf32_error > 20 * error()  # TF32 keeps 10 mantissa bits: its rounding dwarfs fp32's
    finally:
        torch.set_float32_matmul_precision(caller)
    h = fit(mlp(), data(), loss_fn=nn.CrossEntropyLoss(),
            config=TrainConfig(device="cuda", precision="tf32", batch_size=32, steps=6, log_every=3))
    assert h.summary["precision"] == "tf32" and math.isfinite(h.final("loss"))


@pytest.mark.gpu
def test_every_kind_of_data_reaches_the_gpu_whole_and_in_order(monkeypatch):
    """data/device_feed.py on CUDA: `_cuda_side_stream` (non_blocking copies on a side stream,
    record_stream) for gputrain's DataLoader, a user's and a list of batches; the move without a side
    stream for a StatefulDataLoader, whose state is the saved position (side_stream's `-> false`)."""
    from torch.utils.data import DataLoader, Dataset, IterableDataset, TensorDataset

    from gputrain.data import device_feed
    from gputrain.data.feed import make_loader

    x = torch.arange(96 * 3, dtype=torch.float32).reshape(96, 3)
    y = torch.arange(96)

    class Rows(Dataset):
        def __len__(self):
            return len(x)

        def __getitem__(self, i):
            return x[i], y[i]

    class Stream(IterableDataset):
        def __iter__(self):
            return ((x[i], y[i]) for i in range(len(x)))

    side_streams = []
    cuda_side_stream = device_feed._cuda_side_stream

    def counting(device):
        side_streams.append(device)
        return cuda_side_stream(device)

    monkeypatch.setattr(device_feed, "_cuda_side_stream", counting)
    sources = {"dataset": (Rows(), True), "user DataLoader": (DataLoader(TensorDataset(x, y), batch_size=16), True),
               "list of batches": ([(x[i:i + 16], y[i:i + 16]) for i in range(0, 96, 16)], True),
               "stream (a StatefulDataLoader)": (Stream(), False)}
    for name, (source, ahead) in sources.items():
        side_streams.clear()
        loader, _ = make_loader(source, 16, device=torch.device("cuda"), train=False, on_device=False, num_workers=0)
        got = list(loader.iter_epoch(0, 0))
        assert got and all(t.is_cuda for b in got for t in b), name
        assert torch.equal(torch.cat([b[0] for b in got]).cpu(), x), name
        assert torch.equal(torch.cat([b[1] for b in got]).cpu(), y), name
        assert len(side_streams) == (1 if ahead else 0), name


@pytest.mark.gpu
def test_a_callback_sets_the_device_lr_that_the_graph_replays_read():
    """train/loop/callbacks.py's scale_schedule on a capturable optimizer: the lr is a CUDA tensor that the
    captured step reads, written in place (fill_), so the replays after the callback use the new rate."""
    from gputrain.train.loop.trainer import Trainer

    seen: dict = {}

    class Freeze:
        def on_log(self, run, record):
            if run.step == 20 and "before" not in seen:
                seen["lr"] = run.optimizer.param_groups[0]["lr"]
                run.set_lr(1e-30)
                seen["before"] = params(run.model).clone()

    model = mlp()
    trainer = Trainer(model, data(512), loss_fn=nn.CrossEntropyLoss(), callbacks=[Freeze()],
                      scheduler=lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0),
                      config=TrainConfig(device="cuda", precision="fp32", batch_size=64, steps=40, log_every=10,
                                         lr=1e-2, cuda_graphs=True))
    h = trainer.run()
    assert h.summary["cuda_graphs"] == "on" and trainer.parts.step.graphed is not None and trainer.parts.step.graphed.replays > 20
    lr = trainer.parts.optim.optimizer.param_groups[0]["lr"]
    assert lr is seen["lr"] and lr.is_cuda and lr.item() == pytest.approx(1e-30)
    # AdamW moves a weight by about lr a step: at 1e-30 the 20 replays after the callback change nothing
    assert torch.equal(params(model), seen["before"])
    assert not torch.equal(seen["before"].cpu(), params(mlp()))  # (the first 20 steps did train)


@pytest.mark.gpu
def test_the_built_in_schedule_writes_the_device_lr_between_replays():
    """train/optim/build.py's LRSchedule on a capturable optimizer: each change is a fill_ of the lr tensor
    that the graph captured (a Python float would stay at its capture value)."""
    from gputrain.train.loop.trainer import Trainer

    start: dict = {}

    class Watch:
        def on_run_start(self, run):
            start["lr"] = run.optimizer.param_groups[0]["lr"]

    trainer = Trainer(mlp(), data(512), loss_fn=nn.CrossEntropyLoss(), callbacks=[Watch()],
                      config=TrainConfig(device="cuda", precision="fp32", batch_size=64, steps=30, log_every=10,
                                         lr=1e-2, schedule="linear", cuda_graphs=True))
    h = trainer.run()
    assert h.summary["cuda_graphs"] == "on" and trainer.parts.step.graphed is not None and trainer.parts.step.graphed.replays > 20
    lr = trainer.parts.optim.optimizer.param_groups[0]["lr"]
    assert lr is start["lr"] and lr.is_cuda
    assert lr.item() == pytest.approx(1e-2 * trainer.parts.optim.scheduler.fn(30), abs=1e-9)  # linear: 0 at the end
    assert [r["lr"] for r in h.records if "lr" in r] == pytest.approx([1e-2 * 20 / 30, 1e-2 * 10 / 30, 0.0], abs=1e-9)


@pytest.mark.gpu
def test_a_scheduler_that_cycles_momentum_turns_the_graphs_off_before_the_run():
    """runtime/speed.py's SpeedSwitches.refuse_graphs after graphs were decided on (CUDA only)."""
    h = fit(mlp(), data(256), loss_fn=nn.CrossEntropyLoss(),
            scheduler=lambda opt: torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=1e-2, total_steps=20),
            config=TrainConfig(device="cuda", precision="fp32", batch_size=64, steps=20, log_every=10))
    assert h.summary["cuda_graphs"].startswith("off: ") and "cycle_momentum" in h.summary["cuda_graphs"]
    assert h.summary["steps"] == 20


@pytest.mark.gpu
def test_evaluate_and_predict_run_the_model_under_bf16_autocast_on_cuda():
    """Precision.autocast's autocast side in gputrain.evaluate / gputrain.predict on the GPU."""
    from gputrain import evaluate, predict

    class Seen(nn.Module):
        def __init__(self):
            super().__init__()
            self.net = mlp()
            self.dtypes: set[torch.dtype] = set()

        def forward(self, x):
            out = self.net(x)
            self.dtypes.add(out.dtype)
            return out

    x, y = data(256)
    model = Seen()
    scores, outputs = {}, {}
    for p in ("fp32", "bf16"):
        model.dtypes.clear()
        scores[p] = evaluate(model, (x, y), loss_fn=nn.CrossEntropyLoss(), device="cuda", precision=p)
        outputs[p] = predict(model, x, device="cuda", precision=p)
        assert model.dtypes == {torch.float32 if p == "fp32" else torch.bfloat16}, p
    assert outputs["fp32"].dtype == torch.float32 and outputs["bf16"].dtype == torch.bfloat16
    assert torch.allclose(outputs["bf16"].float(), outputs["fp32"], atol=5e-2, rtol=5e-2)
    assert scores["bf16"]["eval_loss"] == pytest.approx(scores["fp32"]["eval_loss"], rel=2e-2)
    assert scores["bf16"]["eval_accuracy"] == pytest.approx(scores["fp32"]["eval_accuracy"], abs=0.02)


@pytest.mark.gpu
def test_host_reads_count_a_cuda_tensor_copied_to_the_host_and_not_one_kept_on_the_gpu():
    """diagnostics/syncs.py's _to_host for a tensor on the GPU (on the CPU a .to('cpu') reads nothing)."""
    from gputrain.diagnostics.syncs import count_host_reads

    t = torch.ones(4, device="cuda")
    to_host = count_host_reads(lambda: (t.to("cpu"), t.to(device="cpu")), steps=2)
    assert to_host["supported"] and to_host["per_step"] >= 2
    assert any("cpu" in s["what"] for s in to_host["sites"])
    assert count_host_reads(lambda: t.to("cuda") * 2, steps=2)["total"] == 0


@pytest.mark.gpu
def test_a_process_group_on_nccl_puts_the_rank_on_its_gpu(monkeypatch):
    """runtime/distributed.py's _rank_device (cuda:LOCAL_RANK) and _collective_device (NCCL's tensors on
    the GPU), in a one-process NCCL group (a one-GPU machine can run it)."""
    import torch.distributed as dist

    from gputrain.runtime import distributed

    monkeypatch.setenv("LOCAL_RANK", "0")
    dist.init_process_group("nccl", store=dist.HashStore(), rank=0, world_size=1)
    try:
        info, device = distributed.init_distributed("auto")
        assert device == torch.device("cuda", 0) and info.backend == "nccl" and not info.owns_group
        assert distributed._collective_device(info) == torch.device("cuda", torch.cuda.current_device())
        t = torch.ones(2, device=device)
        dist.all_reduce(t)
        assert t.tolist() == [1.0, 1.0]
    finally:
        dist.destroy_process_group()


@pytest.mark.gpu
def test_cuda_devices_match_by_index():
    """batch.py's _same for two CUDA devices (an index of None is device 0), as check_devices uses it."""
    from gputrain import batch as batches
    from gputrain import check_devices
    from gputrain.errors import DeviceError

    assert batches._same(torch.device("cuda"), torch.device("cuda:0"))
    assert not batches._same(torch.device("cuda:0"), torch.device("cuda:1"))
    model = mlp().to("cuda")
    assert check_devices(model, (torch.randn(4, 6, device="cuda"),)) == torch.device("cuda", 0)
    with pytest.raises(DeviceError, match="different devices"):
        check_devices(model, (torch.randn(4, 6),))


@pytest.mark.gpu
def test_adamw_without_the_fused_kernel_is_foreach_on_cuda_and_steps_as_the_for_loop_does():
    """train/optim/build.py's make_optimizer with fused off on CUDA: the multi-tensor (foreach) AdamW."""
    from gputrain.train.optim.build import make_optimizer

    dev = torch.device("cuda")
    torch.manual_seed(0)
    a = mlp().to(dev)
    b = copy.deepcopy(a)
    opt_a, how = make_optimizer(None, a.parameters(), lr=1e-2, weight_decay=0.01, device=dev, fused=False)
    assert how == "AdamW (foreach)" and opt_a.defaults["foreach"] is True
    opt_b = torch.optim.AdamW(b.parameters(), lr=1e-2, weight_decay=0.01, foreach=False)
    x, y = (t.to(dev) for t in data(64))
    for _ in range(3):
        for model, opt in ((a, opt_a), (b, opt_b)):
            opt.zero_grad()
            nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
    assert torch.allclose(params(a), params(b), atol=1e-6)


TWO_RANKS = """
import json, sys, torch
from gputrain.runtime import distributed as D

info, device = D.init_distributed("cuda")
model = D.wrap_model(torch.nn.Linear(4, 2).to(device), info, device)
x = torch.ones(8, 4, device=device) * (info.rank + 1)
model(x).sum().backward()  # DDP all-reduces the gradients over NCCL
mean = D.all_reduce_mean(torch.tensor([float(info.rank)], device=D._collective_device(info)), info)
json.dump({"backend": info.backend, "device": str(device), "device_ids": list(model.device_ids),
           "grad": D.unwrap(model).weight.grad[0].tolist(), "mean": mean.tolist()},
          open(f"{sys.argv[1]}/rank{info.rank}.json", "w"))
D.cleanup(info)
"""


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2,
                    reason="needs 2 GPUs: NCCL runs one process on each")
def test_two_ranks_on_two_gpus_join_nccl_and_ddp_binds_each_to_its_gpu(tmp_path):
    """runtime/distributed.py's init_distributed under torchrun (NCCL, bound to the rank's GPU) and
    wrap_model's DDP with device_ids, which no one-GPU machine can run."""
    script = tmp_path / "two_ranks.py"
    script.write_text(TWO_RANKS)
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(Path(__file__).resolve().parents[1] / "src"),
                                                      env.get("PYTHONPATH")]))
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2", "--standalone",
                           str(script), str(tmp_path)], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    for rank in (0, 1):
        seen = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert seen["backend"] == "nccl" and seen["device"] == f"cuda:{rank}" and seen["device_ids"] == [rank]
        assert seen["grad"] == pytest.approx([8 * 1.5] * 4)  # the mean of 8 x (rank + 1) over both ranks
        assert seen["mean"] == pytest.approx([0.5])


@pytest.mark.gpu
def test_the_benchmarks_find_the_gpu_themselves_when_no_device_is_named():
    """bench/common.py's accelerators("auto") on a GPU machine (the smoke and the bench tests name cuda)."""
    from gputrain.bench.common import accelerators

    gpus, why_none = accelerators("auto")
    assert why_none is None and len(gpus) == 1 and gpus[0].type == "cuda"
    every, _ = accelerators("auto", every_gpu=True)
    assert every == [torch.device("cuda", i) for i in range(torch.cuda.device_count())]


def _refused_by_cuda_autocast():
    """A model whose loss CUDA autocast refuses (F.binary_cross_entropy, "unsafe to autocast"), with
    dropout before it: the failed attempt draws from the CUDA generator, which the retry must not see."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Dropout(0.3), nn.Linear(16, 1), nn.Sigmoid(), nn.Flatten(0))
    g = torch.Generator().manual_seed(1)
    batches = [(torch.randn(8, 6, generator=g), torch.randint(0, 2, (8,), generator=g).float()) for _ in range(4)]
    return model, batches


@pytest.mark.gpu
@pytest.mark.parametrize("auto", ["bf16", "fp16"])
def test_a_first_step_that_cuda_autocast_refuses_is_retried_in_fp32_from_the_same_cuda_rng(monkeypatch, auto):
    """train/step/autocast_decider.py on CUDA, with torch's own CUDA autocast refusal: the automatic precision
    (bf16 on this GPU; fp16 with its GradScaler, as on a GPU without bf16) becomes fp32, the retry starts
    from the CUDA generator's state of the failed attempt (first_step.py's `RngState.restore: if self.cuda`),
    and with fp16 the step gives up the GradScaler for the device-side skip of non-finite steps (on_nan='skip';
    `_can_fall_back: if ...skips_nonfinite and ...`, NonFiniteFlag.follow_precision)."""
    from gputrain.runtime import precision as precision_mod
    from gputrain.train.step import first_step
    from gputrain.train.loop.trainer import Trainer

    if auto == "fp16":
        monkeypatch.setattr(precision_mod, "_cuda_bf16", lambda device: False)
    states: list[torch.Tensor] = []
    real_init = first_step.FirstStepGate.__init__

    def recording_init(self, step_fn, deciders, **kw):
        def step(micro_batches):
            states.append(torch.cuda.get_rng_state())
            return step_fn(micro_batches)

        real_init(self, step, deciders, **kw)

    monkeypatch.setattr(first_step.FirstStepGate, "__init__", recording_init)
    model, batches = _refused_by_cuda_autocast()
    t = Trainer(model, batches, loss_fn=nn.functional.binary_cross_entropy,
                config=TrainConfig(device="cuda", steps=4, log_every=2, on_nan="skip", loggers=()))
    try:
        assert t.parts.precision.name == auto and t.parts.precision.scaler.is_enabled() == (auto == "fp16")
        t.run_steps(4)
        assert t.parts.precision.name == "fp32" and not t.parts.precision.scaler.is_enabled()
        assert "unsafe to autocast" in t.parts.precision.precision.reason
        assert len(states) >= 2 and torch.equal(states[0], states[1])  # the retry draws the same dropout mask
        if auto == "fp16":
            assert t.parts.precision.scaled is False and t.parts.step.body.flag.on_device is True
        assert all(math.isfinite(p.detach().float().sum().item()) for p in model.parameters())
    finally:
        t.close()


@pytest.mark.gpu
def test_nhwc_forced_and_refused_at_the_first_step_keeps_the_automatic_bf16(monkeypatch):
    """first_step.py's fall-back with both deciders (the layout's and autocast's, which only a GPU's automatic
    bf16 builds): channels_last=True on the blitz tutorial's `.view` after a convolution fails in NHWC at the
    first step; the layout falls back, autocast's decider is reopened (`AutocastDecider.reopen`), and the run
    goes on in the user's layout, still under bf16."""
    from gputrain.train.loop.trainer import Trainer
    from gputrain.train.step import autocast_decider

    reopened: list[bool] = []
    real_reopen = autocast_decider.AutocastDecider.reopen

    def reopen(self):
        reopened.append(True)
        real_reopen(self)

    monkeypatch.setattr(autocast_decider.AutocastDecider, "reopen", reopen)

    class ViewNet(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv, self.fc = nn.Conv2d(3, 4, 3), nn.Linear(4 * 2 * 2, 3)

        def forward(self, x):
            x = nn.functional.max_pool2d(nn.functional.relu(self.conv(x)), 3)
            return self.fc(x.view(-1, 4 * 2 * 2))

    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(32, 3, 8, 8, generator=g), torch.randint(0, 3, (32,), generator=g)
    t = Trainer(ViewNet(), (x, y), loss_fn=nn.CrossEntropyLoss(),
                config=TrainConfig(device="cuda", steps=4, batch_size=8, log_every=2, channels_last=True, loggers=()))
    try:
        assert t.parts.precision.name == "bf16"
        t.run_steps(4)
        assert reopened == [True] and t.parts.precision.name == "bf16"
        assert t.parts.speed.channels_last is False and "switched off during the run" in t.parts.speed.reasons[
            "channels_last"]
    finally:
        t.close()


@pytest.mark.gpu
def test_the_layout_probe_leaves_the_cuda_generator_where_it_was(monkeypatch):
    """train/step/layout.py on CUDA: the probe's passes (dropout on NHWC activations) run inside
    fork_rng(devices=[cuda]) and start from the CUDA generator's state (first_step.py's `RngState.restore`), so the
    first real step draws the masks it would draw without the probe."""
    from gputrain.train.step import layout

    seen: dict[str, torch.Tensor] = {}
    real_decide = layout.LayoutDecider.decide

    def decide(self, batch):
        seen["before"] = torch.cuda.get_rng_state()
        real_decide(self, batch)
        seen["after"] = torch.cuda.get_rng_state()

    monkeypatch.setattr(layout.LayoutDecider, "decide", decide)

    class ReshapeNet(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv, self.drop, self.fc = nn.Conv2d(3, 4, 3), nn.Dropout(0.3), nn.Linear(4 * 2 * 2, 3)

        def forward(self, x):
            x = self.drop(nn.functional.max_pool2d(nn.functional.relu(self.conv(x)), 3))
            return self.fc(x.reshape(x.shape[0], -1))

    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(32, 3, 8, 8, generator=g), torch.randint(0, 3, (32,), generator=g)
    torch.manual_seed(0)
    h = fit(ReshapeNet(), (x, y), loss_fn=nn.CrossEntropyLoss(),
            config=TrainConfig(device="cuda", steps=4, batch_size=8, log_every=2, loggers=()))
    decision = {d["name"]: d for d in h.summary["decisions"]}["channels_last"]
    assert decision["value"] == "on" and "CUDA rule keeps NHWC" in decision["reason"], decision
    assert torch.equal(seen["before"], seen["after"])


@pytest.mark.gpu
def test_a_cuda_compile_cache_is_keyed_by_the_gpu_and_warms_the_next_cuda_run(tmp_path, caplog):
    """runtime/compile_cache.py on CUDA: the key names the GPU (its description says `cuda:<name>`), the
    first compiled run saves Inductor's CUDA artifacts, the next run on this GPU loads them, and a cache
    made on another GPU is ignored with a line naming both."""
    import logging

    from gputrain.runtime.compile_cache import CompileCache

    def run(run_dir: Path, **extra):
        torch.manual_seed(0)
        return fit(mlp(), data(), loss_fn=nn.CrossEntropyLoss(),
                   config=TrainConfig(device="cuda", compile=True, batch_size=32, steps=4, log_every=2, loggers=(),
                                      run_dir=str(run_dir), **extra))

    run(tmp_path / "first")
    folder = tmp_path / "first" / "compile_cache"
    metas = list(folder.glob("*.json"))
    assert len(metas) == 1 and len(list(folder.glob("*.bin"))) == 1
    parts = json.loads(metas[0].read_text())
    here = f"cuda:{torch.cuda.get_device_name(torch.device('cuda'))}"
    assert parts["device"] == here
    with caplog.at_level(logging.INFO, logger="gputrain"):
        run(tmp_path / "second", compile_cache=str(folder))
    assert any(r.getMessage().startswith("compile cache: loaded ") for r in caplog.records)
    elsewhere = CompileCache(folder, dict(parts, device="cuda:Another GPU"))
    assert elsewhere.load() is False
    assert any(f"made for another device {here!r} here 'cuda:Another GPU'" in line for line in elsewhere.ignored)
