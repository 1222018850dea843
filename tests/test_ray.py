"""Ray Train as a launcher, on the CPU: 2 gloo workers on a local Ray cluster of 2 CPUs.

Every Ray run happens in a subprocess (its own Ray cluster, started and shut down there; HOME in the
test's folder, so that Ray's default storage, ~/ray_results, is too), killed whole on a timeout, as
tests/test_distributed.py runs torchrun. Skipped, with the reason, where Ray is not installed.
"""

from __future__ import annotations

import importlib.util
import json
import re
import sys
from pathlib import Path

import pytest
import torch

from gputrain.checkpoint.read import read_checkpoint
from gputrain.checkpoint.store import CheckpointStore
from helpers import finish_process, start_process, subprocess_env

# One worker runs this file's tests in a row: two local Ray clusters at once would each count the
# machine's cores as their own.
pytestmark = [pytest.mark.xdist_group("ray"), pytest.mark.processes,
              pytest.mark.skipif(importlib.util.find_spec("ray") is None,
                                 reason="needs Ray (pip install 'gputrain[ray]')")]

SCRIPT = str(Path(__file__).parent / "dist_scripts" / "ray_train_func.py")

# A workload whose rank 1 is killed with SIGKILL inside its 7th step, once (KILL_ONCE set, no mark yet).
KILLED_ONCE = '''
import os
import signal
import time
from pathlib import Path

import torch
from torch import nn

from gputrain.workloads.base import DataSplits, Workload

MARK = Path(__file__).with_name("killed")


class KilledOnce(nn.Module):
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 2))
        self.calls = 0

    def forward(self, x):
        if self.training:
            self.calls += 1
            if self.calls == 7 and os.environ.get("RANK") == "1" and os.environ.get("KILL_ONCE") and not MARK.exists():
                MARK.write_text(f"rank 1 (pid {os.getpid()}) killed in step 7")
                # Ray's controller collects the reports when it polls the workers (every
                # RAY_TRAIN_HEALTH_CHECK_INTERVAL_S): a step this long lets it take step 4's checkpoint first.
                time.sleep(10)
                os.kill(os.getpid(), signal.SIGKILL)
        return self.net(x)


def _data():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(320, 8, generator=g)
    y = (x[:, :3].sum(1) > 0).long()
    return DataSplits(train=(x[:256], y[:256]), test=(x[256:], y[256:]))


def make():
    return Workload(name="killed-once", description="test", make_data=_data, make_model=KilledOnce,
                    loss_fn=nn.CrossEntropyLoss(), defaults={"batch_size": 16, "lr": 0.01})
'''


def _latest(run_dir):
    return read_checkpoint(CheckpointStore(run_dir).latest_path())


def _listing(run_dir: Path) -> list[str]:
    return sorted(str(p.relative_to(run_dir)) for p in run_dir.rglob("*") if p.parent.name != "__pycache__"
                  and not p.parent.name.endswith(".dcp"))


# ---------------------------------------------------------------- gputrain.fit in your own TorchTrainer


@pytest.fixture(scope="module")
def api_run(tmp_path_factory):
    """One TorchTrainer run of dist_scripts/ray_train_func.py: fit with RayReport on 2 workers."""
    out = tmp_path_factory.mktemp("ray-api")
    proc = finish_process(start_process([sys.executable, SCRIPT, str(out)], env=subprocess_env(HOME=str(out / "home"))), 300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return out


def test_fit_on_a_ray_worker_takes_rays_process_group_as_it_is(api_run):
    for rank in (0, 1):
        seen = json.loads((api_run / f"worker-{rank}.json").read_text())
        # no second init_process_group; Ray's group, rank and world size; the device Ray gave (the CPU);
        # the group left for Ray to destroy
        assert seen == {"owns_group": False, "rank": rank, "world_size": 2, "device": "cpu", "init_calls": 0,
                        "initialized_after": True}, seen


def test_ray_workers_shard_the_data_as_one_process_with_the_same_global_batch(api_run, monkeypatch):
    """Each worker trained on its half of each global batch (DDP): one process with the global batch
    ends at the same weights (as under torchrun, tests/test_distributed.py)."""
    import importlib

    from torch import nn

    from gputrain import TrainConfig, fit

    # the script reads its OUT from sys.argv when imported (a pytest-xdist worker's argv holds no more than -c)
    monkeypatch.setattr(sys, "argv", [SCRIPT, str(api_run)])
    sys.path.insert(0, str(Path(SCRIPT).parent))
    try:
        data = importlib.import_module("ray_train_func").data
    finally:
        sys.path.pop(0)
    train, test = data()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 2))
    fit(model, train, eval_data=test, loss_fn=nn.CrossEntropyLoss(),
        config=TrainConfig(device="cpu", batch_size=32, steps=12, log_every=2, seed=1, progress=False, loggers=()),
        optimizer=lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9))
    ray_weights = torch.load(api_run / "final.pt", weights_only=True)
    for key, value in model.state_dict().items():
        assert torch.allclose(value, ray_weights[key], atol=1e-5), (key, (value - ray_weights[key]).abs().max())


def test_rays_result_knows_the_latest_and_the_best_checkpoint_with_their_metrics(api_run):
    result = json.loads((api_run / "result.json").read_text())
    assert result["latest"] == ["step-000012.dcp"]  # the run's own format, under its own name
    history = json.loads((api_run / "run" / "history.json").read_text())["records"]
    eval_loss = {r["step"]: r["eval_loss"] for r in history}
    assert result["metrics"]["step"] == 12 and result["metrics"]["eval_loss"] == eval_loss[12]
    # Each checkpoint Ray kept carries the metrics of its own step's log point: Ray ranks them by those.
    best = result["best"]
    assert best and all(b["files"] == [f"step-{b['metrics']['step']:06d}.dcp"] for b in best), best
    assert all(b["metrics"]["eval_loss"] == eval_loss[b["metrics"]["step"]] for b in best), best
    assert min(b["metrics"]["eval_loss"] for b in best) == min(eval_loss[s] for s in (4, 8, 12))
    assert not list((api_run / "run").glob(".ray-checkpoint-*"))  # the staging folders are gone


# ---------------------------------------------------------------- gputrain fit --launcher ray


@pytest.mark.slow
def test_a_sigkilled_worker_restarts_the_group_which_resumes_exactly_where_torchrun_ends(tmp_path):
    """`fit --launcher ray --nproc 2 --max-restarts 1 --ray-storage store`: rank 1 dies by SIGKILL inside
    step 7; Ray restarts the group, which resumes from the newest checkpoint Ray holds in the storage
    named (step 4) and ends bit-equal to an uninterrupted `fit --nproc 2` under torchrun, with the same
    run directory.

    Slow: 112 s on this machine (the serial suite, 2026-11-28, load 5-14): a local Ray cluster starts, a worker
    sleeps 10 s before its SIGKILL so that Ray takes step 4's checkpoint, the group restarts; then the torchrun
    twin."""
    (tmp_path / "killwl.py").write_text(KILLED_ONCE)
    common = ("fit", "killwl.py:make", "--nproc", "2", "--steps", "12", "--log-every", "2", "--checkpoint-every", "4",
              "--device", "cpu", "--no-tensorboard")  # the run log on (--json would quiet it)
    home = tmp_path / "home"
    on_ray = finish_process(start_process([sys.executable, "-m", "gputrain", *common, "--launcher", "ray", "--max-restarts", "1",
                             "--ray-storage", "store", "--run-dir", "on-ray"], env=subprocess_env(HOME=str(home), KILL_ONCE="1", RAY_DEDUP_LOGS="0",
                                                        RAY_TRAIN_HEALTH_CHECK_INTERVAL_S="0.5"), cwd=tmp_path), 400)
    assert on_ray.returncode == 0, on_ray.stderr[-4000:]
    assert (tmp_path / "killed").exists(), "the planted SIGKILL did not happen"
    resumed = re.findall(r"resumed from (\S+) at step (\d+)", on_ray.stderr)
    assert len(resumed) == 1, on_ray.stderr[-4000:]  # rank 0 of the restarted group says so (the others: warnings)
    for path, step in resumed:
        # Ray's copy in the storage --ray-storage named (relative: to the command's folder), not the run
        # directory's own store, nor Ray's default ~/ray_results
        assert step == "4" and path.startswith(str(tmp_path / "store")) and path.endswith("step-000004.dcp"), path
    assert not (home / "ray_results").exists()
    summary = json.loads((tmp_path / "on-ray" / "history.json").read_text())["summary"]
    assert summary["steps"] == 12 and summary["world_size"] == 2

    torchrun = finish_process(start_process([sys.executable, "-m", "gputrain", *common, "--run-dir", "torchrun"],
                              env=subprocess_env(HOME=str(home)), cwd=tmp_path), 240)
    assert torchrun.returncode == 0, torchrun.stderr[-4000:]
    a, b = _latest(tmp_path / "on-ray"), _latest(tmp_path / "torchrun")
    assert a["step"] == b["step"] == 12
    for key in b["model"]:
        assert torch.equal(a["model"][key], b["model"][key]), key
    for slot, state in b["optimizer"]["state"].items():
        assert all(torch.equal(a["optimizer"]["state"][slot][k], v) for k, v in state.items()), slot
    losses = [[(r["step"], r["loss"]) for r in json.loads((tmp_path / d / "history.json").read_text())["records"]]
              for d in ("on-ray", "torchrun")]
    assert losses[0] == losses[1]
    assert _listing(tmp_path / "on-ray") == _listing(tmp_path / "torchrun")


def test_import_gputrain_and_a_run_without_ray_never_import_ray(tmp_path):
    """Ray is imported where a run uses it only: not by `import gputrain`, nor by a fit in a process group
    someone else made (which asks runtime/ray_train.py whether Ray made it), nor by importing the Ray
    modules themselves."""
    code = ("import sys, torch\n"
            "import torch.distributed as dist\n"
            "import gputrain\n"
            f"dist.init_process_group('gloo', store=dist.FileStore({str(tmp_path / 'store')!r}, 1), rank=0, "
            "world_size=1)\n"
            "from gputrain import TrainConfig, fit\n"
            "import gputrain.runtime.ray_train, gputrain.report.ray_report, gputrain.runs.ray_run\n"
            "x = torch.randn(32, 4)\n"
            "fit(torch.nn.Linear(4, 2), (x, (x[:, 0] > 0).long()), loss_fn=torch.nn.CrossEntropyLoss(),\n"
            "    config=TrainConfig(device='auto', steps=2, batch_size=16, progress=False, loggers=()))\n"
            "print(sorted(m for m in sys.modules if m == 'ray' or m.startswith('ray.')))\n")
    proc = finish_process(start_process([sys.executable, "-c", code]), 120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip().splitlines()[-1] == "[]", proc.stdout


def test_a_workers_refusal_in_rays_error_is_raised_as_its_own_one_line():
    """Ray wraps a worker's exception (its cause chain, or its errors by rank): the driver finds the
    gputrain refusal there and raises it as the same type, first line only; None for any other error."""
    from gputrain.errors import CheckpointError, ConfigError
    from gputrain.runs.ray_run import _refusal_in

    class TrainingFailed(RuntimeError):  # as Ray Train's TrainingFailedError carries its workers' errors
        def __init__(self, worker_failures):
            super().__init__("training failed")
            self.worker_failures = worker_failures

    try:
        try:
            raise ConfigError("--batch-size 0: give a positive integer\n(the rest of a long message)")
        except ConfigError as exc:
            raise RuntimeError("Ray's wrapper") from exc
    except RuntimeError as wrapped:
        found = _refusal_in(wrapped)
    assert type(found) is ConfigError and str(found) == "--batch-size 0: give a positive integer"
    by_rank = _refusal_in(TrainingFailed({0: ValueError("other"), 1: CheckpointError("disk full")}))
    assert type(by_rank) is CheckpointError and str(by_rank) == "disk full"
    assert _refusal_in(TrainingFailed([RuntimeError("a crash")])) is None
