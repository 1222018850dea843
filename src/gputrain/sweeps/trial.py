"""A sweep's worker: asks the study for a trial, trains it as `gputrain fit --config` does, tells the
study how it went, and again until the budget is spent.

The coordinator (sweeps/runner.py) starts it as `python -m gputrain.sweeps.trial SWEEP_DIR INDEX`,
with the GPU (CUDA_VISIBLE_DEVICES) or the share of CPU threads that is its own. Each trial is an
ordinary run directory, SWEEP_DIR/trials/trial-NNNN: the trial's config (the sweep's run config
with its parameters) is written there as config.toml, resolved to a run spec and trained as any
run is (gputrain/runs/), which records the resolved spec over it, so `gputrain fit --config
SWEEP_DIR/trials/trial-NNNN/config.toml` repeats a trial. Its evaluations reach Optuna through a callback (`TrialReporter`), from the
records the trainer has already read: no extra host reads.

Prints one JSON line per finished trial on stdout (the coordinator's progress). Exit status: 0 when
the budget is spent; 2, with one line on stderr, when a trial reported no value of the metric (no
trial will: the sweep stops); 130 or 143 after a stop signal (the trial is queued again on resume);
1 when training raised an error that is not gputrain's (the traceback is in the trial's error.txt).
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import signal
import sys
import traceback
from pathlib import Path
from typing import Any, Callable, ContextManager

from gputrain.errors import ConfigError, GputrainError, StopRequested
from gputrain.runs.stated import RunConfig
from gputrain.train.loop.callbacks import Callback

METRIC_MISSING = 2


class TrialReporter(Callback):
    """Reports `metric` at each log point that has it (every evaluation is one) to an Optuna trial,
    and stops the run when the pruner says so. Reads only the record's host floats.

    trial: anything with Optuna's `report(value, step)` and `should_prune()`; lock: a context manager
    factory held around each call into the study (the study's one-process-at-a-time lock).
    """

    state_key = "sweep_trial"

    def __init__(self, trial: Any, metric: str, lock: Callable[[], ContextManager[Any]] = contextlib.nullcontext):
        self.trial, self.metric, self.lock = trial, metric, lock
        self.pruned_at: int | None = None
        self.records: list[dict[str, Any]] | None = None

    def on_log(self, run, record: dict[str, Any]) -> None:
        value = record.get(self.metric)
        if not isinstance(value, (int, float)) or isinstance(value, bool) or self.pruned_at is not None:
            return
        with self.lock():
            self.trial.report(float(value), run.step)
            prune = self.trial.should_prune()
        if prune:
            self.pruned_at = run.step
            run.request_stop(f"pruned by the sweep: {self.metric} {value:.4g} at step {run.step} is worse than "
                             "earlier trials' at this step")

    def on_run_end(self, run, history) -> None:
        self.records = list(history.records)


def trial_value(records: list[dict[str, Any]], metric: str, kind: str, direction: str) -> float | None:
    """The trial's value: the metric's last value ("final") or its best finite one ("best"); None
    when no record has the metric."""
    values = [float(r[metric]) for r in records
              if isinstance(r.get(metric), (int, float)) and not isinstance(r.get(metric), bool)]
    if not values:
        return None
    finite = [v for v in values if math.isfinite(v)]
    if kind == "best" and finite:
        return min(finite) if direction == "min" else max(finite)
    return values[-1]


def reported_keys(records: list[dict[str, Any]] | None) -> list[str]:
    """The metrics a run's records hold (loss and eval_*), for the message of a metric it lacks."""
    return sorted({k for r in records or [] for k in r if k == "loss" or k.startswith("eval_")})


def train_trial(run_dir: Path, stated: RunConfig, reporter: TrialReporter) -> None:
    """Train the trial `stated` in `run_dir` as any run is trained (resolved to a spec, then
    trained), its evaluations reported through `reporter`."""
    from gputrain.runs.stated import merge
    from gputrain.runs.resolve import resolve
    from gputrain.runs.train import train_spec

    spec, workload = resolve(merge(stated, RunConfig(train={"run_dir": str(run_dir)})))
    train_spec(spec, workload, callbacks=[reporter])


def run_worker(sweep_dir: Path, index: int) -> int:
    """Run trials until the budget is spent; returns the exit status (see the module docstring)."""
    from gputrain.io.atomic import write_text
    from gputrain.io.run_layout import CONFIG_FILE
    from gputrain.sweeps import study as studies
    from gputrain.sweeps.runner import load_sweep_file, make_pruner, make_sampler
    from gputrain.sweeps.settings import trial_config, tree_text

    rc, settings, direction = load_sweep_file(sweep_dir)
    with studies.access(sweep_dir):  # seeds differ per worker and per start: a resume draws new values
        started = len(studies.load(sweep_dir, lock=False).get_trials(deepcopy=False))
    study = studies.load(sweep_dir, sampler=make_sampler(settings, index, started), pruner=make_pruner(settings))
    optuna = studies.import_optuna()
    state = optuna.trial.TrialState
    distributions = {p.name: p.distribution() for p in settings.space}
    parent = os.getppid()

    def lock():
        return studies.access(sweep_dir)

    while os.getppid() == parent:  # a coordinator that died leaves its workers to finish their trial only
        with lock():
            if sum(studies.counted(t) for t in study.get_trials(deepcopy=False)) >= settings.trials:
                return 0
            trial = study.ask(distributions)
        run_dir = studies.trial_dir(sweep_dir, trial.number)
        reporter = TrialReporter(trial, settings.metric, lock)
        try:  # from the ask on: a stop signal before the run starts marks the trial too
            stated = trial_config(rc, settings, trial.params)
            write_text(run_dir / CONFIG_FILE, tree_text(stated, header=[
                f"trial {trial.number} of the sweep in {sweep_dir}: its parameters over the sweep's run config"]))
            with lock():
                trial.set_user_attr("run_dir", str(run_dir.relative_to(sweep_dir)))
            train_trial(run_dir, stated, reporter)
        except (StopRequested, KeyboardInterrupt) as exc:  # interrupted: failed now, queued again on resume
            with lock():
                study.tell(trial, state=state.FAIL)
            return exc.exit_code if isinstance(exc, StopRequested) else 130
        except GputrainError as exc:  # the trial's own outcome (a diverged loss, a refused setting)
            _fail(study, trial, lock, f"{type(exc).__name__}: {exc}", state)
            _event(trial.number, "fail", None, trial.params, error=str(exc))
            continue
        except Exception as exc:
            write_text(run_dir / "error.txt", traceback.format_exc())
            _fail(study, trial, lock, f"{type(exc).__name__}: {exc}", state)
            print(f"trial {trial.number} failed: {type(exc).__name__}: {exc} (traceback: {run_dir / 'error.txt'})",
                  file=sys.stderr)
            return 1
        if reporter.pruned_at is not None:
            with lock():
                study.tell(trial, state=state.PRUNED)
            _event(trial.number, "pruned", None, trial.params, step=reporter.pruned_at)
            continue
        value = trial_value(reporter.records or [], settings.metric, settings.value, direction)
        if value is None:
            have = reported_keys(reporter.records)
            message = (f"trial {trial.number} reported no {settings.metric} (its runs report "
                       f"{', '.join(have) or 'nothing'}): set [sweep] metric to one of them and start the sweep in "
                       "a new --sweep-dir")
            _fail(study, trial, lock, message, state)
            print(message, file=sys.stderr)
            return METRIC_MISSING
        if not math.isfinite(value):
            _fail(study, trial, lock, f"{settings.metric} was {value}", state)
            _event(trial.number, "fail", value, trial.params, error=f"{settings.metric} was {value}")
            continue
        with lock():
            study.tell(trial, value)
        _event(trial.number, "complete", value, trial.params)
    return 0


def _fail(study, trial, lock, message: str, state) -> None:
    with lock():
        trial.set_user_attr("error", message)
        study.tell(trial, state=state.FAIL)


def _event(number: int, outcome: str, value: float | None, params: dict[str, Any], **extra: Any) -> None:
    print(json.dumps({"trial": number, "state": outcome, "value": value, "params": params, **extra}), flush=True)


def _stop_on_sigterm(signum, frame):  # between trials (a run handles its stop signals itself)
    raise KeyboardInterrupt


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 2:
        print("usage: python -m gputrain.sweeps.trial SWEEP_DIR WORKER_INDEX (started by gputrain sweep)",
              file=sys.stderr)
        return 2
    signal.signal(signal.SIGTERM, _stop_on_sigterm)
    try:
        return run_worker(Path(argv[0]), int(argv[1]))
    except KeyboardInterrupt:
        return 130
    except ConfigError as exc:
        print(str(exc), file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
