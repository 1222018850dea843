"""The sweep's coordinator: checks the plan, prepares the sweep directory, runs the workers and
writes the report.

    SWEEP_DIR/sweep.toml        the sweep's resolved config (run config + [sweep]); what a resume reads
    SWEEP_DIR/study.db          the Optuna study (SQLite): optuna.load_study(study_name="gputrain",
                                storage="sqlite:///SWEEP_DIR/study.db")
    SWEEP_DIR/trials/trial-NNNN ordinary run directories, one per trial
    SWEEP_DIR/report.html       the trials' table and plots

Workers are processes (sweeps/trial.py), one per GPU with CUDA_VISIBLE_DEVICES set to it (never two
on one GPU), or on the CPU with an equal share of the cores' threads each. A refused sweep writes
nothing; a killed one resumes where it stopped when run again (or with `--sweep-dir DIR` alone).
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
from gputrain.io.toml_file import TomlFile, dumps, read_toml
from gputrain.runs.stated import RunConfig, check_tree, load_run_config, option_text
from gputrain.sweeps import study as studies
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


@dataclass
class SweepResult:
    """What a sweep found. trials: one dict per trial (number, state, value, params, run_dir, ...)."""

    sweep_dir: Path
    metric: str
    direction: str
    best_trial: int | None
    best_value: float | None
    best_params: dict[str, Any]
    best_run_dir: Path | None
    trials: list[dict[str, Any]] = field(default_factory=list)
    report: Path | None = None
    storage: str = ""
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
    if workload:
        rc.workload = workload
    if not rc.workload:
        raise ConfigError(f"{rc.where()}: a sweep needs a workload: workload = NAME in the file, or "
                          "gputrain sweep WORKLOAD")
    settings = check_sweep(rc, overrides)
    from gputrain.metric_direction import metric_direction
    from gputrain.workloads import resolve_workload

    w = resolve_workload(rc.workload, **{k: option_text(v) for k, v in rc.options.items()})
    _check_trials_can_run(rc, settings, w)
    way = metric_direction(settings.metric, rc.train.get("metric_modes"), w.metrics)
    direction = settings.direction or way.mode
    why = "stated" if settings.direction else way.why()
    # The default folder is named for the config file (sweeps/lr for lr.toml): the same command again resumes.
    default = Path("sweeps") / _safe(Path(config).stem if isinstance(config, (str, Path)) else rc.workload)
    folder = Path(sweep_dir or settings.sweep_dir or default)
    resumed = _check_folder(folder, rc, settings, direction)
    slots = worker_slots(str(rc.train.get("device", w.defaults.get("device", "auto"))), settings.workers,
                         cuda_devices)
    return SweepPlan(rc, settings, direction, why, folder, slots, resumed)


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
          direction: str | None = None, on_trial: Callable[[dict[str, Any]], None] | None = None) -> SweepResult:
    """Search hyperparameters with Optuna: each trial an ordinary run directory under the sweep's.

    config: a TOML file (or the same tree as a dict) with the run (workload, [train], ...) and
    [sweep] (trials, metric, [sweep.space]; see gputrain/sweeps/settings.py); None resumes the sweep
    in `sweep_dir`. trials, workers, metric, direction override [sweep]. A sweep run again on its
    directory resumes: its finished trials stay, its interrupted ones run again. on_trial: called
    with each finished trial's event ({"trial", "state", "value", "params"}).

    Returns a SweepResult (best trial, value and params, every trial). Raises ConfigError for bad
    input (nothing written), StopRequested when stopped by a signal (resume by running it again).
    Needs Optuna (pip install 'gputrain[sweep]').
    """
    plan = plan_sweep(config, workload=workload, sweep_dir=sweep_dir,
                      overrides={"trials": trials, "workers": workers, "metric": metric, "direction": direction})
    studies.import_optuna()  # after the plan: a bad config is said first, with or without Optuna
    return run_plan(plan, on_trial)


def run_plan(plan: SweepPlan, on_trial: Callable[[dict[str, Any]], None] | None = None) -> SweepResult:
    """Run a checked plan: lock the directory, record sweep.toml, open the study, queue interrupted
    trials again, run the workers, write the report."""
    folder, settings = plan.sweep_dir, plan.settings
    made = next((f for f in (*reversed(folder.parents), folder) if not f.exists()), None)  # taken away if refused
    lock = studies.open_sweep(folder)  # made, locked and its study checked before anything is written
    try:
        try:
            _write_sweep_file(plan)
            study = studies.create_or_load(folder, plan.direction, settings.metric)
        except GputrainError:  # the study cannot be written (a full disk, a file-size limit): no trial ran
            if made is not None:
                shutil.rmtree(made, ignore_errors=True)  # the folders this call made, with what it wrote
            raise
        again = studies.retry_interrupted(folder, study)
        if again:
            log.info("resuming: trials %s were interrupted and run again", ", ".join(map(str, again)))
        with studies.access(folder):
            left = settings.trials - sum(studies.counted(t) for t in study.get_trials(deepcopy=False))
        if left > 0:
            log.info("sweep of %s in %s: %d trial(s) to run on %d worker(s); %s (%s)", plan.rc.workload, folder,
                     left, min(left, len(plan.slots)), f"{settings.metric}, {plan.direction}", plan.direction_why)
            try:
                _run_workers(plan, plan.slots[:left], lock, on_trial)
            finally:
                _write_report(plan, study)
        else:
            _write_report(plan, study)
        return _result(plan, study)
    finally:
        studies.release(lock)


def load_sweep_file(sweep_dir: Path) -> tuple[RunConfig, SweepSettings, str]:
    """(run config, settings, direction) of SWEEP_DIR/sweep.toml, for the workers."""
    rc = load_run_config(sweep_dir / SWEEP_FILE, what="--sweep-dir")
    settings = check_sweep(rc)
    return rc, settings, settings.direction or "min"


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


# ---------------------------------------------------------------- the sweep directory


def _check_folder(folder: Path, rc: RunConfig, settings: SweepSettings, direction: str) -> bool:
    """True when `folder` holds this sweep (a resume), False when it is new or empty; ConfigError
    when it is a file, holds another sweep, or holds something else."""
    if folder.exists() and not folder.is_dir():
        raise ConfigError(f"--sweep-dir {folder} is a file: give a folder")
    recorded = folder / SWEEP_FILE
    if recorded.is_file():
        old = load_run_config(recorded, what="--sweep-dir")
        old_settings = check_sweep(old)
        differs = _differences(_identity(old, old_settings, old_settings.direction or direction),
                               _identity(rc, settings, direction))
        if differs:
            raise ConfigError(f"{folder} holds another study (its {SWEEP_FILE} differs in {', '.join(differs[:4])}"
                              f"{' and more' if len(differs) > 4 else ''}): resume it with `gputrain sweep --sweep-dir "
                              f"{folder}`, or start this sweep in another --sweep-dir")
        return True
    if (folder / studies.DB_FILE).exists():
        raise ConfigError(f"{folder} holds a {studies.DB_FILE} that gputrain sweep did not make (no {SWEEP_FILE}): "
                          "give another --sweep-dir")
    if folder.is_dir() and any(folder.iterdir()):
        raise ConfigError(f"--sweep-dir {folder} is not empty and holds no sweep (no {SWEEP_FILE}): give a new or "
                          "empty folder")
    return False


def _identity(rc: RunConfig, settings: SweepSettings, direction: str) -> dict[str, Any]:
    sweep = settings.identity()
    sweep["direction"] = direction
    return {"workload": rc.workload, "options": rc.options, **({"optimizers": rc.optimizers} if rc.optimizers else {}),
            "train": rc.train, "fit": rc.fit, "sweep": sweep}


def _differences(a: Any, b: Any, prefix: str = "") -> list[str]:
    if isinstance(a, dict) and isinstance(b, dict):
        out = []
        for key in list(dict.fromkeys([*a, *b])):
            out += _differences(a.get(key), b.get(key), f"{prefix}{key}" if not prefix else f"{prefix}.{key}")
        return out
    norm = (lambda v: list(v) if isinstance(v, tuple) else v)
    return [] if norm(a) == norm(b) else [prefix or "the config"]


def _write_sweep_file(plan: SweepPlan) -> None:
    from gputrain.io.atomic import write_text

    rc, table = plan.rc, plan.settings.table()
    table["direction"] = plan.direction
    optimizers = {n: {k: list(v) if isinstance(v, tuple) else v for k, v in values.items()}
                  for n, values in rc.optimizers.items()}
    tables = {"options": rc.options, **({"optimizers": optimizers} if optimizers else {}),
              "train": {k: list(v) if isinstance(v, tuple) else v for k, v in rc.train.items()},
              "fit": rc.fit, "sweep": table}
    header = ["gputrain sweep: this sweep's config. Resume it: gputrain sweep --sweep-dir THIS_FOLDER",
              "(trials and workers may change on a resume; the rest is the study's identity)."]
    write_text(plan.sweep_dir / SWEEP_FILE, dumps({"workload": rc.workload}, tables, header=header))


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
        params = ", ".join(f"{k}={_short(v)}" for k, v in (event.get("params") or {}).items())
        value = "" if event.get("value") is None else f" {_short(event['value'])}"
        log.info("trial %s %s%s (%s)", event.get("trial"), event.get("state"), value, params)
        if on_trial is not None:
            on_trial(event)


# ---------------------------------------------------------------- results


def _write_report(plan: SweepPlan, study) -> Path:
    from gputrain.io.atomic import write_text
    from gputrain.report.sweep_page import render_sweep_page

    rows = studies.trial_rows(plan.sweep_dir, study, plan.settings.metric)
    page = render_sweep_page(rows, name=plan.rc.workload or "sweep", metric=plan.settings.metric,
                             direction=plan.direction, budget=plan.settings.trials, sweep_dir=str(plan.sweep_dir),
                             space={p.name: p.spec() for p in plan.settings.space},
                             storage=studies.storage_url(plan.sweep_dir))
    return write_text(plan.sweep_dir / REPORT_FILE, page)


def _result(plan: SweepPlan, study) -> SweepResult:
    rows = studies.trial_rows(plan.sweep_dir, study, plan.settings.metric)
    done = [r for r in rows if r["state"] == "complete" and r["value"] is not None]
    pick = min if plan.direction == "min" else max
    best = pick(done, key=lambda r: r["value"]) if done else None
    return SweepResult(sweep_dir=plan.sweep_dir, metric=plan.settings.metric, direction=plan.direction,
                       best_trial=best["number"] if best else None, best_value=best["value"] if best else None,
                       best_params=dict(best["params"]) if best else {},
                       best_run_dir=plan.sweep_dir / best["run_dir"] if best and best["run_dir"] else None,
                       trials=rows, report=plan.sweep_dir / REPORT_FILE, storage=studies.storage_url(plan.sweep_dir))


def _safe(name: str) -> str:
    return "".join(c if c.isalnum() or c in "-_." else "_" for c in name)
