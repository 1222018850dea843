"""torch.distributed on the CPU: gloo, 2 processes on loopback, started by torchrun.

Every distributed run happens in subprocesses (each in its own session, killed whole on a
timeout), so no process group, env var or stray worker leaks out of a test.
"""

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from gputrain.checkpoint import load_checkpoint

SCRIPT = str(Path(__file__).parent / "dist_scripts" / "train_small.py")
TORCHRUN = [sys.executable, "-m", "torch.distributed.run"]


def _env(**extra):
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
           and not k.startswith("TORCHELASTIC_")}
    env.update(GLOO_SOCKET_IFNAME="lo", OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", **extra)
    return env


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start(cmd, **kwargs) -> subprocess.Popen:
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True, env=kwargs.pop("env", None) or _env(), **kwargs)


def _finish(proc: subprocess.Popen, timeout: float) -> subprocess.CompletedProcess:
    """Wait for proc; on a timeout kill its whole session (torchrun and its workers) and fail."""
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        pytest.fail(f"{proc.args[:6]}... still running after {timeout} s (a hang):\n{err[-3000:]}")
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def _torchrun(args, nproc=2, extra=(), timeout=180, **kwargs):
    cmd = [*TORCHRUN, f"--nproc-per-node={nproc}", "--rdzv-backend=c10d",
           f"--rdzv-endpoint=127.0.0.1:{_free_port()}", *extra, *args]
    return _finish(_start(cmd, **kwargs), timeout)


def _single(args, timeout=120):
    return _finish(_start([sys.executable, *args]), timeout)


def _params(run_dir):
    return load_checkpoint(Path(run_dir) / "checkpoint.pt")["model"]


def _result(run_dir):
    return json.loads((Path(run_dir) / "result.json").read_text())


def _assert_same(a, b):
    assert a.keys() == b.keys()
    for k in a:
        assert torch.allclose(a[k], b[k], atol=1e-5), (k, (a[k] - b[k]).abs().max())


def _initial_first_weight():
    """net.0.weight as train_small.py initializes it (torch.manual_seed(0), then the first Linear)."""
    with torch.random.fork_rng():
        torch.manual_seed(0)
        return torch.nn.Linear(8, 16).weight.detach().clone()


@pytest.mark.parametrize("accumulate", [1, 2])
def test_ddp_matches_one_process_with_the_same_global_batch(tmp_path, accumulate):
    steps = 8
    one = _single([SCRIPT, str(tmp_path / "one"), "32", str(accumulate), "0", str(steps)])
    assert one.returncode == 0, one.stderr[-2000:]
    two = _torchrun([SCRIPT, str(tmp_path / "two"), "16", str(accumulate), "0", str(steps)])
    assert two.returncode == 0, two.stderr[-2000:]
    _assert_same(_params(tmp_path / "one"), _params(tmp_path / "two"))
    result = _result(tmp_path / "two")
    summary = result["summary"]
    assert result["wrapper"] == "DistributedDataParallel"
    assert summary["world_size"] == 2 and summary["effective_batch"] == 16 * accumulate * 2
    # One gradient all-reduce per optimizer step (the model fits one bucket): with accumulation the
    # non-final micro-steps run under no_sync and communicate nothing.
    assert result["grad_allreduces"] == steps
    assert not torch.allclose(_params(tmp_path / "two")["net.0.weight"], _initial_first_weight(), atol=1e-3)


def test_fsdp2_trains_and_its_checkpoint_resumes_in_one_process(tmp_path):
    fsdp, one = tmp_path / "fsdp", tmp_path / "one"
    proc = _torchrun([SCRIPT, str(fsdp), "16", "1", "1", "6"])
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert _result(fsdp)["wrapper"].startswith("FSDP")  # fully_shard swaps in an FSDP<Model> class
    state = load_checkpoint(fsdp / "checkpoint.pt")
    assert state["step"] == 6 and state["world_size"] == 2
    # Full tensors, not DTensor shards: loadable without a process group.
    assert all(isinstance(v, torch.Tensor) and not hasattr(v, "placements") for v in state["model"].values())
    ref = _single([SCRIPT, str(one), "32", "1", "0", "6"])
    assert ref.returncode == 0, ref.stderr[-2000:]
    _assert_same(_params(one), state["model"])  # FSDP2 on 2 processes = one process, same global batch
    # The FSDP run directory, continued to step 10 by a single process (global batch 32 = 2 x 16).
    cont = _single([SCRIPT, str(fsdp), "32", "1", "0", "10"])
    assert cont.returncode == 0, cont.stderr[-2000:]
    assert "resumed from" in cont.stderr and "at step 6" in cont.stderr
    assert _result(fsdp)["summary"]["steps"] == 10 and _result(fsdp)["summary"]["world_size"] == 1
    assert load_checkpoint(fsdp / "checkpoint.pt")["step"] == 10


def test_a_failing_rank_stops_the_job_with_its_error(tmp_path):
    start = time.monotonic()
    proc = _torchrun([SCRIPT, str(tmp_path / "fail"), "16", "1", "0", "8", "raise"], timeout=90)
    elapsed = time.monotonic() - start
    assert proc.returncode != 0
    assert "planted failure on rank 1" in proc.stdout + proc.stderr
    assert elapsed < 60, f"torchrun took {elapsed:.0f} s to stop after a rank failed"


def test_a_killed_rank_restarts_and_resumes_from_its_checkpoint(tmp_path):
    run = tmp_path / "restart"
    proc = _torchrun([SCRIPT, str(run), "16", "1", "0", "12", "kill-once"], extra=["--max-restarts=1"], timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = _result(run)
    assert result["restart"] == "1" and result["summary"]["steps"] == 12
    # Killed inside step 7; checkpoints every 2 steps, so the second attempt starts after step 6.
    assert "resumed from" in proc.stderr and "at step 6" in proc.stderr, proc.stderr[-3000:]
    assert load_checkpoint(run / "checkpoint.pt")["step"] == 12


def test_two_nodes_rendezvous_on_loopback(tmp_path):
    # Two launchers stand in for two machines. Both endpoints are this machine, so each would offer
    # to host the rendezvous store: is_host names the one that does (on real machines the one whose
    # address is the endpoint hosts it). --node-rank is ignored by the c10d backend.
    port = _free_port()
    cmds = [[*TORCHRUN, "--nnodes=2", "--nproc-per-node=1", "--rdzv-backend=c10d",
             f"--rdzv-endpoint=127.0.0.1:{port}", f"--rdzv-id=gputrain-test-{port}",
             f"--rdzv-conf=is_host={'true' if node == 0 else 'false'}",
             SCRIPT, str(tmp_path / "nodes"), "16", "1", "0", "4"] for node in (0, 1)]
    procs = [_start(c) for c in cmds]
    try:
        outs = [_finish(p, 120) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.communicate()
    assert [o.returncode for o in outs] == [0, 0], [o.stderr[-2000:] for o in outs]
    summary = _result(tmp_path / "nodes")["summary"]
    assert summary["world_size"] == 2 and summary["steps"] == 4 and summary["effective_batch"] == 32


def test_fit_nproc_runs_torchrun_end_to_end(tmp_path, cache_dir):
    proc = _finish(_start([sys.executable, "-m", "gputrain", "fit", "mnist1d-mlp", "--nproc", "2", "--device", "cpu",
                           "--steps", "20", "--no-save", "--json"],
                          env=_env(GPUTRAIN_CACHE=str(cache_dir)), cwd=tmp_path), 180)
    assert proc.returncode == 0, proc.stderr[-3000:]
    # Only rank 0 prints: exactly one JSON document on stdout.
    doc, end = json.JSONDecoder().raw_decode(proc.stdout, proc.stdout.index("{"))
    assert proc.stdout[end:].strip() == ""
    summary = doc["summary"]
    assert summary["world_size"] == 2 and summary["steps"] == 20
    assert summary["effective_batch"] == summary["batch_size"] * summary["accumulate"] * 2
    assert not (tmp_path / "runs").exists()  # --no-save


def test_data_parallel_is_unwrapped_with_a_warning():
    from gputrain import TrainConfig, fit

    model = torch.nn.DataParallel(torch.nn.Linear(4, 2))
    with pytest.warns(UserWarning, match="nn.DataParallel"):
        fit(model, (torch.randn(16, 4), torch.randint(0, 2, (16,))), loss_fn=torch.nn.CrossEntropyLoss(),
            config=TrainConfig(device="cpu", steps=2))
