"""Slurm without Slurm: srun's variables, the sbatch script, and SIGUSR1 -> checkpoint -> requeue ->
resume, with two local processes standing in for two srun tasks and a stub `scontrol` on PATH that
records how it was called."""

import os
import signal
import socket
import stat
import sys
import time
from pathlib import Path

import pytest

from gputrain.cli import main
from gputrain.errors import ConfigError
from gputrain.checkpoint.names import is_dcp
from gputrain.checkpoint.store import CheckpointStore
from gputrain.runtime.distributed import SINGLE, DistInfo
from gputrain.runtime.slurm import (DEFAULT_PORT_BASE, launcher_rank, parse_nodelist, requeue_after_stop,
                                    slurm_task)
from helpers import finish_process, start_process, subprocess_env

TINY = f"{Path(__file__).parents[1] / 'benchmarks' / 'faults' / 'tiny.py'}:workload"


@pytest.mark.parametrize("nodelist,hosts", [
    ("node[01-04,07]", ["node01", "node02", "node03", "node04", "node07"]),
    ("localhost", ["localhost"]),
    ("gpu5,cpu[9-11]", ["gpu5", "cpu9", "cpu10", "cpu11"]),
    ("n[098-101]", ["n098", "n099", "n100", "n101"]),
    ("rack[1-2]-n[1,3],login", ["rack1-n1", "rack1-n3", "rack2-n1", "rack2-n3", "login"]),
])
def test_node_lists_expand_like_scontrol_show_hostnames(nodelist, hosts):
    assert parse_nodelist(nodelist) == hosts


@pytest.mark.parametrize("bad", ["node[01-04", "node01]", "node[a-b]", "node[4-1]", ""])
def test_a_malformed_node_list_is_named(bad):
    with pytest.raises(ConfigError, match="malformed Slurm node list"):
        parse_nodelist(bad)


SRUN = {"SLURM_PROCID": "3", "SLURM_NTASKS": "16", "SLURM_LOCALID": "3", "SLURM_STEP_ID": "0",
        "SLURM_JOB_ID": "123456", "SLURM_JOB_NODELIST": "gpu[07-08]"}


def test_a_task_of_srun_gets_its_rank_and_the_first_node_as_rendezvous():
    task = slurm_task(SRUN)
    assert task is not None
    assert task.as_env() == {"RANK": "3", "WORLD_SIZE": "16", "LOCAL_RANK": "3", "MASTER_ADDR": "gpu07",
                             "MASTER_PORT": str(DEFAULT_PORT_BASE + 123456 % 10000)}
    # the step's own node list first (rank 0 runs on its first node), MASTER_* override, and who is not a task
    assert slurm_task({**SRUN, "SLURM_STEP_NODELIST": "gpu08", "SLURM_STEP_NUM_TASKS": "8"}).as_env()["MASTER_ADDR"] \
        == "gpu08"
    assert slurm_task({**SRUN, "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29500"}).as_env()["MASTER_PORT"] == "29500"
    assert slurm_task({**SRUN, "RANK": "0", "WORLD_SIZE": "2"}) is None  # torchrun inside the allocation
    assert slurm_task({k: v for k, v in SRUN.items() if k != "SLURM_STEP_ID"}) is None  # the batch script
    assert slurm_task({**SRUN, "SLURM_NTASKS": "1"}) is None
    with pytest.raises(ConfigError, match=r"SLURM_PROCID='three' is not an integer from 0 to 15"):
        slurm_task({**SRUN, "SLURM_PROCID": "three"})
    with pytest.raises(ConfigError, match=r"MASTER_PORT='29500x' is not an integer from 1 to 65535"):
        slurm_task({**SRUN, "MASTER_PORT": "29500x"})
    with pytest.raises(ConfigError, match=r"SLURM_RESTART_COUNT='-1' is not an integer >= 0"):
        slurm_task({**SRUN, "SLURM_RESTART_COUNT": "-1"})
    # is_main_process's answer before any process group exists
    assert launcher_rank(SRUN) == 3 and launcher_rank({**SRUN, "RANK": "1", "WORLD_SIZE": "2"}) == 1
    assert launcher_rank({}) == 0 and launcher_rank({**SRUN, "SLURM_PROCID": "three"}) == 0


def test_gputrain_slurm_prints_an_sbatch_script(capsys):
    assert main(["slurm", "gpt-mini", "--nodes", "2", "--gpus-per-node", "8", "--run-dir", "/shared/runs/gpt",
                 "--partition", "gpu", "--fit-args=--async-checkpoint --shard"]) == 0
    script = capsys.readouterr().out
    directives = [line.split()[1] for line in script.splitlines() if line.startswith("#SBATCH")]
    for expected in ("--nodes=2", "--ntasks-per-node=8", "--gpus-per-node=8", "--signal=USR1@120", "--requeue",
                     "--partition=gpu", "--open-mode=append"):
        assert expected in directives, (expected, directives)
    srun = next(line for line in script.splitlines() if line.startswith("srun "))
    assert "python -m gputrain fit gpt-mini" in srun and '--resume "$RUN_DIR"' in srun
    assert srun.endswith("--async-checkpoint --shard") and "RUN_DIR=/shared/runs/gpt" in script
    assert main(["slurm", "gpt-mini", "--run-dir", "/x", "--time", "four hours"]) == 2


def _sweep_file(tmp_path: Path) -> Path:
    from test_sweep import SWEEP  # iris-mlp, 20 steps a trial

    (tmp_path / "sweep.toml").write_text(SWEEP.replace("trials = 8", "trials = 3"))
    return tmp_path / "sweep.toml"


def test_gputrain_slurm_sweep_prints_a_job_array_of_workers_of_one_study(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    _sweep_file(tmp_path)
    assert main(["slurm", "--sweep", "sweep.toml", "--tasks", "8", "--sweep-dir", "/shared/sweeps/lr", "--study", "lr",
                 "--storage", "postgresql://sweeper@db-host/sweeps", "--gpus-per-node", "2", "--partition", "gpu",
                 "--setup", "source ~/venv/bin/activate"]) == 0
    script = capsys.readouterr().out
    directives = [line.split()[1] for line in script.splitlines() if line.startswith("#SBATCH")]
    for expected in ("--array=0-7", "--nodes=1", "--ntasks=1", "--gpus=2", "--requeue", "--partition=gpu",
                     "--job-name=gputrain-sweep-lr"):
        assert expected in directives, (expected, directives)
    command = script.splitlines()[-1]
    assert command == ('python -m gputrain sweep --config "$CONFIG" --study lr --sweep-dir '
                       '"$SWEEP_DIR/task-$SLURM_ARRAY_TASK_ID" --workers 2 --storage postgresql://sweeper@db-host/sweeps')
    assert f"CONFIG={tmp_path / 'sweep.toml'}" in script and "SWEEP_DIR=/shared/sweeps/lr" in script
    assert script.index("source ~/venv/bin/activate") < script.index(command)
    # No storage anywhere: the tasks must find the URL in their environment, or stop at once.
    assert main(["slurm", "--sweep", "sweep.toml", "--sweep-dir", "/shared/sweeps/lr"]) == 0
    out, err = capsys.readouterr()
    assert ': "${GPUTRAIN_SWEEP_STORAGE:?' in out and "--storage" not in out.splitlines()[-1]
    assert "the tasks take the study's URL from GPUTRAIN_SWEEP_STORAGE" in err


@pytest.mark.parametrize("argv,says", [
    (["--storage", "postgresql://sweeper:hunter2@db/sweeps"], "a password in the URL would be written into the script"),
    (["--storage", "lr.journal"], "give the journal file's absolute path on storage every node sees"),
    (["--run-dir", "/shared/run"], "--run-dir: belongs to a sweep's array (--sweep)"),
    (["--fit-args=--steps 5", "--nodes", "2"], "--nodes, --fit-args: belong to a sweep's array"),
    (["--study", ""], "must be a name of 1 to 512 printable characters"),
    (["--trials", "0"], "--trials"),
])
def test_gputrain_slurm_sweep_refuses_before_it_writes(tmp_path, capsys, monkeypatch, argv, says):
    monkeypatch.chdir(tmp_path)
    _sweep_file(tmp_path)
    try:
        code = main(["slurm", "--sweep", "sweep.toml", "--sweep-dir", "/shared/lr", "--output", "array.sbatch", *argv])
    except SystemExit as exc:  # argparse's refusal of a flag's type (--trials 0)
        code = exc.code
    assert code == 2
    err = capsys.readouterr().err
    assert says in err and "hunter2" not in err
    assert not (tmp_path / "array.sbatch").exists()


@pytest.mark.processes
def test_a_sweep_job_array_runs_its_tasks_as_workers_of_one_study(tmp_path):
    """The written script run as Slurm would run two tasks of the array, at once, on a journal file:
    the study ends with its budget of finished trials, each trial in the folder of the task that ran it;
    a task without the study's URL in its environment stops at once, saying so."""
    import subprocess

    import optuna
    from optuna.storages.journal import JournalFileBackend

    _sweep_file(tmp_path)
    journal = tmp_path / "lr.journal"
    env = subprocess_env()
    env.pop("GPUTRAIN_SWEEP_STORAGE", None)
    for storage, script in (([], "no-url.sbatch"), (["--storage", str(journal)], "array.sbatch")):
        proc = subprocess.run([sys.executable, "-m", "gputrain", "slurm", "--sweep", "sweep.toml", "--tasks", "2",
                               "--sweep-dir", str(tmp_path / "out"), "--python", sys.executable, *storage,
                               "--output", script], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
        assert proc.returncode == 0, proc.stderr[-3000:]
    proc = subprocess.run(["bash", "no-url.sbatch"], cwd=tmp_path, env={**env, "SLURM_ARRAY_TASK_ID": "0"},
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode != 0 and "set GPUTRAIN_SWEEP_STORAGE to the URL of the study" in proc.stderr
    assert not (tmp_path / "out").exists()
    tasks = [subprocess.Popen(["bash", "array.sbatch"], cwd=tmp_path, env={**env, "SLURM_ARRAY_TASK_ID": str(k)},
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for k in (0, 1)]
    for task in tasks:
        out, err = task.communicate(timeout=300)
        assert task.returncode == 0, err[-3000:]
    study = optuna.load_study(study_name="gputrain",
                              storage=optuna.storages.JournalStorage(JournalFileBackend(str(journal))))
    # finished: complete or pruned (the sweep's median pruner may stop a trial whose sampled lr is poor;
    # which values are sampled depends on which task asks first)
    done = (optuna.trial.TrialState.COMPLETE, optuna.trial.TrialState.PRUNED)
    states = [t.state for t in study.get_trials()]
    assert sum(s in done for s in states) == 3 and optuna.trial.TrialState.RUNNING not in states, states
    folders = {t.user_attrs["sweep_dir"] for t in study.get_trials() if t.state in done}
    assert folders <= {str(tmp_path / "out" / "task-0"), str(tmp_path / "out" / "task-1")}, folders
    for t in study.get_trials():
        if t.state in done:  # an ordinary run directory in its task's folder (a pruned one stopped early)
            run = Path(t.user_attrs["sweep_dir"]) / t.user_attrs["run_dir"]
            assert (run / "config.toml").is_file(), (t.number, t.state, sorted(p.name for p in run.iterdir()))


def _stub_scontrol(folder: Path, requeue: int) -> tuple[dict[str, str], Path]:
    """A directory with an `scontrol` that appends its arguments to a log; PATH for it."""
    folder.mkdir(parents=True, exist_ok=True)
    log = folder / "scontrol.log"
    stub = folder / "scontrol"
    stub.write_text(f'#!/bin/sh\necho "$@" >> {log}\n'
                    f'[ "$1" = show ] && echo "JobId=$4 JobName=t Requeue={requeue} Restarts=0"\nexit 0\n')
    stub.chmod(stub.stat().st_mode | stat.S_IXUSR)
    return {"PATH": f"{folder}{os.pathsep}{os.environ.get('PATH', '')}"}, log


@pytest.mark.processes
@pytest.mark.parametrize("hangs", [True, False])
def test_an_scontrol_that_hangs_or_fails_is_a_warning_within_a_bounded_wait(tmp_path, monkeypatch, caplog, hangs):
    """The stop's checkpoint is written by then: a slurmctld that does not answer (or an scontrol that
    cannot run) costs at most SCONTROL_TIMEOUT_S per call and ends in one warning, not an exception."""
    import shutil
    import time

    from gputrain.runtime import slurm

    stub = tmp_path / "scontrol"
    sleep = shutil.which("sleep") or "/bin/sleep"
    stub.write_text(f"#!/bin/sh\nexec {sleep} 30\n" if hangs else "not a program")  # no #!: exec fails (OSError)
    stub.chmod(stub.stat().st_mode | stat.S_IXUSR)
    monkeypatch.setattr(slurm, "SCONTROL_TIMEOUT_S", 1.0)
    start = time.monotonic()
    assert requeue_after_stop(signal.SIGUSR1, SINGLE, {"PATH": str(tmp_path), "SLURM_JOB_ID": "77"}) is False
    assert time.monotonic() - start < 10  # show and requeue, each cut at 1 s
    assert "scontrol requeue 77 failed" in caplog.text and "not requeued" in caplog.text
    assert ("no answer in 1 s" in caplog.text) is hangs


@pytest.mark.processes
@pytest.mark.parametrize("requeue,sig,called", [(1, signal.SIGUSR1, True), (0, signal.SIGUSR1, False),
                                                (1, signal.SIGTERM, False), (1, None, False)])
def test_requeue_only_after_slurms_sigusr1_and_only_when_requeuable(tmp_path, requeue, sig, called):
    path, log = _stub_scontrol(tmp_path, requeue)
    env = {**path, "SLURM_JOB_ID": "77"}
    assert requeue_after_stop(sig, SINGLE, env) is called
    calls = log.read_text().splitlines() if log.exists() else []
    assert ("requeue 77" in calls) is called
    before = log.read_text() if log.exists() else ""
    assert requeue_after_stop(signal.SIGUSR1, DistInfo(False, rank=1), env) is False  # rank 0's call only
    assert requeue_after_stop(signal.SIGUSR1, SINGLE, {**path}) is False  # not a Slurm job
    assert (log.read_text() if log.exists() else "") == before


def _free_slurm_port() -> int:
    """A job id whose derived MASTER_PORT (20000 + id mod 10000) is free here."""
    for port in range(DEFAULT_PORT_BASE + 1000 + os.getpid() % 5000, DEFAULT_PORT_BASE + 10000):
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        return 50000 + (port - DEFAULT_PORT_BASE)
    raise RuntimeError("no free port in 20000-29999")


def _srun(tmp_path, job_id: int, extra_env: dict[str, str], *fit_args: str):
    """Two local `gputrain fit` processes with the variables srun gives two tasks of one step."""
    procs = []
    for rank in (0, 1):
        env = subprocess_env(SLURM_PROCID=str(rank), SLURM_NTASKS="2", SLURM_LOCALID=str(rank), SLURM_STEP_ID="0",
                   SLURM_JOB_ID=str(job_id), SLURM_JOB_NODELIST="localhost,gpu[02-04]", **extra_env)
        cmd = [sys.executable, "-m", "gputrain", "fit", TINY, "--device", "cpu", "--run-dir", "run", "--resume", "run",
               "--checkpoint-every", "5", "--log-every", "5", "--no-tensorboard", "--async-checkpoint", *fit_args]
        procs.append(start_process(cmd, env=env, cwd=tmp_path))
    return procs


@pytest.mark.processes
def test_sigusr1_under_slurm_checkpoints_requeues_and_the_next_start_resumes(tmp_path):
    path, log = _stub_scontrol(tmp_path / "bin", requeue=1)
    (tmp_path / "run").mkdir()  # the sbatch script's mkdir -p
    job = _free_slurm_port()
    procs = _srun(tmp_path, job, path, "--steps", "100000", "--option", "sleep_ms=5")
    metrics = tmp_path / "run" / "metrics.jsonl"
    deadline = time.time() + 150
    while time.time() < deadline and all(p.poll() is None for p in procs):
        if metrics.exists() and len(metrics.read_text().splitlines()) >= 3:
            break
        time.sleep(0.3)
    if not all(p.poll() is None for p in procs):  # one ended before the signal: stop the other, show both
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
        pytest.fail("\n".join(p.communicate(timeout=60)[1][-3000:] for p in procs))
    for p in procs:  # Slurm signals every task of the job's steps
        os.kill(p.pid, signal.SIGUSR1)
    outs = [finish_process(p, 120) for p in procs]
    assert [o.returncode for o in outs] == [138, 138], [o.stderr[-3000:] for o in outs]
    assert "requeued" in outs[0].stderr, outs[0].stderr[-3000:]
    calls = log.read_text().splitlines()
    assert calls == [f"show job -o {job}", f"requeue {job}"]  # rank 0 only, once
    store = CheckpointStore(tmp_path / "run")
    latest = store.latest_path()
    assert latest is not None and is_dcp(latest) and store.verify(latest) is True
    state, _ = store.load_latest()
    step = state["step"]
    assert state["world_size"] == 2 and step > 0 and step % 10 == 0  # the ranks agree every 10 steps

    # The requeued job starts again: the same script, SLURM_RESTART_COUNT=1.
    procs = _srun(tmp_path, job, {**path, "SLURM_RESTART_COUNT": "1"}, "--steps", str(step + 10))
    outs = [finish_process(p, 180) for p in procs]
    assert [o.returncode for o in outs] == [0, 0], [o.stderr[-3000:] for o in outs]
    assert f"at step {step}" in outs[0].stderr and "resumed from" in outs[0].stderr, outs[0].stderr[-3000:]
    final, _ = store.load_latest()
    assert final["step"] == step + 10 and final["world_size"] == 2
    assert log.read_text().splitlines() == calls  # no second requeue
