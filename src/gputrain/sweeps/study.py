"""The sweep's Optuna study in SQLite (SWEEP_DIR/study.db), and the locks around it.

- One sweep at a time in a directory: the coordinator holds an exclusive lock on SWEEP_DIR/sweep.lock
  and hands it to its workers, so a second `gputrain sweep` there is refused while any of them lives.
- One process at a time in the database: every read and write of the study goes through
  `access(sweep_dir)` (a lock on SWEEP_DIR/study.lock), so SQLite never sees two writers (its
  "database is locked" under parallel Optuna workers).
- A trial that was running when its sweep was killed is failed and queued again with the same
  parameters (`retry_interrupted`), so a resumed sweep goes on where it stopped. A trial that failed
  on its own (`user_attrs["error"]`) counts toward the budget and is not retried.

Optuna is imported only here and in the worker: `import gputrain` stays fast.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import warnings
from pathlib import Path
from typing import Any, Iterator

from gputrain.errors import ConfigError

STUDY_NAME = "gputrain"
DB_FILE = "study.db"
LOCK_FILE = "sweep.lock"
ACCESS_FILE = "study.lock"
TRIALS_DIR = "trials"


def storage_url(sweep_dir: str | Path) -> str:
    return f"sqlite:///{Path(sweep_dir).resolve() / DB_FILE}"


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


def storage(sweep_dir: str | Path):
    """The study's RDBStorage (a long SQLite timeout as a second guard beside `access`)."""
    optuna = import_optuna()
    return optuna.storages.RDBStorage(storage_url(sweep_dir), engine_kwargs={"connect_args": {"timeout": 120}})


@contextlib.contextmanager
def access(sweep_dir: str | Path) -> Iterator[None]:
    """Hold SWEEP_DIR/study.lock: the study's one reader or writer at a time."""
    fd = _lock_file(Path(sweep_dir) / ACCESS_FILE)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # closing releases the lock


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


def open_sweep(sweep_dir: Path) -> int:
    """Make the sweep's folder, lock it (`hold_sweep`) and check what it holds (`check_study`) before
    anything is written there; ConfigError in one line when any of it fails. Returns the lock's
    descriptor (closed by `release`)."""
    from gputrain.io.preflight import check_output_dir

    check_output_dir(sweep_dir, "--sweep-dir")  # below a file, in /proc, read-only: said before anything is made
    try:
        sweep_dir.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ConfigError(f"--sweep-dir {sweep_dir}: cannot create it ({exc.strerror or exc}): give another "
                          "--sweep-dir") from None
    fd = hold_sweep(sweep_dir)
    try:
        check_study(sweep_dir)
    except BaseException:
        release(fd)
        raise
    return fd


def check_study(sweep_dir: Path) -> None:
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
    problem = _database_problem(db)
    # With no trial yet, a database without the study (a sweep stopped while creating it, a full disk)
    # is made whole by the next start; one that is not SQLite or is damaged is refused all the same.
    unfinished = problem is not None and problem.startswith(("empty", "missing the study's", "without the study"))
    if problem is not None and (trials or not unfinished):
        raise ConfigError(f"{db} is {problem}{held}: restore it from a copy, or start this sweep in another "
                          "--sweep-dir")


def _database_problem(db: Path) -> str | None:
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
        if con.execute("SELECT 1 FROM studies WHERE study_name = ?", (STUDY_NAME,)).fetchone() is None:
            return f"without the study {STUDY_NAME!r}"
    except sqlite3.Error as exc:  # "database disk image is malformed", "file is not a database"
        return f"damaged ({exc})"
    finally:
        con.close()
    return None


def release(fd: int) -> None:
    with contextlib.suppress(OSError):
        os.close(fd)


def create_or_load(sweep_dir: Path, direction: str, metric: str):
    """The sweep's study, made on the first run (direction "min" or "max"), loaded on the next."""
    optuna = import_optuna()
    from sqlalchemy.exc import OperationalError

    with access(sweep_dir):
        try:
            study = optuna.create_study(storage=storage(sweep_dir), study_name=STUDY_NAME, load_if_exists=True,
                                        direction="minimize" if direction == "min" else "maximize")
            if not study.metric_names:
                with warnings.catch_warnings():  # "experimental since Optuna 3.2": the name is for Optuna's readers
                    warnings.simplefilter("ignore")
                    study.set_metric_names([metric])
        except OperationalError as exc:  # "database or disk is full", "disk I/O error" (a file-size limit)
            why = str(getattr(exc, "orig", None) or exc).strip().splitlines()[0][:200]
            raise ConfigError(f"cannot write the sweep's study {sweep_dir / DB_FILE} ({why}): free disk space (or "
                              "raise the file-size limit) and run the sweep again") from None
    return study


def load(sweep_dir: str | Path, sampler=None, pruner=None, lock: bool = True):
    """The sweep's study (lock=False: the caller holds `access` already)."""
    optuna = import_optuna()
    with access(sweep_dir) if lock else contextlib.nullcontext():
        return optuna.load_study(study_name=STUDY_NAME, storage=storage(sweep_dir), sampler=sampler, pruner=pruner)


def counted(trial) -> bool:
    """Whether a trial uses up the budget: finished (complete, pruned, failed on its own) or running."""
    from optuna.trial import TrialState

    state = trial.state
    return state in (TrialState.COMPLETE, TrialState.PRUNED, TrialState.RUNNING) or (
        state == TrialState.FAIL and "error" in trial.user_attrs)


def retry_interrupted(sweep_dir: Path, study) -> list[int]:
    """Fail the trials left running by a killed sweep, and queue every interrupted trial (failed with
    no error of its own) once more with its parameters. Call it with no worker alive (under
    `hold_sweep`). Returns the numbers of the trials queued again."""
    from optuna.trial import TrialState

    with access(sweep_dir):
        for t in study.get_trials(deepcopy=False, states=(TrialState.RUNNING,)):
            study.tell(t.number, state=TrialState.FAIL)
        trials = study.get_trials(deepcopy=False)
        retried = {t.user_attrs.get("retry_of") for t in trials}
        again = [t for t in trials if t.state == TrialState.FAIL and "error" not in t.user_attrs
                 and t.number not in retried and t.params]
        for t in again:
            study.enqueue_trial(t.params, user_attrs={"retry_of": t.number})
    return [t.number for t in again]


def trial_rows(sweep_dir: Path, study, metric: str) -> list[dict[str, Any]]:
    """One plain dict per trial (number, state, value, params, steps reported, seconds, run_dir,
    error, retry_of) for the report page and the command's table; report/ needs no Optuna."""
    from optuna.trial import TrialState

    with access(sweep_dir):
        trials = study.get_trials(deepcopy=False)
    rows = []
    for t in trials:
        interrupted = t.state == TrialState.FAIL and "error" not in t.user_attrs  # ended by the resume, not itself
        seconds = (t.datetime_complete - t.datetime_start).total_seconds() \
            if t.datetime_start and t.datetime_complete and not interrupted else None
        steps = sorted(t.intermediate_values)
        rows.append({"number": t.number, "state": t.state.name.lower(), "value": t.value,
                     "params": dict(t.params), "last_step": steps[-1] if steps else None, "seconds": seconds,
                     "run_dir": t.user_attrs.get("run_dir"), "error": t.user_attrs.get("error"),
                     "retry_of": t.user_attrs.get("retry_of"), "metric": metric})
    return rows
