"""Sharded (DCP) checkpoints in one process: the store's promises for .dcp folders (whole or absent,
verified file by file, retention with the one-file format, fallback naming the damaged file), and
fit's `checkpoint_format="dcp"` / `async_checkpoint` resuming exactly. Several processes:
tests/test_checkpoint_dcp_distributed.py."""

import os
import random
import select
import signal
import time
import warnings

import pytest
import torch
from torch import nn
from helpers import file_names, flip_a_byte, fork_child

from gputrain import TrainConfig, fit
from gputrain.errors import CheckpointError, ConfigError
from gputrain.checkpoint import sharded
from gputrain.checkpoint.digests import Damage, verify
from gputrain.checkpoint.names import staging_name, step_of
from gputrain.checkpoint.store import CheckpointStore, CheckpointWarning
from gputrain.runtime.distributed import SINGLE
from gputrain.checkpoint.sharded_save import DcpCheckpointer, resolve_format


def _model_and_optimizer(value: float):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 64), nn.ReLU(), nn.Linear(64, 2))
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(value)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.randn(3, 4)).sum().backward()
    optimizer.step()
    optimizer.zero_grad()
    return model, optimizer


def _save(store, step, writer=None, metrics=None):
    writer = writer or DcpCheckpointer(SINGLE, torch.device("cpu"), "dcp")
    model, optimizer = _model_and_optimizer(float(step))
    path = writer.save(store, step, model, optimizer, {"step": step, "run": {"step": step}}, metrics)
    writer.close()
    return path


# ---------------------------------------------------------------- the store's promises, for folders


def test_a_sharded_checkpoint_is_a_committed_folder_with_a_manifest_of_every_file(tmp_path):
    store = CheckpointStore(tmp_path, keep_last=2)
    path = _save(store, 7)
    assert path == store.folder / "step-000007.dcp" and path.is_dir()
    assert file_names(store.folder) == ["latest", "step-000007.dcp"]  # no staging folder left
    assert file_names(path) == [".metadata", "MANIFEST.sha256", "__0_0.distcp", "run-00000.pt"]
    listed = [line.split("  ")[1] for line in (path / "MANIFEST.sha256").read_text().splitlines()]
    assert listed == [".metadata", "__0_0.distcp", "run-00000.pt"]
    assert (store.folder / "latest").read_text() == "step-000007.dcp\n"
    assert store.verify(path) is True and step_of(path) == 7
    state, found = store.load_latest()
    assert found == path and state["step"] == 7 and "model" not in state  # the run state, rank 0's
    full = sharded.load_full(path)
    model, optimizer = _model_and_optimizer(7.0)  # the same state, made again
    for name, value in model.state_dict().items():
        assert torch.equal(full["model"][name], value), name
    assert torch.equal(full["optimizer"]["state"]["0.weight"]["exp_avg"],
                       optimizer.state[model[0].weight]["exp_avg"])


def test_retention_and_the_best_span_both_formats(tmp_path):
    store = CheckpointStore(tmp_path, keep_last=2, best_metric="acc")
    store.save({"step": 1, "w": torch.zeros(3)}, 1, {"acc": 0.9})  # a one-file checkpoint, the best
    for step, acc in ((2, 0.1), (3, 0.2), (4, 0.3)):
        _save(store, step, metrics={"acc": acc})
    assert [p.name for p in store.list()] == ["step-000001.pt", "step-000003.dcp", "step-000004.dcp"]
    _save(store, 5, metrics={"acc": 0.95})
    assert [p.name for p in store.list()] == ["step-000004.dcp", "step-000005.dcp"]
    assert store.best_path() == store.folder / "step-000005.dcp"
    assert not [n for n in file_names(store.folder) if n.endswith(".tmp")]


def test_a_damaged_shard_falls_back_to_the_previous_checkpoint_naming_the_file(tmp_path):
    store = CheckpointStore(tmp_path, keep_last=3)
    for step in (1, 2, 3):
        _save(store, step)
    flip_a_byte(store.folder / "step-000003.dcp" / "__0_0.distcp")
    why = store.verify(store.folder / "step-000003.dcp")
    assert not why and "__0_0.distcp: its content hash does not match MANIFEST.sha256" in why
    with pytest.warns(CheckpointWarning, match=r"step-000003.dcp skipped: __0_0.distcp: its content hash does not "
                                               r"match.*resuming from step-000002.dcp"):
        state, path = store.load_latest()
    assert state["step"] == 2 and path.name == "step-000002.dcp"
    # a missing file, or a folder without its manifest, is as bad
    (store.folder / "step-000002.dcp" / "run-00000.pt").unlink()
    (store.folder / "step-000001.dcp" / "MANIFEST.sha256").unlink()
    with pytest.raises(CheckpointError, match=r"no checkpoint verifies \(step-000003.dcp: __0_0.distcp.*"
                                              r"step-000002.dcp: run-00000.pt is missing; step-000001.dcp: it has no "
                                              r"MANIFEST.sha256"):
        store.load_latest()


def test_shares_of_the_files_verify_separately(tmp_path):
    path = _save(CheckpointStore(tmp_path), 1)
    flip_a_byte(path / "run-00000.pt")  # the third of .metadata, __0_0.distcp, run-00000.pt
    damage = verify(path, share=(0, 2))  # files 0 and 2
    assert isinstance(damage, Damage) and bool(damage) is False  # a reason that tests false
    assert "run-00000.pt: its content hash does not match" in damage
    assert verify(path, share=(1, 2)) is True  # file 1


@pytest.mark.parametrize("async_save", [False, True])
def test_a_sharded_save_leaves_the_warning_filters_as_it_found_them(tmp_path, async_save):
    """DCP warns, in one process, that it assumes one process (the intent): the save drops that
    warning within its own scope (even from DCP's writer thread) and installs no process-wide filter."""
    store = CheckpointStore(tmp_path)
    before = list(warnings.filters)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        inside = list(warnings.filters)
        for step in (1, 2):
            _save(store, step, DcpCheckpointer(SINGLE, torch.device("cpu"), "dcp", async_save=async_save))
        assert warnings.filters == inside
    assert warnings.filters == before
    assert not [w for w in caught if "torch.distributed is disabled" in str(w.message)]
    assert store.verify(store.latest_path()) is True


@pytest.mark.parametrize("async_save", [False, True])
def test_a_sharded_save_that_cannot_write_is_one_line_and_the_previous_checkpoint_stays(tmp_path, monkeypatch,
                                                                                         async_save):
    """A full disk while DCP writes (synchronously, or in its writer thread, seen at the next wait):
    CheckpointError names the step, the folder, the cause and the intact previous checkpoint."""
    from torch.distributed.checkpoint.filesystem import FileSystemWriter

    store = CheckpointStore(tmp_path)
    writer = DcpCheckpointer(SINGLE, torch.device("cpu"), "dcp", async_save=async_save)
    first = _save(store, 1, writer)

    def full(self, plan, planner):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(FileSystemWriter, "write_data", full)
    model, optimizer = _model_and_optimizer(2.0)
    with pytest.raises(CheckpointError) as info:
        writer.save(store, 2, model, optimizer, {"step": 2, "run": {"step": 2}}, None)
        writer.wait()
    writer.close()
    assert str(info.value).startswith(f"could not write the checkpoint of step 2 to {store.folder}: ")
    assert ": rank 0: [Errno 28] No space left on device; " in str(info.value)  # DCP's error unwrapped
    assert str(info.value).endswith(f"the previous checkpoint {first} is intact. Free space (or choose another "
                                    f"--run-dir) and resume with --resume {store.run_dir}")
    assert store.latest_path() == first and store.verify(first) is True


def test_a_staging_folder_is_never_taken_for_a_checkpoint_and_the_next_save_clears_it(tmp_path):
    store = CheckpointStore(tmp_path)
    _save(store, 1)
    staged = store.folder / staging_name(2, "killed")
    staged.mkdir()
    (staged / "__0_0.distcp").write_bytes(b"half of a shard")
    assert [p.name for p in store.list()] == ["step-000001.dcp"] and store.load_latest()[0]["step"] == 1
    _save(store, 2)
    assert file_names(store.folder) == ["latest", "step-000001.dcp", "step-000002.dcp"]


def test_formats_and_their_settings():
    assert resolve_format("auto", 1, False)[0] == "file" and resolve_format("auto", 2, False)[0] == "dcp"
    assert resolve_format("auto", 1, True)[0] == "dcp" and resolve_format("file", 4, False)[0] == "file"
    with pytest.raises(ConfigError, match="async_checkpoint needs"):
        TrainConfig(checkpoint_format="file", async_checkpoint=True)
    with pytest.raises(ConfigError, match="checkpoint_format must be"):
        TrainConfig(checkpoint_format="zip")


# ---------------------------------------------------------------- fit, one process


def _fit(run_dir, steps, **kw):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(256, 8, generator=g)
    y = (x[:, :3].sum(1) > 0).long()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Dropout(0.2), nn.Linear(32, 2))
    cfg = TrainConfig(device="cpu", batch_size=16, steps=steps, log_every=4, seed=3, run_dir=str(run_dir),
                      checkpoint_every=4, loggers=("csv",), **kw)
    return fit(model, (x, y), loss_fn=nn.CrossEntropyLoss(), config=cfg), model


@pytest.mark.parametrize("async_save", [False, True])
def test_fit_with_dcp_checkpoints_resumes_exactly(tmp_path, async_save):
    ref, ref_model = _fit(tmp_path / "file", 16)  # one process, the one-file format (dropout: RNG matters)
    stopped, _ = _fit(tmp_path / "dcp", 16, stop_at_step=10, checkpoint_format="dcp", async_checkpoint=async_save)
    assert stopped.summary["steps"] == 10
    assert stopped.summary["checkpoint_format"] == "dcp" and stopped.summary["checkpoint_async"] is async_save
    assert stopped.summary["checkpoint_saves"] == 3  # steps 4, 8 and the stop at 10
    store = CheckpointStore(tmp_path / "dcp")
    assert [p.name for p in store.list()] == ["step-000008.dcp", "step-000010.dcp"]
    resumed, model = _fit(tmp_path / "dcp", 16, resume=True, checkpoint_format="dcp", async_checkpoint=async_save)
    for (name, a), b in zip(model.state_dict().items(), ref_model.state_dict().values()):
        assert torch.equal(a, b), name
    # The interval cut by the stop sums its losses in another order: equal to the last bits or so.
    assert [r["loss"] for r in resumed.records] == pytest.approx([r["loss"] for r in ref.records], rel=1e-6)
    full = sharded.load_full(store.latest_path())
    assert full["step"] == 16 and torch.equal(full["model"]["0.weight"], ref_model.state_dict()["0.weight"])


def test_a_one_process_run_keeps_one_file_and_resumes_a_sharded_checkpoint(tmp_path):
    _fit(tmp_path / "run", 8, checkpoint_format="dcp")
    h, _ = _fit(tmp_path / "run", 12, resume=True)  # auto: one file from now on; resumes the folder
    assert h.summary["checkpoint_format"] == "file" and h.summary["steps"] == 12
    names = [p.name for p in CheckpointStore(tmp_path / "run").list()]
    assert names == ["step-000008.dcp", "step-000012.pt"]
    # A folder named explicitly resumes like a file does (here: back to step 8, then on to 10).
    again, _ = _fit(tmp_path / "run", 10, resume=str(tmp_path / "run" / "checkpoints" / "step-000008.dcp"))
    assert again.summary["steps"] == 10 and [r["step"] for r in again.records] == [4, 8, 10]


# ---------------------------------------------------------------- killed while saving


def _writer(run_dir, progress, ready_fd):
    warnings.simplefilter("ignore")
    store = CheckpointStore(run_dir, keep_last=2)
    found = store.load_latest()
    step = found[0]["step"] + 1 if found else 1
    writer = DcpCheckpointer(SINGLE, torch.device("cpu"), "dcp")
    with open(progress, "a") as prog:
        while True:
            model, optimizer = _model_and_optimizer(float(step))
            writer.save(store, step, model, optimizer, {"step": step}, None)
            prog.write(f"saved {step}\n")
            prog.flush()
            if ready_fd is not None:  # the first save is done: the saves to be hit follow
                os.write(ready_fd, b"r")
                ready_fd = None
            step += 1


@pytest.mark.processes
@pytest.mark.skipif(not hasattr(os, "fork"), reason="forks writers to kill them")
def test_a_writer_killed_at_any_moment_of_a_dcp_save_leaves_a_verifying_checkpoint(tmp_path):
    rng = random.Random(20261124)
    run_dir, progress = tmp_path / "run", tmp_path / "progress.txt"
    store = CheckpointStore(run_dir, keep_last=2)
    mid_save = 0  # kills that left a staging folder: they landed inside a save
    _save(CheckpointStore(tmp_path / "warm-up"), 1)  # DCP imported and torch initialized before the forks
    for trial in range(12):
        progress.write_text("")
        pid, read_fd = fork_child(lambda ready_fd: _writer(run_dir, progress, ready_fd), tmp_path / "writer-error.txt")
        assert select.select([read_fd], [], [], 60)[0], "the writer never got ready"
        os.close(read_fd)
        time.sleep(rng.uniform(0.0, 0.1))
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        assert not (tmp_path / "writer-error.txt").exists(), (tmp_path / "writer-error.txt").read_text()
        saved = [int(line.split()[1]) for line in progress.read_text().splitlines()]
        mid_save += store.folder.is_dir() and any(name.endswith(".tmp") for name in file_names(store.folder))
        for path in store.list():  # every folder under a step name is whole
            assert store.verify(path) is True, (trial, path, store.verify(path), file_names(path))
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # nothing skipped: the newest is intact
            found = store.load_latest()
        if saved:
            assert found is not None and found[0]["step"] in (saved[-1], saved[-1] + 1), (trial, saved, found)
            full = sharded.load_full(found[1])
            step = found[0]["step"]
            assert torch.equal(full["model"]["2.bias"], _model_and_optimizer(float(step))[0].state_dict()["2.bias"])
    assert mid_save >= 3, (mid_save, saved)
