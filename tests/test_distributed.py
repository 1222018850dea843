"""torch.distributed on the CPU: gloo, 2 processes on loopback, started by torchrun.

Every distributed run happens in subprocesses, so no process group or env var leaks into the test
process.
"""

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from gputrain.checkpoint import load_checkpoint

SCRIPT = str(Path(__file__).parent / "dist_scripts" / "train_small.py")


def _env(**extra):
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    env.update(GLOO_SOCKET_IFNAME="lo", OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", **extra)
    return env


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _torchrun(args, nproc=2, extra=(), timeout=180):
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}",
           "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{_free_port()}", *extra, *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=_env())


def _single(args, timeout=120):
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=timeout, env=_env())


def _params(run_dir):
    return load_checkpoint(Path(run_dir) / "checkpoint.pt")["model"]


def _assert_same(a, b):
    assert a.keys() == b.keys()
    for k in a:
        assert torch.allclose(a[k], b[k], atol=1e-5), k


@pytest.mark.parametrize("accumulate", [1, 2])
def test_ddp_matches_one_process_with_the_same_global_batch(tmp_path, accumulate):
    one = _single([SCRIPT, str(tmp_path / "one"), "32", str(accumulate), "0", "8"])
    assert one.returncode == 0, one.stderr[-2000:]
    two = _torchrun([SCRIPT, str(tmp_path / "two"), "16", str(accumulate), "0", "8"])
    assert two.returncode == 0, two.stderr[-2000:]
    _assert_same(_params(tmp_path / "one"), _params(tmp_path / "two"))
    summary = json.loads((tmp_path / "two" / "result.json").read_text())["summary"]
    assert summary["world_size"] == 2 and summary["effective_batch"] == 16 * accumulate * 2
    before = torch.nn.Linear(8, 16).weight  # sanity: training moved the weights away from the init
    assert not torch.equal(_params(tmp_path / "two")["net.0.weight"], before)


def test_fsdp2_trains_and_its_checkpoint_resumes_in_one_process(tmp_path):
    run = tmp_path / "fsdp"
    proc = _torchrun([SCRIPT, str(run), "16", "1", "1", "6"])
    assert proc.returncode == 0, proc.stderr[-2000:]
    state = load_checkpoint(run / "checkpoint.pt")
    assert state["step"] == 6 and state["world_size"] == 2
    assert all(isinstance(v, torch.Tensor) and not hasattr(v, "placements") for v in state["model"].values())
    # The same run directory, continued to step 10 by a single process (global batch 32 = 2 x 16).
    cont = _single([SCRIPT, str(run), "32", "1", "0", "10"])
    assert cont.returncode == 0, cont.stderr[-2000:]
    assert "resumed from" in cont.stderr
    assert json.loads((run / "result.json").read_text())["summary"]["steps"] == 10


def test_a_failing_rank_stops_the_job_with_its_error(tmp_path):
    proc = _torchrun([SCRIPT, str(tmp_path / "fail"), "16", "1", "0", "8", "raise"], timeout=120)
    assert proc.returncode != 0
    assert "planted failure on rank 1" in proc.stdout + proc.stderr


def test_a_killed_rank_restarts_and_resumes_from_its_checkpoint(tmp_path):
    run = tmp_path / "restart"
    proc = _torchrun([SCRIPT, str(run), "16", "1", "0", "12", "kill-once"], extra=["--max-restarts=1"], timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads((run / "result.json").read_text())
    assert result["restart"] == "1" and result["summary"]["steps"] == 12
    assert "resumed from" in proc.stderr


def test_two_nodes_rendezvous_on_loopback(tmp_path):
    port = _free_port()
    cmds = [[sys.executable, "-m", "torch.distributed.run", "--nnodes=2", "--nproc-per-node=1",
             "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{port}", "--rdzv-id=gputrain-test",
             f"--node-rank={rank}", SCRIPT, str(tmp_path / "nodes"), "16", "1", "0", "4"] for rank in (0, 1)]
    procs = [subprocess.Popen(c, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=_env()) for c in cmds]
    outs = [p.communicate(timeout=180) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], [o[1][-2000:] for o in outs]
    summary = json.loads((tmp_path / "nodes" / "result.json").read_text())["summary"]
    assert summary["world_size"] == 2 and summary["steps"] == 4


def test_fit_nproc_runs_torchrun_end_to_end(tmp_path, cache_dir):
    env = _env(GPUTRAIN_CACHE=str(cache_dir))
    proc = subprocess.run([sys.executable, "-m", "gputrain", "fit", "mlp-binary", "--nproc", "2", "--device", "cpu",
                           "--steps", "10", "--batch-size", "32", "--no-save", "--json"],
                          capture_output=True, text=True, timeout=180, env=env, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads(proc.stdout[proc.stdout.index("{"):])["summary"]
    assert summary["world_size"] == 2 and summary["effective_batch"] == 64 and summary["steps"] == 10


def test_data_parallel_is_unwrapped_with_a_warning():
    from gputrain import TrainConfig, fit

    model = torch.nn.DataParallel(torch.nn.Linear(4, 2))
    with pytest.warns(UserWarning, match="nn.DataParallel"):
        fit(model, (torch.randn(16, 4), torch.randint(0, 2, (16,))), loss_fn=torch.nn.CrossEntropyLoss(),
            config=TrainConfig(device="cpu", steps=2))
