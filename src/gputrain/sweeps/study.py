"""The sweep's Optuna study, wherever it lives (sweeps/storage.py: SQLite in SWEEP_DIR/study.db by
default, else a database server or a journal file that workers on several machines share), and the
locks around the SQLite one.

- One sweep at a time in a directory: the coordinator holds an exclusive lock on SWEEP_DIR/sweep.lock
  and hands it to its workers, so a second `gputrain sweep` there is refused while any of them lives.
- One process at a time in the database: every read and write of the study goes through
  `access(sweep_dir)` (a lock on SWEEP_DIR/study.lock), so SQLite never sees two writers (its
  "database is locked" under parallel Optuna workers).
- A trial that was running when its sweep was killed is failed and queued again with the same
  parameters (`retry_interrupted`, on SQLite; on a shared study, the heartbeat finds it), so a resumed
  sweep goes on where it stopped. A trial that failed on its own (`user_attrs["error"]`) counts
  toward the budget and is not retried.
- The study holds what makes it one sweep (study user attrs: the sweep's identity, its budget): a
  worker that joins with another workload or search space is refused before it runs a trial, and
  the budget is the study's, so that every worker, on any machine, stops at the same count.

Optuna is imported only here and in the worker: `import gputrain` stays fast.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import warnings
from pathlib import Path
from typing import Any, Iterator

from gputrain.errors import ConfigError
from gputrain.sweeps.storage import Place, open_storage, patiently, quiet_experimental

STUDY_NAME = "gputrain"
DB_FILE = "study.db"
LOCK_FILE = "sweep.lock"
ACCESS_FILE = "study.lock"
TRIALS_DIR = "trials"
IDENTITY_ATTR = "gputrain_sweep"  # the study's user attr: what makes it one sweep (a JSON tree)
BUDGET_ATTR = "gputrain_trials"  # the study's user attr: the budget of finished trials


def trial_dir(sweep_dir: str | Path, number: int) -> Path:
    return Path(sweep_dir) / TRIALS_DIR / f"trial-{number:04d}"


def import_optuna():
    """optuna, quiet (warnings only), or a ConfigError saying how to install it."""
    try:
        import optuna
    except ImportError:
        raise ConfigError("gputrain sweep needs Optuna: pip install 'gputrain[sweep]' (or pip install optuna)") from None
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    return optuna


@contextlib.contextmanager
def access(sweep_dir: str | Path) -> Iterator[None]:
    """Hold SWEEP_DIR/study.lock: the study's one reader or writer at a time."""
    fd = _lock_file(Path(sweep_dir) / ACCESS_FILE)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # closing releases the lock


def guard(place: Place):
    """The lock around a read or write of the study: SWEEP_DIR/study.lock for SQLite (its one process
    at a time); nothing for a server or a journal file, which order their writers themselves."""
    if place.kind == "sqlite":
        return access(place.folder)
    return contextlib.nullcontext()


def hold_sweep(sweep_dir: Path) -> int:
    """Lock SWEEP_DIR/sweep.lock for this sweep (and the workers given the descriptor); a ConfigError
    when another sweep holds it. Returns the descriptor (closed by `release`)."""
    fd = _lock_file(sweep_dir / LOCK_FILE)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise ConfigError(f"{sweep_dir}: another gputrain sweep is running there (it holds {sweep_dir / LOCK_FILE}); "
                          "wait for it, or stop it and run this again to resume") from None
    return fd


def _lock_file(path: Path) -> int:
    """A descriptor of the lock file `path` (created when missing; locked, never written)."""
    try:
        return os.open(path, os.O_RDONLY | os.O_CREAT, 0o644)
    except OSError as exc:
        what = "a folder is in its place" if path.is_dir() else exc.strerror or type(exc).__name__
        raise ConfigError(f"cannot open the sweep's lock file {path} ({what}): remove what is there, or give another "
                          "--sweep-dir") from None


def open_sweep(sweep_dir: Path, local: bool = True, name: str = STUDY_NAME) -> int:
    """Make the sweep's folder, lock it (`hold_sweep`) and check what it holds (`check_study`, when
    the study is the folder's SQLite: `local`) before anything is written there; ConfigError in one
    line when any of it fails. Returns the lock's descriptor (closed by `release`)."""
    from gputrain.io.preflight import check_output_dir

    check_output_dir(sweep_dir, "--sweep-dir")  # below a file, in /proc, read-only: said before anything is made
    try:
        sweep_dir.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ConfigError(f"--sweep-dir {sweep_dir}: cannot create it ({exc.strerror or exc}): give another "
                          "--sweep-dir") from None
    fd = hold_sweep(sweep_dir)
    try:
        if local:
            check_study(sweep_dir, name)
    except BaseException:
        release(fd)
        raise
    return fd


def check_study(sweep_dir: Path, name: str = STUDY_NAME) -> None:
    """Refuse (ConfigError, one line) a sweep folder whose study.db cannot carry on the sweep its trials/
    began: missing (deleted, renamed) while trials exist, emptied, not SQLite, damaged, or without
    the study's tables. A new study there would run its trials again over trials/trial-NNNN and lose
    the old ones' values. Read-only: the database is opened with SQLite's mode=ro."""
    db = sweep_dir / DB_FILE
    folder = sweep_dir / TRIALS_DIR
    trials = sorted(p.name for p in folder.glob("trial-*")) if folder.is_dir() else []
    held = (f"; {folder} holds {len(trials)} trial(s) ({trials[0]}{', ...' if len(trials) > 1 else ''}) that a new "
            "study would train over") if trials else ""
    if not db.exists() and not db.is_symlink():
        if trials:
            raise ConfigError(f"{db} is missing{held}: put the sweep's {DB_FILE} back (was it renamed or moved?), or "
                              "start this sweep in another --sweep-dir")
        return
    problem = _database_problem(db, name)
    # With no trial yet, a database without the study (a sweep stopped while creating it, a full disk)
    # is made whole by the next start; one that is not SQLite or is damaged is refused all the same.
    unfinished = problem is not None and problem.startswith(("empty", "missing the study's", "without the study"))
    if problem is not None and (trials or not unfinished):
        raise ConfigError(f"{db} is {problem}{held}: restore it from a copy, or start this sweep in another "
                          "--sweep-dir")


def _database_problem(db: Path, name: str = STUDY_NAME) -> str | None:
    """What keeps `db` from being this sweep's Optuna study, or None when it is one."""
    import sqlite3

    if db.is_dir():
        return "a folder, not a database file"
    try:
        if db.stat().st_size == 0:
            return "empty (0 bytes)"
        with open(db, "rb") as f:
            if f.read(16) != b"SQLite format 3\x00":
                return "not an SQLite database"
        con = sqlite3.connect(f"{db.resolve().as_uri()}?mode=ro", uri=True)
    except (OSError, sqlite3.Error) as exc:
        return f"unreadable ({exc})"
    try:
        check = con.execute("PRAGMA quick_check").fetchone()
        if not check or check[0] != "ok":
            return f"damaged (SQLite's quick_check: {check[0] if check else 'no answer'})"
        tables = {row[0] for row in con.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
        missing = [t for t in ("studies", "trials", "trial_params", "trial_values") if t not in tables]
        if missing:
            return f"missing the study's table(s) {', '.join(missing)}"
        if con.execute("SELECT 1 FROM studies WHERE study_name = ?", (name,)).fetchone() is None:
            return f"without the study {name!r}"
    except sqlite3.Error as exc:  # "database disk image is malformed", "file is not a database"
        return f"damaged ({exc})"
    finally:
        con.close()
    return None


def release(fd: int) -> None:
    with contextlib.suppress(OSError):
        os.close(fd)


def create_or_load(place: Place, direction: str, metric: str, identity: dict[str, Any], budget: int,
                   say=None):
    """The sweep's study, made on the first run (direction "min" or "max"), loaded on the next and by
    every worker that joins it. Refuses (ConfigError, one line) a study that runs another sweep
    (`identity` differs) or that gputrain did not make; sets the study's budget to `budget`."""
    optuna = import_optuna()
    from sqlalchemy.exc import OperationalError

    def make():
        with guard(place):
            study = optuna.create_study(storage=open_storage(place), study_name=place.name, load_if_exists=True,
                                        direction="minimize" if direction == "min" else "maximize")
            check_identity(place, study, identity)
            if not study.metric_names:
                with warnings.catch_warnings():  # "experimental since Optuna 3.2": the name is for Optuna's readers
                    warnings.simplefilter("ignore")
                    study.set_metric_names([metric])
            if study.user_attrs.get(BUDGET_ATTR) != budget:
                study.set_user_attr(BUDGET_ATTR, budget)
            return study

    try:
        return patiently(place, "opening the study", make, say)
    except OperationalError as exc:  # "database or disk is full", "disk I/O error" (a file-size limit)
        why = str(getattr(exc, "orig", None) or exc).strip().splitlines()[0][:200]
        raise ConfigError(f"cannot write the sweep's study {place.shown} ({why}): free disk space (or raise the "
                          "file-size limit) and run the sweep again") from None


def _plain(tree: Any) -> Any:
    return json.loads(json.dumps(tree, default=str))  # tuples as lists, as the study keeps them


def check_identity(place: Place, study, identity: dict[str, Any], record: bool = True) -> None:
    """Refuse a study whose recorded identity differs from `identity` (another workload, search space,
    metric, base run), naming the first differences; record it in a study that has none (record)."""
    mine = _plain(identity)
    theirs = study.user_attrs.get(IDENTITY_ATTR)
    if theirs is None:
        if place.shared and study.get_trials(deepcopy=False):
            raise ConfigError(f"the study {place.name!r} in {place.shown} holds trials of a study gputrain sweep did "
                              "not make: give another --study name")
        if not record:
            return
        study.set_user_attr(IDENTITY_ATTR, mine)
        theirs = study.user_attrs.get(IDENTITY_ATTR, mine)  # two machines making it at once: the first one's
    differs = differences(theirs, mine)
    if differs:
        raise ConfigError(f"the study {place.name!r} in {place.shown} runs another sweep (it differs in "
                          f"{', '.join(differs[:4])}{' and more' if len(differs) > 4 else ''}): join it with its own "
                          "config, or give another --study name")


def check_joinable(place: Place, identity: dict[str, Any]) -> None:
    """Before anything is written here: the shared study, if it exists already, runs this sweep."""
    optuna = import_optuna()

    def look() -> None:
        try:
            study = optuna.load_study(study_name=place.name, storage=open_storage(place))
        except KeyError:  # "Record does not exist": this command makes the study
            return
        check_identity(place, study, identity, record=False)

    patiently(place, "reading the study", look)


def differences(a: Any, b: Any, prefix: str = "") -> list[str]:
    """The dotted keys where the trees `a` and `b` differ ("sweep.space.lr.loguniform")."""
    if isinstance(a, dict) and isinstance(b, dict):
        out = []
        for key in list(dict.fromkeys([*a, *b])):
            out += differences(a.get(key), b.get(key), f"{prefix}{key}" if not prefix else f"{prefix}.{key}")
        return out
    norm = (lambda v: list(v) if isinstance(v, tuple) else v)
    return [] if norm(a) == norm(b) else [prefix or "the config"]


def budget(study, default: int) -> int:
    """The study's budget of finished trials (the last command that started or joined it set it)."""
    value = study.user_attrs.get(BUDGET_ATTR)
    return value if isinstance(value, int) and value > 0 else default


def load(place: Place, sampler=None, pruner=None, storage=None):
    """The sweep's study (`storage`: one already open, else `place`'s)."""
    optuna = import_optuna()
    with guard(place):
        return optuna.load_study(study_name=place.name, storage=storage or open_storage(place), sampler=sampler,
                                 pruner=pruner)


def finished(trial) -> bool:
    """Whether a trial uses up the budget for good: complete, pruned, or failed on its own."""
    from optuna.trial import TrialState

    state = trial.state
    return state in (TrialState.COMPLETE, TrialState.PRUNED) or (
        state == TrialState.FAIL and "error" in trial.user_attrs)


def counted(trial) -> bool:
    """Whether a trial uses up the budget: finished, or running."""
    from optuna.trial import TrialState

    return finished(trial) or trial.state == TrialState.RUNNING


def interrupted(trial) -> bool:
    """A trial stopped from outside (a signal, a dead worker): failed, with no error of its own, and
    not one that a worker gave back unrun when the budget was reached (`over_budget`)."""
    from optuna.trial import TrialState

    return trial.state == TrialState.FAIL and "error" not in trial.user_attrs and \
        "over_budget" not in trial.user_attrs


def retry_of(trial) -> int | None:
    """The trial this one runs again: queued by a stop signal or a resume (user attr retry_of), or by
    the heartbeat (Optuna's RetryHeartbeatStaleTrialCallback)."""
    if "retry_of" in trial.user_attrs:
        return trial.user_attrs["retry_of"]
    import optuna

    with quiet_experimental():
        return optuna.storages.RetryHeartbeatStaleTrialCallback.retried_trial_number(trial)


def retry_interrupted(place: Place, study) -> list[int]:
    """Fail the trials left running by a killed sweep, and queue every interrupted trial (failed with
    no error of its own) once more with its parameters. Only for the sweep folder's SQLite, with no
    worker alive (under `hold_sweep`): on a shared store another machine's trials may be running.
    Returns the numbers of the trials queued again."""
    from optuna.trial import TrialState

    with guard(place):
        for t in study.get_trials(deepcopy=False, states=(TrialState.RUNNING,)):
            study.tell(t.number, state=TrialState.FAIL)
        trials = study.get_trials(deepcopy=False)
        retried = {retry_of(t) for t in trials}
        again = [t for t in trials if interrupted(t) and t.number not in retried and t.params]
        for t in again:
            study.enqueue_trial(t.params, user_attrs={"retry_of": t.number})
    return [t.number for t in again]


def trial_rows(place: Place, study, metric: str) -> list[dict[str, Any]]:
    """One plain dict per trial (number, state, value, params, steps reported, seconds, run_dir,
    machine, sweep_dir, error, retry_of) for the report page and the command's table; report/ needs
    no Optuna. Trials a worker gave back unrun (over the budget) are left out."""
    from optuna.trial import TrialState

    with guard(place):
        trials = patiently(place, "reading the trials", lambda: study.get_trials(deepcopy=False))
    rows = []
    for t in trials:
        if "over_budget" in t.user_attrs:
            continue
        stopped = t.state == TrialState.FAIL and "error" not in t.user_attrs  # ended from outside, not itself
        seconds = (t.datetime_complete - t.datetime_start).total_seconds() \
            if t.datetime_start and t.datetime_complete and not stopped else None
        steps = sorted(t.intermediate_values)
        rows.append({"number": t.number, "state": t.state.name.lower(), "value": t.value,
                     "params": dict(t.params), "last_step": steps[-1] if steps else None, "seconds": seconds,
                     "run_dir": t.user_attrs.get("run_dir"), "machine": t.user_attrs.get("machine"),
                     "sweep_dir": t.user_attrs.get("sweep_dir"), "error": t.user_attrs.get("error"),
                     "retry_of": retry_of(t), "metric": metric})
    return rows


def best_trial(study):
    """Optuna's own best trial (`study.best_trial`), or None while no trial is complete."""
    try:
        return study.best_trial
    except ValueError:  # "Record does not exist": no complete trial yet
        return None
