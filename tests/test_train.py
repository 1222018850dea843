"""The trainer: precision rules, accumulation, no host syncs, determinism, exact resume, OOM recovery."""

import pytest
import torch
from helpers import data, mlp, OOMAbove, params, sgd
from torch import nn

from gputrain import TrainConfig, fit
from gputrain.errors import CheckpointError, ConfigError, GputrainError
from gputrain.runtime.precision import resolve_precision

CPU = torch.device("cpu")


# ---------------------------------------------------------------- precision

def test_precision_on_cpu():
    assert resolve_precision("auto", CPU).name == "fp32"
    assert "CPU" in resolve_precision("auto", CPU).reason
    assert resolve_precision("bf16", CPU).autocast_dtype == torch.bfloat16
    with pytest.raises(ConfigError, match="fp16 is not supported on the CPU"):
        resolve_precision("fp16", CPU)
    with pytest.raises(ConfigError, match="tf32 needs an NVIDIA GPU"):
        resolve_precision("tf32", CPU)
    with pytest.raises(ConfigError, match="unknown precision 'fp8'"):
        resolve_precision("fp8", CPU)


@pytest.mark.parametrize("cap,name,auto,scaler", [((9, 0), "NVIDIA H100 80GB HBM3", "bf16", False),
                                                  ((7, 5), "Tesla T4", "fp16", True)])
def test_precision_auto_on_faked_gpus(monkeypatch, cap, name, auto, scaler):
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda d=None: cap)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda d=None: name)
    p = resolve_precision("auto", torch.device("cuda", 0))
    assert p.name == auto and p.use_scaler is scaler and name in p.reason
    if cap < (8, 0):
        with pytest.raises(ConfigError, match="bf16 needs compute capability 8.0"):
            resolve_precision("bf16", torch.device("cuda", 0))
        with pytest.raises(ConfigError, match="tf32 needs compute capability 8.0"):
            resolve_precision("tf32", torch.device("cuda", 0))


def test_fit_rejects_fp16_on_cpu():
    with pytest.raises(ConfigError, match="fp16"):
        fit(mlp(), data(), loss_fn=nn.CrossEntropyLoss(), config=TrainConfig(device="cpu", precision="fp16", steps=1))


def test_config_validation_messages():
    with pytest.raises(ConfigError, match="batch_size must be a positive integer, got 0"):
        TrainConfig(batch_size=0)
    with pytest.raises(ConfigError, match="resume=True needs run_dir"):
        TrainConfig(resume=True)


def test_checkpointing_is_the_old_name_of_recompute():
    with pytest.warns(DeprecationWarning, match=r"TrainConfig\(checkpointing=\.\.\.\) is deprecated.*`recompute`"):
        old = TrainConfig(checkpointing=["blocks.0"])
    assert old.recompute == ["blocks.0"] and "checkpointing" not in old.to_dict()
    assert old.replace(lr=0.1).recompute == ["blocks.0"]


# ---------------------------------------------------------------- the update

def test_accumulation_equals_one_big_batch():
    x, y = data(64)
    a, b = mlp(), mlp()
    fit(a, (x, y), loss_fn=nn.CrossEntropyLoss(), optimizer=sgd(),
        config=TrainConfig(device="cpu", batch_size=8, accumulate=4, steps=4, seed=3))
    fit(b, (x, y), loss_fn=nn.CrossEntropyLoss(), optimizer=sgd(),
        config=TrainConfig(device="cpu", batch_size=32, accumulate=1, steps=4, seed=3))
    assert torch.allclose(params(a), params(b), atol=1e-6)
    assert not torch.equal(params(a), params(mlp()))  # it did train


def test_training_learns_and_reports_accuracy():
    x, y = data(400)
    model = mlp()
    h = fit(model, (x[:300], y[:300]), loss_fn=nn.CrossEntropyLoss(), eval_data=(x[300:], y[300:]),
            config=TrainConfig(device="cpu", batch_size=32, epochs=15, lr=1e-2, log_every=20))
    assert h.records[-1]["loss"] < h.records[0]["loss"]
    assert h.summary["final_eval_accuracy"] > 0.85
    assert h.summary["precision"] == "fp32" and h.summary["data"] == "host-slices"
    assert all(r["samples_per_s"] > 0 for r in h.records)


def test_no_host_sync_in_the_hot_loop(monkeypatch):
    """Only log points read device values: count every .item/.cpu/.tolist/.numpy during a run."""
    calls = []
    for name in ("item", "cpu", "tolist", "numpy"):
        original = getattr(torch.Tensor, name)

        def counting(self, *a, _orig=original, _name=name, **k):
            calls.append(_name)
            return _orig(self, *a, **k)

        monkeypatch.setattr(torch.Tensor, name, counting)
    x, y = data(64)
    fit(mlp(), (x, y), loss_fn=nn.CrossEntropyLoss(),
        config=TrainConfig(device="cpu", batch_size=4, steps=40, log_every=10))
    assert len(calls) == 4, calls  # 40 steps, a log point every 10: one read each, none per step
    calls.clear()
    fit(mlp(), (x, y), loss_fn=nn.CrossEntropyLoss(), eval_data=(x, y),
        config=TrainConfig(device="cpu", batch_size=4, steps=40, log_every=20))
    assert len(calls) == 2 * 2, calls  # per log point: the loss read and one read of eval totals


def test_reruns_with_a_seed_are_identical():
    x, y = data(80)
    runs = []
    for _ in range(2):
        model = mlp(dropout=0.2)
        h = fit(model, (x, y), loss_fn=nn.CrossEntropyLoss(),
                config=TrainConfig(device="cpu", batch_size=8, epochs=3, log_every=5, seed=11))
        runs.append(([r["loss"] for r in h.records], params(model)))
    assert runs[0][0] == runs[1][0]
    assert torch.equal(runs[0][1], runs[1][1])


# ---------------------------------------------------------------- checkpoints and resume

def test_resume_is_exact(tmp_path):
    x, y = data(90)
    cfg = dict(device="cpu", batch_size=8, steps=30, log_every=5, seed=2, schedule="cosine", warmup_steps=3)
    full = mlp(dropout=0.3)
    h_full = fit(full, (x, y), loss_fn=nn.CrossEntropyLoss(), config=TrainConfig(**cfg))

    part = mlp(dropout=0.3)
    run_dir = tmp_path / "run"
    h1 = fit(part, (x, y), loss_fn=nn.CrossEntropyLoss(), config=TrainConfig(**cfg, run_dir=str(run_dir), stop_at_step=13))
    assert h1.summary["stopped_early"] and h1.summary["steps"] == 13
    resumed = mlp(dropout=0.3, seed=99)  # different initial weights: the checkpoint must replace them
    h2 = fit(resumed, (x, y), loss_fn=nn.CrossEntropyLoss(), config=TrainConfig(**cfg, run_dir=str(run_dir), resume=True))
    assert h2.summary["steps"] == 30
    assert torch.equal(params(resumed), params(full))
    assert [r["loss"] for r in h2.records] == pytest.approx([r["loss"] for r in h_full.records], rel=1e-6)
    assert (run_dir / "metrics.jsonl").exists() and (run_dir / "history.json").exists()


def test_resume_rejects_a_corrupt_checkpoint(tmp_path):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "checkpoint.pt").write_bytes(b"\x00garbage" * 10)
    with pytest.raises(CheckpointError, match="checkpoint.pt"):
        fit(mlp(), data(), loss_fn=nn.CrossEntropyLoss(),
            config=TrainConfig(device="cpu", steps=2, run_dir=str(run_dir), resume=True))


def test_resume_rejects_another_models_checkpoint(tmp_path):
    run_dir = tmp_path / "run"
    fit(mlp(), data(), loss_fn=nn.CrossEntropyLoss(), config=TrainConfig(device="cpu", steps=2, run_dir=str(run_dir)))
    other = nn.Sequential(nn.Linear(6, 32), nn.ReLU(), nn.Linear(32, 3))
    with pytest.raises(CheckpointError):
        fit(other, data(), loss_fn=nn.CrossEntropyLoss(),
            config=TrainConfig(device="cpu", steps=4, run_dir=str(run_dir), resume=True))


# ---------------------------------------------------------------- out of memory

def test_oom_halves_the_micro_batch_and_keeps_the_result():
    x, y = data(64)
    ref = mlp()
    fit(ref, (x, y), loss_fn=nn.CrossEntropyLoss(), optimizer=sgd(), config=TrainConfig(device="cpu", batch_size=32, steps=4))
    small = OOMAbove(mlp(), limit=10)
    h = fit(small, (x, y), loss_fn=nn.CrossEntropyLoss(), optimizer=sgd(),
            config=TrainConfig(device="cpu", batch_size=32, steps=4))
    assert small.ooms >= 2  # 32 -> 16 -> 8
    assert h.summary["oom_splits"] == 4 and h.summary["effective_batch"] == 32
    assert torch.allclose(params(small.inner), params(ref), atol=1e-6)


def test_oom_at_micro_batch_one_gives_up_clearly():
    x, y = data(8)
    with pytest.raises(GputrainError, match="out of memory on cpu even with micro-batches of 1"):
        fit(OOMAbove(mlp(), limit=0), (x, y), loss_fn=nn.CrossEntropyLoss(),
            config=TrainConfig(device="cpu", batch_size=4, steps=1))


def test_cuda_graphs_fall_back_on_cpu_with_a_reason():
    h = fit(mlp(), data(), loss_fn=nn.CrossEntropyLoss(),
            config=TrainConfig(device="cpu", steps=2, cuda_graphs=True))
    assert h.summary["cuda_graphs"].startswith("off: CUDA graphs need a CUDA device")


# ---------------------------------------------------------------- GPU

@pytest.mark.gpu
@pytest.mark.parametrize("schedule", ["constant", "cosine"])
def test_graphed_step_matches_eager_on_gpu(schedule):
    """Graphs (one per batch shape: 50 and the last, partial 6) end where eager steps end."""
    from gputrain.train.loop.trainer import Trainer

    x, y = data(256)
    runs = {}
    for graphs in (False, True):
        model = mlp()
        cfg = TrainConfig(device="cuda", precision="fp32", batch_size=50, epochs=4, cuda_graphs=graphs, seed=1,
                          schedule=schedule, warmup_steps=5)
        trainer = Trainer(model, (x, y), loss_fn=nn.CrossEntropyLoss(), config=cfg)
        h = trainer.run()
        runs[graphs] = (params(model).cpu(), h, trainer.parts.step.graphed)
    assert runs[True][1].summary["cuda_graphs"] == "on"
    graphed = runs[True][2]
    # 24 steps: 3 warm-up, then the 50-batch graph; the first partial batch runs eagerly once and
    # is captured the next epoch, so the later ones replay too.
    # Resident data: the graph assembles each batch itself (key: the data source and the batch size).
    assert sorted(k[-1] for k in graphed.graphs) == [6, 50] and all(k[0] == "deferred" for k in graphed.graphs)
    assert graphed.eager_fallbacks == 1 and graphed.replays == 24 - 3 - 1
    assert torch.allclose(runs[True][0], runs[False][0], atol=1e-4)
    assert [r["loss"] for r in runs[True][1].records] == pytest.approx([r["loss"] for r in runs[False][1].records],
                                                                        rel=1e-4)


@pytest.mark.gpu
def test_graphed_steps_assemble_augmented_uint8_batches_like_eager_steps_on_gpu():
    """uint8 images normalized, crop-flipped and made channels_last inside the graph: the run ends
    where the eager run ends (same order and draws per epoch)."""
    from gputrain.data import BatchTransform
    from gputrain.train.loop.trainer import Trainer

    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, 256, (200, 3, 16, 16), dtype=torch.uint8, generator=g)
    y = (x.float().mean((1, 2, 3)) > 127.5).long()
    transform = BatchTransform(mean=(120.0,) * 3, std=(60.0,) * 3, augment="crop-flip")
    runs = {}
    for graphs in (False, True):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(),
                              nn.Linear(8, 2))
        cfg = TrainConfig(device="cuda", precision="fp32", batch_size=64, epochs=5, cuda_graphs=graphs, seed=2,
                          cudnn_benchmark=False)
        trainer = Trainer(model, (x, y), loss_fn=nn.CrossEntropyLoss(), config=cfg, transform=transform)
        trainer.run()
        runs[graphs] = (params(model).cpu(), trainer)
    graphed = runs[True][1].graphed
    assert runs[True][1].train_loader.defer and graphed.failed is None
    assert sorted(k[-1] for k in graphed.graphs) == [8, 64] and graphed.replays >= 20 - 3 - 1
    assert torch.allclose(runs[True][0], runs[False][0], atol=1e-4)


@pytest.mark.gpu
def test_graph_input_copies_are_skipped_only_for_unchanged_batches():
    """Full-batch training passes the same tensor each step: no copy; an in-place change is seen."""
    from gputrain.runtime.precision import RunPrecision, resolve_precision
    from gputrain.train.step.graphs import GraphedStep
    from gputrain.train.step.loss import LossRule
    from gputrain.train.optim.build import make_optimizer
    from gputrain.train.step.train_step import TrainStep

    dev = torch.device("cuda")
    x, y = (t.to(dev) for t in data(64))

    def run(graphed_steps: bool):
        model = mlp().to(dev)
        opt, _ = make_optimizer(None, model.parameters(), lr=1e-2, weight_decay=0.0, device=dev, capturable=True)
        prec = RunPrecision(resolve_precision("fp32", dev), dev)
        step = GraphedStep(TrainStep(model, LossRule(nn.CrossEntropyLoss()), opt, prec, device=dev), dev)
        inputs = x.clone()
        for i in range(8):
            if i == 6:
                inputs.mul_(-1.0)  # in place: same address, new contents
            if graphed_steps:
                step([(inputs, y)])
            else:
                step._side_stream_step([(inputs, y)])
        torch.cuda.synchronize()
        return params(model).cpu(), step

    graphed, step = run(True)
    eager, _ = run(False)
    assert step.replays == 5
    assert torch.allclose(graphed, eager, atol=1e-5)


@pytest.mark.gpu
def test_no_sync_in_hot_loop_on_gpu():
    """Syncs must not grow with the number of steps: count them with CUDA's sync debug mode."""
    import warnings

    x, y = data(4096)

    def syncs(steps):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                fit(mlp(), (x, y), loss_fn=nn.CrossEntropyLoss(),
                    config=TrainConfig(device="cuda", batch_size=64, steps=steps, log_every=10_000,
                                       cuda_graphs=False, data_on_device=True))
            finally:
                torch.cuda.set_sync_debug_mode(0)
        # Only real syncs: the mode's one-time "prototype feature" notice also says "synchronization".
        return sum("called a synchronizing CUDA operation" in str(w.message) for w in caught)

    assert syncs(60) == syncs(20)


def test_fit_accepts_a_dataset_and_a_dataloader():
    from torch.utils.data import DataLoader, Dataset, TensorDataset

    x, y = data(96)

    class Pairs(Dataset):  # a plain map-style dataset: goes through the DataLoader path
        def __len__(self):
            return len(x)

        def __getitem__(self, i):
            return x[i], y[i]

    h1 = fit(mlp(), Pairs(), loss_fn=nn.CrossEntropyLoss(), eval_data=TensorDataset(x, y),
             config=TrainConfig(device="cpu", batch_size=16, epochs=2, num_workers=0))
    assert h1.summary["data"] == "dataloader" and h1.summary["steps"] == 12
    h2 = fit(mlp(), DataLoader(TensorDataset(x, y), batch_size=32, shuffle=True), loss_fn=nn.CrossEntropyLoss(),
             config=TrainConfig(device="cpu", epochs=2))
    assert h2.summary["data"] == "user-dataloader" and h2.summary["steps"] == 6
    assert h1.records[-1]["eval_accuracy"] > 0


@pytest.mark.gpu
def test_fit_gives_back_cudnn_benchmark():
    """fit switches cudnn.benchmark for its run only (an MLP: off) and restores the caller's value."""
    before = torch.backends.cudnn.benchmark
    torch.backends.cudnn.benchmark = True
    try:
        fit(mlp(), data(), loss_fn=nn.CrossEntropyLoss(), config=TrainConfig(device="cuda", steps=2))
        assert torch.backends.cudnn.benchmark is True
    finally:
        torch.backends.cudnn.benchmark = before
