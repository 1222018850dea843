"""Sweeps beyond one machine: `gputrain sweep --storage URL --study NAME` on a real PostgreSQL server
(started here, tests/postgres_server.py), every sweep command a worker pool of its own "machine" (its
own --sweep-dir), and the faults a shared study must survive: a sweep killed with -9 mid-trial (its
trial failed by the heartbeat and run again by the other), the server restarted mid-sweep, a
joiner with another search space, a wrong password, a missing database; and the password kept out
of every file the sweep writes and everything it prints. A journal file is the other shared store.

Trials train iris-mlp for 20 steps on the CPU; the heartbeat is 2 s ([sweep] heartbeat), so that a
dead worker's trial is failed within 3 heartbeats of its last one (6 s) plus one heartbeat for a
live worker to look: the tests hold it to 12 s (8 s and slack for a loaded machine).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from helpers import subprocess_env
from mysql_server import MysqlServer, find_binaries as find_mysql
from postgres_server import PostgresServer, find_binaries

HAS_OPTUNA = __import__("importlib.util").util.find_spec("optuna") is not None
HAS_PSYCOPG = __import__("importlib.util").util.find_spec("psycopg") is not None
HAS_PYMYSQL = __import__("importlib.util").util.find_spec("pymysql") is not None
pytestmark = pytest.mark.skipif(not HAS_OPTUNA, reason="needs Optuna (pip install 'gputrain[sweep]')")

HEARTBEAT = 2
STALE_WITHIN_S = 3 * HEARTBEAT + HEARTBEAT + 4  # grace (3 beats) + a live worker's look (1 beat) + slack
SWEEP = f'''workload = "iris-mlp"

[train]
steps = 20
log_every = 5
device = "cpu"
loggers = ["csv"]

[sweep]
trials = 6
workers = 1
pruner = "none"
heartbeat = {HEARTBEAT}

[sweep.space]
lr = {{loguniform = [1e-4, 1e-1]}}
weight_decay = {{uniform = [0.0, 0.1], step = 0.01}}
'''


def _throwaway_server(find, has_driver: bool, no_driver: str, start):
    """A fixture's body: a server of its own for the session's tests (skipped with the reason where its
    binaries or its driver are missing), removed afterwards."""
    binaries, why = find()
    if binaries is None:
        pytest.skip(why)
    if not has_driver:
        pytest.skip(no_driver)
    server = start()
    try:
        yield server
    finally:
        server.remove()


@pytest.fixture(scope="session")
def postgres():
    yield from _throwaway_server(find_binaries, HAS_PSYCOPG, "needs psycopg, PostgreSQL's driver (pip install "
                                 "'gputrain[postgres]')", PostgresServer.start_new)


@pytest.fixture(scope="session")
def mysql():
    yield from _throwaway_server(find_mysql, HAS_PYMYSQL, "needs PyMySQL, the MySQL driver gputrain names (pip "
                                 "install 'gputrain[mysql]')", MysqlServer.start_new)


def _sweep(cwd: Path, *argv: str, env: dict[str, str] | None = None, **popen) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "gputrain", "sweep", *argv], cwd=cwd,
                            env=subprocess_env(COLUMNS="250", **(env or {})), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True, **popen)


def _study(url: str, name: str = "gputrain"):
    import optuna

    optuna.logging.set_verbosity(optuna.logging.WARNING)  # postgresql:// is psycopg2 to SQLAlchemy: name psycopg (3)
    return optuna.load_study(study_name=name, storage=url.replace("postgresql://", "postgresql+psycopg://"))


def _states(url: str) -> list:
    try:
        return _study(url).get_trials()
    except KeyError:  # not made yet
        return []


def _wait_for(what: str, check, timeout: float, procs=()) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for p in procs:
            if p.poll() is not None:
                pytest.fail(f"a sweep ended before {what}: {p.stderr.read()[-3000:]}")
        if check():
            return
        time.sleep(0.2)
    pytest.fail(f"no {what} in {timeout} s")


def _kill(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


def _written(folder: Path) -> str:
    """Every file under `folder`, as text (bytes that are not UTF-8 replaced): what a grep reads."""
    return "\n".join(p.read_bytes().decode("utf-8", "replace") for p in sorted(folder.rglob("*")) if p.is_file())


def _kill_a_mid_trial(a: subprocess.Popen, b: subprocess.Popen, trials, here: dict[str, str]):
    """Kill sweep A (process group, -9) once A and B each have a trial running; wait for B to end.
    Returns (A's trials that were running, the kill's time.time(), A's output, B's stdout, B's stderr)."""
    from optuna.trial import TrialState

    try:
        def both() -> bool:
            return {t.user_attrs.get("sweep_dir") for t in trials() if t.state == TrialState.RUNNING} \
                >= set(here.values())

        _wait_for("trials running on both", both, 240, [a, b])
        os.killpg(a.pid, signal.SIGKILL)
        killed_at = time.time()
        a_out, a_err = a.communicate()
        running = [t for t in trials() if t.state == TrialState.RUNNING and t.user_attrs.get("sweep_dir") == here["a"]]
        b_out, b_err = b.communicate(timeout=400)
    finally:
        _kill(a)
        _kill(b)
    assert running, "A was killed between two trials"
    assert b.returncode == 0, b_err[-3000:]
    return running, killed_at, a_out + a_err, b_out, b_err


def _check_retried(trials: list, running: list, killed_at: float, here: dict[str, str], budget: int) -> list:
    """The study after the kill: `budget` trials finished, none running or waiting; each of A's
    running trials failed by the heartbeat within STALE_WITHIN_S of the kill (no error of its own) and
    run again once, with its parameters, by B. Returns the finished trials."""
    from optuna.trial import TrialState

    finished = [t for t in trials if t.state in (TrialState.COMPLETE, TrialState.PRUNED)]
    assert len(finished) == budget, [(t.number, t.state) for t in trials]
    assert not [t for t in trials if t.state in (TrialState.RUNNING, TrialState.WAITING)]
    for dead in running:
        failed = next(t for t in trials if t.number == dead.number)
        assert failed.state == TrialState.FAIL and "error" not in failed.user_attrs
        # failed by the heartbeat (the test runs on the machine whose clock the heartbeats read)
        took = failed.datetime_complete.timestamp() - killed_at
        assert took <= STALE_WITHIN_S, f"trial {dead.number} was failed {took:.1f} s after the kill"
        print(f"trial {dead.number} of the killed sweep failed by the heartbeat {took:.1f} s after the kill")
        again = [t for t in trials if t.system_attrs.get("failed_trial") == dead.number]
        assert len(again) == 1 and again[0].params == dead.params and again[0].state == TrialState.COMPLETE
        assert again[0].user_attrs["sweep_dir"] == here["b"]  # a live worker: B's
    return finished


# ---------------------------------------------------------------- two machines, one killed with -9


@pytest.mark.processes
def test_two_sweeps_on_one_study_one_killed_with_minus_9_its_trial_retried_by_the_other(postgres, tmp_path):
    """Two sweep commands (two folders: two machines) join one study on PostgreSQL; A is killed with
    -9 while its trial runs. B's worker finds A's trial by the heartbeat (failed within 3 beats + 1),
    runs it again with its parameters, and the study ends with the budget of finished trials, none
    running or waiting; no trial ran twice; B's report lists every trial with its machine, and its
    best trial is the one optuna.load_study names. The password, given to A in the URL and to B in
    GPUTRAIN_SWEEP_STORAGE, is in no file either wrote and nothing either printed."""
    url = postgres.url(postgres.new_database())
    (tmp_path / "sweep.toml").write_text(SWEEP.replace("steps = 20", "steps = 150"))  # trials of a few seconds
    here = {d: str((tmp_path / d).resolve()) for d in "ab"}
    a = _sweep(tmp_path, "--config", "sweep.toml", "--sweep-dir", "a", "--storage", url)
    b = _sweep(tmp_path, "--config", "sweep.toml", "--sweep-dir", "b", "--json", env={"GPUTRAIN_SWEEP_STORAGE": url})
    running, killed_at, a_printed, b_out, b_err = _kill_a_mid_trial(a, b, lambda: _states(url), here)
    study = _study(url)
    trials = study.get_trials()
    finished = _check_retried(trials, running, killed_at, here, budget=6)

    # no trial ran twice: each run directory is in the folder its trial names, and in no other
    ran = {}
    for folder in ("a", "b"):
        for run in (tmp_path / folder / "trials").glob("trial-*"):
            assert run.name not in ran, f"{run.name} ran in both folders"
            ran[run.name] = folder
    for t in finished:
        assert ran[f"trial-{t.number:04d}"] == Path(t.user_attrs["sweep_dir"]).name
        assert t.user_attrs["machine"] and t.user_attrs["run_dir"] == f"trials/trial-{t.number:04d}"

    out = json.loads(b_out)
    assert out["best_trial"] == study.best_trial.number and out["best_params"] == study.best_params
    assert out["storage"] == url.replace(postgres.password, "***").replace("postgresql://", "postgresql+psycopg://")
    assert len([r for r in out["trials"] if r["state"] in ("complete", "pruned")]) == 6
    page = (tmp_path / "b" / "report.html").read_text()
    assert "<th>machine</th>" in page and page.count(f"<td class='n'>{finished[0].user_attrs['machine']}</td>") \
        == len([t for t in trials if t.user_attrs.get("machine")])
    for folder, printed in (("a", a_printed), ("b", b_out + b_err)):
        assert postgres.password not in printed
        assert postgres.password not in _written(tmp_path / folder), f"the password is in a file under {folder}"
    assert "***@127.0.0.1" in a_printed  # shown masked
    recorded = json.dumps([study.user_attrs, [(t.user_attrs, t.system_attrs) for t in trials]], default=str)
    assert postgres.password not in recorded and "gputrain_sweep" in recorded  # nor in what the study records


# ---------------------------------------------------------------- the server restarted mid-sweep


@pytest.mark.processes
def test_the_server_restarted_mid_sweep_the_workers_wait_and_nothing_finished_is_lost(postgres, tmp_path):
    """PostgreSQL stopped and started again while a sweep's two workers train: they wait, reconnect
    (one line each way), and the sweep ends with its budget; every trial finished before the restart
    is there as it was. The password comes from PGPASSWORD (libpq's)."""
    from optuna.trial import TrialState

    db = postgres.new_database()
    url = postgres.url(db, password=False)
    (tmp_path / "sweep.toml").write_text(SWEEP.replace("workers = 1", "workers = 2"))
    proc = _sweep(tmp_path, "--config", "sweep.toml", "--sweep-dir", "s", "--storage", url,
                  env={"PGPASSWORD": postgres.password})
    full = postgres.url(db)
    try:
        def going() -> bool:
            states = [t.state for t in _states(full)]
            return TrialState.COMPLETE in states and TrialState.RUNNING in states

        _wait_for("a finished trial and one running", going, 240, [proc])
        before = {t.number: (t.params, t.value) for t in _states(full) if t.state == TrialState.COMPLETE}
        postgres.stop()
        time.sleep(HEARTBEAT + 1)
        postgres.start()
        out, err = proc.communicate(timeout=400)
    finally:
        _kill(proc)
    assert proc.returncode == 0, err[-3000:]
    trials = _study(full).get_trials()
    assert len([t for t in trials if t.state == TrialState.COMPLETE]) == 6
    assert not [t for t in trials if t.state in (TrialState.RUNNING, TrialState.WAITING)]
    for n, (params, value) in before.items():
        assert (trials[n].state, trials[n].params, trials[n].value) == (TrialState.COMPLETE, params, value)
    assert postgres.password not in out + err and postgres.password not in _written(tmp_path / "s")


@pytest.mark.processes
def test_a_server_that_stays_away_stops_the_sweep_in_one_line(postgres, tmp_path):
    """The server stopped for good mid-sweep: the worker waits 10 heartbeats, then the sweep stops
    with one line saying what to do (exit 2), and the study resumes once the server is back."""
    from optuna.trial import TrialState

    db = postgres.new_database()
    url = postgres.url(db)
    (tmp_path / "sweep.toml").write_text(SWEEP.replace(f"heartbeat = {HEARTBEAT}", "heartbeat = 1"))
    proc = _sweep(tmp_path, "--config", "sweep.toml", "--sweep-dir", "s", "--storage", url, "--quiet")
    try:
        _wait_for("a running trial", lambda: any(t.state == TrialState.RUNNING for t in _states(url)), 240, [proc])
        postgres.stop()
        started = time.monotonic()
        out, err = proc.communicate(timeout=300)
        took = time.monotonic() - started
    finally:
        _kill(proc)
        postgres.start()
    lines = [line for line in err.splitlines() if line.strip()]
    assert proc.returncode == 2 and len(lines) == 1, err[-3000:]
    assert re.match(r"gputrain sweep: error: lost the study's database postgresql\+psycopg://gputrain:\*\*\*@"
                    rf"127\.0\.0\.1:\d+/{db} for 10 s while .*: start it again, then run the same command to resume",
                    lines[0]), lines[0]
    assert took < 120, took
    assert postgres.password not in out + err


# ---------------------------------------------------------------- refused before a trial runs


@pytest.mark.processes
def test_a_joiner_with_another_search_space_or_workload_is_refused_before_any_trial(postgres, tmp_path):
    from optuna.trial import TrialState

    url = postgres.url(postgres.new_database())
    (tmp_path / "sweep.toml").write_text(SWEEP.replace("trials = 6", "trials = 1"))
    first = subprocess.run([sys.executable, "-m", "gputrain", "sweep", "--config", "sweep.toml", "--sweep-dir", "a",
                            "--storage", url, "--quiet"], cwd=tmp_path, env=subprocess_env(), capture_output=True,
                           text=True, timeout=300)
    assert first.returncode == 0, first.stderr[-3000:]
    for name, text, says in (
            ("space", SWEEP.replace("loguniform = [1e-4, 1e-1]", "loguniform = [1e-3, 1e-1]"),
             r"it differs in sweep\.space\.lr\.loguniform"),
            ("workload", SWEEP.replace('"iris-mlp"', '"linear-regression"'), r"it differs in workload")):
        (tmp_path / f"{name}.toml").write_text(text)
        proc = subprocess.run([sys.executable, "-m", "gputrain", "sweep", "--config", f"{name}.toml", "--sweep-dir",
                               name, "--storage", url], cwd=tmp_path, env=subprocess_env(), capture_output=True,
                              text=True, timeout=300)
        lines = [line for line in proc.stderr.splitlines() if line.strip()]
        assert proc.returncode == 2 and len(lines) == 1 and proc.stdout == "", proc.stderr[-3000:]
        assert re.search(rf"the study 'gputrain' in postgresql\+psycopg://gputrain:\*\*\*@127\.0\.0\.1:\d+/\w+ runs "
                         rf"another sweep \({says}", lines[0]), lines[0]
        assert not (tmp_path / name).exists()  # nothing written
    assert [t.state for t in _study(url).get_trials()] == [TrialState.COMPLETE]  # no trial of theirs


@pytest.mark.processes
@pytest.mark.parametrize("case", ["wrong-password", "no-such-database"])
def test_a_wrong_password_or_a_missing_database_is_one_line_and_writes_nothing(postgres, tmp_path, case):
    (tmp_path / "sweep.toml").write_text(SWEEP)
    url = postgres.url("postgres").replace(postgres.password, "not-the-password") if case == "wrong-password" \
        else postgres.url("no_such_database")
    proc = subprocess.run([sys.executable, "-m", "gputrain", "sweep", "--config", "sweep.toml", "--sweep-dir", "s",
                           "--storage", url], cwd=tmp_path, env=subprocess_env(), capture_output=True, text=True,
                          timeout=300)
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert proc.returncode == 2 and len(lines) == 1 and proc.stdout == "", proc.stderr[-3000:]
    says = (r"password authentication failed for user \"gputrain\"\): check the user and its password"
            if case == "wrong-password" else
            r"database \"no_such_database\" does not exist\): create the database first")
    assert re.search(r"--storage postgresql\+psycopg://gputrain:\*\*\*@127\.0\.0\.1:\d+/\w+: cannot connect \(.*"
                     + says, lines[0]), lines[0]
    assert "not-the-password" not in proc.stderr and postgres.password not in proc.stderr
    assert not (tmp_path / "s").exists()


# ---------------------------------------------------------------- MySQL (MariaDB): the same study on its server


@pytest.mark.processes
def test_two_sweeps_on_a_mysql_study_one_killed_with_minus_9_its_trial_retried_by_the_other(mysql, tmp_path):
    """The kill of the PostgreSQL test on MariaDB (mysql://, PyMySQL): A killed with -9 mid-trial, its
    trial failed by Optuna's heartbeat within 3 beats + 1 and run again by B with its parameters, the
    budget reached with none running or waiting; the password (A's URL, B's GPUTRAIN_SWEEP_STORAGE) in
    nothing either printed or wrote."""
    import optuna

    url = mysql.url(mysql.new_database())
    (tmp_path / "sweep.toml").write_text(SWEEP.replace("steps = 20", "steps = 150").replace("trials = 6", "trials = 4"))
    here = {d: str((tmp_path / d).resolve()) for d in "ab"}

    def trials() -> list:
        try:
            storage = url.replace("mysql://", "mysql+pymysql://")
            return optuna.load_study(study_name="gputrain", storage=storage).get_trials()
        except KeyError:  # not made yet
            return []

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    a = _sweep(tmp_path, "--config", "sweep.toml", "--sweep-dir", "a", "--storage", url)
    b = _sweep(tmp_path, "--config", "sweep.toml", "--sweep-dir", "b", env={"GPUTRAIN_SWEEP_STORAGE": url})
    running, killed_at, a_printed, b_out, b_err = _kill_a_mid_trial(a, b, trials, here)
    _check_retried(trials(), running, killed_at, here, budget=4)
    for folder, printed in (("a", a_printed), ("b", b_out + b_err)):
        assert mysql.password not in printed
        assert mysql.password not in _written(tmp_path / folder), f"the password is in a file under {folder}"
    assert "gputrain:***@127.0.0.1" in a_printed  # shown masked


@pytest.mark.processes
def test_a_wrong_password_or_a_missing_database_on_mysql_is_one_line_and_writes_nothing(mysql, tmp_path):
    (tmp_path / "sweep.toml").write_text(SWEEP)
    for url, says in ((mysql.url(mysql.new_database()).replace(mysql.password, "not-the-password"),
                       r"Access denied for user 'gputrain'.*\): check the user and its password"),
                      (mysql.url("no_such_database"),
                       r"Unknown database 'no_such_database'.*\): create the database first")):
        proc = subprocess.run([sys.executable, "-m", "gputrain", "sweep", "--config", "sweep.toml", "--sweep-dir", "s",
                               "--storage", url], cwd=tmp_path, env=subprocess_env(), capture_output=True, text=True,
                              timeout=300)
        lines = [line for line in proc.stderr.splitlines() if line.strip()]
        assert proc.returncode == 2 and len(lines) == 1 and proc.stdout == "", proc.stderr[-3000:]
        assert re.search(r"--storage mysql\+pymysql://gputrain:\*\*\*@127\.0\.0\.1:\d+/\w+: cannot connect \(.*"
                         + says, lines[0]), lines[0]
        assert "not-the-password" not in proc.stderr and mysql.password not in proc.stderr
        assert not (tmp_path / "s").exists()


# ---------------------------------------------------------------- the password from a .pgpass; a journal file


@pytest.mark.processes
def test_the_password_from_a_pgpass_file_is_used_and_written_nowhere(postgres, tmp_path):
    db = postgres.new_database()
    pgpass = tmp_path / "pgpass"
    pgpass.write_text(f"127.0.0.1:{postgres.port}:{db}:gputrain:{postgres.password}\n")
    pgpass.chmod(0o600)  # libpq ignores a .pgpass that others may read
    (tmp_path / "sweep.toml").write_text(SWEEP.replace("trials = 6", "trials = 1"))
    proc = subprocess.run([sys.executable, "-m", "gputrain", "sweep", "--config", "sweep.toml", "--sweep-dir", "s",
                           "--storage", postgres.url(db, password=False)], cwd=tmp_path,
                          env=subprocess_env(PGPASSFILE=str(pgpass)), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"storage = \"postgresql+psycopg://gputrain@127.0.0.1:{postgres.port}/{db}\"" in \
        (tmp_path / "s" / "sweep.toml").read_text()
    pgpass.unlink()
    assert postgres.password not in proc.stdout + proc.stderr and postgres.password not in _written(tmp_path / "s")
    assert len(_study(postgres.url(db)).get_trials()) == 1


@pytest.mark.processes
def test_a_journal_file_is_a_study_that_two_folders_share(tmp_path):
    """Optuna's JournalStorage (a file on a shared filesystem): a second folder joins the first's
    study and raises its budget; each trial runs in the folder of the command that ran it."""
    journal = tmp_path / "shared" / "lr.journal"
    journal.parent.mkdir()
    (tmp_path / "sweep.toml").write_text(SWEEP.replace("trials = 6", "trials = 2"))
    for folder, trials in (("a", "2"), ("b", "3")):
        proc = subprocess.run([sys.executable, "-m", "gputrain", "sweep", "--config", "sweep.toml", "--sweep-dir",
                               folder, "--storage", str(journal), "--trials", trials, "--json"], cwd=tmp_path,
                              env=subprocess_env(), capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, proc.stderr[-3000:]
    import optuna
    from optuna.storages.journal import JournalFileBackend

    storage = optuna.storages.JournalStorage(JournalFileBackend(str(journal)))
    study = optuna.load_study(study_name="gputrain", storage=storage)
    assert [t.user_attrs["sweep_dir"] for t in study.get_trials()] == [str((tmp_path / d).resolve()) for d in "aab"]
    assert json.loads(proc.stdout)["best_trial"] == study.best_trial.number

    # A's page was written before B joined: `gputrain report --sweep a` reads the study again
    assert "2 of 2" in (tmp_path / "a" / "report.html").read_text()
    proc = subprocess.run([sys.executable, "-m", "gputrain", "report", "--sweep", "a"], cwd=tmp_path,
                          env=subprocess_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and proc.stdout.startswith(f"report: a/report.html"), proc.stderr[-3000:]
    page = (tmp_path / "a" / "report.html").read_text()
    assert "<th>machine</th>" in page and "3 of 3" in page and "b/trials/trial-0002" in page
    assert "<a href='trials/trial-0000/report.html'>" in page and "href='trials/trial-0002" not in page


@pytest.mark.processes
def test_a_journal_sweep_killed_with_minus_9_has_its_trial_retried_by_the_other_by_heartbeat(tmp_path):
    """The same fault on a journal file (Optuna's JournalStorage keeps no heartbeats; gputrain's are
    trial system attrs through Optuna's BaseHeartbeat, sweeps/storage.py): A killed with -9 mid-trial,
    its trial failed within 3 beats + 1 and run again with its parameters by B, the budget reached
    with none running or waiting."""
    import optuna
    from optuna.storages.journal import JournalFileBackend

    journal = tmp_path / "lr.journal"
    (tmp_path / "sweep.toml").write_text(SWEEP.replace("steps = 20", "steps = 150").replace("trials = 6", "trials = 4"))
    here = {d: str((tmp_path / d).resolve()) for d in "ab"}

    def trials() -> list:
        if not journal.exists():
            return []
        try:
            storage = optuna.storages.JournalStorage(JournalFileBackend(str(journal)))
            return optuna.load_study(study_name="gputrain", storage=storage).get_trials()
        except KeyError:  # not made yet
            return []

    a = _sweep(tmp_path, "--config", "sweep.toml", "--sweep-dir", "a", "--storage", str(journal))
    b = _sweep(tmp_path, "--config", "sweep.toml", "--sweep-dir", "b", "--storage", str(journal))
    running, killed_at, _, _, _ = _kill_a_mid_trial(a, b, trials, here)
    _check_retried(trials(), running, killed_at, here, budget=4)


def test_a_journal_trial_is_stale_after_the_grace_period_of_its_last_heartbeat_and_not_before(tmp_path, monkeypatch):
    """The journal's heartbeat rule, as RDBStorage's: a running trial whose last beat is older than the
    grace period is stale; a fresh beat, a finished trial and a trial that never beat are not."""
    import optuna

    from gputrain.sweeps import storage as stores

    place = stores.resolve(str(tmp_path / "lr.journal"), "gputrain", 2, tmp_path)
    storage = stores.open_storage(place)
    study = optuna.create_study(study_name="gputrain", storage=storage)
    beating, silent, done = study.ask(), study.ask(), study.ask()
    study.tell(done, 1.0)
    now = [1000.0]
    monkeypatch.setattr(stores.time, "time", lambda: now[0])
    for t in (beating, done):
        with contextlib.suppress(Exception):  # a finished trial takes no beat
            storage.record_heartbeat(t._trial_id)
    now[0] += 3 * 2  # the grace period (3 beats of 2 s): not yet
    assert storage._get_stale_trial_ids(study._study_id) == []
    now[0] += 0.5
    assert storage._get_stale_trial_ids(study._study_id) == [beating._trial_id]
    with stores.quiet_experimental():
        optuna.storages.fail_stale_trials(study)
    states = {t.number: t.state for t in study.get_trials()}
    assert states[beating.number] == optuna.trial.TrialState.FAIL
    assert states[silent.number] == optuna.trial.TrialState.RUNNING  # left to the worker's own rule
    retried = [t for t in study.get_trials() if t.system_attrs.get("failed_trial") == beating.number]
    assert len(retried) == 1 and retried[0].state == optuna.trial.TrialState.WAITING


# ---------------------------------------------------------------- the budget when two machines ask at once


def test_a_trial_asked_past_the_budget_by_two_machines_at_once_is_given_back_unrun():
    """The race no lock covers on a shared study: two workers count 1 finished of a budget of 2, and
    both ask. The one whose trial is numbered second gives it back unrun (failed, over_budget, not in
    the report) and waits; the budget is never passed. And the rules around it: with finished +
    running at the budget a worker on a server waits (a running trial may be a dead worker's), one on
    SQLite stops; with the finished trials at the budget, every worker stops."""
    import contextlib

    import optuna
    from optuna.distributions import FloatDistribution
    from optuna.trial import TrialState

    from gputrain.sweeps import study as studies
    from gputrain.sweeps.storage import Place
    from gputrain.sweeps.trial import _claim

    space = {"lr": FloatDistribution(1e-4, 1e-1, log=True)}
    study = optuna.create_study()
    study.set_user_attr(studies.BUDGET_ATTR, 2)
    study.add_trial(optuna.create_trial(params={"lr": 0.01}, distributions=space, value=1.0))

    class OtherMachineAsksFirst:  # the study as a worker sees it, another machine's ask landing before its own
        def __getattr__(self, name):
            return getattr(study, name)

        def ask(self, distributions):
            study.ask(distributions)
            return study.ask(distributions)

    server, sqlite = Place("rdb", "postgresql+psycopg://u@h/db", "s", 1), Place("sqlite", "sqlite:///x", "s")
    claim = (lambda who, place: _claim(who, place, 5, space, contextlib.nullcontext, lambda: None, TrialState))
    assert claim(OtherMachineAsksFirst(), server) == "wait"
    mine = study.trials[-1]
    assert mine.state == TrialState.FAIL and mine.user_attrs == {"over_budget": True}
    assert [t.state for t in study.trials] == [TrialState.COMPLETE, TrialState.RUNNING, TrialState.FAIL]
    assert not studies.interrupted(mine)  # never queued again
    assert [r["number"] for r in studies.trial_rows(server, study, "eval_loss")] == [0, 1]
    assert claim(study, server) == "wait" and claim(study, sqlite) is None  # 1 finished + 1 running: the budget
    study.tell(1, 0.5)
    assert claim(study, server) is None and len(study.trials) == 3  # 2 finished: done, nothing asked


def test_a_trial_whose_worker_died_before_its_first_heartbeat_is_failed_and_run_again_by_a_waiting_worker():
    """A worker killed between its ask and its first heartbeat leaves a running trial that the
    heartbeat never finds (it has none) and that never said where it runs: a worker waiting at the
    budget fails it after 3 heartbeats of its own clock and queues it again, once."""
    import contextlib

    import optuna
    from optuna.distributions import FloatDistribution
    from optuna.trial import TrialState

    from gputrain.sweeps import study as studies
    from gputrain.sweeps.storage import Place
    from gputrain.sweeps.trial import _claim

    space = {"lr": FloatDistribution(1e-4, 1e-1, log=True)}
    study = optuna.create_study()
    study.set_user_attr(studies.BUDGET_ATTR, 3)
    study.add_trial(optuna.create_trial(params={"lr": 0.01}, distributions=space, value=1.0))
    orphan = study.ask(space)  # its worker died here: no heartbeat, no run_dir of its own
    alive = study.ask(space)
    alive.set_user_attr("run_dir", f"trials/trial-{alive.number:04d}")  # a live worker's trial, said where it runs
    orphan.set_user_attr("run_dir", "trials/trial-0000")  # a retry's, carried from the trial it runs again
    server = Place("rdb", "postgresql+psycopg://u@h/db", "s", heartbeat=1)
    unheard: dict[int, float] = {}
    claim = (lambda: _claim(study, server, 3, space, contextlib.nullcontext, lambda: None, TrialState, unheard))
    assert claim() == "wait" and study.trials[orphan.number].state == TrialState.RUNNING  # seen, not yet failed
    assert claim() == "wait"  # a second look within the grace: still running
    unheard[orphan.number] -= 3.5  # three heartbeats and a half later: failed and queued again...
    assert claim() == "wait" and study.trials[orphan.number].state == TrialState.FAIL
    again = claim()  # ... and run at the next look
    assert again not in (None, "wait") and again.params == orphan.params
    trials = study.trials
    assert trials[orphan.number].state == TrialState.FAIL and trials[alive.number].state == TrialState.RUNNING
    assert [t.number for t in trials if t.user_attrs.get("retry_of") == orphan.number] == [again.number]
    assert trials[again.number].state == TrialState.RUNNING


def test_a_lost_connection_is_found_along_the_chain_of_causes_and_a_bad_request_is_not():
    """A restart reaches the worker as Optuna's StorageInternalError whose cause is SQLAlchemy's error
    (its .orig the driver's), or as an error raised while handling the cut commit (its context): either
    way it is the database going away; a constraint error is not."""
    import optuna
    import sqlalchemy.exc as sa

    from gputrain.sweeps.storage import lost_connection

    class DriverOperationalError(Exception):
        pass

    DriverOperationalError.__module__ = "psycopg"
    DriverOperationalError.__name__ = "OperationalError"

    def chained(inner: BaseException, how: str) -> BaseException:
        outer = optuna.exceptions.StorageInternalError("An exception is raised during the commit.")
        setattr(outer, "__cause__" if how == "cause" else "__context__", inner)
        return outer

    driver = DriverOperationalError("server closed the connection unexpectedly")
    assert lost_connection(chained(sa.DatabaseError("COMMIT", None, driver), "cause"))  # through .orig
    assert lost_connection(chained(sa.OperationalError("COMMIT", None, Exception("gone")), "context"))
    assert lost_connection(chained(chained(driver, "cause"), "context"))
    assert not lost_connection(chained(sa.IntegrityError("INSERT", None, Exception("duplicate key")), "cause"))
