"""`gputrain sweep` / `gputrain.sweep(...)` on Optuna: trials as run directories, the study in SQLite,
a killed sweep resumed, pruning through the callback interface, workers per GPU, and bad input.

The sweeps train iris-mlp (full batch, 20 steps, an evaluation every 5) on the CPU; a worker is a
process, as on a GPU machine.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from torch import nn

from helpers import cli as _cli, docs_page, subprocess_env

HAS_OPTUNA = __import__("importlib.util").util.find_spec("optuna") is not None
needs_optuna = pytest.mark.skipif(not HAS_OPTUNA, reason="needs Optuna (pip install 'gputrain[sweep]')")

RUN = '''workload = "iris-mlp"

[train]
steps = 20
log_every = 5
device = "cpu"
loggers = ["csv"]
'''
SWEEP = RUN + '''
[sweep]
trials = 8
workers = 2
metric = "eval_loss"
startup_trials = 2

[sweep.space]
lr = {loguniform = [1e-4, 1e-1]}
weight_decay = {uniform = [0.0, 0.1], step = 0.01}
'''


def _snapshot(folder: Path) -> dict[str, str]:
    return {str(p.relative_to(folder)): "dir" if p.is_dir() else hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*"))}


def _trials(sweep_dir: Path):
    import optuna

    from gputrain.sweeps.study import access

    with access(sweep_dir):
        return optuna.load_study(study_name="gputrain", storage=f"sqlite:///{sweep_dir}/study.db").get_trials()


# ---------------------------------------------------------------- the test: 8 trials, 2 workers, killed, resumed


@pytest.mark.slow
@pytest.mark.processes
@needs_optuna
def test_a_killed_sweep_resumes_and_optuna_reads_the_study(tmp_path, capsys):
    """Slow: 89 s on this machine (the serial suite, 2026-11-28, load 5-14): a sweep of trial processes is
    killed, then resumed to its budget."""
    import optuna
    from optuna.trial import TrialState

    (tmp_path / "sweep.toml").write_text(SWEEP)
    sweep_dir = tmp_path / "s"
    argv = [sys.executable, "-m", "gputrain", "sweep", "--config", str(tmp_path / "sweep.toml"), "--sweep-dir",
            str(sweep_dir)]
    proc = subprocess.Popen(argv, cwd=tmp_path, env=subprocess_env(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            start_new_session=True)  # its own process group: the kill takes the workers too
    deadline = time.monotonic() + 240
    try:
        while time.monotonic() < deadline:  # kill it with two trials finished and at least one running
            if proc.poll() is not None:
                pytest.fail(f"the sweep ended before it was killed: {proc.stderr.read().decode()[-2000:]}")
            if (sweep_dir / "study.db").exists():
                states = [t.state for t in _trials(sweep_dir)]
                finished = sum(s in (TrialState.COMPLETE, TrialState.PRUNED) for s in states)
                if finished >= 2 and TrialState.RUNNING in states:
                    break
            time.sleep(0.05)
        else:
            pytest.fail("the sweep did not get two trials done in 240 s")
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    before = {t.number: (t.state, t.params, t.value) for t in _trials(sweep_dir)}
    running = [n for n, (state, _, _) in before.items() if state == TrialState.RUNNING]
    assert running and len(before) < 8 + len(running)

    resumed = subprocess.run([*argv[:4], "--sweep-dir", str(sweep_dir), "--json"], cwd=tmp_path, env=subprocess_env(),
                             capture_output=True, text=True, timeout=300)
    assert resumed.returncode == 0 and resumed.stderr == "", resumed.stderr[-3000:]  # --json: no progress lines

    study = optuna.load_study(study_name="gputrain", storage=f"sqlite:///{sweep_dir}/study.db")  # Optuna's own API
    trials = study.get_trials()
    finished = [t for t in trials if t.state in (TrialState.COMPLETE, TrialState.PRUNED)]
    assert len(finished) == 8
    assert set(study.best_params) == {"lr", "weight_decay"}
    assert study.best_trial.state == TrialState.COMPLETE and study.direction.name == "MINIMIZE"
    assert study.best_value == min(t.value for t in trials if t.state == TrialState.COMPLETE)
    for n, (state, params, value) in before.items():  # nothing done before the kill was lost or redone
        if state in (TrialState.COMPLETE, TrialState.PRUNED):
            assert (trials[n].state, trials[n].params, trials[n].value) == (state, params, value)
    for n in running:  # each interrupted trial failed and ran once more with its parameters
        assert trials[n].state == TrialState.FAIL and "error" not in trials[n].user_attrs
        again = [t for t in trials if t.user_attrs.get("retry_of") == n]
        assert len(again) == 1 and again[0].params == trials[n].params and again[0].state != TrialState.FAIL
    assert len({tuple(sorted(t.params.items())) for t in finished}) == 8  # the resumed workers drew new values

    out = json.loads(resumed.stdout)
    assert out["best_trial"] == study.best_trial.number and out["best_params"] == study.best_params
    for t in finished:  # every trial is an ordinary run directory
        run = sweep_dir / t.user_attrs["run_dir"]
        assert (run / "config.toml").is_file() and (run / "workload.json").is_file() and (run / "history.json").is_file()
    page = (sweep_dir / "report.html").read_text()
    assert page.count("<img src='data:image/png;base64,") == 1 and "best so far" in page
    assert all(f"trials/trial-{t.number:04d}/report.html" in page for t in trials if t.user_attrs.get("run_dir"))
    assert "interrupted: runs again on resume" in page

    # The best trial, repeated from its recorded config, ends with the value the study holds.
    best = sweep_dir / study.best_trial.user_attrs["run_dir"]
    code, stdout, err = _cli(capsys, "fit", "--config", str(best / "config.toml"), "--run-dir", str(tmp_path / "again"),
                             "--json", "--quiet")
    assert code == 0, err
    assert json.loads(stdout)["summary"]["final_eval_loss"] == study.best_value


@pytest.mark.processes
@needs_optuna
def test_sigterm_to_the_sweep_stops_its_workers_and_exits_143_leaving_the_trials_to_run_again(tmp_path):
    """A job scheduler's SIGTERM to the sweep (not to its process group): the sweep passes it on, each
    worker checkpoints its trial and marks it interrupted, the sweep exits 128 + SIGTERM, and the
    interrupted trials wait in the study for a resume."""
    from optuna.trial import TrialState

    (tmp_path / "sweep.toml").write_text(SWEEP)
    sweep_dir = tmp_path / "s"
    proc = subprocess.Popen([sys.executable, "-m", "gputrain", "sweep", "--config", str(tmp_path / "sweep.toml"),
                             "--sweep-dir", str(sweep_dir)], cwd=tmp_path, env=subprocess_env(),
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, start_new_session=True)
    deadline = time.monotonic() + 240
    try:
        while time.monotonic() < deadline:  # SIGTERM with a trial running
            if proc.poll() is not None:
                pytest.fail(f"the sweep ended before the signal: {proc.stderr.read()[-2000:]}")
            if (sweep_dir / "study.db").exists() and TrialState.RUNNING in [t.state for t in _trials(sweep_dir)]:
                break
            time.sleep(0.05)
        else:
            pytest.fail("no trial started in 240 s")
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=180)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert proc.returncode == 143, err[-2000:]
    assert "sweep stopped; the running trials will run again when you resume it" in err
    trials = _trials(sweep_dir)
    assert TrialState.RUNNING not in [t.state for t in trials]  # every worker marked its trial before exiting
    assert any(t.state == TrialState.FAIL and "error" not in t.user_attrs for t in trials), \
        [(t.number, t.state, t.user_attrs) for t in trials]


# ---------------------------------------------------------------- from Python, resumed with a larger budget, refusals


@pytest.fixture(scope="module")
def small_sweep(tmp_path_factory):
    """A finished 2-trial sweep from Python (one worker), and the config it came from."""
    if not HAS_OPTUNA:
        pytest.skip("needs Optuna (pip install 'gputrain[sweep]')")
    import gputrain

    folder = tmp_path_factory.mktemp("small")
    (folder / "sweep.toml").write_text(SWEEP.replace("trials = 8", "trials = 2").replace("workers = 2", "workers = 1"))
    events: list[dict] = []
    result = gputrain.sweep(folder / "sweep.toml", sweep_dir=folder / "s", on_trial=events.append)
    return folder, result, events


@pytest.mark.processes
def test_sweep_from_python_returns_the_best_trial(small_sweep):
    folder, result, events = small_sweep
    assert [e["trial"] for e in sorted(events, key=lambda e: e["trial"])] == [0, 1]
    assert len(result.trials) == 2 and result.metric == "eval_loss" and result.direction == "min"
    done = [r for r in result.trials if r["state"] == "complete"]
    assert result.best_value == min(r["value"] for r in done)
    assert result.best_run_dir == folder / "s" / "trials" / f"trial-{result.best_trial:04d}"
    assert set(result.best_params) == {"lr", "weight_decay"}
    assert result.storage == f"sqlite:///{(folder / 's').resolve()}/study.db"


@pytest.mark.processes
def test_a_resumed_sweep_keeps_its_trials_and_runs_up_to_the_new_budget(small_sweep, tmp_path):
    import shutil

    import gputrain

    folder, first, _ = small_sweep
    copy = tmp_path / "s"
    shutil.copytree(folder / "s", copy)
    same = gputrain.sweep(sweep_dir=copy)  # the budget is spent: nothing runs
    assert [(r["number"], r["value"]) for r in same.trials] == [(r["number"], r["value"]) for r in first.trials]
    more = gputrain.sweep(sweep_dir=copy, trials=3)
    assert len(more.trials) == 3 and more.trials[:2] == same.trials
    assert "trials = 3" in (copy / "sweep.toml").read_text()


@pytest.mark.processes
@needs_optuna
def test_a_sweep_directory_of_another_study_is_refused_and_left_as_it_was(small_sweep, tmp_path, capsys):
    folder, _, _ = small_sweep
    sweep_dir = folder / "s"
    before = _snapshot(sweep_dir)
    other = tmp_path / "other.toml"
    other.write_text((folder / "sweep.toml").read_text().replace("loguniform = [1e-4, 1e-1]", "loguniform = [1e-3, 1e-1]"))
    code, out, err = _cli(capsys, "sweep", "--config", str(other), "--sweep-dir", str(sweep_dir))
    assert code == 2 and out == "" and len(err.strip().splitlines()) == 1, err
    assert re.search(rf"{re.escape(str(sweep_dir))} holds another study \(its sweep.toml differs in sweep.space.lr.loguniform\): "
                     rf"resume it with `gputrain sweep --sweep-dir {re.escape(str(sweep_dir))}`", err), err
    code, _, err = _cli(capsys, "sweep", "--config", str(folder / "sweep.toml"), "--sweep-dir", str(sweep_dir),
                        "--metric", "eval_accuracy")
    assert code == 2 and "differs in sweep.metric, sweep.direction" in err, err
    assert _snapshot(sweep_dir) == before


# ---------------------------------------------------------------- a metric no trial reports


@pytest.mark.processes
@needs_optuna
def test_a_metric_no_trial_reports_stops_the_sweep_in_one_line(tmp_path, capsys):
    from optuna.trial import TrialState

    (tmp_path / "sweep.toml").write_text(SWEEP.replace("workers = 2", "workers = 1"))
    sweep_dir = tmp_path / "s"
    code, out, err = _cli(capsys, "sweep", "--config", str(tmp_path / "sweep.toml"), "--sweep-dir", str(sweep_dir),
                          "--metric", "eval_f1", "--quiet")
    lines = err.strip().splitlines()
    assert code == 2 and out == "" and len(lines) == 1, err
    assert lines[0] == ("gputrain sweep: error: trial 0 reported no eval_f1 (its runs report eval_accuracy, eval_loss, "
                        "loss): set [sweep] metric to one of them and start the sweep in a new --sweep-dir")
    (trial,) = _trials(sweep_dir)  # recorded, not lost: the trial, its error, its run directory
    assert trial.state == TrialState.FAIL and "reported no eval_f1" in trial.user_attrs["error"]
    assert (sweep_dir / "trials" / "trial-0000" / "history.json").is_file()


# ---------------------------------------------------------------- bad input: one line, nothing written


BAD = [
    ("loguniform-from-zero", "lr = {loguniform = [0, 0.1]}", r"line 16: \[sweep.space\] lr: loguniform = \[0, 0.1\] "
                                                             r"cannot be sampled: a log scale needs low > 0"),
    ("low-above-high", "lr = {uniform = [0.1, 0.01]}", r"line 16: .*cannot be sampled: low must be below high"),
    ("no-choices", "batch_size = {choices = []}", r"line 16: \[sweep.space\] batch_size: choices must be a non-empty list"),
    ("unknown-distribution", "lr = {normal = [0, 1]}", r"give one distribution as a table: \{loguniform = \[low, high\]\}"),
    ("step-does-not-divide", "weight_decay = {uniform = [0.0, 0.1], step = 0.03}",
     r"step 0.03 does not divide \[0.0, 0.1\] into whole steps"),
    ("floats-for-an-integer", "batch_size = {uniform = [16, 64]}",
     r"batch_size: can sample 40.0, which the run refuses: \[train\] batch_size must be an integer"),
    ("a-value-the-run-refuses", "lr = {uniform = [0, 0.1]}", r"lr: can sample 0, which the run refuses: \[train\] lr: "
                                                              r"lr must be > 0"),
    ("a-choice-the-run-refuses", 'schedule = {choices = ["cosine", "exponential"]}',
     r"can sample 'exponential', which the run refuses: .*unknown schedule 'exponential'"),
    ("no-such-setting", "learning_rate = {loguniform = [1e-4, 0.1]}", r"learning_rate: no such setting"),
    ("run-dir-searched", 'run_dir = {choices = ["a", "b"]}', r"run_dir is not searched"),
    ("int-with-step-and-log", "steps = {int = [10, 40], step = 10, log = true}", r"int takes step or log = true, not both"),
    ("optimizers-on-the-built-in-step", "optimizers.generator.lr = {loguniform = [1e-4, 0.1]}",
     r"line 16: \[sweep.space\] optimizers.generator.lr: iris-mlp trains with the built-in step"),
    ("an-optimizer-setting-the-run-refuses", "optimizers.generator.lr = {uniform = [0, 0.1]}",
     r"can sample 0, which the run refuses: \[optimizers.generator\] lr must be a number above 0"),
    ("an-optimizer-without-its-key", "optimizers.generator = {uniform = [0, 0.1]}",
     r"a named optimizer's setting is optimizers.NAME.KEY"),
]


@needs_optuna
@pytest.mark.parametrize("name,space,says", BAD, ids=[b[0] for b in BAD])
def test_a_space_that_cannot_be_sampled_is_one_line_with_its_line(name, space, says, tmp_path, capsys):
    text = SWEEP.split("[sweep.space]")[0] + "[sweep.space]\n" + space + "\n"
    assert text.splitlines()[15] == space  # line 16 of the file
    (tmp_path / "sweep.toml").write_text(text)
    code, out, err = _cli(capsys, "sweep", "--config", str(tmp_path / "sweep.toml"), "--sweep-dir", str(tmp_path / "s"))
    lines = err.strip().splitlines()
    assert code == 2 and out == "" and len(lines) == 1, err
    assert lines[0].startswith(f"gputrain sweep: error: {tmp_path / 'sweep.toml'}"), lines[0]
    assert re.search(says, lines[0]), lines[0]
    assert not (tmp_path / "s").exists()


@needs_optuna
@pytest.mark.parametrize("argv,text,says", [
    ((), SWEEP.replace('metric = "eval_loss"', 'metric = "accuracy"'),
     r"line 12: \[sweep\] metric 'accuracy' is no value a run reports: runs report loss and eval_\*"),
    ((), SWEEP.split("[sweep.space]")[0], r"the sweep has no search space: add \[sweep.space\]"),
    ((), SWEEP.replace("trials = 8\n", ""), r"a sweep needs a budget: trials = N in \[sweep\], or --trials N"),
    ((), SWEEP.replace("[sweep]\n", "[sweep]\npatience = 3\n"), r"unknown key 'patience' in \[sweep\]"),
    ((), SWEEP.replace("[sweep]\n", '[sweep]\npruner = "hyperband"\n'), r"pruner must be 'median' or 'none'"),
    ((), SWEEP.replace('device = "cpu"', 'device = "cpu"\nrun_dir = "runs/x"'), r"\[train\] run_dir: a sweep puts"),
    ((), SWEEP.replace("[sweep]", "[fit]\nnproc = 2\n[sweep]"), r"\[fit\] nproc: a trial trains in one process"),
    (("nosuch-workload",), SWEEP, r"unknown workload 'nosuch-workload'"),
    ((), SWEEP.replace('workload = "iris-mlp"\n', ""), r"a sweep needs a workload"),
])
def test_a_bad_sweep_config_is_one_line_and_writes_nothing(argv, text, says, tmp_path, capsys):
    (tmp_path / "sweep.toml").write_text(text)
    code, out, err = _cli(capsys, "sweep", *argv, "--config", str(tmp_path / "sweep.toml"), "--sweep-dir",
                          str(tmp_path / "s"))
    lines = err.strip().splitlines()
    assert code == 2 and out == "" and len(lines) == 1, err
    assert re.search(says, lines[0]), lines[0]
    assert not (tmp_path / "s").exists()


def test_the_sweep_flags_are_its_settings_fields_and_refuse_as_the_file_does():
    """`gputrain sweep`'s flags are generated from SweepSettings' fields (as fit's from the run spec):
    each sets its [sweep] key, an absent flag states nothing, and a value is refused by the same
    check that refuses it in [sweep], whether it came from the file or the command line."""
    import argparse
    import dataclasses

    from gputrain.commands.sweep import add_arguments
    from gputrain.errors import ConfigError
    from gputrain.fields import flags_of
    from gputrain.runs.flags import given
    from gputrain.runs.stated import RunConfig
    from gputrain.sweeps.settings import SweepSettings, check_sweep

    p = argparse.ArgumentParser()
    add_arguments(p)
    dests = {a.dest: a.option_strings for a in p._actions}
    flagged = [f for f in dataclasses.fields(SweepSettings) if flags_of(f)]
    assert {f.name for f in flagged} == {"trials", "workers", "metric", "direction", "sweep_dir", "storage", "study"}
    for f in flagged:
        assert dests[f.name] == list(flags_of(f)[0].names), f.name
    assert given(p.parse_args([]), SweepSettings) == {}
    assert given(p.parse_args(["--trials", "3", "--direction", "max"]), SweepSettings) == {"trials": 3, "direction": "max"}
    rc = RunConfig(workload="iris-mlp", sweep={"trials": 2, "direction": "up", "space": {"lr": {"uniform": [0.1, 0.2]}}})
    with pytest.raises(ConfigError, match=r"^the config: \[sweep\] direction must be 'min' or 'max', got 'up'$"):
        check_sweep(rc)
    rc.sweep = {"trials": 2, "space": {"lr": {"uniform": [0.1, 0.2]}}}
    with pytest.raises(ConfigError, match=r"^the command line: \[sweep\] direction must be 'min' or 'max', got 'up'$"):
        check_sweep(rc, {"direction": "up"})
    assert check_sweep(rc, {"workers": 3}).table()["workers"] == 3


def test_a_metric_from_the_command_line_is_blamed_on_the_flag_not_the_file(tmp_path, capsys):
    (tmp_path / "sweep.toml").write_text(SWEEP)
    code, _, err = _cli(capsys, "sweep", "--config", str(tmp_path / "sweep.toml"), "--sweep-dir", str(tmp_path / "s"),
                        "--metric", "accuracy")
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert "error: --metric accuracy is no value a run reports" in err and "line 12" not in err, err
    assert not (tmp_path / "s").exists()


@needs_optuna
def test_a_folder_that_holds_no_sweep_is_refused(tmp_path, capsys):
    (tmp_path / "sweep.toml").write_text(SWEEP)
    for folder, says in ((tmp_path / "full", r"is not empty and holds no sweep \(no sweep.toml\)"),
                         (tmp_path / "foreign", r"holds a study.db that gputrain sweep did not make")):
        folder.mkdir()
        (folder / ("notes.txt" if folder.name == "full" else "study.db")).write_text("not mine\n")
        before = _snapshot(folder)
        code, _, err = _cli(capsys, "sweep", "--config", str(tmp_path / "sweep.toml"), "--sweep-dir", str(folder))
        assert code == 2 and re.search(says, err) and len(err.strip().splitlines()) == 1, err
        assert _snapshot(folder) == before
    code, _, err = _cli(capsys, "sweep", "--sweep-dir", str(tmp_path / "nothing-here"))
    assert code == 2 and "give a sweep's config (--config FILE), or --sweep-dir of a sweep to resume" in err


def test_the_default_folder_is_named_for_the_config_so_the_same_command_resumes(tmp_path, monkeypatch):
    from gputrain.sweeps.runner import plan_sweep

    monkeypatch.chdir(tmp_path)
    (tmp_path / "lr-search.toml").write_text(SWEEP)
    plan = plan_sweep(tmp_path / "lr-search.toml")
    assert plan.sweep_dir == Path("sweeps") / "lr-search" and not plan.resumed and not (tmp_path / "sweeps").exists()
    tree = {"workload": "iris-mlp", "train": {"steps": 5}, "sweep": {"trials": 2, "space": {"lr": {"choices": [0.1]}}}}
    assert plan_sweep(tree).sweep_dir == Path("sweeps") / "iris-mlp"


@pytest.mark.processes
def test_optuna_is_imported_only_when_a_sweep_runs():
    code = "import sys, gputrain; gputrain.sweep; gputrain.SweepResult; print('optuna' in sys.modules)"
    proc = subprocess.run([sys.executable, "-c", code], env=subprocess_env(), capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0 and proc.stdout.strip() == "False", proc.stderr[-2000:]


def test_without_optuna_the_sweep_says_how_to_install_it(monkeypatch, tmp_path, capsys):
    monkeypatch.setitem(sys.modules, "optuna", None)  # import optuna raises ImportError (after the plan passed)
    (tmp_path / "sweep.toml").write_text(SWEEP)
    code, _, err = _cli(capsys, "sweep", "--config", str(tmp_path / "sweep.toml"), "--sweep-dir", str(tmp_path / "s"))
    assert code == 2 and "needs Optuna: pip install 'gputrain[sweep]'" in err and not (tmp_path / "s").exists()


# ---------------------------------------------------------------- workers: one per GPU, never two on one


def test_workers_take_one_gpu_each_and_never_share_one(fake_cuda, monkeypatch):
    from gputrain.errors import ConfigError
    from gputrain.sweeps.runner import visible_gpus, worker_slots

    fake_cuda(count=2)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    assert visible_gpus() == ["0", "1"]
    assert worker_slots("auto", None) == [{"CUDA_VISIBLE_DEVICES": "0"}, {"CUDA_VISIBLE_DEVICES": "1"}]
    assert worker_slots("cuda", 1) == [{"CUDA_VISIBLE_DEVICES": "0"}]
    with pytest.raises(ConfigError, match=r"workers = 3, but this machine has 2 GPUs: a sweep runs one trial per "
                                          r"GPU, never two on one"):
        worker_slots("auto", 3)
    with pytest.raises(ConfigError, match=r"device = 'cuda:1' puts every trial on one GPU"):
        worker_slots("cuda:1", 2)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "5,7")  # the GPUs this process may use, by their names
    assert worker_slots("auto", None) == [{"CUDA_VISIBLE_DEVICES": "5"}, {"CUDA_VISIBLE_DEVICES": "7"}]
    monkeypatch.setattr(os, "cpu_count", lambda: 8)
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    assert worker_slots("cpu", 4) == [{"OMP_NUM_THREADS": "2", "MKL_NUM_THREADS": "2"}] * 4  # CPU: a share each
    assert worker_slots("cpu", None) == [{"OMP_NUM_THREADS": "8", "MKL_NUM_THREADS": "8"}]
    assert worker_slots("auto", 2, cuda_devices=[]) == [{"OMP_NUM_THREADS": "4", "MKL_NUM_THREADS": "4"}] * 2
    with pytest.raises(ConfigError, match=r"device = 'cuda', but no CUDA GPU is visible here"):
        worker_slots("cuda", None, cuda_devices=[])


def test_more_cpu_workers_than_cores_is_refused_before_a_slot_is_made(monkeypatch):
    """workers = 10**20 on the CPU is one line, not a list of 10**20 environments filling the memory."""
    from gputrain.errors import ConfigError
    from gputrain.sweeps.runner import worker_slots

    monkeypatch.setattr(os, "cpu_count", lambda: 4)
    for workers in (5, 10**20):
        with pytest.raises(ConfigError, match=rf"workers = {workers}, but this machine has 4 CPU cores"):
            worker_slots("cpu", workers, cuda_devices=[])
    assert len(worker_slots("cpu", 4, cuda_devices=[])) == 4


# ---------------------------------------------------------------- pruning through the callback interface


class FakeTrial:
    """Optuna's Trial as the reporter uses it: report() and should_prune() (prune at the 2nd report)."""

    def __init__(self, prune_at: int | None):
        self.reports: list[tuple[int, float]] = []
        self.prune_at = prune_at

    def report(self, value: float, step: int) -> None:
        self.reports.append((step, value))

    def should_prune(self) -> bool:
        return self.prune_at is not None and len(self.reports) >= self.prune_at


def test_the_reporter_reports_evaluations_and_prunes_with_no_extra_host_reads():
    import gputrain
    from gputrain.diagnostics.syncs import count_host_reads
    from gputrain.sweeps.trial import TrialReporter

    g = torch.Generator().manual_seed(0)
    x = torch.randn(256, 8, generator=g)
    y = (x[:, 0] > 0).long()

    def run(callbacks):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 2))
        return gputrain.fit(model, (x, y), loss_fn=nn.CrossEntropyLoss(), eval_data=(x[:64], y[:64]),
                            callbacks=callbacks, config=gputrain.TrainConfig(device="cpu", batch_size=32, steps=40,
                                                                             log_every=5, eval_every=10))

    watch = TrialReporter(FakeTrial(prune_at=None), "eval_loss")
    plain = count_host_reads(lambda: run([]), steps=1)
    reported = count_host_reads(lambda: run([watch]), steps=1)
    assert plain["total"] == reported["total"], (plain["sites"], reported["sites"])
    assert [s for s, _ in watch.trial.reports] == [10, 20, 30, 40]  # the evaluations, not every log point
    assert watch.pruned_at is None and watch.records is not None

    from gputrain.train.loop.callbacks import CallbackList

    assert CallbackList([watch]).per_step == []  # log points only: the CUDA-graph decision is the same

    pruned = TrialReporter(FakeTrial(prune_at=2), "eval_loss")
    history = run([pruned])
    assert pruned.pruned_at == 20 and history.summary["steps"] == 20
    assert "pruned by the sweep: eval_loss" in history.summary["stopped_by"]


def test_a_trials_value_is_its_final_or_its_best_evaluation():
    from gputrain.sweeps.trial import reported_keys, trial_value

    records = [{"loss": 1.0}, {"loss": 0.8, "eval_loss": 0.5}, {"loss": 0.7, "eval_loss": 0.6, "eval_accuracy": 0.9}]
    assert trial_value(records, "eval_loss", "final", "min") == 0.6
    assert trial_value(records, "eval_loss", "best", "min") == 0.5
    assert trial_value(records, "eval_loss", "best", "max") == 0.6
    assert trial_value(records, "eval_f1", "final", "min") is None
    assert reported_keys(records) == ["eval_accuracy", "eval_loss", "loss"]


def test_the_sweep_page_shows_every_trial_and_the_best_so_far():
    from gputrain.report.sweep_page import best_so_far, render_sweep_page

    rows = [{"number": 0, "state": "complete", "value": 0.9, "params": {"lr": 0.01}, "last_step": 20, "seconds": 1.0,
             "run_dir": "trials/trial-0000", "error": None, "retry_of": None},
            {"number": 1, "state": "pruned", "value": 1.5, "params": {"lr": 0.1}, "last_step": 5, "seconds": 0.4,
             "run_dir": "trials/trial-0001", "error": None, "retry_of": None},
            {"number": 2, "state": "fail", "value": None, "params": {"lr": 0.02}, "last_step": None, "seconds": None,
             "run_dir": "trials/trial-0002", "error": None, "retry_of": None},
            {"number": 3, "state": "complete", "value": 0.7, "params": {"lr": 0.02}, "last_step": 20, "seconds": 1.1,
             "run_dir": "trials/trial-0003", "error": None, "retry_of": 2},
            {"number": 4, "state": "complete", "value": 0.8, "params": {"lr": 0.03}, "last_step": 20, "seconds": 1.2,
             "run_dir": "trials/trial-0004", "error": None, "retry_of": None}]
    assert best_so_far(rows, "min") == [(0, 0.9), (3, 0.7), (4, 0.7)]
    assert best_so_far(rows, "max") == [(0, 0.9), (3, 0.9), (4, 0.9)]
    page = render_sweep_page(rows, name="iris-mlp", metric="eval_loss", direction="min", budget=4, sweep_dir="s",
                             space={"lr": {"loguniform": [1e-4, 0.1]}})
    assert "trial 3: eval_loss 0.7 with lr = 0.02" in page and "<img src='data:image/png;base64," in page
    assert "interrupted: runs again on resume" in page and "runs trial 2 again" in page
    assert page.count("<tr>") == 1 + 5 + 1  # the header, a row per trial, the space's one row
    assert "<script" not in page


# ---------------------------------------------------------------- the docs' example


@pytest.mark.processes
@needs_optuna
def test_the_sweep_example_runs_and_is_the_one_the_docs_show(tmp_path, monkeypatch, capsys):
    import runpy
    import shutil

    root = Path(__file__).resolve().parents[1]
    section = docs_page("how-to/sweeps.md")
    for name, lang in (("sweep.toml", "toml"), ("sweep_from_python.py", "python")):
        source = (root / "docs" / "examples" / name).read_text().strip()
        assert f"```{lang}\n{source}\n```" in section, f"docs/how-to/sweeps.md does not show docs/examples/{name}"
    shutil.copytree(root / "docs" / "examples", tmp_path / "docs" / "examples")
    monkeypatch.chdir(tmp_path)
    runpy.run_path(str(tmp_path / "docs" / "examples" / "sweep_from_python.py"), run_name="__main__")
    printed = capsys.readouterr().out
    assert re.search(r"best trial \d: eval_loss [0-9.]+ with \{'lr': [0-9.e-]+, 'weight_decay': [0-9.]+\}", printed)
    assert "4 trials in the study" in printed and (tmp_path / "sweeps" / "iris-lr" / "report.html").is_file()


@pytest.mark.processes
@needs_optuna
def test_a_local_sweeps_study_may_be_named_and_resumes_under_its_name(tmp_path):
    """--study NAME without --storage: the study in SWEEP_DIR/study.db is named so, and a resume
    (the folder alone) finds it under that name."""
    import optuna

    import gputrain

    (tmp_path / "sweep.toml").write_text(SWEEP.replace("trials = 8", "trials = 1").replace("workers = 2", "workers = 1"))
    first = gputrain.sweep(tmp_path / "sweep.toml", sweep_dir=tmp_path / "s", study="lr-search")
    assert first.study_name == "lr-search" and 'study = "lr-search"' in (tmp_path / "s" / "sweep.toml").read_text()
    more = gputrain.sweep(sweep_dir=tmp_path / "s", trials=2)
    assert [r["number"] for r in more.trials] == [0, 1]
    study = optuna.load_study(study_name="lr-search", storage=f"sqlite:///{tmp_path / 's' / 'study.db'}")
    assert len(study.trials) == 2 and more.best_trial == study.best_trial.number
