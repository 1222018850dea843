"""Checkpoints: atomic writes, safe loads, and errors that name the file and the problem."""

import random
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch
from torch import nn

from gputrain.checkpoint import (VERSION, capture_rng_state, check_model_state, load_checkpoint,
                                 restore_rng_state, save_checkpoint)
from gputrain.errors import CheckpointError


def _state(value=1.0):
    model = nn.Linear(3, 2)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(4, 3)).sum().backward()
    opt.step()
    with torch.no_grad():
        model.weight.fill_(value)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 0.5)
    scaler = torch.amp.GradScaler("cpu", enabled=False)
    return {"model": model.state_dict(), "optimizer": opt.state_dict(), "scheduler": sched.state_dict(),
            "scaler": scaler.state_dict(), "rng": capture_rng_state(torch.device("cpu")), "step": 7,
            "config": {"lr": 1e-3, "checkpointing": ["a", "b"], "resume": False, "run_dir": None},
            "history": [{"step": 5, "loss": 0.5, "eval_accuracy": None}]}


def test_round_trip_under_weights_only(tmp_path):
    path = save_checkpoint(tmp_path / "ck.pt", _state())
    state = load_checkpoint(path)
    assert state["version"] == VERSION and state["step"] == 7
    assert torch.equal(state["model"]["weight"], torch.ones(2, 3))
    assert state["optimizer"]["state"][0]["exp_avg"].shape == (2, 3)
    assert state["history"][0]["loss"] == 0.5


def test_a_crash_mid_write_keeps_the_previous_checkpoint(tmp_path, monkeypatch):
    path = tmp_path / "ck.pt"
    save_checkpoint(path, _state(1.0))
    real_save = torch.save

    def half_then_crash(obj, f, *a, **k):
        import io

        buf = io.BytesIO()
        real_save(obj, buf)
        f.write(buf.getvalue()[: len(buf.getvalue()) // 2])
        raise OSError("disk full (simulated)")

    monkeypatch.setattr(torch, "save", half_then_crash)
    with pytest.raises(OSError, match="simulated"):
        save_checkpoint(path, _state(2.0))
    monkeypatch.setattr(torch, "save", real_save)
    assert torch.equal(load_checkpoint(path)["model"]["weight"], torch.ones(2, 3))
    assert [p.name for p in tmp_path.iterdir()] == ["ck.pt"]  # no temp file left behind


def test_a_killed_writer_keeps_the_previous_checkpoint(tmp_path):
    """SIGKILL a process in the middle of writing a big checkpoint: the old one still loads."""
    path = tmp_path / "ck.pt"
    save_checkpoint(path, _state(1.0))
    script = textwrap.dedent(f"""
        import os, signal, torch
        from gputrain import checkpoint
        real = torch.save
        def slow(obj, f, *a, **k):
            f.write(b"PK" + b"x" * 1000)
            f.flush()
            os.kill(os.getpid(), signal.SIGKILL)  # dies half-way through the write
        torch.save = slow
        checkpoint.save_checkpoint({str(path)!r}, {{"model": {{"w": torch.zeros(1000)}}}})
    """)
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, timeout=60)
    assert proc.returncode == -9
    assert torch.equal(load_checkpoint(path)["model"]["weight"], torch.ones(2, 3))


@pytest.mark.parametrize("content,needle", [
    (b"", "empty"),
    (b"\x00garbage" * 50, "corrupt"),
])
def test_bad_files_are_explained(tmp_path, content, needle):
    path = tmp_path / "bad.pt"
    path.write_bytes(content)
    with pytest.raises(CheckpointError, match=needle) as exc_info:
        load_checkpoint(path)
    assert str(path) in str(exc_info.value)


def test_truncated_checkpoint(tmp_path):
    path = save_checkpoint(tmp_path / "ck.pt", _state())
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match="ck.pt"):
        load_checkpoint(path)


def test_missing_foreign_and_future_files(tmp_path):
    with pytest.raises(CheckpointError, match="no checkpoint there"):
        load_checkpoint(tmp_path / "nope.pt")
    torch.save({"a": torch.ones(1)}, tmp_path / "plain.pt")
    with pytest.raises(CheckpointError, match="not a gputrain checkpoint"):
        load_checkpoint(tmp_path / "plain.pt")
    torch.save({"format": "gputrain-checkpoint", "version": VERSION + 1}, tmp_path / "future.pt")
    with pytest.raises(CheckpointError, match="newer than this gputrain"):
        load_checkpoint(tmp_path / "future.pt")
    torch.save({"format": "gputrain-checkpoint", "version": 1, "obj": nn.Linear(1, 1)}, tmp_path / "pickled.pt")
    with pytest.raises(CheckpointError, match="only tensors and plain data"):
        load_checkpoint(tmp_path / "pickled.pt")


def test_check_model_state_names_the_differences():
    state = nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 2)).state_dict()
    check_model_state(state, nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 2)))
    with pytest.raises(CheckpointError, match=r"shape mismatch.*0.weight \(4, 3\) vs \(8, 3\)"):
        check_model_state(state, nn.Sequential(nn.Linear(3, 8), nn.Linear(4, 2)))
    with pytest.raises(CheckpointError, match="missing 2 key"):
        check_model_state(state, nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 2), nn.Linear(2, 2)))


def test_rng_state_round_trip(tmp_path):
    state = capture_rng_state(torch.device("cpu"))
    save_checkpoint(tmp_path / "rng.pt", {"rng": state})
    first = (torch.rand(3), random.random(), np.random.rand())
    restore_rng_state(load_checkpoint(tmp_path / "rng.pt")["rng"], torch.device("cpu"))
    second = (torch.rand(3), random.random(), np.random.rand())
    assert torch.equal(first[0], second[0]) and first[1:] == second[1:]
