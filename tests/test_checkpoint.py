"""Checkpoints: atomic writes, safe loads, and errors that name the file and the problem."""

import io
import os
import random
import stat
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch
from torch import nn
from helpers import file_names

from gputrain.checkpoint.format import FORMAT, VERSION, check_model_state, load_checkpoint, write_checkpoint
from gputrain.checkpoint.rng import capture_rng_state, restore_rng_state
from gputrain.config import TrainConfig
from gputrain.errors import CheckpointError
from gputrain.train.optim.build import make_optimizer, make_scheduler


def _state(value=1.0, schedule="cosine"):
    """A state dict shaped like the trainer's: every entry it saves, from the objects it builds."""
    model = nn.Linear(3, 2)
    opt, _ = make_optimizer(None, model.parameters(), lr=1e-3, weight_decay=0.1, device=torch.device("cpu"))
    sched = make_scheduler(opt, schedule, total_steps=10, warmup_steps=2)
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)  # enabled: scale and growth tracker
    model(torch.randn(4, 3)).sum().backward()
    opt.step()
    sched.step()
    with torch.no_grad():
        model.weight.fill_(value)
    shuffle = torch.Generator().manual_seed(3)
    torch.randperm(10, generator=shuffle)
    return {"model": model.state_dict(), "optimizer": opt.state_dict(), "scheduler": sched.state_dict(),
            "scaler": scaler.state_dict(), "rng": capture_rng_state(torch.device("cpu")), "step": 7, "epoch": 1,
            "batch_in_epoch": 3, "samples_seen": 448, "loss_since_log": 1.5,
            "config": TrainConfig(device="cpu", steps=10, recompute=["a", "b"]).to_dict(),
            "history": [{"step": 5, "loss": 0.5, "eval_accuracy": None, "device": "cpu"}],
            "loader": {"generator": shuffle.get_state()}}


@pytest.mark.parametrize("schedule", ["constant", "cosine", "onecycle"])
def test_the_trainers_state_round_trips_under_weights_only(tmp_path, schedule):
    saved = _state(schedule=schedule)
    path = write_checkpoint(tmp_path / "ck.pt", saved)
    state = load_checkpoint(path)  # weights_only=True inside
    assert state["format"] == FORMAT and state["version"] == VERSION
    assert (state["step"], state["epoch"], state["batch_in_epoch"], state["samples_seen"]) == (7, 1, 3, 448)
    assert torch.equal(state["model"]["weight"], torch.ones(2, 3))
    assert torch.equal(state["optimizer"]["state"][0]["exp_avg"], saved["optimizer"]["state"][0]["exp_avg"])
    assert state["scaler"]["scale"] == 1024.0 and state["config"]["recompute"] == ["a", "b"]
    assert state["history"] == saved["history"]
    assert torch.equal(state["loader"]["generator"], saved["loader"]["generator"])
    # ... and loads back into fresh objects
    model = nn.Linear(3, 2)
    opt, _ = make_optimizer(None, model.parameters(), lr=1e-3, weight_decay=0.1, device=torch.device("cpu"))
    sched = make_scheduler(opt, schedule, total_steps=10, warmup_steps=2)
    scaler = torch.amp.GradScaler("cpu")
    model.load_state_dict(state["model"])
    opt.load_state_dict(state["optimizer"])
    sched.load_state_dict(state["scheduler"])
    scaler.load_state_dict(state["scaler"])
    assert sched.last_epoch == 1 and scaler.get_scale() == 1024.0
    assert opt.param_groups[0]["lr"] == pytest.approx(saved["optimizer"]["param_groups"][0]["lr"])
    gen = torch.Generator()
    gen.set_state(state["loader"]["generator"])
    shuffle = torch.Generator().manual_seed(3)
    torch.randperm(10, generator=shuffle)
    assert torch.equal(torch.randperm(10, generator=gen), torch.randperm(10, generator=shuffle))


def test_unloadable_values_are_refused_before_anything_is_written(tmp_path):
    path = write_checkpoint(tmp_path / "ck.pt", _state(1.0))
    bad = _state(2.0)
    bad["history"][0]["loss"] = np.float64(0.5)  # a float subclass that weights_only refuses
    with pytest.raises(CheckpointError, match=r"history'\]\[0\]\['loss'\].*numpy.float64.*float\(\)"):
        write_checkpoint(path, bad)
    with pytest.raises(CheckpointError, match="nn.modules.linear.Linear"):
        write_checkpoint(path, {"obj": nn.Linear(1, 1)})
    assert torch.equal(load_checkpoint(path)["model"]["weight"], torch.ones(2, 3))
    assert file_names(tmp_path) == ["ck.pt"]


def test_a_crash_mid_write_keeps_the_previous_checkpoint(tmp_path, monkeypatch):
    path = tmp_path / "ck.pt"
    write_checkpoint(path, _state(1.0))
    real_save = torch.save

    def half_then_crash(obj, f, *a, **k):
        buf = io.BytesIO()
        real_save(obj, buf)
        f.write(buf.getvalue()[: len(buf.getvalue()) // 2])
        raise OSError("disk full (simulated)")

    monkeypatch.setattr(torch, "save", half_then_crash)
    with pytest.raises(OSError, match="simulated"):
        write_checkpoint(path, _state(2.0))
    monkeypatch.setattr(torch, "save", real_save)
    assert torch.equal(load_checkpoint(path)["model"]["weight"], torch.ones(2, 3))
    assert file_names(tmp_path) == ["ck.pt"]  # no temp file left behind


@pytest.mark.processes
def test_a_killed_writer_keeps_the_previous_checkpoint(tmp_path):
    """SIGKILL a process half-way through writing a checkpoint: the old one still loads, and the
    next save removes the dead writer's temp file."""
    path = tmp_path / "ck.pt"
    write_checkpoint(path, _state(1.0))
    script = textwrap.dedent(f"""
        import io, os, signal, torch
        from gputrain.checkpoint import format as checkpoint
        real = torch.save
        def killed_half_way(obj, f, *a, **k):
            buf = io.BytesIO()
            real(obj, buf)
            f.write(buf.getvalue()[: len(buf.getvalue()) // 2])
            f.flush()
            os.kill(os.getpid(), signal.SIGKILL)
        torch.save = killed_half_way
        checkpoint.write_checkpoint({str(path)!r}, {{"model": {{"weight": torch.zeros(100_000)}}}})
    """)
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, timeout=60)
    assert proc.returncode == -9, proc.stderr.decode()[-2000:]
    leftovers = [n for n in file_names(tmp_path) if n != "ck.pt"]
    assert len(leftovers) == 1 and leftovers[0].endswith(".tmp")  # it died after writing, before the rename
    assert (tmp_path / leftovers[0]).stat().st_size > 100_000
    assert torch.equal(load_checkpoint(path)["model"]["weight"], torch.ones(2, 3))
    write_checkpoint(path, _state(3.0))
    assert file_names(tmp_path) == ["ck.pt"]
    assert torch.equal(load_checkpoint(path)["model"]["weight"], torch.full((2, 3), 3.0))


def test_the_file_gets_the_usual_permissions(tmp_path):
    path = write_checkpoint(tmp_path / "ck.pt", {"step": 1})
    umask = os.umask(0)
    os.umask(umask)
    assert stat.S_IMODE(path.stat().st_mode) == 0o666 & ~umask  # not mkstemp's 0600


@pytest.mark.parametrize("content,needle", [
    (b"", "empty"),
    (b"\x00garbage" * 50, "corrupt"),
    # Random bytes, seeded so a failure repeats: the unpickler fails on them in many ways.
    *[(random.Random(seed).randbytes(4096), "corrupt") for seed in range(40)],
])
def test_bad_files_are_explained(tmp_path, content, needle):
    path = tmp_path / "bad.pt"
    path.write_bytes(content)
    with pytest.raises(CheckpointError, match=needle) as exc_info:
        load_checkpoint(path)
    assert str(path) in str(exc_info.value)


def test_truncated_checkpoint(tmp_path):
    path = write_checkpoint(tmp_path / "ck.pt", _state())
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match="ck.pt.*truncated or corrupt") as exc_info:
        load_checkpoint(path)
    assert str(path) in str(exc_info.value)


def test_missing_foreign_and_future_files(tmp_path):
    with pytest.raises(CheckpointError, match="nope.pt: no checkpoint there.*--resume"):
        load_checkpoint(tmp_path / "nope.pt")
    with pytest.raises(CheckpointError, match="is a folder"):
        load_checkpoint(tmp_path)
    torch.save({"a": 1}, tmp_path / "plain.pt")
    with pytest.raises(CheckpointError, match="plain.pt: a PyTorch file but not a gputrain checkpoint"):
        load_checkpoint(tmp_path / "plain.pt")
    with pytest.raises(CheckpointError, match=r"no checkpoint there \(the folder holds plain.pt\)"):
        load_checkpoint(tmp_path / "nope.pt")
    torch.save({"format": FORMAT, "version": VERSION + 1}, tmp_path / "future.pt")
    with pytest.raises(CheckpointError, match=f"future.pt: checkpoint format version {VERSION + 1} is newer"):
        load_checkpoint(tmp_path / "future.pt")
    torch.save({"format": FORMAT, "version": 1, "obj": nn.Linear(1, 1)}, tmp_path / "pickled.pt")
    with pytest.raises(CheckpointError, match=r"pickled.pt: .*\(torch.nn.modules.linear.Linear\).*only tensors "
                                              "and plain data"):
        load_checkpoint(tmp_path / "pickled.pt")


def test_check_model_state_names_the_differences():
    state = nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 2)).state_dict()
    check_model_state(state, nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 2)))
    with pytest.raises(CheckpointError, match=r"ck.pt: .*2 shape mismatch.*0.weight \(4, 3\) vs \(8, 3\)"):
        check_model_state(state, nn.Sequential(nn.Linear(3, 8), nn.Linear(4, 2)), path="ck.pt")
    with pytest.raises(CheckpointError, match="missing 2 key.*2.weight, 2.bias"):
        check_model_state(state, nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 2), nn.Linear(2, 2)))
    with pytest.raises(CheckpointError, match="unexpected 2 key.*1.weight, 1.bias"):
        check_model_state(state, nn.Sequential(nn.Linear(3, 4)))
    ddp_state = {f"module.{k}": v for k, v in state.items()}
    with pytest.raises(CheckpointError, match="starts with 'module.'"):
        check_model_state(ddp_state, nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 2)))


def test_rng_state_round_trip(tmp_path):
    random.random(), np.random.normal()  # numpy caches a second Gaussian: that is state too
    write_checkpoint(tmp_path / "rng.pt", {"rng": capture_rng_state("cpu")})
    first = (torch.rand(3), random.random(), random.gauss(0, 1), np.random.rand(), np.random.normal())
    for _ in range(5):  # move every generator on
        torch.rand(7), random.random(), np.random.rand()
    restore_rng_state(load_checkpoint(tmp_path / "rng.pt")["rng"], torch.device("cpu"))
    second = (torch.rand(3), random.random(), random.gauss(0, 1), np.random.rand(), np.random.normal())
    assert torch.equal(first[0], second[0]) and first[1:] == second[1:]
    with pytest.raises(CheckpointError, match="random-number state is malformed"):
        restore_rng_state({"torch": torch.get_rng_state()}, "cpu")


@pytest.mark.gpu
def test_cuda_rng_state_round_trip(tmp_path):
    device = torch.device("cuda")
    write_checkpoint(tmp_path / "rng.pt", {"rng": capture_rng_state(device)})
    first = torch.rand(3, device=device)
    torch.rand(5, device=device)
    restore_rng_state(load_checkpoint(tmp_path / "rng.pt")["rng"], device)
    assert torch.equal(first, torch.rand(3, device=device))


@pytest.mark.parametrize("schedule", ["constant", "cosine", "onecycle"])
def test_lr_schedule_matches_lambdalr_and_loads_its_state(schedule):
    """gputrain's LRSchedule gives LambdaLR's lrs step for step and resumes from a LambdaLR state."""
    from gputrain.train.optim.build import make_schedule

    def opt():
        return torch.optim.SGD([torch.nn.Parameter(torch.zeros(2))], lr=0.1)

    fn = make_schedule(schedule, total_steps=20, warmup_steps=3)
    ours_opt, ref_opt = opt(), opt()
    ours, ref = make_scheduler(ours_opt, schedule, total_steps=20, warmup_steps=3), \
        torch.optim.lr_scheduler.LambdaLR(ref_opt, fn)
    for _ in range(20):
        assert ours_opt.param_groups[0]["lr"] == pytest.approx(ref_opt.param_groups[0]["lr"], abs=1e-12)
        assert ours.get_last_lr()[0] == pytest.approx(ref.get_last_lr()[0], abs=1e-12)
        ours_opt.step(), ref_opt.step()
        ours.step(), ref.step()
    resumed_opt = opt()
    resumed = make_scheduler(resumed_opt, schedule, total_steps=20, warmup_steps=3)
    resumed.load_state_dict(ref.state_dict())  # a checkpoint written before LRSchedule existed
    assert resumed.last_epoch == 20
    assert resumed_opt.param_groups[0]["lr"] == pytest.approx(ref_opt.param_groups[0]["lr"], abs=1e-12)

