"""torch.distributed on the CPU: gloo, 2 processes on loopback, started by torchrun.

Every distributed run happens in subprocesses (each in its own session, killed whole on a
timeout), so no process group, env var or stray worker leaks out of a test.
"""

import copy
import importlib.util
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from helpers import (DIST_SCRIPTS, TORCHRUN, assert_same_tensors, finish_process, free_port, run_python,
                     start_process, subprocess_env, torchrun)

from gputrain.checkpoint.store import CheckpointStore

from gputrain.runtime import distributed as D
from gputrain.checkpoint.format import load_checkpoint
from gputrain.errors import ConfigError, DeviceError

SCRIPT = str(DIST_SCRIPTS / "train_small.py")


def _checkpoint(path):
    """A checkpoint whole, in either format (several processes write step-N.dcp folders by default)."""
    from gputrain.checkpoint.read import read_checkpoint

    return read_checkpoint(path)


def _params(run_dir):
    return _checkpoint(CheckpointStore(run_dir).latest_path())["model"]


def _result(run_dir):
    return json.loads((Path(run_dir) / "result.json").read_text())


def _initial_first_weight():
    """net.0.weight as train_small.py initializes it (torch.manual_seed(0), then the first Linear)."""
    with torch.random.fork_rng():
        torch.manual_seed(0)
        return torch.nn.Linear(8, 16).weight.detach().clone()


# ---------------------------------------------------------------- the primitives, in a hand-written loop


def _load_primitives():
    spec = importlib.util.spec_from_file_location("gputrain_test_primitives", DIST_SCRIPTS / "primitives.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


P = _load_primitives()


@pytest.fixture(scope="module")
def primitives(tmp_path_factory):
    """One 2-process torchrun of dist_scripts/primitives.py; what it observed and saved."""
    out = tmp_path_factory.mktemp("primitives")
    proc = torchrun([str(DIST_SCRIPTS / "primitives.py"), str(out)], timeout=150)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads((out / "checks.json").read_text()), out


def _saved(out, name):
    return torch.load(out / name, weights_only=True)


@pytest.mark.processes
def test_collectives_and_rank_helpers_under_torchrun(primitives):
    checks, _ = primitives
    for rank, seen in enumerate(checks):
        assert seen["info"] == [True, rank, rank, 2, "gloo", True]
        assert seen["again"] == [True, rank, 2, False]  # a second init joins the group, does not own it
        assert seen["device"] == "cpu"
        assert seen["is_main_process"] == (rank == 0)
        assert seen["rank_zero_only"] == ("ran" if rank == 0 else None)
        assert seen["mean"] == [1.5, 5.0] and seen["sum"] == [3.0]
        assert seen["broadcast"] == {"from": 0}
        assert seen["second_group"] == [True, 2.0]  # after cleanup, a new group works (fit called twice)


@pytest.mark.processes
def test_ddp_hand_loop_with_accumulation_matches_one_process(primitives):
    checks, out = primitives
    ref, _ = P.reference(P.STEPS)
    assert_same_tensors(_saved(out, "ddp.pt")["model"], ref.state_dict(), atol=1e-5)
    for seen in checks:
        assert seen["ddp"]["wrapper"] == "DistributedDataParallel" and seen["ddp"]["unwrapped"] == "Sequential"
        # One all-reduce per optimizer step, not per micro-step: no_sync skipped the first of 2.
        assert seen["ddp"]["allreduces"] == P.STEPS
    assert checks[1]["ddp"]["non_main_state_empty"] and not checks[0]["ddp"]["non_main_state_empty"]


@pytest.mark.processes
def test_fsdp2_hand_loop_matches_one_process_and_defers_the_reduce_scatter(primitives):
    checks, out = primitives
    ref, _ = P.reference(P.STEPS)
    saved = _saved(out, "fsdp.pt")
    assert list(saved["model"]) == list(ref.state_dict())  # plain names, full tensors
    assert all(type(v) is torch.Tensor for v in saved["model"].values())
    assert_same_tensors(saved["model"], ref.state_dict(), atol=1e-5)
    for seen in checks:
        fsdp = seen["fsdp"]
        assert fsdp["wrapper"] == "FSDPSequential" and fsdp["unwrapped_is_model"] and fsdp["dtensor_params"]
        # No sharded gradient after a no_sync micro-step; all of them after the last micro-step.
        assert fsdp["grads_after"] == {"no_sync": [0] * P.STEPS, "sync": [fsdp["n_params"]] * P.STEPS}
    assert checks[1]["fsdp"]["non_main_state_empty"]


@pytest.mark.processes
def test_fsdp2_full_state_continues_in_one_plain_process(primitives):
    _, out = primitives
    saved = _saved(out, "fsdp.pt")  # optimizer state keyed by parameter name
    assert list(saved["optimizer"]["state"]) == [name for name, _ in P.make_model().named_parameters()]
    model = P.make_model(seed=7)
    optimizer = P.make_optimizer(model)
    D.load_model_state_dict(model, saved["model"], D.SINGLE)
    D.load_optimizer_state_dict(model, optimizer, saved["optimizer"], D.SINGLE)
    P.train(model, optimizer, P.MORE, start=P.STEPS)
    ref, _ = P.reference(P.STEPS + P.MORE)  # momentum carried over exactly, or this differs
    assert_same_tensors(model.state_dict(), ref.state_dict(), atol=1e-5)


@pytest.mark.processes
def test_one_process_state_loads_under_ddp_and_fsdp2(primitives):
    checks, out = primitives
    ref, ref_opt = P.reference(P.STEPS + P.MORE)
    for name in ("ddp_resumed.pt", "fsdp_resumed.pt"):
        saved = _saved(out, name)
        assert_same_tensors(saved["model"], ref.state_dict(), atol=1e-5)
    assert all(seen["ddp_resumed_replica_equal"] for seen in checks)
    momentum = _saved(out, "fsdp_resumed.pt")["optimizer"]["state"]["0.weight"]["momentum_buffer"]
    assert torch.allclose(momentum, ref_opt.state[ref.get_parameter("0.weight")]["momentum_buffer"], atol=1e-6)


# ---------------------------------------------------------------- through gputrain.fit


@pytest.mark.processes
@pytest.mark.parametrize("accumulate", [1, 2])
def test_ddp_matches_one_process_with_the_same_global_batch(tmp_path, accumulate):
    steps = 8
    one = run_python([SCRIPT, str(tmp_path / "one"), "32", str(accumulate), "0", str(steps)])
    assert one.returncode == 0, one.stderr[-2000:]
    two = torchrun([SCRIPT, str(tmp_path / "two"), "16", str(accumulate), "0", str(steps)])
    assert two.returncode == 0, two.stderr[-2000:]
    assert_same_tensors(_params(tmp_path / "one"), _params(tmp_path / "two"), atol=1e-5)
    result = _result(tmp_path / "two")
    summary = result["summary"]
    assert result["wrapper"] == "DistributedDataParallel"
    assert summary["world_size"] == 2 and summary["effective_batch"] == 16 * accumulate * 2
    # One gradient all-reduce per optimizer step (the model fits one bucket): with accumulation the
    # non-final micro-steps run under no_sync and communicate nothing.
    assert result["grad_allreduces"] == steps
    assert not torch.allclose(_params(tmp_path / "two")["net.0.weight"], _initial_first_weight(), atol=1e-3)


@pytest.mark.processes
def test_fsdp2_trains_and_its_checkpoint_resumes_in_one_process(tmp_path):
    fsdp, one = tmp_path / "fsdp", tmp_path / "one"
    proc = torchrun([SCRIPT, str(fsdp), "16", "2", "1", "6"])  # accumulate 2: no_sync on FSDP2 too
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert _result(fsdp)["wrapper"].startswith("FSDP")  # fully_shard swaps in an FSDP<Model> class
    state = _checkpoint(CheckpointStore(fsdp).latest_path())
    assert state["step"] == 6 and state["world_size"] == 2
    # Full tensors, not DTensor shards: loadable without a process group.
    assert all(type(v) is torch.Tensor for v in state["model"].values())
    assert state["optimizer"]["state"], "the momentum buffers are missing from the checkpoint"
    ref = run_python([SCRIPT, str(one), "32", "2", "0", "10"])  # global batch 64 = 2 processes x 16 x 2
    assert ref.returncode == 0, ref.stderr[-2000:]
    # The FSDP run directory, continued to step 10 by a single process: the same parameters as
    # one process all along, so the sharded run and its momentum were exact.
    cont = run_python([SCRIPT, str(fsdp), "32", "2", "0", "10"])
    assert cont.returncode == 0, cont.stderr[-2000:]
    assert "resumed from" in cont.stderr and "at step 6" in cont.stderr
    assert _result(fsdp)["summary"]["steps"] == 10 and _result(fsdp)["summary"]["world_size"] == 1
    assert_same_tensors(_params(one), _params(fsdp), atol=1e-5)


@pytest.mark.processes
def test_a_failing_rank_stops_the_job_with_its_error(tmp_path):
    start = time.monotonic()
    proc = torchrun([SCRIPT, str(tmp_path / "fail"), "16", "1", "0", "8", "raise"], timeout=90)
    elapsed = time.monotonic() - start
    assert proc.returncode != 0
    assert "planted failure on rank 1" in proc.stdout + proc.stderr
    assert elapsed < 60, f"torchrun took {elapsed:.0f} s to stop after a rank failed"


@pytest.mark.processes
@pytest.mark.skipif(not os.path.isdir("/proc"), reason="finds the workers through /proc")
def test_a_hung_job_is_killed_whole_on_timeout(tmp_path):
    # The harness itself: a timeout must fail the test promptly and leave no worker behind.
    script = tmp_path / "hang.py"
    script.write_text("import os, pathlib, sys, time\n"
                      "pathlib.Path(sys.argv[1], 'pid-' + os.environ['RANK']).write_text(str(os.getpid()))\n"
                      "time.sleep(600)\n")
    start = time.monotonic()
    with pytest.raises(pytest.fail.Exception, match="still running after 15 s"):
        torchrun([str(script), str(tmp_path)], timeout=15)
    assert time.monotonic() - start < 60
    pids = [int((tmp_path / f"pid-{rank}").read_text()) for rank in (0, 1)]
    time.sleep(0.5)
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat") as f:
                state = f.read().rsplit(")", 1)[1].split()[0]
        except FileNotFoundError:
            continue
        assert state in ("Z", "X"), f"worker {pid} still running (state {state})"  # a zombie awaits init


@pytest.mark.processes
def test_a_killed_rank_restarts_and_resumes_from_its_checkpoint(tmp_path):
    run = tmp_path / "restart"
    proc = torchrun([SCRIPT, str(run), "16", "1", "0", "12", "kill-once"], extra=["--max-restarts=1"], timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = _result(run)
    assert result["restart"] == "1" and result["summary"]["steps"] == 12
    # Killed inside step 7; checkpoints every 2 steps, so the second attempt starts after step 6.
    assert "resumed from" in proc.stderr and "at step 6" in proc.stderr, proc.stderr[-3000:]
    assert _checkpoint(CheckpointStore(run).latest_path())["step"] == 12
    # The interrupted job ends where an uninterrupted one (here: one process, same global batch) does.
    ref = run_python([SCRIPT, str(tmp_path / "one"), "32", "1", "0", "12"])
    assert ref.returncode == 0, ref.stderr[-2000:]
    assert_same_tensors(_params(tmp_path / "one"), _params(run), atol=1e-5)


@pytest.mark.processes
def test_two_nodes_rendezvous_on_loopback(tmp_path):
    # Two launchers stand in for two machines. Both endpoints are this machine, so each would offer
    # to host the rendezvous store: is_host names the one that does (on real machines the one whose
    # address is the endpoint hosts it). --node-rank is ignored by the c10d backend.
    port = free_port()
    cmds = [[*TORCHRUN, "--nnodes=2", "--nproc-per-node=1", "--rdzv-backend=c10d",
             f"--rdzv-endpoint=127.0.0.1:{port}", f"--rdzv-id=gputrain-test-{port}",
             f"--rdzv-conf=is_host={'true' if node == 0 else 'false'}",
             SCRIPT, str(tmp_path / "nodes"), "16", "1", "0", "4"] for node in (0, 1)]
    procs = [start_process(c) for c in cmds]
    try:
        outs = [finish_process(p, 120) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.communicate()
    assert [o.returncode for o in outs] == [0, 0], [o.stderr[-2000:] for o in outs]
    summary = _result(tmp_path / "nodes")["summary"]
    assert summary["world_size"] == 2 and summary["steps"] == 4 and summary["effective_batch"] == 32


@pytest.mark.slow
@pytest.mark.processes
def test_fit_nproc_equals_one_process_with_the_same_global_batch(tmp_path, cache_dir):
    """Slow: 61 s on this machine (the serial suite, 2026-11-28, load 5-14): `gputrain fit` once in one process
    and once under --nproc 2 (torchrun and two workers), mnist1d built first."""
    def gputrain_fit(*args, timeout=180):
        cmd = [sys.executable, "-m", "gputrain", "fit", "mnist1d-mlp", "--device", "cpu", "--steps", "20", "--json",
               *args]
        env = subprocess_env(GPUTRAIN_CACHE=str(cache_dir))
        return finish_process(start_process(cmd, env=env, cwd=tmp_path), timeout)

    one = gputrain_fit("--batch-size", "64", "--run-dir", "one")  # also builds the cached data set
    assert one.returncode == 0, one.stderr[-3000:]
    two = gputrain_fit("--nproc", "2", "--batch-size", "32", "--run-dir", "two")
    assert two.returncode == 0, two.stderr[-3000:]
    # Only rank 0 prints: exactly one JSON document on stdout.
    doc, end = json.JSONDecoder().raw_decode(two.stdout, two.stdout.index("{"))
    assert two.stdout[end:].strip() == ""
    summary = doc["summary"]
    assert summary["world_size"] == 2 and summary["steps"] == 20
    single = json.loads(one.stdout)["summary"]
    assert summary["effective_batch"] == 32 * summary["accumulate"] * 2 == single["effective_batch"]
    assert_same_tensors(_params(tmp_path / "one"), _params(tmp_path / "two"), atol=1e-5)


@pytest.mark.processes
def test_fit_config_with_nproc_trains_in_torchruns_processes_and_returns_the_history(tmp_path, monkeypatch, capfd):
    """gputrain.fit_config(..., nproc=2) from Python: the launch decision below the command line
    (runs/launch.py) starts torchrun's two processes (gloo on loopback), which train the spec
    resolved here in one run directory; the History comes back from it (world size 2, every
    record). The same tree with nproc 1 trains in this process to the same weights: one global batch."""
    import tomllib

    import gputrain
    from gputrain.io.history import History

    from helpers import _LAUNCHER_VARS, subprocess_env

    for key, value in subprocess_env(GPUTRAIN_CACHE=str(tmp_path / "cache")).items():
        monkeypatch.setenv(key, value)  # what torchrun's processes inherit
    for key in _LAUNCHER_VARS:
        monkeypatch.delenv(key, raising=False)
    monkeypatch.chdir(tmp_path)
    tree = {"workload": "linear-regression", "options": {"n": 256},
            "train": {"device": "cpu", "steps": 6, "log_every": 3, "lr": 0.05, "loggers": ["csv"], "progress": False}}
    history = gputrain.fit_config(tree, run_dir="two", nproc=2, batch_size=16)
    assert history.summary["world_size"] == 2 and history.summary["steps"] == 6
    assert history.records == History.load(tmp_path / "two" / "history.json").records and len(history.records) == 2
    assert tomllib.loads((tmp_path / "two" / "config.toml").read_text())["fit"]["nproc"] == 2
    assert capfd.readouterr().out.count("gputrain fit") == 1  # rank 0 printed the summary, as `fit --nproc 2` does
    one = gputrain.fit_config(tree, run_dir="one", batch_size=32)
    assert one.summary["world_size"] == 1
    assert_same_tensors(_params(tmp_path / "one"), _params(tmp_path / "two"), atol=1e-5)


def test_fit_config_refuses_what_cannot_reach_torchruns_processes(tmp_path, monkeypatch):
    """Callbacks live in this process, and a run without a run directory has no history to read
    back: fit_config with nproc 2 refuses both in one line, before any process starts."""
    import gputrain
    from gputrain import Callback

    monkeypatch.delenv("LOCAL_RANK", raising=False)
    monkeypatch.chdir(tmp_path)
    tree = {"workload": "linear-regression", "train": {"device": "cpu", "steps": 2}}
    with pytest.raises(ConfigError, match=r"callbacks live in this process: they cannot reach the processes torchrun"):
        gputrain.fit_config(tree, nproc=2, callbacks=[Callback()])
    with pytest.raises(ConfigError, match=r"read back from its run directory: drop no_save"):
        gputrain.fit_config(tree, nproc=2, no_save=True)
    assert list(tmp_path.iterdir()) == []


def test_data_parallel_is_unwrapped_with_a_warning():
    from gputrain import TrainConfig, fit

    model = torch.nn.DataParallel(torch.nn.Linear(4, 2))
    with pytest.warns(UserWarning, match="nn.DataParallel"):
        fit(model, (torch.randn(16, 4), torch.randint(0, 2, (16,))), loss_fn=torch.nn.CrossEntropyLoss(),
            config=TrainConfig(device="cpu", steps=2))


# ---------------------------------------------------------------- one process, no torchrun


def test_single_process_is_a_no_op_everywhere():
    info, device = D.init_distributed("cpu")
    assert info == D.SINGLE and not info.enabled and info.is_main and device == torch.device("cpu")
    model = torch.nn.Sequential(torch.nn.Linear(4, 3))
    assert D.wrap_model(model, info, device) is model and D.unwrap(model) is model
    with D.no_sync(model, sync=False):
        model(torch.randn(2, 4)).sum().backward()
    t = torch.tensor([2.0])
    assert D.all_reduce_mean(t, info) is t and D.all_reduce_sum(t, info) is t and t.item() == 2.0
    assert D.broadcast_object({"a": 1}, info) == {"a": 1}
    D.barrier(info)
    D.cleanup(info)
    state = D.model_state_dict(model, info)
    assert list(state) == ["0.weight", "0.bias"] and state["0.weight"] is not model[0].weight
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    optimizer.step()
    other = torch.nn.Sequential(torch.nn.Linear(4, 3))
    other_opt = torch.optim.SGD(other.parameters(), lr=0.1, momentum=0.9)
    D.load_model_state_dict(other, state, info)
    D.load_optimizer_state_dict(other, other_opt, copy.deepcopy(D.optimizer_state_dict(model, optimizer, info)), info)
    assert_same_tensors(other.state_dict(), model.state_dict(), atol=1e-5)
    momentum = [opt.state[m[0].weight]["momentum_buffer"] for opt, m in ((other_opt, other), (optimizer, model))]
    assert torch.equal(*momentum)


def test_data_parallel_is_unwrapped_by_wrap_model_with_the_reason():
    inner = torch.nn.Linear(4, 2)
    with pytest.warns(UserWarning, match=r"nn.DataParallel.*slower than DistributedDataParallel.*model.module"):
        assert D.wrap_model(torch.nn.DataParallel(inner), D.SINGLE, torch.device("cpu")) is inner
    assert D.unwrap(torch.nn.DataParallel(inner)) is inner


def test_unwrap_sees_through_compile():
    inner = torch.nn.Linear(4, 2)
    assert D.unwrap(torch.compile(inner)) is inner


def _torchrun_env(monkeypatch, **values):
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(key, raising=False)
    for key, value in values.items():
        monkeypatch.setenv(key, value)


def test_incomplete_torchrun_environment_is_an_error_naming_what_is_missing(monkeypatch):
    _torchrun_env(monkeypatch, WORLD_SIZE="2", RANK="0", LOCAL_RANK="0")
    with pytest.raises(ConfigError, match=r"WORLD_SIZE=2 but MASTER_ADDR, MASTER_PORT not set.*torchrun"):
        D.init_distributed("cpu")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error on a machine without CUDA")
def test_cuda_under_torchrun_without_cuda_is_a_device_error(monkeypatch):
    _torchrun_env(monkeypatch, WORLD_SIZE="2", RANK="1", LOCAL_RANK="1", MASTER_ADDR="127.0.0.1", MASTER_PORT="1")
    with pytest.raises(DeviceError, match="cuda"):
        D.init_distributed("cuda")
    assert not torch.distributed.is_initialized()


def test_the_device_before_the_trainer_is_the_one_the_trainer_will_take(monkeypatch, fake_cuda):
    """process_device (autotune, the batch-size search, profile) decides as init_distributed will:
    one process takes pick_device's answer; the second of two torchrun processes on a node with two
    GPUs takes cuda:1, where pick_device("auto") alone would say cuda:0."""
    from gputrain.runtime.devices import pick_device

    fake_cuda(count=2)
    _torchrun_env(monkeypatch)
    assert D.process_device("auto") == pick_device("auto") == torch.device("cuda", 0)
    assert D.process_device("cpu") == torch.device("cpu")
    _torchrun_env(monkeypatch, WORLD_SIZE="2", RANK="1", LOCAL_RANK="1", MASTER_ADDR="127.0.0.1", MASTER_PORT="1")
    assert D.process_device("auto") == torch.device("cuda", 1)
    assert D.process_device("cuda:0") == torch.device("cuda", 1)  # one GPU per process, as the trainer does
    assert not torch.distributed.is_initialized()  # decided without joining a group


def test_rank_helpers_read_the_environment_without_a_process_group(monkeypatch):
    calls = []
    report = D.rank_zero_only(lambda x: calls.append(x) or "done")
    monkeypatch.setenv("RANK", "1")
    assert not D.is_main_process() and report(1) is None
    monkeypatch.setenv("RANK", "0")
    assert D.is_main_process() and report(2) == "done"
    assert calls == [2]


def test_launch_torchrun_runs_gputrain_under_torchrun(monkeypatch):
    seen = {}

    class FakePopen:
        def __init__(self, cmd, env):
            seen["cmd"], seen["env"] = cmd, env

        def wait(self, timeout=None):
            return 0

    monkeypatch.setattr(subprocess, "Popen", FakePopen)
    assert D.launch_torchrun(2, ["fit", "mnist1d-mlp", "--steps", "5"], max_restarts=1) == 0
    cmd = seen["cmd"]
    assert cmd[1:3] == ["-m", "gputrain.runtime.launch"]  # torchrun, quiet about a refusal
    assert "--nproc-per-node=2" in cmd and "--max-restarts=1" in cmd
    assert cmd[-6:] == ["-m", "gputrain", "fit", "mnist1d-mlp", "--steps", "5"]
    assert int(seen["env"]["OMP_NUM_THREADS"]) >= 1


@pytest.mark.parametrize("signalled,torchrun_code,expected", [(False, 1, 1), (True, 1, 143), (True, 0, 0),
                                                               (False, -9, 137)])
def test_launch_torchrun_reports_a_stop_signal_in_the_shells_code(monkeypatch, signalled, torchrun_code, expected):
    """torchrun exits 1 when a SIGTERM stops it; the launcher that forwarded it says 143, as one process would."""
    sent = []

    class FakePopen:
        def __init__(self, cmd, env):
            pass

        def send_signal(self, signum):
            sent.append(signum)

        def wait(self, timeout=None):
            if signalled:
                os.kill(os.getpid(), signal.SIGTERM)  # the scheduler's SIGTERM reaches the launcher
            return torchrun_code

    before = signal.getsignal(signal.SIGTERM)
    monkeypatch.setattr(subprocess, "Popen", FakePopen)
    assert D.launch_torchrun(2, ["fit"]) == expected
    assert sent == ([signal.SIGTERM] if signalled else [])  # passed on to torchrun
    assert signal.getsignal(signal.SIGTERM) is before


def test_launch_torchrun_puts_back_the_default_for_a_sigterm_handler_installed_from_c(monkeypatch):
    """signal.signal reports a handler installed from C as None, which cannot be installed again:
    the launcher puts back SIG_DFL, the closest, instead of failing with a TypeError on its way out."""
    real_signal = signal.signal
    installed = []

    def signal_over_a_c_handler(signum, handler):
        installed.append(handler)
        real_signal(signum, handler)
        return None  # what Python says of the handler a C library had installed

    class FakePopen:
        def __init__(self, cmd, env):
            pass

        def wait(self, timeout=None):
            return 0

    before = signal.getsignal(signal.SIGTERM)
    monkeypatch.setattr(subprocess, "Popen", FakePopen)
    monkeypatch.setattr(signal, "signal", signal_over_a_c_handler)
    try:
        assert D.launch_torchrun(2, ["fit"]) == 0
        assert installed[-1] is signal.SIG_DFL
    finally:
        real_signal(signal.SIGTERM, before)


def test_cli_main_passes_its_own_argv_to_the_launcher(monkeypatch):
    """gputrain.cli.main(argv) with --nproc starts the processes with argv, not with sys.argv."""
    from gputrain import cli

    seen = {}
    monkeypatch.setattr(D, "launch_torchrun", lambda nproc, argv, max_restarts=0: seen.update(
        nproc=nproc, argv=argv, max_restarts=max_restarts) or 0)
    monkeypatch.setattr(sys, "argv", ["pytest", "--something-else"])
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    assert cli.main(["fit", "mnist1d-mlp", "--nproc", "2", "--steps", "3", "--max-restarts", "1"]) == 0
    assert seen == {"nproc": 2, "argv": ["fit", "mnist1d-mlp", "--steps", "3"], "max_restarts": 1}


@pytest.mark.slow
@pytest.mark.processes
def test_sigterm_to_fit_nproc_checkpoints_every_rank_and_exits_143(tmp_path, cache_dir):
    """A scheduler's SIGTERM to `gputrain fit --nproc 2`: the ranks stop at an agreed step, save one
    checkpoint, and the launcher exits 143; --resume then finishes the run.

    Slow: 78 s on this machine (the serial suite, 2026-11-28, load 5-14): torchrun and two workers start twice
    (stopped, then resumed), mnist1d built first."""
    cmd = [sys.executable, "-m", "gputrain", "fit", "mnist1d-mlp", "--device", "cpu", "--batch-size", "32",
           "--steps", "100000", "--log-every", "10", "--run-dir", "run", "--nproc", "2", "--no-tensorboard"]
    env = subprocess_env(GPUTRAIN_CACHE=str(cache_dir))
    proc = start_process(cmd, env=env, cwd=tmp_path)
    metrics = tmp_path / "run" / "metrics.jsonl"
    deadline = time.time() + 150
    while time.time() < deadline and proc.poll() is None:  # wait until both ranks train
        if metrics.exists() and len(metrics.read_text().splitlines()) >= 3:
            break
        time.sleep(0.5)
    assert proc.poll() is None, proc.communicate()[1][-3000:]
    os.kill(proc.pid, signal.SIGTERM)  # the launcher only, as a scheduler would
    out = finish_process(proc, 120)
    assert out.returncode == 143, out.stderr[-3000:]
    store = CheckpointStore(tmp_path / "run")
    step = _checkpoint(store.latest_path())["step"]
    assert 0 < step < 100000
    resumed = finish_process(start_process([sys.executable, "-m", "gputrain", "fit", "mnist1d-mlp", "--device", "cpu",
                              "--batch-size", "32", "--steps", str(step + 20), "--log-every", "10", "--resume", "run",
                              "--nproc", "2", "--no-tensorboard", "--json"], env=env, cwd=tmp_path), 180)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    doc = json.loads(resumed.stdout[resumed.stdout.index("{"):])
    assert doc["summary"]["steps"] == step + 20


def test_an_existing_process_group_is_joined_and_no_sync_reaches_ddp_through_compile(tmp_path):
    import gc

    import torch.distributed as dist

    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    try:
        info, device = D.init_distributed("cpu")
        assert (info.rank, info.world_size, info.backend, info.owns_group) == (0, 1, "gloo", False)
        D.cleanup(info)
        assert dist.is_initialized()  # not ours to destroy
        inner = torch.nn.Linear(4, 2)
        ddp = torch.nn.parallel.DistributedDataParallel(inner)
        compiled = torch.compile(ddp)
        with D.no_sync(compiled, sync=False):
            assert not ddp.require_backward_grad_sync
        assert ddp.require_backward_grad_sync
        assert D.unwrap(compiled) is inner
    finally:
        ddp = compiled = None
        gc.collect()
        dist.destroy_process_group()
