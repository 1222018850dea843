"""From what was stated (a RunConfig: the command line over a file, a sweep's trial, Python's
arguments) to a RunSpec: the workload resolved, its defaults under the stated settings, the run
directory and resume target decided, and every field checked. Nothing is written here."""

from __future__ import annotations

import dataclasses
import sys
import time
from pathlib import Path
from typing import Any

from gputrain.config import DEFAULT_LOGGERS, tensorboard_loggers, workload_config
from gputrain.errors import ConfigError
from gputrain.io.run_layout import CHECKPOINTS_DIR, LEGACY_CHECKPOINT
from gputrain.runs.stated import RunConfig, option_text
from gputrain.runs.spec import AUTO_FIELDS, DEFAULT_WORKLOAD, RunSettings, RunSpec, WorkloadSpec

RUNS_FOLDER = "runs"  # the default run directory: runs/WORKLOAD/TIME


def resolve(stated: RunConfig, workload: Any = None) -> tuple[RunSpec, Any]:
    """(RunSpec, Workload) of what `stated` says; `workload`: the Workload when the caller built it.

    Each setting from the first of: `stated`, the workload's defaults, the fields' defaults.
    Raises ConfigError (one line) for a value a field refuses, a resume with nothing to resume, a
    best_metric or early_stop the workload's runs never report, or a compile cache folder that cannot
    be one (runtime/compile_cache.py).
    """
    fit = RunSettings(**stated.fit)
    train = dict(stated.train)
    options = {k: option_text(v) for k, v in stated.options.items()}  # options reach a workload as strings
    name, options = _workload_to_train(stated.workload, options, train)
    if workload is None:
        from gputrain.workloads import resolve_workload

        workload = resolve_workload(name, **options)
    auto = tuple(k for k in AUTO_FIELDS if train.get(k, "auto" if k == "progress" else None) == "auto")
    tensorboard = train.pop("tensorboard", None)  # --no-tensorboard: the loggers without it
    given = {k: v for k, v in train.items() if k not in ("run_dir", "resume") and k not in auto}
    if tensorboard is not None:
        given["loggers"] = tensorboard_loggers(given.get("loggers", workload.defaults.get("loggers", DEFAULT_LOGGERS)),
                                               tensorboard)
    given["run_dir"], given["resume"] = _place(workload.name, train.get("run_dir"), train.get("resume", False),
                                               fit.no_save)
    if "progress" in auto:
        given["progress"] = sys.stderr.isatty()
    # a batch size stated as "auto" is stated: a full-batch workload's is searched too
    config = workload_config(workload, given, full_batch=workload.full_batch and "batch_size" not in train)
    check_reported(config.best_metric, workload, fit.ema, "best_metric")
    check_reported(fit.early_stop, workload, fit.ema, "early_stop")  # else the run trains without stopping early
    if config.compile:  # before torch's compiler is imported (it makes TORCHINDUCTOR_CACHE_DIR's folder then)
        from gputrain.runtime.compile_cache import check_folders
        from gputrain.runtime.distributed import process_device

        check_folders(config.compile_cache, process_device(config.device))
    if workload.step_fn is not None:
        from gputrain.train.step.own_step import refuse_unsupported

        refuse_unsupported(config)
    if stated.optimizers and workload.step_fn is None:
        raise ConfigError(f"[optimizers] sets {', '.join(stated.optimizers)}, but {workload.name} trains with the "
                          "built-in step (one optimizer: set [train] lr and weight_decay instead)")
    spec = RunSpec(WorkloadSpec(name, options, dict(stated.optimizers)), config, fit, auto, run_dir_stated=bool(train.get("run_dir")))
    return spec, workload


def resolve_measured(stated: RunConfig) -> tuple[RunSpec, Any]:
    """(RunSpec, Workload) of a run that is measured, not trained (`gputrain profile`, `memory`): as
    `resolve`, but nothing is written or resumed (a file's run_dir and resume, and its [fit]
    settings, belong to a run that trains) and no progress bar unless stated. ConfigError when
    neither a workload nor a config file is given."""
    if stated.workload is None and stated.source is None:
        raise ConfigError("give a workload (a built-in one, see `gputrain fit --list`, or module:function) or a run's "
                          "--config FILE")
    train = {k: v for k, v in stated.train.items() if k not in ("run_dir", "resume")}
    train.setdefault("progress", False)
    return resolve(dataclasses.replace(stated, train=train, fit={"no_save": True}))


def check_reported(metric: str | None, workload: Any, ema: float | None, what: str) -> None:
    """Refuse a metric that the workload's evaluations never report (loss, eval_loss, eval_accuracy
    for a classifier, eval_<name> of its metrics; eval_ema_* with an EMA). A workload with a metric
    of its own callable may report eval_<name>_<key>: those are let through."""
    if metric is None or metric == "loss":
        return
    names = set(workload.metrics or {})
    reported = {"eval_loss", *(f"eval_{n}" for n in names)}
    if workload.task in ("classification", "binary"):
        reported.add("eval_accuracy")
    key = metric.replace("eval_ema_", "eval_", 1)
    if key in reported or any(key.startswith(f"eval_{n}_") for n in names):
        if metric != key and ema is None:
            raise ConfigError(f"{what} {metric!r} is an EMA's evaluation: keep one (--ema DECAY, [fit] ema) or name "
                              f"{key}")
        return
    raise ConfigError(f"{what} {metric!r} is not reported by {workload.name}'s runs: they report loss and "
                      f"{', '.join(sorted(reported))}{' (and eval_ema_* with --ema)' if ema is None else ''}")


def latest_run(workload_name: str) -> Path | None:
    """The newest run under runs/WORKLOAD/ that holds a checkpoint; None when there is none."""
    base = Path(RUNS_FOLDER) / safe_name(workload_name)
    if not base.is_dir():
        return None
    runs = sorted(d for d in base.iterdir() if (d / CHECKPOINTS_DIR).is_dir() or (d / LEGACY_CHECKPOINT).exists())
    return runs[-1] if runs else None


def resumed_run_dir(path: Path) -> Path:
    """The run directory of a resume target: the folder itself, or the run a checkpoint
    (RUN_DIR/checkpoints/step-N.pt or .dcp, or an older RUN_DIR/checkpoint.pt) belongs to."""
    if path.is_dir() and not path.name.endswith(".dcp"):
        return path
    return path.parent.parent if path.parent.name == CHECKPOINTS_DIR else path.parent


def safe_name(name: str) -> str:
    """A workload's name as a folder name."""
    return "".join(c if c.isalnum() or c in "-_." else "_" for c in name)


def _place(workload_name: str, run_dir: str | None, resume: bool | str, no_save: bool) -> tuple[str | None, bool | str]:
    """(run_dir, resume) of the run: None with --no-save; a resume target's own run directory; else
    runs/WORKLOAD/TIME."""
    if no_save:
        if resume:
            raise ConfigError("--resume needs a run directory: drop --no-save")
        return None, False
    if resume is True and run_dir is None:
        latest = latest_run(workload_name)
        if latest is None:
            raise ConfigError(f"--resume: no earlier run of {workload_name} with a checkpoint under {RUNS_FOLDER}/; "
                              "give the run directory or checkpoint file")
        run_dir = str(latest)
    elif isinstance(resume, str):
        path = Path(resume)
        if not path.exists():
            raise ConfigError(f"--resume {resume}: no such run directory or checkpoint file")
        if path.is_dir() and not path.name.endswith(".dcp"):
            resume = True
        run_dir = run_dir or str(resumed_run_dir(path))
    if run_dir is None:
        run_dir = str(Path(RUNS_FOLDER) / safe_name(workload_name) / time.strftime("%Y%m%d-%H%M%S"))
    return run_dir, resume


def _workload_to_train(name: str | None, options: dict, train: dict) -> tuple[str, dict]:
    """(workload spec, options) the run trains: as stated, else (resuming a run) the run's own from
    its workload.json, else the default. A resume without options keeps the run's options."""
    from gputrain.workloads.from_run import recorded_workload, stored_spec

    run_dir, resume = train.get("run_dir"), train.get("resume")
    target = Path(run_dir) if run_dir else \
        resumed_run_dir(Path(resume)) if isinstance(resume, str) and Path(resume).exists() else None
    recorded = recorded_workload(target) if resume and target is not None else None
    chosen: str = name or (recorded["workload"] if recorded else DEFAULT_WORKLOAD)
    if recorded and recorded["workload"] in (chosen, stored_spec(chosen)) and not options:
        options = dict(recorded["options"])
    return chosen, options
