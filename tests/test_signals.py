"""StopSignals records stop requests without acting on them, chains and restores handlers;
agree_to_stop makes all ranks decide together."""

import json
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from gputrain.checkpoint import digests, format as checkpoint
from gputrain.checkpoint.store import CheckpointStore
from gputrain.runtime.distributed import SINGLE, DistInfo
from gputrain.train.loop.signals import StopSignals, agree_to_stop

pytestmark = pytest.mark.skipif(not hasattr(signal, "SIGUSR1"), reason="POSIX signals")


def _send(sig, stop):
    """os.kill this process, and wait until the main thread has run the Python handler."""
    before = stop.count
    os.kill(os.getpid(), sig)
    deadline = time.monotonic() + 5
    while stop.count == before and time.monotonic() < deadline:
        time.sleep(0.001)
    assert stop.count > before, f"{signal.Signals(sig).name} was not handled"


@pytest.fixture
def restore_handlers():
    """Put back every handler a test changed, even when it fails."""
    saved = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1, signal.SIGUSR2)}
    yield
    for s, handler in saved.items():
        signal.signal(s, handler)


def test_a_signal_is_recorded_not_acted_on_and_the_handler_is_restored(restore_handlers):
    before = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1)}
    with StopSignals() as stop:
        assert stop.installed and stop.requested is None and stop.exit_code is None and stop.name is None
        _send(signal.SIGUSR1, stop)  # the default action would end the process
        assert stop.requested == signal.SIGUSR1 and stop.name == "SIGUSR1" and stop.exit_code == 128 + 10
    assert {s: signal.getsignal(s) for s in before} == before
    assert not stop.installed and stop.requested == signal.SIGUSR1  # readable after the block


@pytest.mark.parametrize("sig,code", [("SIGTERM", 143), ("SIGINT", 130), ("SIGUSR1", 138)])
def test_exit_codes_are_the_shells(sig, code, restore_handlers):
    with StopSignals() as stop:
        _send(getattr(signal, sig), stop)  # SIGINT: no KeyboardInterrupt mid-step
    assert stop.exit_code == code and stop.name == sig


def test_sigint_default_handler_is_not_chained(restore_handlers, caplog):
    signal.signal(signal.SIGINT, signal.default_int_handler)
    with StopSignals() as stop, caplog.at_level(logging.WARNING, logger="gputrain.train.loop.signals"):
        _send(signal.SIGINT, stop)  # chained, it would raise KeyboardInterrupt in the middle of a step
        _send(signal.SIGINT, stop)
    assert stop.requested == signal.SIGINT and stop.count == 2
    assert "KeyboardInterrupt" not in caplog.text  # it was never called (our handler would log it)
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


def test_an_earlier_python_handler_is_chained_and_put_back(restore_handlers, caplog):
    calls = []

    def theirs(signum, frame):
        calls.append(signum)
        if len(calls) == 2:
            raise RuntimeError("their handler fails")

    signal.signal(signal.SIGTERM, theirs)
    signal.signal(signal.SIGUSR1, signal.SIG_IGN)
    with StopSignals() as stop:
        _send(signal.SIGTERM, stop)
        with caplog.at_level(logging.WARNING, logger="gputrain.train.loop.signals"):
            _send(signal.SIGTERM, stop)  # their exception is logged, not raised into our code
        _send(signal.SIGUSR1, stop)  # SIG_IGN is not a callable to chain
    assert calls == [signal.SIGTERM, signal.SIGTERM]
    assert "raised RuntimeError: their handler fails" in caplog.text
    assert stop.requested == signal.SIGTERM and stop.count == 3  # the first one counts, later ones are counted
    assert signal.getsignal(signal.SIGTERM) is theirs and signal.getsignal(signal.SIGUSR1) is signal.SIG_IGN


def test_handlers_are_restored_when_the_block_raises(restore_handlers):
    before = signal.getsignal(signal.SIGTERM)
    with pytest.raises(ZeroDivisionError):
        with StopSignals([signal.SIGTERM]):
            assert signal.getsignal(signal.SIGTERM) is not before
            1 / 0
    assert signal.getsignal(signal.SIGTERM) is before
    stop = StopSignals([signal.SIGUSR2])
    with stop, pytest.raises(RuntimeError, match="already active"):
        with stop:
            pass


def test_a_signal_that_cannot_be_caught_is_named_and_the_others_are_put_back(restore_handlers):
    before = signal.getsignal(signal.SIGTERM)
    with pytest.raises(ValueError, match="SIGKILL"):  # not SIGTERM, whose handler was put back first
        with StopSignals([signal.SIGTERM, signal.SIGKILL]):
            pass
    assert signal.getsignal(signal.SIGTERM) is before


def test_signals_during_a_save_do_not_interrupt_it(tmp_path, restore_handlers, monkeypatch):
    store = CheckpointStore(tmp_path)
    real_write = digests.Sha256Writer.write
    sent = []

    def write(self, data):  # a signal arrives half-way through writing the checkpoint
        if len(sent) < 2:
            sent.append(1)
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(0.01)  # the handler runs in here, between two bytecodes of the save
        return real_write(self, data)

    monkeypatch.setattr(digests.Sha256Writer, "write", write)
    with StopSignals() as stop:
        _send(signal.SIGUSR1, stop)
        path = store.save({"w": torch.arange(10_000.0)}, 5)
    assert stop.count == 3 and stop.requested == signal.SIGUSR1
    assert store.verify(path) is True and torch.equal(store.load_latest()[0]["w"], torch.arange(10_000.0))


def test_outside_the_main_thread_it_does_nothing(restore_handlers, caplog):
    before = signal.getsignal(signal.SIGTERM)
    seen = {}

    def worker():
        with caplog.at_level(logging.DEBUG, logger="gputrain.train.loop.signals"):
            with StopSignals() as stop:
                seen["installed"] = stop.installed
                seen["handler"] = signal.getsignal(signal.SIGTERM)

    thread = threading.Thread(target=worker)
    thread.start()
    thread.join(10)
    assert seen == {"installed": False, "handler": before}
    assert "not in the main thread" in caplog.text


# ---------------------------------------------------------------- all ranks agree


def test_one_process_agrees_with_itself():
    assert agree_to_stop(True, SINGLE) is True and agree_to_stop(False, SINGLE) is False
    # enabled but no process group (a misconfigured caller): its own flag, not a hang
    assert agree_to_stop(True, DistInfo(enabled=True, world_size=2)) is True


@pytest.mark.processes
def test_two_gloo_ranks_agree_when_only_rank_1_got_the_signal(tmp_path):
    script = Path(__file__).parent / "dist_scripts" / "agree_to_stop.py"
    src = str(Path(checkpoint.__file__).resolve().parents[2])
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    env.update(GLOO_SOCKET_IFNAME="lo", OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join(filter(None, [src, env.get("PYTHONPATH")])))
    procs = [subprocess.Popen([sys.executable, str(script), str(rank), "2", str(tmp_path / "store"),
                               str(tmp_path)], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              text=True, start_new_session=True) for rank in (0, 1)]
    outputs = []
    try:
        for proc in procs:
            outputs.append(proc.communicate(timeout=60)[0])
    finally:
        for proc in procs:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
    assert [p.returncode for p in procs] == [0, 0], "\n".join(o[-2000:] for o in outputs)
    seen = [json.loads((tmp_path / f"rank-{rank}.json").read_text()) for rank in (0, 1)]
    for rank, s in enumerate(seen):
        assert s["before"] is False
        assert s["local"] is (rank == 1)  # only rank 1 was signalled ...
        assert s["agreed"] is True  # ... and both stop at the same call
        assert s["exit_code"] == (138 if rank == 1 else None)
        assert s["side_group_before"] is False  # gloo default group: no side group
        assert s["nccl_agreed"] == [True, False]
        assert s["side_group_made_once"] and s["side_group_is_gloo"]
        assert s["side_group_freed"]  # not kept alive past destroy_process_group
