"""Where a sweep's study lives: SQLite in the sweep's folder (one machine), or a store that workers on
any machine share (`--storage`): a database server (PostgreSQL, MySQL) or a journal file on a shared
filesystem. Optuna's storage is the seam; everything else of a sweep is the same on either.

    --storage postgresql://USER@HOST:PORT/DB    the driver is psycopg (pip install 'gputrain[postgres]')
    --storage mysql://USER@HOST:PORT/DB         MySQL or MariaDB; the driver is PyMySQL (pip install 'gputrain[mysql]')
    --storage /shared/sweeps/lr.journal         Optuna's JournalStorage (a path, no scheme)

Secrets: a password is never written (sweep.toml keeps the URL without it) nor shown (the URL is
printed with *** in its place). It comes from the URL on the command line, PGPASSWORD or ~/.pgpass
(libpq reads them), or GPUTRAIN_SWEEP_STORAGE (the whole URL); the workers a sweep starts get the
URL in that variable, never on their command line.

Dead workers: each running trial records a heartbeat every `heartbeat` seconds (a thread beside the
training); a trial with none for 3 heartbeats is failed by the next live worker that looks (each
looks once a heartbeat) and queued again with its parameters (Optuna's
RetryHeartbeatStaleTrialCallback). A database server keeps them in Optuna's own table; a journal
file, whose JournalStorage has none, through Optuna's BaseHeartbeat (the seam it documents for a
backend): each beat a trial system attr holding the machine's wall clock, so the machines' clocks
must agree to well within 3 heartbeats (NTP does).

A lost connection (a database restarting) is waited for, up to 10 heartbeats, then one line.
"""

from __future__ import annotations

import contextlib
import functools
import os
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, TypeVar

from gputrain.errors import ConfigError

ENV = "GPUTRAIN_SWEEP_STORAGE"  # the whole URL (password included): read by the sweep and its workers
# The drivers gputrain installs (its postgres and mysql extras), named for SQLAlchemy; a URL that names
# its own driver (mysql+mysqldb://) keeps it.
SCHEMES = {"postgresql": "postgresql+psycopg", "postgres": "postgresql+psycopg", "mysql": "mysql+pymysql"}
GRACE_BEATS = 3  # heartbeats missed before a running trial counts as dead
WAIT_BEATS = 10  # heartbeats a worker waits for a lost database before it gives up
MAX_RETRY = 2  # times a dead worker's trial runs again (a trial that kills its worker each time stops there)
T = TypeVar("T")


@dataclass(frozen=True)
class Place:
    """Where the study lives. kind: "sqlite" (SWEEP_DIR/study.db), "rdb" (a database server) or
    "journal" (a journal file). url: what Optuna opens (a password included: never written or
    shown); name: the study's name; heartbeat: seconds between a running trial's heartbeats."""

    kind: str
    url: str
    name: str
    heartbeat: int = 30
    folder: str = ""  # SQLite's: the sweep folder as given (its study.lock; named so in messages)

    @property
    def shared(self) -> bool:
        """Whether workers on other machines may join (anything but the sweep folder's SQLite)."""
        return self.kind != "sqlite"

    @property
    def shown(self) -> str:
        """The URL as printed: its password masked."""
        return _masked(self.url) if self.kind == "rdb" else self.url

    @property
    def written(self) -> str:
        """The URL as sweep.toml keeps it: without its password."""
        return without_password(self.url) if self.kind == "rdb" else self.url

    @property
    def heartbeats(self) -> bool:
        """Whether running trials send heartbeats, and dead workers' trials are failed and queued again
        (the shared stores; on SQLite one machine's coordinator sees its own workers die)."""
        return self.kind in ("rdb", "journal")

    @property
    def wait_s(self) -> float:
        return float(WAIT_BEATS * self.heartbeat)


def sqlite_place(sweep_dir: str | Path, name: str) -> Place:
    return Place("sqlite", f"sqlite:///{Path(sweep_dir).resolve() / 'study.db'}", name, folder=str(sweep_dir))


# ---------------------------------------------------------------- the URL, checked as written


def check_storage(name: str, value: Any) -> None:
    """[sweep] storage's check: a URL of a known scheme or a journal file's path (not its reach)."""
    if value is None:
        return
    if not isinstance(value, str) or not value.strip():
        raise ConfigError(f"{name} must be a database URL (postgresql://USER@HOST/DB) or a journal file's path, "
                          f"got {value!r}")
    scheme = value.split("://", 1)[0].lower() if "://" in value else None
    if scheme is None:
        return
    dialect = scheme.split("+", 1)[0]
    if dialect == "sqlite":
        raise ConfigError(f"{name} {value!r}: SQLite is the default already (SWEEP_DIR/study.db, one machine); "
                          "workers on several machines share a database server (postgresql://USER@HOST/DB) or a "
                          "journal file on a shared filesystem (a path)")
    if dialect not in SCHEMES:
        raise ConfigError(f"{name} {_masked(value)!r}: unknown scheme {scheme!r}: give postgresql://USER@HOST/DB, "
                          "mysql://USER@HOST/DB, or a journal file's path on a shared filesystem")
    try:
        from sqlalchemy.engine import make_url
    except ImportError:
        raise ConfigError(f"{name}: a database server needs Optuna (and SQLAlchemy, which comes with it): pip "
                          "install 'gputrain[sweep]'") from None
    try:
        url = make_url(value)
    except Exception as exc:  # sqlalchemy.exc.ArgumentError: "Could not parse SQLAlchemy URL"
        raise ConfigError(f"{name}: cannot read {_masked(value)!r} as a URL ({type(exc).__name__}): write it as "
                          f"{dialect}://USER@HOST:PORT/DB") from None
    if not url.database:
        raise ConfigError(f"{name} {_masked(value)!r} names no database: write it as {dialect}://USER@HOST:PORT/DB")


def has_password(value: str) -> bool:
    if "://" not in value:
        return False
    from sqlalchemy.engine import make_url

    return bool(make_url(value).password)


def without_password(value: str) -> str:
    from sqlalchemy.engine import make_url

    return _no_password(make_url(value)).render_as_string(hide_password=False)


def _no_password(url):
    """A SQLAlchemy URL without its password (URL.set(password=None) keeps it: None is "unchanged")."""
    from sqlalchemy.engine import URL

    return URL.create(url.drivername, url.username, None, url.host, url.port, url.database, url.query)


def _with_driver(value: str):
    """The URL with its driver named: postgresql:// is psycopg (3), mysql:// PyMySQL, the drivers gputrain
    installs."""
    from sqlalchemy.engine import make_url

    url = make_url(value)
    scheme = url.drivername.split("+", 1)[0].lower()
    return url.set(drivername=SCHEMES[scheme]) if "+" not in url.drivername and scheme in SCHEMES else url


def _masked(value: str) -> str:
    try:
        from sqlalchemy.engine import make_url

        return make_url(value).render_as_string(hide_password=True)
    except Exception:  # not a URL SQLAlchemy reads: show its scheme only, never what may be a password
        return value.split("://", 1)[0] + "://..." if "://" in value else value


def resolve(stated: str | None, name: str, heartbeat: int, sweep_dir: str | Path) -> Place:
    """The Place of a sweep: `stated` (--storage or [sweep] storage), else GPUTRAIN_SWEEP_STORAGE,
    else SQLite in `sweep_dir`. A stated URL without a password takes the variable's when the
    variable names the same database (a resume: sweep.toml keeps the URL without it)."""
    env = os.environ.get(ENV) or None
    if env is not None:
        check_storage(f"{ENV}", env)
    url = stated or env
    if url is None:
        return sqlite_place(sweep_dir, name)
    if "://" not in url:
        return Place("journal", str(Path(url).expanduser().resolve()), name, heartbeat)
    full = _with_driver(url)
    if not full.password and env is not None and "://" in env:
        other = _with_driver(env)
        if other.password and _no_password(other) == full:
            full = full.set(password=other.password)  # the variable's password for the database sweep.toml names
    return Place("rdb", full.render_as_string(hide_password=False), name, heartbeat)


# ---------------------------------------------------------------- reaching it


def check_reachable(place: Place) -> None:
    """Refuse (ConfigError, one line, nothing written) a store that cannot be used: a server that
    does not answer, a wrong password, a database that does not exist, a missing driver; a journal
    file whose folder is missing, is a file, or cannot be written."""
    if place.kind == "journal":
        path = Path(place.url)
        parent = next((p for p in path.parents if p.exists()), None)
        if path.is_dir():
            raise ConfigError(f"--storage {path} is a folder: give a journal file's path (made if missing)")
        if parent is not None and not parent.is_dir():
            raise ConfigError(f"--storage {path}: {parent} is a file, not a folder: give a journal file's path in a "
                              "folder on a shared filesystem")
        if not path.parent.is_dir():
            raise ConfigError(f"--storage {path}: its folder {path.parent} does not exist: create it on the shared "
                              "filesystem first")
        if not os.access(path.parent, os.W_OK) or (path.exists() and not os.access(path, os.W_OK)):
            raise ConfigError(f"--storage {path}: cannot write there: give a journal file in a folder you can write")
        return
    if place.kind != "rdb":
        return
    engine = _engine(place)
    try:
        with engine.connect():
            pass
    except Exception as exc:
        raise ConfigError(f"--storage {place.shown}: cannot connect ({_why(exc)}): {_advice(exc)}") from None
    finally:
        engine.dispose()


def _engine(place: Place):
    try:
        import sqlalchemy

        return sqlalchemy.create_engine(place.url, **engine_kwargs(place))
    except ImportError as exc:
        raise ConfigError(f"--storage {place.shown} needs its database driver ({exc.name or exc}): "
                          f"{_driver_hint(place)}") from None


def engine_kwargs(place: Place) -> dict[str, Any]:
    """SQLAlchemy's engine settings for a server: connections checked before use (a restarted server
    leaves dead ones in the pool), and a connection attempt bounded."""
    kwargs: dict[str, Any] = {"pool_pre_ping": True}
    if place.url.startswith("postgresql"):
        kwargs["connect_args"] = {"connect_timeout": 10}
    elif place.url.startswith("mysql"):
        kwargs["connect_args"] = {"connect_timeout": 10}
    return kwargs


def _driver_hint(place: Place) -> str:
    if place.url.startswith("postgresql"):
        return "pip install 'gputrain[postgres]' (psycopg)"
    if place.url.startswith("mysql+pymysql"):
        return "pip install 'gputrain[mysql]' (PyMySQL)"
    return "install the driver the URL names (mysql+mysqldb://: pip install mysqlclient), or write mysql:// for PyMySQL"


def _why(exc: BaseException) -> str:
    """The driver's own first line (psycopg: 'connection failed: ... password authentication failed
    for user "x"'; PyMySQL: '(1045, "Access denied for user ...")'), without SQLAlchemy's wrapping;
    never the URL."""
    e: BaseException = exc
    for _ in range(3):  # optuna's StorageInternalError -> SQLAlchemy's error -> the driver's (.orig)
        if getattr(e, "orig", None) is not None:
            e = getattr(e, "orig")
            break
        if e.__cause__ is None:
            break
        e = e.__cause__
    text = " ".join(str(e).split())
    return text[:300] or type(e).__name__


def _advice(exc: BaseException) -> str:
    why = _why(exc).lower()  # PostgreSQL's words, then MySQL's (errors 1045 and 1049)
    if "password" in why or "authentication" in why or "access denied" in why:
        return ("check the user and its password (in the URL, GPUTRAIN_SWEEP_STORAGE holding the URL, or for "
                "PostgreSQL PGPASSWORD or ~/.pgpass)")
    if ("does not exist" in why and "database" in why) or "unknown database" in why:
        return "create the database first (createdb NAME; on MySQL, CREATE DATABASE NAME), or name one that exists"
    return "check that the server runs and that the host and port are right"


def open_storage(place: Place):
    """The Optuna storage of `place` (its tables made on first use). On a server and in a journal
    file: heartbeats every `place.heartbeat` s, a trial dead for GRACE_BEATS heartbeats failed and
    queued again."""
    import warnings

    import optuna

    if place.kind == "journal":
        from optuna.storages.journal import JournalFileBackend

        with warnings.catch_warnings():  # RetryHeartbeatStaleTrialCallback is experimental
            warnings.simplefilter("ignore")
            retry = optuna.storages.RetryHeartbeatStaleTrialCallback(max_retry=MAX_RETRY)
        return journal_with_heartbeats()(JournalFileBackend(place.url), heartbeat=place.heartbeat,
                                         grace=GRACE_BEATS * place.heartbeat, on_stale=retry)
    if place.kind == "sqlite":
        return optuna.storages.RDBStorage(place.url, engine_kwargs={"connect_args": {"timeout": 120}})
    with warnings.catch_warnings():  # "heartbeat_interval is experimental": what finds a dead worker
        warnings.simplefilter("ignore")
        retry = optuna.storages.RetryHeartbeatStaleTrialCallback(max_retry=MAX_RETRY)
        try:
            return optuna.storages.RDBStorage(place.url, engine_kwargs=engine_kwargs(place),
                                              heartbeat_interval=place.heartbeat,
                                              grace_period=GRACE_BEATS * place.heartbeat,
                                              heartbeat_stale_trial_callback=retry)
        except ImportError:
            raise ConfigError(f"--storage {place.shown} needs its database driver: {_driver_hint(place)}") from None


# ---------------------------------------------------------------- a lost connection, waited for


def lost_connection(exc: BaseException) -> bool:
    """Whether `exc` is the database going away (a restart, a network cut), not a bad request: along
    the chain of causes (Optuna's StorageInternalError wraps SQLAlchemy's error, which wraps the
    driver's; a commit cut by a restart can arrive as the context of another error), a connection
    error of SQLAlchemy's or of the driver's."""
    from sqlalchemy.exc import DBAPIError, DisconnectionError, InterfaceError, OperationalError

    seen: set[int] = set()
    e: BaseException | None = exc
    while e is not None and id(e) not in seen and len(seen) < 8:
        seen.add(id(e))
        if isinstance(e, (OperationalError, InterfaceError, DisconnectionError)) or \
                (isinstance(e, DBAPIError) and e.connection_invalidated):
            return True
        if type(e).__module__.startswith(("psycopg", "psycopg2")) and type(e).__name__ in (
                "OperationalError", "InterfaceError"):
            return True
        e = getattr(e, "orig", None) or e.__cause__ or e.__context__
    return False


class StorageLost(ConfigError):
    """The study's database was away for longer than a worker waits (one line; resume later)."""


LOST_STATUS = 3  # a worker's exit status after StorageLost (its one line on stderr)


def patiently(place: Place, what: str, call: Callable[[], T], say: Callable[[str], None] | None = None) -> T:
    """`call()`, again after a lost connection, for up to `place.wait_s` seconds (backing off from
    0.5 s to one heartbeat); then StorageLost. `say`: told once when the wait starts and once when
    the database is back."""
    if place.kind != "rdb":
        return call()
    deadline, pause, waited = time.monotonic() + place.wait_s, 0.5, False
    while True:
        try:
            result = call()
        except Exception as exc:
            if not lost_connection(exc):
                raise
            if time.monotonic() >= deadline:
                raise StorageLost(f"lost the study's database {place.shown} for {place.wait_s:.0f} s while {what} "
                                  f"({_why(exc)}): start it again, then run the same command to resume") from None
            if not waited and say is not None:
                say(f"the study's database {place.shown} is away ({_why(exc)[:120]}); waiting up to "
                    f"{place.wait_s:.0f} s for it")
            waited = True
            time.sleep(pause)
            pause = min(2 * pause, float(place.heartbeat))
            continue
        if waited and say is not None:
            say(f"the study's database {place.shown} is back")
        return result


class Heartbeat:
    """A thread that records a running trial's heartbeat every `place.heartbeat` s (and fails the
    trials of dead workers, so that one is found within GRACE_BEATS + 1 heartbeats even while every
    live worker trains). A lost connection is tried again every second: a restarted server sees
    the heartbeat within a second of its return. Nothing on SQLite."""

    def __init__(self, place: Place, storage, trial_id: int, fail_stale: Callable[[], None]):
        self.place, self.storage, self.trial_id, self.fail_stale = place, storage, trial_id, fail_stale
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._beat, daemon=True, name="gputrain-heartbeat")

    def __enter__(self) -> Heartbeat:
        if self.place.heartbeats:
            self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=30)

    def _beat(self) -> None:
        while not self._stop.is_set():
            try:
                self.storage.record_heartbeat(self.trial_id)
                self.fail_stale()
                wait = float(self.place.heartbeat)
            except Exception:  # the database is away: beat again soon; the trial's own calls wait for it
                wait = 1.0
            if self._stop.wait(wait):
                return


BEAT_ATTR = "gputrain:heartbeat"  # a journal trial's system attr: its last heartbeat, time.time() in seconds


@functools.cache
def journal_with_heartbeats() -> type:
    """Optuna's JournalStorage with heartbeats (a class made on first use: Optuna is imported only
    by a sweep). Optuna's fail_stale_trials, RetryHeartbeatStaleTrialCallback and its heartbeat
    thread work on it as on RDBStorage."""
    from optuna.storages import JournalStorage
    # Private in name, but the seam Optuna's docstring names for a backend with heartbeats, and what its
    # fail_stale_trials tests with isinstance (Optuna is pinned: constraints.txt).
    from optuna.storages._heartbeat import BaseHeartbeat
    from optuna.trial import TrialState

    class JournalWithHeartbeats(JournalStorage, BaseHeartbeat):
        def __init__(self, backend, *, heartbeat: int, grace: int, on_stale):
            super().__init__(backend)
            self._heartbeat, self._grace, self._on_stale = heartbeat, grace, on_stale

        def record_heartbeat(self, trial_id: int) -> None:
            self.set_trial_system_attr(trial_id, BEAT_ATTR, time.time())

        def _get_stale_trial_ids(self, study_id: int) -> list[int]:
            # As RDBStorage's: a running trial whose last heartbeat is older than the grace period (one
            # that never beat is left to the worker's own rule: sweeps/trial.py `_fail_unheard`).
            now = time.time()
            return [t._trial_id for t in self.get_all_trials(study_id, deepcopy=False, states=(TrialState.RUNNING,))
                    if BEAT_ATTR in t.system_attrs and now - float(t.system_attrs[BEAT_ATTR]) > self._grace]

        def get_heartbeat_interval(self) -> int | None:
            return self._heartbeat

        def get_heartbeat_stale_trial_callback(self):
            return self._on_stale

    return JournalWithHeartbeats


@contextlib.contextmanager
def quiet_experimental():
    """Optuna's ExperimentalWarning (heartbeats, fail_stale_trials) kept off the user's terminal."""
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield
