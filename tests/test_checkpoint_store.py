"""CheckpointStore: retention, content hashes, the newest verifying checkpoint after damage or a kill."""

import hashlib
import json
import os
import pathlib
import random
import select
import signal
import sys
import time
import warnings

import numpy as np
import pytest
import torch
from helpers import file_names, flip_a_byte, fork_child

from gputrain.errors import CheckpointError, ConfigError
from gputrain.checkpoint import digests, format as checkpoint, store as checkpoint_store
from gputrain.checkpoint.format import write_checkpoint
from gputrain.checkpoint.digests import Damage, verify
from gputrain.checkpoint.names import step_of
from gputrain.checkpoint.store import CheckpointStore, CheckpointWarning


def _state(step):
    return {"step": step, "model": {"w": torch.full((1000,), float(step))}}


def _saved_steps(store):
    return [step_of(p) for p in store.list()]


# ---------------------------------------------------------------- saving and retention


def test_save_writes_the_checkpoint_its_hash_and_latest_and_keeps_the_last_two(tmp_path):
    store = CheckpointStore(tmp_path, keep_last=2)
    for step in (100, 200, 300):
        path = store.save(_state(step), step)
    folder = tmp_path / "checkpoints"
    assert path == folder / "step-000300.pt"
    assert file_names(folder) == ["latest", "step-000200.pt", "step-000200.pt.sha256",
                              "step-000300.pt", "step-000300.pt.sha256"]
    # sha256sum's format, of the file's bytes
    digest = hashlib.sha256(path.read_bytes()).hexdigest()
    assert (folder / "step-000300.pt.sha256").read_text() == f"{digest}  step-000300.pt\n"
    assert (folder / "latest").read_text() == "step-000300.pt\n"
    assert store.list() == [folder / "step-000200.pt", folder / "step-000300.pt"]
    assert store.latest_path() == path and store.best_path() is None
    assert store.verify(path) is True
    state, loaded = store.load_latest()
    assert loaded == path and state["step"] == 300 and torch.equal(state["model"]["w"], torch.full((1000,), 300.0))


def test_step_numbers_order_the_files_not_their_names_or_times(tmp_path):
    store = CheckpointStore(tmp_path, keep_last=3)
    for step in (999_999, 1_000_000, 5):  # 7 digits sorts before 6 as text; 5 is written last
        store.save(_state(step), step)
    os.utime(store.folder / "step-1000000.pt", (0, 0))  # the oldest mtime: must not matter
    (store.folder / "latest").unlink()
    assert _saved_steps(store) == [5, 999_999, 1_000_000]
    assert store.load_latest()[0]["step"] == 1_000_000


def test_the_best_by_the_metric_is_kept_across_restarts(tmp_path):
    accs = {1: 0.1, 2: 0.9, 3: 0.3, 4: 0.2, 5: 0.4, 6: 0.5}
    store = CheckpointStore(tmp_path, keep_last=2, best_metric="eval_accuracy")
    for step, acc in accs.items():
        store.save(_state(step), step, {"eval_accuracy": acc, "loss": 1.0})
    assert _saved_steps(store) == [2, 5, 6]
    assert store.best_path() == store.folder / "step-000002.pt"
    assert store.best_record()["value"] == 0.9
    # A new process (a resumed run) knows the best from index.json, not from memory.
    again = CheckpointStore(tmp_path, keep_last=2, best_metric="eval_accuracy")
    again.save(_state(7), 7, {"eval_accuracy": 0.6})
    again.save(_state(8), 8, {"eval_accuracy": float("nan")})  # NaN is never the best
    again.save(_state(9), 9)  # no metric at this step
    assert _saved_steps(again) == [2, 8, 9]
    again.save(_state(10), 10, {"eval_accuracy": 0.95})
    assert _saved_steps(again) == [9, 10] and again.best_path().name == "step-000010.pt"
    assert json.loads((again.folder / "index.json").read_text())["best"]["step"] == 10


def test_min_mode_keeps_the_lowest(tmp_path):
    store = CheckpointStore(tmp_path, keep_last=1, best_metric="eval_loss", best_mode="min")
    for step, loss in enumerate([0.9, 0.2, 0.5, 0.7], start=1):
        store.save(_state(step), step, {"eval_loss": loss})
    assert _saved_steps(store) == [2, 4]


def test_bad_settings_and_unsaveable_states_fail_before_anything_is_written(tmp_path):
    with pytest.raises(ConfigError, match="keep_last must be an integer >= 1"):
        CheckpointStore(tmp_path, keep_last=0)
    with pytest.raises(ConfigError, match="best_mode must be 'auto', 'max' or 'min'"):
        CheckpointStore(tmp_path, best_mode="maximum")
    store = CheckpointStore(tmp_path, best_metric="acc")
    store.save(_state(1), 1)
    before = file_names(store.folder)
    with pytest.raises(CheckpointError, match="numpy"):
        store.save({"x": np.float64(1.0)}, 2)
    with pytest.raises(ConfigError, match="'acc'.*not a number"):
        store.save(_state(2), 2, {"acc": "high"})
    with pytest.raises(ValueError, match="step must be an integer >= 0"):
        store.save(_state(2), -1)
    assert file_names(store.folder) == before and store.load_latest()[0]["step"] == 1


def test_a_failed_write_leaves_the_previous_checkpoints(tmp_path, monkeypatch):
    store = CheckpointStore(tmp_path)
    store.save(_state(1), 1)
    real = torch.save

    def disk_full(obj, f, *a, **k):
        f.write(b"PK\x03\x04 half")
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(torch, "save", disk_full)
    with pytest.raises(OSError, match="No space"):
        store.save(_state(2), 2)
    monkeypatch.setattr(torch, "save", real)
    assert file_names(store.folder) == ["latest", "step-000001.pt", "step-000001.pt.sha256"]
    assert store.load_latest()[0]["step"] == 1


def test_a_save_clears_what_killed_writers_left(tmp_path):
    store = CheckpointStore(tmp_path)
    store.save(_state(1), 1)
    leftovers = [".step-000007.pt.x1y2z3.tmp", ".step-000007.pt.sha256.a1b2c3.tmp", "step-000007.pt.sha256"]
    for name in leftovers:
        (store.folder / name).write_bytes(b"left by a writer killed while saving step 7")
    store.save(_state(2), 2)
    assert file_names(store.folder) == ["latest", "step-000001.pt", "step-000001.pt.sha256",
                                    "step-000002.pt", "step-000002.pt.sha256"]


# ---------------------------------------------------------------- verifying and falling back


def test_a_damaged_newest_checkpoint_falls_back_to_the_one_before_with_a_warning(tmp_path):
    store = CheckpointStore(tmp_path, keep_last=3)
    for step in (1, 2, 3):
        store.save(_state(step), step)
    newest = store.folder / "step-000003.pt"
    flip_a_byte(newest)
    why = store.verify(newest)
    assert not why and isinstance(why, Damage) and "content hash does not match" in why
    assert verify(newest, share=(0, 2)) == why and verify(newest, share=(1, 2)) is True  # a file: rank 0 reads it
    with pytest.warns(CheckpointWarning, match=r"step-000003.pt skipped: its content hash does not match.*"
                                               r"resuming from step-000002.pt"):
        state, path = store.load_latest()
    assert state["step"] == 2 and path.name == "step-000002.pt"
    # a missing hash is as bad as a wrong one
    (store.folder / "step-000002.pt.sha256").unlink()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert store.load_latest()[0]["step"] == 1
    assert [str(w.message).split(" skipped: ")[1][:30] for w in caught] == [
        "its content hash does not matc", "it has no step-000002.pt.sha25"]
    assert all(w.category is CheckpointWarning for w in caught)


def test_none_verifying_is_an_error_listing_them_and_an_empty_run_is_none(tmp_path):
    store = CheckpointStore(tmp_path / "run")
    assert store.load_latest() is None  # no run dir yet
    store.folder.mkdir(parents=True)
    assert store.load_latest() is None and store.latest_path() is None
    for step in (1, 2):
        store.save(_state(step), step)
    flip_a_byte(store.folder / "step-000001.pt")
    (store.folder / "step-000002.pt").write_bytes(b"")
    with pytest.raises(CheckpointError, match=r"no checkpoint verifies \(step-000002.pt: its content hash.*"
                                              r"0 bytes.*; step-000001.pt: its content hash.*--resume"):
        store.load_latest()


def test_a_verified_file_that_cannot_load_is_an_error_not_a_silent_fallback(tmp_path):
    store = CheckpointStore(tmp_path)
    store.save(_state(1), 1)
    path = store.folder / "step-000002.pt"
    torch.save({"format": checkpoint.FORMAT, "version": checkpoint.VERSION + 1}, path)  # a newer gputrain's
    (store.folder / "step-000002.pt.sha256").write_text(
        f"{hashlib.sha256(path.read_bytes()).hexdigest()}  step-000002.pt\n")
    (store.folder / "latest").write_text("step-000002.pt\n")
    with pytest.raises(CheckpointError, match="step-000002.pt: checkpoint format version 2 is newer"):
        store.load_latest()


def test_latest_wins_over_higher_steps_left_by_a_rewound_run(tmp_path):
    """A run resumed from step 2 (say, with --resume) saves step 3 again: the old steps 3 and 4
    are another history. latest names the new step 3; nothing is deleted that the run did not
    pass again."""
    store = CheckpointStore(tmp_path, keep_last=3)
    for step in (1, 2, 3, 4):
        store.save(_state(step), step)
    rewound = CheckpointStore(tmp_path, keep_last=2)
    rewound.save({"step": 3, "model": {"w": torch.zeros(1000)}}, 3)
    assert _saved_steps(rewound) == [2, 3, 4]  # 4 kept: not ours to judge yet
    assert (rewound.folder / "step-000003.pt.sha256").read_text().count("\n") == 1  # the old digest is gone
    state, path = rewound.load_latest()
    assert path.name == "step-000003.pt" and torch.equal(state["model"]["w"], torch.zeros(1000))
    flip_a_byte(path)  # then the one below latest, not the stale step 4
    with pytest.warns(CheckpointWarning, match="step-000003.pt skipped"):
        assert rewound.load_latest()[1].name == "step-000002.pt"
    rewound.save(_state(4), 4)
    rewound.save(_state(5), 5)
    assert _saved_steps(rewound) == [4, 5]


def test_a_run_dir_from_before_the_store_still_loads(tmp_path, caplog):
    write_checkpoint(tmp_path / "checkpoint.pt", _state(42))
    store = CheckpointStore(tmp_path)
    with caplog.at_level("INFO", logger="gputrain.checkpoint.store"):
        state, path = store.load_latest()
    assert path == tmp_path / "checkpoint.pt" and state["step"] == 42
    assert "no hash to verify" in caplog.text
    store.save(_state(43), 43)  # the next save goes to checkpoints/, and is preferred
    assert store.load_latest()[0]["step"] == 43
    damaged = tmp_path / "old-run"
    damaged.mkdir()
    (damaged / "checkpoint.pt").write_bytes(b"junk" * 10)
    with pytest.raises(CheckpointError, match="checkpoint.pt: corrupt"):
        CheckpointStore(damaged).load_latest()


# ---------------------------------------------------------------- killed at any moment
#
# Writers are forked from this process (torch already imported: a fork starts in milliseconds, a
# new interpreter in seconds) and SIGKILLed: at named moments, at a seeded random line of the
# store's code, and after a seeded random time. Each writer first resumes from load_latest, so a
# writer killed before it moved `latest` is followed by one that saves the same step again.

KEEP = 2
SEED = 20261123


def _acc(step):
    return random.Random(step).random()


def _payload(step):
    # the writer's pid: a step saved again by the next writer gets other bytes, so another digest
    return {"step": step, "writer": os.getpid(), "model": {"w": torch.full((50_000,), float(step))}}


def _arm(mode, arg):
    """Make this (forked) process SIGKILL itself at a moment of a save."""
    def die(where):
        with open(os.environ["CKPT_TEST_WHERE"], "a") as f:
            f.write(f"{mode}:{where}\n")
        os.kill(os.getpid(), signal.SIGKILL)

    store_cls = checkpoint_store.CheckpointStore
    if mode == "mid_write":  # some bytes of the checkpoint written, not all
        real_write, calls = digests.Sha256Writer.write, [0]

        def write(self, data):
            n = real_write(self, data)
            calls[0] += 1
            if calls[0] == arg:
                self.flush()
                die("mid-write")
            return n
        digests.Sha256Writer.write = write
    elif mode == "hash_written":  # the .sha256 in place, the checkpoint not yet renamed
        real_hash = store_cls._write_hash

        def write_hash(self, path, digests):
            real_hash(self, path, digests)
            die(f"after writing {len(digests)} digest(s)")
        store_cls._write_hash = write_hash
    elif mode == "before_latest":
        def write_latest(self, path):
            die("before latest")
        store_cls._write_latest = write_latest
    elif mode == "before_prune":  # the checkpoint written and `latest` moved, the prune after it not run
        real_prune = store_cls._prune

        def prune(self, step, newest):
            if (self.folder / "latest").read_text().strip() == newest.name:
                die(f"before pruning after {newest.name}")
            real_prune(self, step, newest)
        store_cls._prune = prune
    elif mode == "mid_prune":  # the first file of a checkpoint deleted, the other not yet
        real_prune, real_unlink = store_cls._prune, pathlib.Path.unlink
        pruning = [False]

        def prune(self, *a):
            pruning[0] = True
            real_prune(self, *a)
            pruning[0] = False

        def unlink(self, *a, **k):
            real_unlink(self, *a, **k)
            if pruning[0] and step_of(self.name.removesuffix(".sha256")) is not None:
                die(f"after deleting {self.name}")
        store_cls._prune, pathlib.Path.unlink = prune, unlink
    elif mode == "line":  # the arg-th line the store (or format.py, digests.py) runs
        files = {checkpoint_store.__file__, checkpoint.__file__, digests.__file__}
        count = [0]

        def on_line(frame, event, _):
            if event == "line":
                count[0] += 1
                if count[0] >= arg:
                    die(f"{frame.f_code.co_name}:{frame.f_lineno}")
            return on_line
        sys.settrace(lambda frame, event, _: on_line if frame.f_code.co_filename in files else None)


def _writer(run_dir, progress, mode, arg, ready_fd):
    warnings.simplefilter("ignore")
    store = CheckpointStore(run_dir, keep_last=KEEP, best_metric="acc")
    found = store.load_latest()
    step = found[0]["step"] + 1 if found else 1
    with open(progress, "a") as prog:
        prog.write(f"resumed {step - 1}\n")
        prog.flush()
        _arm(mode, arg)
        os.write(ready_fd, b"r")
        while True:
            store.save(_payload(step), step, {"acc": _acc(step)})
            prog.write(f"saved {step}\n")
            prog.flush()
            step += 1


def _fork_writer(run_dir, progress, mode, arg, delay=None, timeout=30.0):
    """Run one writer in a forked child until it dies; returns how it ended."""
    pid, read_fd = fork_child(lambda ready_fd: _writer(run_dir, progress, mode, arg, ready_fd),
                              run_dir / "writer-error.txt")
    try:
        if delay is not None:
            assert select.select([read_fd], [], [], timeout)[0], "the writer never got ready"
            os.read(read_fd, 1)
            time.sleep(delay)
            os.kill(pid, signal.SIGKILL)
        deadline = time.monotonic() + timeout
        while True:
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                break
            if time.monotonic() > deadline:
                os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
                pytest.fail(f"writer ({mode} {arg}) still running after {timeout} s")
            time.sleep(0.005)
    finally:
        os.close(read_fd)
    error = run_dir / "writer-error.txt"
    assert not error.exists(), error.read_text()
    assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL, status


@pytest.mark.processes
@pytest.mark.skipif(not hasattr(os, "fork"), reason="forks writers to kill them")
def test_writers_killed_before_their_prune_do_not_pile_up_checkpoints(tmp_path, monkeypatch):
    """Each writer killed after its save but before the prune that follows it would leave one more
    file; the next save prunes first, so the folder holds at most kept + best + the one written."""
    run_dir, progress = tmp_path / "run", tmp_path / "progress.txt"
    monkeypatch.setenv("CKPT_TEST_WHERE", str(tmp_path / "where.txt"))
    store = CheckpointStore(run_dir, keep_last=KEEP, best_metric="acc")
    for step in range(1, 4):
        store.save(_payload(step), step, {"acc": _acc(step)})
    for i in range(4):
        progress.write_text("")
        _fork_writer(run_dir, progress, "before_prune", None)
        assert "before pruning after" in (tmp_path / "where.txt").read_text().splitlines()[-1]
        assert len(store.list()) <= KEEP + 2, (i, file_names(store.folder))
    assert step_of(store.load_latest()[1]) == 3 + 4  # every killed writer's save was whole


def _lines_per_save(tmp_path):
    store = CheckpointStore(tmp_path / "calibrate", keep_last=KEEP, best_metric="acc")
    files, count = {checkpoint_store.__file__, checkpoint.__file__, digests.__file__}, [0]

    def on_line(frame, event, _):
        count[0] += event == "line"
        return on_line
    for step in (1, 2, 3):
        store.save(_payload(step), step, {"acc": 0.5})
    # Put back the tracer that was there: under `make coverage` it is coverage's, and settrace(None)
    # would stop the measurement of every later test in this process.
    previous = sys.gettrace()
    sys.settrace(lambda frame, event, _: on_line if frame.f_code.co_filename in files else None)
    try:
        store.save(_payload(4), 4, {"acc": 0.5})
    finally:
        sys.settrace(previous)
    return count[0]


@pytest.mark.processes
@pytest.mark.skipif(not hasattr(os, "fork"), reason="forks writers to kill them")
def test_a_writer_killed_at_any_moment_leaves_a_verifying_checkpoint(tmp_path, monkeypatch):
    rng = random.Random(SEED)
    lines = _lines_per_save(tmp_path)
    kills = [("mid_write", 3, None), ("mid_prune", None, None),
             ("before_latest", None, None),  # the next writer then saves the same step again,
             ("hash_written", None, None)]  # and is killed with both digests in its .sha256
    kills += [("line", rng.randint(1, 2 * lines), None) for _ in range(8)]
    kills += [("time", None, rng.uniform(0.0, 0.15)) for _ in range(4)]
    run_dir, progress, where = tmp_path / "run", tmp_path / "progress.txt", tmp_path / "where.txt"
    run_dir.mkdir()
    monkeypatch.setenv("CKPT_TEST_WHERE", str(where))
    store = CheckpointStore(run_dir, keep_last=KEEP, best_metric="acc")
    completed = []  # every step whose save returned, in any writer
    for i, (mode, arg, delay) in enumerate(kills):
        progress.write_text("")
        _fork_writer(run_dir, progress, mode, arg, delay)
        events = progress.read_text().split("\n")[:-1]
        done = [int(e.split()[1]) for e in events if e.startswith("saved")]
        completed += done
        last = done[-1] if done else int(events[0].split()[1])
        at = where.read_text().splitlines()[-1] if mode != "time" else f"after {delay:.3f} s"
        context = f"kill {i} ({mode} {arg or ''}, {at}), files {file_names(store.folder)}"
        # Every checkpoint present verifies: none appears without its hash, none loses it first.
        for path in store.list():
            assert store.verify(path) is True, (path, store.verify(path), context)
        assert len(store.list()) <= KEEP + 2, context  # kept, best, and one not yet pruned
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # nothing is skipped: the newest is intact
            found = store.load_latest()
        if found is None:  # killed during the very first save
            assert last == 0 and not store.list(), context
            continue
        state, path = found
        # The last completed save, or the one cut short after it moved `latest`.
        assert step_of(path) in (last, last + 1), (step_of(path), last, context)
        assert state["step"] == step_of(path) and torch.equal(state["model"]["w"], _payload(state["step"])["model"]["w"])
        best = store.best_record()
        if completed:
            assert best["value"] >= max(_acc(s) for s in completed), context
            assert best["value"] == _acc(best["step"]) and store.verify(store.best_path()) is True, context
        if mode == "hash_written":  # an overwrite cut short: the old file still verifies by its old digest
            overwritten = store.folder / f"step-{last + 1:06d}.pt.sha256"
            assert overwritten.read_text().count("\n") == 2, context
        if mode == "mid_write":
            assert any(n.endswith(".tmp") for n in file_names(store.folder)), context
    assert len(completed) >= len(kills) // 2  # the writers got somewhere
    # The next clean save clears what the killed writers left.
    state, _ = store.load_latest()
    store.save(_payload(state["step"] + 1), state["step"] + 1, {"acc": 0.0})
    leftovers = [n for n in file_names(store.folder) if n.endswith(".tmp")
                 or (n.endswith(".sha256") and not (store.folder / n[:-7]).exists())]
    assert not leftovers
    assert len(store.list()) <= KEEP + 1


@pytest.mark.processes
def test_a_write_removes_only_the_temp_files_of_writers_that_are_gone(tmp_path):
    """Several processes may write one path at once (the ranks of a run filling one data cache): a
    writer that finishes first must not remove the others' temp files mid-write (their rename then
    fails), only those of a dead process of this host and unowned ones older than an hour."""
    import subprocess
    import time

    from gputrain.io import atomic

    host = atomic._writer_tag().rsplit("-", 1)[0]
    live = subprocess.Popen(["sleep", "60"])
    dead = subprocess.Popen(["true"])
    dead.wait()
    try:
        names = {"live": f".x.npz.{host}-{live.pid}.a1.tmp", "dead": f".x.npz.{host}-{dead.pid}.a2.tmp",
                 "other host": f".x.npz.elsewhere-{dead.pid}.a3.tmp", "unowned": ".x.npz.a4.tmp",
                 "unowned, old": ".x.npz.a5.tmp"}
        for name in names.values():
            (tmp_path / name).write_text("partial")
        old = time.time() - 2 * atomic.UNOWNED_STALE_S
        os.utime(tmp_path / names["unowned, old"], (old, old))
        atomic.write_text(tmp_path / "x.npz", "whole")
        left = {p.name for p in tmp_path.iterdir()}
    finally:
        live.kill()
    assert left == {"x.npz", names["live"], names["other host"], names["unowned"]}


def test_two_files_of_one_step_count_once_the_canonical_name_or_the_one_latest_names(tmp_path):
    """step-5.pt beside step-000005.pt (written by hand, or by another tool): one checkpoint of step 5,
    the canonical name, unless `latest` names the other; a file and a folder of one step: the one
    `latest` names."""
    store = CheckpointStore(tmp_path)
    canonical = store.save(_state(5), 5)
    odd = store.folder / "step-5.pt"
    odd.write_bytes(canonical.read_bytes())
    assert store.list() == [canonical]
    (store.folder / "latest").write_text(odd.name)
    assert store.list() == [odd]
    folder = store.folder / "step-000005.dcp"
    folder.mkdir()
    (store.folder / "latest").write_text(folder.name)
    assert store.list() == [folder]


@pytest.mark.processes
def test_a_save_removes_the_temp_files_of_latest_and_the_index_left_by_a_killed_writer(tmp_path):
    """A writer killed while rewriting `latest` or index.json leaves `.NAME.<host>-<pid>.<random>.tmp`;
    those files are rewritten only when they change, so the next save (one that is not the best)
    removes them with the step files' leftovers. A live writer's temp file is left alone."""
    import subprocess

    from gputrain.io import atomic

    store = CheckpointStore(tmp_path / "run", keep_last=KEEP, best_metric="acc")
    store.save(_payload(1), 1, {"acc": 0.9})
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    host = atomic._writer_tag().rsplit("-", 1)[0]
    dead = [store.folder / f".{name}.{host}-{gone.stdout.strip()}.x1y2z3.tmp" for name in ("latest", "index.json")]
    live = store.folder / f".index.json.{atomic._writer_tag()}.a1b2c3.tmp"  # this process: a writer at work
    for path in (*dead, live):
        path.write_text("cut short")
    store.save(_payload(2), 2, {"acc": 0.1})  # not the best: the index is not rewritten
    assert [p.name for p in dead if p.exists()] == []
    assert live.exists()
