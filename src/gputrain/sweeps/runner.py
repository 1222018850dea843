"""The sweep's coordinator: checks the plan, prepares the sweep directory, runs the workers and
writes the report.

    SWEEP_DIR/sweep.toml        the sweep's resolved config (run config + [sweep]); what a resume reads
    SWEEP_DIR/study.db          the Optuna study (SQLite): optuna.load_study(study_name="gputrain",
                                storage="sqlite:///SWEEP_DIR/study.db"); with --storage, the study is
                                in that database (or journal file) and every machine's sweep joins it
    SWEEP_DIR/trials/trial-NNNN ordinary run directories, one per trial
    SWEEP_DIR/report.html       the trials' table and plots

Workers are processes (sweeps/trial.py), one per GPU with CUDA_VISIBLE_DEVICES set to it (never two
on one GPU), or on the CPU with an equal share of the cores' threads each. A refused sweep writes
nothing; a killed one resumes where it stopped when run again (or with `--sweep-dir DIR` alone).
With --storage, the same command on another machine (its own --sweep-dir) adds workers to the study.
"""

from __future__ import annotations

import collections
import json
import logging
import os
import queue
import shutil
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from gputrain.errors import ConfigError, GputrainError, StopRequested
from gputrain.io.run_layout import REPORT_FILE
from gputrain.io.toml_file import TomlFile
from gputrain.runs.stated import RunConfig, check_tree, load_run_config, option_text
from gputrain.sweeps import storage as stores, study as studies
from gputrain.sweeps.folder import check_folder, identity, load_sweep_file, safe_name, write_sweep_file
from gputrain.sweeps.settings import MAX_SEED, SWEEP_FILE, SweepSettings, check_sweep

log = logging.getLogger("gputrain")


class SweepFailed(GputrainError):
    """A trial raised an error that is not gputrain's (its traceback is in the trial's error.txt)."""


@dataclass
class SweepPlan:
    rc: RunConfig
    settings: SweepSettings
    direction: str  # "min" | "max": stated, or the metric's rule
    direction_why: str
    sweep_dir: Path
    slots: list[dict[str, str]]  # one environment per worker
    resumed: bool
    place: stores.Place  # where the study lives (its URL may hold a password: never written or shown)


@dataclass
class SweepResult:
    """What a sweep found. trials: one dict per trial (number, state, value, params, run_dir, ...)."""

    sweep_dir: Path
    metric: str
    direction: str
    best_trial: int | None
    best_value: float | None
    best_params: dict[str, Any]
    best_run_dir: Path | None  # on the machine that ran it (best_machine)
    trials: list[dict[str, Any]] = field(default_factory=list)
    report: Path | None = None
    best_machine: str | None = None
    storage: str = ""  # the study's storage URL, its password masked
    study_name: str = studies.STUDY_NAME


def plan_sweep(config: str | Path | dict | None = None, *, workload: str | None = None,
               sweep_dir: str | Path | None = None, overrides: dict[str, Any] | None = None,
               cuda_devices: list[str] | None = None) -> SweepPlan:
    """Check everything and decide the sweep directory and the workers; writes nothing.

    config: a TOML file, or the same tree as a dict; None: the sweep in `sweep_dir` (a resume).
    overrides: [sweep] keys the command line gave (trials, workers, metric, direction).
    cuda_devices: the GPUs to use (default: those torch sees).
    """
    existing = Path(sweep_dir) / SWEEP_FILE if sweep_dir is not None else None
    if config is None:
        if existing is None or not existing.is_file():
            raise ConfigError("give a sweep's config (--config FILE), or --sweep-dir of a sweep to resume "
                              f"({'no ' + str(existing) if existing else 'none given'})")
        rc = load_run_config(existing, what="--sweep-dir")
    elif isinstance(config, dict):
        rc = check_tree(TomlFile("the config", dict(config)))
    else:
        rc = load_run_config(config)
    rc, settings, w = checked_sweep(rc, workload=workload, overrides=overrides)
    from gputrain.metric_direction import metric_direction

    way = metric_direction(settings.metric, rc.train.get("metric_modes"), w.metrics)
    direction = settings.direction or way.mode
    why = "stated" if settings.direction else way.why()
    # The default folder is named for the config file (sweeps/lr for lr.toml): the same command again resumes.
    default = Path("sweeps") / safe_name(Path(config).stem if isinstance(config, (str, Path)) else rc.workload or w.name)
    folder = Path(sweep_dir or settings.sweep_dir or default)
    place = stores.resolve(settings.storage, settings.study, settings.heartbeat, folder)
    settings.storage = place.written if place.shared else None  # what sweep.toml keeps: no password
    resumed = check_folder(folder, rc, settings, direction)
    slots = worker_slots(str(rc.train.get("device", w.defaults.get("device", "auto"))), settings.workers,
                         cuda_devices)
    if place.shared:  # the server answers, and its study (if there is one) is this sweep: before anything is written
        studies.import_optuna()
        stores.check_reachable(place)
        studies.check_joinable(place, identity(rc, settings, direction, where=False))
    return SweepPlan(rc, settings, direction, why, folder, slots, resumed, place)


def checked_sweep(rc: RunConfig, *, workload: str | None = None, overrides: dict[str, Any] | None = None
                  ) -> tuple[RunConfig, SweepSettings, Any]:
    """The sweep's config checked as far as it can be without its folder, its GPUs or its database:
    the workload (`workload` over the file's), the [sweep] table with `overrides` over it, and what only
    the workload can say of every sampled value. Returns (rc, settings, the resolved workload); raises
    ConfigError. `gputrain slurm --sweep` checks a sweep with it before the job waits in the queue."""
    from gputrain.workloads import resolve_workload

    if workload:
        rc.workload = workload
    if not rc.workload:
        raise ConfigError(f"{rc.where()}: a sweep needs a workload: workload = NAME in the file, or "
                          "gputrain sweep WORKLOAD")
    settings = check_sweep(rc, overrides)
    w = resolve_workload(rc.workload, **{k: option_text(v) for k, v in rc.options.items()})
    _check_trials_can_run(rc, settings, w)
    return rc, settings, w


def _check_trials_can_run(rc: RunConfig, settings: SweepSettings, workload: Any) -> None:
    """What only the workload can say, before the first trial: every sampled option builds it
    (options.n on a workload without n, or a value it refuses), and [train] best_metric is one its
    runs report."""
    from gputrain.runs.resolve import check_reported
    from gputrain.workloads import resolve_workload

    searched = [p for p in settings.space if p.section == "optimizers"]
    if searched and workload.step_fn is None:
        raise ConfigError(f"{rc.where('sweep', 'space', *searched[0].name.split('.'))}: [sweep.space] {searched[0].name}: "
                          f"{workload.name} trains with the built-in step (one optimizer): search lr and weight_decay "
                          "instead")
    options = {k: option_text(v) for k, v in rc.options.items()}
    for p in settings.space:
        if p.section != "options":
            continue
        samples = p.choices or (p.low, p.high)
        for value in samples:
            try:
                resolve_workload(rc.workload or "", **{**options, p.key: option_text(value)})
            except ConfigError as exc:
                raise ConfigError(f"{rc.where('sweep', 'space', 'options', p.key)}: [sweep.space] {p.name}: can "
                                  f"sample {value!r}, which the workload refuses: {exc}") from None
    try:
        check_reported(rc.train.get("best_metric"), workload, rc.fit.get("ema"), "best_metric")
    except ConfigError as exc:
        raise ConfigError(f"{rc.where('train', 'best_metric')}: [train] {exc}") from None
    _check_samples_resolve(rc, settings, workload)


def _check_samples_resolve(rc: RunConfig, settings: SweepSettings, workload: Any) -> None:
    """Each sampled value's trial resolved as it will be (runs/resolve.py: compile with a step of your
    own...), and each named optimizer's setting taken by the workload's optimizers: refused before the
    first trial, not by every trial."""
    from gputrain.runs.resolve import resolve
    from gputrain.sweeps.settings import trial_config
    from gputrain.train.optim.by_name import NamedOptimizers

    for p in (p for p in settings.space if p.section != "options"):  # options: resolved above
        where = f"{rc.where('sweep', 'space', *p.name.split('.'))}: [sweep.space] {p.name}"
        for value in p.choices or (p.low, p.high):
            try:
                if p.section != "optimizers":
                    resolve(trial_config(rc, settings, {p.name: value}), workload)
                elif workload.optimizers is not None:
                    name, key = p.key.split(".")
                    NamedOptimizers(workload.optimizers, {name: {key: value}}).check(workload.make_model)
            except ConfigError as exc:
                raise ConfigError(f"{where}: can sample {value!r}, which the run refuses: {exc}") from None
    if workload.step_fn is not None and workload.optimizers is not None:
        NamedOptimizers(workload.optimizers, rc.optimizers).check(workload.make_model)


def sweep(config: str | Path | dict | None = None, *, workload: str | None = None, sweep_dir: str | Path | None = None,
          trials: int | None = None, workers: int | None = None, metric: str | None = None,
          direction: str | None = None, storage: str | None = None, study: str | None = None,
          on_trial: Callable[[dict[str, Any]], None] | None = None) -> SweepResult:
    """Search hyperparameters with Optuna: each trial an ordinary run directory under the sweep's.

    config: a TOML file (or the same tree as a dict) with the run (workload, [train], ...) and
    [sweep] (trials, metric, [sweep.space]; see gputrain/sweeps/settings.py); None resumes the sweep
    in `sweep_dir`. trials, workers, metric, direction override [sweep]. A sweep run again on its
    directory resumes: its finished trials stay, its interrupted ones run again. storage, study: the
    study in a database server (postgresql://USER@HOST/DB) or a journal file, under that name, which
    the same call on other machines joins (sweeps/storage.py; default: SQLite in `sweep_dir`). on_trial: called
    with each finished trial's event ({"trial", "state", "value", "params"}).

    Returns a SweepResult (best trial, value and params, every trial). Raises ConfigError for bad
    input (nothing written), StopRequested when stopped by a signal (resume by running it again).
    Needs Optuna (pip install 'gputrain[sweep]').
    """
    plan = plan_sweep(config, workload=workload, sweep_dir=sweep_dir,
                      overrides={"trials": trials, "workers": workers, "metric": metric, "direction": direction,
                                 "storage": storage, "study": study})
    studies.import_optuna()  # after the plan: a bad config is said first, with or without Optuna
    return run_plan(plan, on_trial)


def run_plan(plan: SweepPlan, on_trial: Callable[[dict[str, Any]], None] | None = None) -> SweepResult:
    """Run a checked plan: lock the directory, record sweep.toml, open the study, queue interrupted
    trials again, run the workers, write the report."""
    folder, settings, place = plan.sweep_dir, plan.settings, plan.place
    made = next((f for f in (*reversed(folder.parents), folder) if not f.exists()), None)  # taken away if refused
    # made, locked and its study checked before anything is written
    lock = studies.open_sweep(folder, local=not place.shared, name=place.name)
    try:
        try:
            write_sweep_file(folder, plan.rc, settings, plan.direction)
            study = studies.create_or_load(place, plan.direction, settings.metric,
                                           identity(plan.rc, settings, plan.direction, where=False), settings.trials,
                                           say=log.warning)
        except GputrainError:  # the study cannot be written (a full disk, a file-size limit): no trial ran
            if made is not None:
                shutil.rmtree(made, ignore_errors=True)  # the folders this call made, with what it wrote
            raise
        if not place.shared:  # on a shared study another machine's trials may be running: the heartbeat finds dead ones
            again = studies.retry_interrupted(place, study)
            if again:
                log.info("resuming: trials %s were interrupted and run again", ", ".join(map(str, again)))
        with studies.guard(place):
            trials = stores.patiently(place, "reading the trials", lambda: study.get_trials(deepcopy=False))
        # A shared study's running trials may belong to dead workers: this machine's workers wait for them.
        left = settings.trials - sum((studies.finished if place.shared else studies.counted)(t) for t in trials)
        if left > 0:
            log.info("sweep of %s in %s: %d trial(s) to run on %d worker(s); %s (%s)%s", plan.rc.workload, folder,
                     left, min(left, len(plan.slots)), f"{settings.metric}, {plan.direction}", plan.direction_why,
                     f"; the study {place.name!r} in {place.shown}" if place.shared else "")
            try:
                _run_workers(plan, plan.slots[:left], lock, on_trial)
            except stores.StorageLost:  # the database is away: no report to read from it
                raise
            except BaseException:  # stopped, or a trial failed: the report of what there is
                _write_report(plan, study)
                raise
        _write_report(plan, study)
        return _result(plan, study)
    finally:
        studies.release(lock)


def make_sampler(settings: SweepSettings, index: int = 0, started: int = 0):
    """The sweep's sampler for worker `index`, started when the study had `started` trials: seeded
    from all three, so that two workers, or a resumed sweep's workers, never draw the same values."""
    optuna = studies.import_optuna()
    seed = (settings.seed + index + 1009 * started) % (MAX_SEED + 1)  # stays in the samplers' range
    if settings.sampler == "random":
        return optuna.samplers.RandomSampler(seed=seed)
    return optuna.samplers.TPESampler(seed=seed)


def make_pruner(settings: SweepSettings):
    optuna = studies.import_optuna()
    if settings.pruner == "none":
        return optuna.pruners.NopPruner()
    return optuna.pruners.MedianPruner(n_startup_trials=settings.startup_trials)


def worker_slots(device: str, workers: int | None, cuda_devices: list[str] | None = None) -> list[dict[str, str]]:
    """One environment per worker. On GPUs (device auto or cuda, and GPUs present): one worker per
    GPU, CUDA_VISIBLE_DEVICES set to it; more workers than GPUs is refused. On the CPU: `workers`
    processes (default 1), each with an equal share of the cores' threads."""
    if device.startswith("cuda") or device == "auto":
        gpus = visible_gpus() if cuda_devices is None else list(cuda_devices)
        if gpus:
            if device.startswith("cuda:") and (workers or 1) > 1:
                raise ConfigError(f"device = {device!r} puts every trial on one GPU: with workers = {workers}, set "
                                  "device = \"cuda\" (one trial per GPU) or workers = 1")
            if device.startswith("cuda:"):
                return [{}]
            n = workers or len(gpus)
            if n > len(gpus):
                raise ConfigError(f"workers = {n}, but this machine has {len(gpus)} GPU{'s' if len(gpus) > 1 else ''}: "
                                  "a sweep runs one trial per GPU, never two on one; set workers to "
                                  f"{len(gpus)} or fewer, or device = \"cpu\"")
            return [{"CUDA_VISIBLE_DEVICES": g} for g in gpus[:n]]
        if device.startswith("cuda"):
            raise ConfigError(f"device = {device!r}, but no CUDA GPU is visible here: every trial would fail; "
                              "set device = \"cpu\" (or \"auto\") in [train]")
    if device == "mps" and (workers or 1) > 1:
        raise ConfigError(f"workers = {workers} on device mps: a Mac has one GPU; set workers = 1")
    n = workers or 1
    cores = os.cpu_count() or 1
    if n > cores:  # before a slot is made for each: a huge count would fill the memory first
        raise ConfigError(f"workers = {n}, but this machine has {cores} CPU core{'s' if cores > 1 else ''}: a worker "
                          f"is a process with at least one core's thread; set workers to {cores} or fewer")
    threads = str(max(1, cores // n))
    env = {"OMP_NUM_THREADS": threads, "MKL_NUM_THREADS": threads}
    if os.environ.get("OMP_NUM_THREADS", "").isdigit() and int(os.environ["OMP_NUM_THREADS"]) < int(threads):
        env = {}  # already fewer threads than the share: keep the user's setting
    return [dict(env) for _ in range(n)]


def visible_gpus() -> list[str]:
    """The CUDA devices this process may use, as CUDA_VISIBLE_DEVICES names them (or their indices)."""
    import torch

    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    named = [d.strip() for d in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if d.strip()]
    return named[:count] if named else [str(i) for i in range(count)]


# ---------------------------------------------------------------- workers


def _run_workers(plan: SweepPlan, slots: list[dict[str, str]], lock_fd: int,
                 on_trial: Callable[[dict[str, Any]], None] | None) -> None:
    """Start one worker per slot and wait for them all; stop them all on the first one that fails,
    on Ctrl-C or on SIGTERM."""
    src = str(Path(__file__).resolve().parents[2])  # the folder gputrain is imported from: the workers' too
    events: queue.Queue = queue.Queue()
    procs, tails = [], []
    for i, slot in enumerate(slots):
        env = {**os.environ, **slot, "PYTHONUNBUFFERED": "1"}
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [src, env.get("PYTHONPATH")]))
        env.setdefault("GPUTRAIN_COMPILE_CACHE", str(plan.sweep_dir / "compile_cache"))  # trials share compiled code
        if plan.place.kind == "rdb":  # the URL, password included, in the environment: never on a command line
            env[stores.ENV] = plan.place.url
        proc = subprocess.Popen([sys.executable, "-m", "gputrain.sweeps.trial", str(plan.sweep_dir), str(i)], env=env,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, pass_fds=(lock_fd,))
        tail: collections.deque = collections.deque(maxlen=40)
        threading.Thread(target=_read_events, args=(proc.stdout, i, events), daemon=True).start()
        threading.Thread(target=_read_tail, args=(proc.stderr, tail), daemon=True).start()
        procs.append(proc)
        tails.append(tail)
    stop = _Stop()
    previous = signal.signal(signal.SIGTERM, stop) if threading.current_thread() is threading.main_thread() else None
    try:
        while True:
            _drain(events, on_trial)
            done = [p.poll() for p in procs]
            failed = next((i for i, rc in enumerate(done) if rc not in (None, 0)), None)
            if failed is not None:
                _stop(procs)
                _drain(events, on_trial)
                raise _worker_error(done[failed], tails[failed], plan.sweep_dir)
            if all(rc == 0 for rc in done):
                _drain(events, on_trial)
                return
            time.sleep(0.1)
    except KeyboardInterrupt:
        _stop(procs)
        _drain(events, on_trial)
        raise StopRequested(f"sweep stopped; the running trials will run again when you resume it: gputrain sweep "
                            f"--sweep-dir {plan.sweep_dir}", exit_code=128 + (stop.signum or signal.SIGINT), step=0,
                            checkpoint=None) from None
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)


class _Stop:
    """SIGTERM's handler while the workers run: remembered, then raised as KeyboardInterrupt."""

    signum: int | None = None

    def __call__(self, signum, frame):
        self.signum = signum
        raise KeyboardInterrupt


def _stop(procs: list[subprocess.Popen], wait_s: float = 120.0) -> None:
    """SIGTERM to the workers still running (each checkpoints its trial and marks it interrupted),
    then SIGKILL to those still there after `wait_s`."""
    for p in procs:
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + wait_s
    for p in procs:
        try:
            p.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


def _worker_error(rc: int, tail: collections.deque, sweep_dir: Path) -> GputrainError:
    last = next((line for line in reversed(tail) if line.strip()), "")
    if rc == 2:
        return ConfigError(last or f"a worker of the sweep in {sweep_dir} refused to go on")
    if rc == stores.LOST_STATUS:
        return stores.StorageLost(last or f"a worker of the sweep in {sweep_dir} lost the study's database")
    if rc in (130, 143):
        return StopRequested(f"a worker was stopped by a signal; resume: gputrain sweep --sweep-dir {sweep_dir}",
                             exit_code=rc, step=0, checkpoint=None)
    return SweepFailed(last or f"a worker of the sweep in {sweep_dir} exited with status {rc}:\n" + "".join(tail))


def _read_events(stream, worker: int, events: queue.Queue) -> None:
    for line in stream:
        try:
            event = json.loads(line)
        except ValueError:
            continue
        if isinstance(event, dict):
            events.put({**event, "worker": worker})


def _read_tail(stream, tail: collections.deque) -> None:
    for line in stream:
        tail.append(line.rstrip("\n"))


def _drain(events: queue.Queue, on_trial: Callable[[dict[str, Any]], None] | None) -> None:
    from gputrain.report.sweep_page import short as _short

    while True:
        try:
            event = events.get_nowait()
        except queue.Empty:
            return
        if "note" in event:  # a worker's word: its database went away, came back (progress: --quiet hides it)
            log.info("worker %s: %s", event.get("worker"), event["note"])
            continue
        params = ", ".join(f"{k}={_short(v)}" for k, v in (event.get("params") or {}).items())
        value = "" if event.get("value") is None else f" {_short(event['value'])}"
        log.info("trial %s %s%s (%s)", event.get("trial"), event.get("state"), value, params)
        if on_trial is not None:
            on_trial(event)


# ---------------------------------------------------------------- results


def report_sweep(sweep_dir: str | Path) -> Path:
    """Rewrite SWEEP_DIR/report.html from the study as it is now (a shared study: every trial, of
    every machine); ConfigError in one line for a folder that holds no sweep or a study that cannot
    be read. Returns the page's path."""
    folder = Path(sweep_dir)
    if not (folder / SWEEP_FILE).is_file():
        raise ConfigError(f"{folder}: not a sweep's folder (no {SWEEP_FILE}): give the --sweep-dir of a sweep")
    rc, settings, direction = load_sweep_file(folder)
    place = stores.resolve(settings.storage, settings.study, settings.heartbeat, folder)
    studies.import_optuna()
    if place.shared:
        stores.check_reachable(place)
    else:
        studies.check_study(folder, place.name)
    plan = SweepPlan(rc, settings, direction, "", folder, [], True, place)
    try:
        study = stores.patiently(place, "reading the study", lambda: studies.load(place))
    except KeyError:  # "Record does not exist"
        raise ConfigError(f"{folder}: its study {place.name!r} is not in {place.shown} (yet): run the sweep first") \
            from None
    return _write_report(plan, study)


def _write_report(plan: SweepPlan, study) -> Path:
    from gputrain.io.atomic import write_text
    from gputrain.report.sweep_page import render_sweep_page

    rows = studies.trial_rows(plan.place, study, plan.settings.metric)
    best = studies.best_trial(study)
    page = render_sweep_page(rows, name=plan.rc.workload or "sweep", metric=plan.settings.metric,
                             direction=plan.direction, budget=studies.budget(study, plan.settings.trials),
                             sweep_dir=str(plan.sweep_dir),
                             space={p.name: p.spec() for p in plan.settings.space}, storage=plan.place.shown,
                             study_name=plan.place.name, best=best.number if best else None,
                             here=str(plan.sweep_dir.resolve()) if plan.place.shared else None)
    return write_text(plan.sweep_dir / REPORT_FILE, page)


def _result(plan: SweepPlan, study) -> SweepResult:
    rows = studies.trial_rows(plan.place, study, plan.settings.metric)
    best_trial = studies.best_trial(study)  # Optuna's own pick: what optuna.load_study(...).best_trial names
    best = next((r for r in rows if best_trial is not None and r["number"] == best_trial.number), None)
    here = str(plan.sweep_dir.resolve())
    where = Path(best["sweep_dir"]) if best and best.get("sweep_dir") not in (None, here) else plan.sweep_dir
    return SweepResult(sweep_dir=plan.sweep_dir, metric=plan.settings.metric, direction=plan.direction,
                       best_trial=best["number"] if best else None, best_value=best["value"] if best else None,
                       best_params=dict(best["params"]) if best else {},
                       best_run_dir=where / best["run_dir"] if best and best["run_dir"] else None,
                       best_machine=best.get("machine") if best else None,
                       trials=rows, report=plan.sweep_dir / REPORT_FILE, storage=plan.place.shown,
                       study_name=plan.place.name)
