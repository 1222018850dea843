"""Preflight: a run directory that cannot be made or written, or a disk too small, fails at once."""

import io
import shutil
import sys
from collections import namedtuple

import pytest
import torch
from torch import nn

from gputrain.errors import ConfigError
from gputrain.checkpoint.store import CheckpointStore
from gputrain.io.preflight import METADATA_BYTES, estimate_checkpoint_bytes, preflight_run_dir

linux_only = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="uses /sys, read-only on Linux")


def _one_line(exc_info):
    message = str(exc_info.value)
    assert "\n" not in message
    return message


def test_the_run_dir_is_created_and_left_empty(tmp_path):
    run_dir = tmp_path / "a" / "b" / "run"
    preflight_run_dir(run_dir, needed_bytes=1000)
    assert run_dir.is_dir() and list(run_dir.iterdir()) == []  # the write probe is gone
    preflight_run_dir(run_dir, needed_bytes=1000)  # an existing folder is fine


def test_a_file_in_the_way_is_a_config_error(tmp_path):
    (tmp_path / "taken").write_text("x")
    with pytest.raises(ConfigError) as exc_info:
        preflight_run_dir(tmp_path / "taken", needed_bytes=1)
    assert f"cannot create run directory {tmp_path / 'taken'}" in _one_line(exc_info)
    assert "choose another --run-dir" in str(exc_info.value)
    with pytest.raises(ConfigError, match="cannot create run directory .*taken/run: .*choose another --run-dir"):
        preflight_run_dir(tmp_path / "taken" / "run", needed_bytes=1)


@linux_only
def test_an_uncreatable_or_unwritable_dir_says_why_and_what_to_do():
    with pytest.raises(ConfigError) as exc_info:
        preflight_run_dir("/sys/gputrain-run", needed_bytes=1)
    assert _one_line(exc_info) == ("cannot create run directory /sys/gputrain-run: Operation not permitted: "
                                   "choose another --run-dir")
    with pytest.raises(ConfigError) as exc_info:  # exists, but nothing can be written there (even as root)
        preflight_run_dir("/sys/kernel", needed_bytes=1)
    assert _one_line(exc_info) == ("cannot write in run directory /sys/kernel: Permission denied: fix its "
                                   "permissions or choose another --run-dir")


Usage = namedtuple("Usage", "total used free")


def test_too_little_disk_for_the_kept_checkpoints(tmp_path, monkeypatch):
    monkeypatch.setattr(shutil, "disk_usage", lambda path: Usage(10 << 30, 0, 399 << 20))
    # 100 MiB checkpoints, keeping 2: 2 kept + the best + the one being written = 400 MiB
    with pytest.raises(ConfigError) as exc_info:
        preflight_run_dir(tmp_path, needed_bytes=100 << 20, keep_last=2)
    assert _one_line(exc_info) == (
        f"not enough free disk for checkpoints in {tmp_path}: 399.0 MiB free, a run keeping 2 needs about "
        "400.0 MiB (4 x 100.0 MiB: the kept ones, the best, and the one being written): free disk space, "
        "choose another --run-dir, or keep fewer checkpoints")
    preflight_run_dir(tmp_path, needed_bytes=100 << 20, keep_last=1)  # 300 MiB: fits
    monkeypatch.setattr(shutil, "disk_usage", lambda path: Usage(10 << 30, 0, 400 << 20))
    preflight_run_dir(tmp_path, needed_bytes=100 << 20, keep_last=2)


def test_checkpoints_already_there_count_as_room(tmp_path, monkeypatch):
    store = CheckpointStore(tmp_path)
    store.save({"w": torch.zeros(100_000)}, 1)  # ~400 KB, as a resumed run finds it
    held = store.list()[0].stat().st_size
    monkeypatch.setattr(shutil, "disk_usage", lambda path: Usage(10 << 30, 0, 4 * held - held))
    assert store.bytes_held() == held
    preflight_run_dir(tmp_path, needed_bytes=held, keep_last=2, held_bytes=held)
    monkeypatch.setattr(shutil, "disk_usage", lambda path: Usage(10 << 30, 0, 4 * held - held - 1))
    with pytest.raises(ConfigError, match=r"free \(plus 3\d\d\.\d KiB in checkpoints already there\)"):
        preflight_run_dir(tmp_path, needed_bytes=held, keep_last=2, held_bytes=store.bytes_held())


# ---------------------------------------------------------------- the size of a checkpoint


def _saved_size(model, optimizer):
    buf = io.BytesIO()
    torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict()}, buf)
    return len(buf.getvalue())


def test_estimate_counts_weights_buffers_and_adamw_moments():
    model = nn.Sequential(nn.Linear(300, 400), nn.BatchNorm1d(400), nn.Linear(400, 10))
    params = sum(p.numel() for p in model.parameters()) * 4
    buffers = sum(b.numel() * b.element_size() for b in model.buffers())
    assert estimate_checkpoint_bytes(model, "adamw") == params * 3 + buffers + METADATA_BYTES
    assert estimate_checkpoint_bytes(model, None) == params * 3 + buffers + METADATA_BYTES  # the default
    assert estimate_checkpoint_bytes(model, "sgd") == params * 2 + buffers + METADATA_BYTES  # momentum
    # An optimizer that has stepped: its real state; the estimate bounds what torch.save writes.
    opt = torch.optim.AdamW(model.parameters())
    assert estimate_checkpoint_bytes(model, opt) == params * 3 + buffers + METADATA_BYTES  # before a step
    model(torch.randn(8, 300)).sum().backward()
    opt.step()
    estimate = estimate_checkpoint_bytes(model, opt)
    actual = _saved_size(model, opt)
    assert actual <= estimate <= actual + METADATA_BYTES
    plain_sgd = torch.optim.SGD(model.parameters(), lr=0.1)
    assert estimate_checkpoint_bytes(model, plain_sgd) == params + buffers + METADATA_BYTES


def test_estimate_uses_each_dtype_and_counts_tied_weights_once():
    embed = nn.Embedding(1000, 64)
    head = nn.Linear(64, 1000, bias=False)
    head.weight = embed.weight  # tied, as in GPT-2
    model = nn.ModuleDict({"embed": embed, "head": head}).to(torch.bfloat16)
    assert estimate_checkpoint_bytes(model, "adamw") == 1000 * 64 * 2 * 3 + METADATA_BYTES
    with pytest.raises(ConfigError, match="unknown optimizer 'lion'.*give one of adadelta, adagrad"):
        estimate_checkpoint_bytes(model, "lion")


# ---------------------------------------------------------------- what a run holds, and what it cannot write


def test_an_output_path_is_never_a_file_the_run_holds(tmp_path):
    from gputrain.io.preflight import check_output_dir, check_output_file, run_held

    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)
    for name in ("history.json", "workload.json", "config.toml", "events.out.tfevents.1.host.0"):
        (run / name).write_text("{}")
    for path in (run / "checkpoints" / "step-000004.pt", run / "checkpoints" / "new.pt", run / "history.json",
                 run / "workload.json", run / "events.out.tfevents.1.host.0", tmp_path / "run" / ".." / "run" / "config.toml"):
        with pytest.raises(ConfigError, match=r"--out .* writing there would destroy what the run holds; give another "
                                              r"path, e.g. .*run/model.onnx"):
            check_output_file(path, "--out", example="model.onnx", run_dir=run)
    with pytest.raises(ConfigError, match="in the checkpoints of the run"):
        check_output_dir(run / "checkpoints", "--out", run_dir=run)
    assert run_held(tmp_path, run) is not None  # a folder above the run holds it
    for path in (run / "report.html", run / "predictions.pt", run / "export" / "model.onnx", tmp_path / "p.pt"):
        assert check_output_file(path, "--out", run_dir=run) == path  # the commands' own outputs


def test_a_file_size_limit_below_a_checkpoint_is_said_before_the_run(tmp_path, monkeypatch):
    import resource

    monkeypatch.setattr(resource, "getrlimit", lambda which: (100 << 10, resource.RLIM_INFINITY))
    with pytest.raises(ConfigError) as exc_info:
        preflight_run_dir(tmp_path / "run", needed_bytes=2 << 20)
    assert _one_line(exc_info) == ("a checkpoint of this run takes about 2.0 MiB, but this process may write no file "
                                   "over 100.0 KiB (its file-size limit, ulimit -f): raise the limit (ulimit -f "
                                   "unlimited) before starting the run")
    preflight_run_dir(tmp_path / "run", needed_bytes=50 << 10)  # below the limit: fine


def test_a_checkpoint_store_that_cannot_be_written_is_said_before_the_run(tmp_path):
    store = CheckpointStore(tmp_path / "run")
    store.check_writable()  # nothing there yet: made at the first save
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "checkpoints").write_text("x")
    with pytest.raises(ConfigError, match=r"checkpoints is a file where the run keeps its checkpoints"):
        store.check_writable()
    (tmp_path / "run" / "checkpoints").unlink()
    (tmp_path / "run" / "checkpoints" / "latest").mkdir(parents=True)
    with pytest.raises(ConfigError, match=r"checkpoints/latest is a folder where the store writes a file"):
        store.check_writable()
