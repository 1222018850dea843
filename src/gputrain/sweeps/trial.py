"""A sweep's worker: asks the study for a trial, trains it as `gputrain fit --config` does, tells the
study how it went, and again until the budget is spent.

The coordinator (sweeps/runner.py) starts it as `python -m gputrain.sweeps.trial SWEEP_DIR INDEX`,
with the GPU (CUDA_VISIBLE_DEVICES) or the share of CPU threads that is its own. Each trial is an
ordinary run directory, SWEEP_DIR/trials/trial-NNNN: the trial's config (the sweep's run config
with its parameters) is written there as config.toml, resolved to a run spec and trained as any
run is (gputrain/runs/), which records the resolved spec over it, so `gputrain fit --config
SWEEP_DIR/trials/trial-NNNN/config.toml` repeats a trial. Its evaluations reach Optuna through a callback (`TrialReporter`), from the
records the trainer has already read: no extra host reads.

A worker asks for a trial only while the study's finished trials and those running are fewer than
its budget; on a shared study it then checks its trial's place in line (the trials numbered before
it), so that two machines asking at once never run past the budget: the one over it gives its
trial back unrun (failed, user attr over_budget, left out of the report). With finished + running
at the budget, a worker on a shared study waits (a running trial may be a dead worker's, failed
by the heartbeat and queued again, sweeps/storage.py) and stops once the finished trials reach it;
a running trial that never said where it runs (its worker died before its first heartbeat) is
failed and queued again by a waiting worker after 3 heartbeats.
Each trial records where it ran: user attrs machine (the host's name), sweep_dir and run_dir.

Prints one JSON line per finished trial on stdout (the coordinator's progress; {"note": ...} for a
database that went away and came back). Exit status: 0 when the budget is spent; 2, with one line
on stderr, when a trial reported no value of the metric (no trial will: the sweep stops); 130 or
143 after a stop signal (the trial is queued again);
1 when training raised an error that is not gputrain's (the traceback is in the trial's error.txt);
3, with one line, when the study's database was away for longer than a worker waits.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import signal
import socket
import sys
import time
import traceback
from pathlib import Path
from typing import Any, Callable, ContextManager

from gputrain.errors import ConfigError, GputrainError, StopRequested
from gputrain.runs.stated import RunConfig
from gputrain.sweeps.storage import LOST_STATUS, StorageLost
from gputrain.train.loop.callbacks import Callback

METRIC_MISSING = 2


class TrialReporter(Callback):
    """Reports `metric` at each log point that has it (every evaluation is one) to an Optuna trial,
    and stops the run when the pruner says so. Reads only the record's host floats.

    trial: anything with Optuna's `report(value, step)` and `should_prune()`; lock: a context manager
    factory held around each call into the study (the study's one-process-at-a-time lock); call:
    runs each call (a shared study's: again after a lost connection, sweeps/storage.py `patiently`).
    A trial failed from outside meanwhile (by the heartbeat, while the database was away) stops the
    run: it runs again as another trial (`lost`).
    """

    state_key = "sweep_trial"

    def __init__(self, trial: Any, metric: str, lock: Callable[[], ContextManager[Any]] = contextlib.nullcontext,
                 call: Callable[[Callable[[], Any]], Any] = lambda f: f()):
        self.trial, self.metric, self.lock, self.call = trial, metric, lock, call
        self.pruned_at: int | None = None
        self.lost = False
        self.records: list[dict[str, Any]] | None = None

    def on_log(self, run, record: dict[str, Any]) -> None:
        value = record.get(self.metric)
        if not isinstance(value, (int, float)) or isinstance(value, bool) or self.pruned_at is not None or self.lost:
            return

        def report() -> bool:
            with self.lock():
                self.trial.report(float(value), run.step)
                return self.trial.should_prune()

        try:
            prune = self.call(report)
        except Exception as exc:
            if type(exc).__name__ != "UpdateFinishedTrialError":  # optuna.exceptions': failed from outside
                raise
            self.lost = True
            run.request_stop("the sweep's study failed this trial from outside (no heartbeat while its database was "
                             "away); it runs again as another trial")
            return
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
    """Run trials until the study's budget is spent; returns the exit status (see the module docstring)."""
    from gputrain.sweeps import storage as stores, study as studies
    from gputrain.sweeps.folder import load_sweep_file
    from gputrain.sweeps.runner import make_pruner, make_sampler

    rc, settings, direction = load_sweep_file(sweep_dir)
    place = stores.resolve(settings.storage, settings.study, settings.heartbeat, sweep_dir)

    def call(what: str, fn: Callable[[], Any]) -> Any:  # a shared study's call, again after a lost connection
        return stores.patiently(place, what, fn, say=lambda note: _note(note))

    def lock():
        return studies.guard(place)

    storage = call("opening the study", lambda: stores.open_storage(place))
    # seeds differ per worker and per start: a resume draws new values
    started = call("opening the study", lambda: len(studies.load(place, storage=storage).get_trials(deepcopy=False)))
    study = studies.load(place, sampler=make_sampler(settings, index, started), pruner=make_pruner(settings),
                         storage=storage)
    optuna = studies.import_optuna()
    state = optuna.trial.TrialState
    distributions = {p.name: p.distribution() for p in settings.space}
    study_id = call("opening the study", lambda: storage.get_study_id_from_name(place.name))
    where = {"machine": socket.gethostname(), "sweep_dir": str(sweep_dir.resolve())}

    def fail_stale() -> None:  # a dead worker's trial: failed, queued again (storage.py); nothing on SQLite
        if place.heartbeats:
            with stores.quiet_experimental():
                optuna.storages.fail_stale_trials(study)

    unheard: dict[int, float] = {}
    parent = os.getppid()
    while os.getppid() == parent:  # a coordinator that died leaves its workers to finish their trial only
        trial = call("asking for a trial", lambda: _claim(study, place, settings.trials, distributions, lock,
                                                          fail_stale, state, unheard))
        if trial is None:
            return 0
        if trial == "wait":
            time.sleep(place.heartbeat)
            continue
        trial_id = call("asking for a trial",
                        lambda: storage.get_trial_id_from_study_id_trial_number(study_id, trial.number))
        with stores.Heartbeat(place, storage, trial_id, fail_stale):
            status = _run_trial(sweep_dir, trial, study, rc, settings, direction, where, lock, call, state)
        if status is not None:
            return status
    return 0


def _claim(study, place, trials: int, distributions, lock, fail_stale, state, unheard: dict[int, float] | None = None):
    """The next trial to run; "wait" (running trials may be dead workers': look again in a
    heartbeat); None when the budget is spent (see the module docstring). unheard: {trial number:
    when this worker first saw it running without a word of where it runs} (`_fail_unheard`)."""
    from gputrain.sweeps import study as studies

    with lock():
        fail_stale()
        have = study.get_trials(deepcopy=False)
        goal = studies.budget(study, trials)
        done = sum(studies.finished(t) for t in have)
        if done >= goal:
            return None
        if done + sum(t.state == state.RUNNING for t in have) >= goal:
            if not place.heartbeats:
                return None
            _fail_unheard(study, place, have, {} if unheard is None else unheard, state)
            return "wait"
        trial = study.ask(distributions)
    if not place.shared:  # the lock made the count and the ask one step
        return trial
    ahead = [t for t in study.get_trials(deepcopy=False) if t.number < trial.number]
    if sum(studies.counted(t) or t.state == state.WAITING for t in ahead) >= goal:  # another machine asked first
        trial.set_user_attr("over_budget", True)
        study.tell(trial, state=state.FAIL)
        return "wait" if place.heartbeats else None
    return trial


def _fail_unheard(study, place, have, unheard: dict[int, float], state) -> None:
    """Fail and queue again the running trials that never said where they run (their own run_dir:
    a retry carries its first run's user attrs) for GRACE_BEATS heartbeats of this worker's clock: a
    worker killed between its ask and its first heartbeat leaves one that the heartbeat never finds
    (it has no heartbeat at all)."""
    from gputrain.sweeps.storage import GRACE_BEATS
    from gputrain.sweeps.study import TRIALS_DIR

    now = time.monotonic()
    for t in have:
        if t.state != state.RUNNING or t.user_attrs.get("run_dir") == f"{TRIALS_DIR}/trial-{t.number:04d}":
            continue
        if now - unheard.setdefault(t.number, now) <= GRACE_BEATS * place.heartbeat:
            continue
        try:  # only the worker whose tell fails it queues it again: another's raises (already finished)
            study.tell(t.number, state=state.FAIL)
        except Exception as exc:  # ValueError "Cannot tell a FAIL trial", optuna's UpdateFinishedTrialError
            if isinstance(exc, ValueError) or type(exc).__name__ == "UpdateFinishedTrialError":
                continue
            raise
        if t.params:
            study.enqueue_trial(t.params, user_attrs={"retry_of": t.number})


def _run_trial(sweep_dir, trial, study, rc, settings, direction, where, lock, call, state) -> int | None:
    """Train one trial and tell the study how it went; an exit status to stop the worker with, or
    None to go on."""
    from gputrain.io.atomic import write_text
    from gputrain.io.run_layout import CONFIG_FILE
    from gputrain.sweeps import study as studies
    from gputrain.sweeps.settings import trial_config, tree_text

    run_dir = studies.trial_dir(sweep_dir, trial.number)
    reporter = TrialReporter(trial, settings.metric, lock, call=lambda fn: call("reporting to the study", fn))

    def tell(**outcome) -> None:
        def told():
            with lock():
                return study.tell(trial, skip_if_finished=True, **outcome)

        frozen = call("telling the study", told)
        if frozen.state == state.FAIL and outcome.get("state") != state.FAIL:
            _note(f"trial {trial.number} was failed from outside while it ran (no heartbeat while the study's "
                  "database was away): it runs again as another trial")

    try:  # from the ask on: a stop signal before the run starts marks the trial too
        stated = trial_config(rc, settings, trial.params)
        write_text(run_dir / CONFIG_FILE, tree_text(stated, header=[
            f"trial {trial.number} of the sweep in {sweep_dir}: its parameters over the sweep's run config"]))

        def record_where():
            with lock():
                for key, value in {**where, "run_dir": str(run_dir.relative_to(sweep_dir))}.items():
                    trial.set_user_attr(key, value)

        call("recording the trial", record_where)
        train_trial(run_dir, stated, reporter)
    except (StopRequested, KeyboardInterrupt) as exc:  # interrupted: failed now, queued again with its parameters
        tell(state=state.FAIL)

        def again():
            with lock():
                study.enqueue_trial(trial.params, user_attrs={"retry_of": trial.number})

        with contextlib.suppress(Exception):  # the database away at a stop: the heartbeat or a resume queues it
            call("queueing the trial again", again)
        return exc.exit_code if isinstance(exc, StopRequested) else 130
    except GputrainError as exc:  # the trial's own outcome (a diverged loss, a refused setting)
        _fail(study, trial, lock, f"{type(exc).__name__}: {exc}", state, call)
        _event(trial.number, "fail", None, trial.params, error=str(exc))
        return None
    except Exception as exc:
        write_text(run_dir / "error.txt", traceback.format_exc())
        _fail(study, trial, lock, f"{type(exc).__name__}: {exc}", state, call)
        print(f"trial {trial.number} failed: {type(exc).__name__}: {exc} (traceback: {run_dir / 'error.txt'})",
              file=sys.stderr)
        return 1
    if reporter.lost:
        return None
    if reporter.pruned_at is not None:
        tell(state=state.PRUNED)
        _event(trial.number, "pruned", None, trial.params, step=reporter.pruned_at)
        return None
    value = trial_value(reporter.records or [], settings.metric, settings.value, direction)
    if value is None:
        have = reported_keys(reporter.records)
        message = (f"trial {trial.number} reported no {settings.metric} (its runs report "
                   f"{', '.join(have) or 'nothing'}): set [sweep] metric to one of them and start the sweep in "
                   "a new --sweep-dir")
        _fail(study, trial, lock, message, state, call)
        print(message, file=sys.stderr)
        return METRIC_MISSING
    if not math.isfinite(value):
        _fail(study, trial, lock, f"{settings.metric} was {value}", state, call)
        _event(trial.number, "fail", value, trial.params, error=f"{settings.metric} was {value}")
        return None
    tell(values=value)
    _event(trial.number, "complete", value, trial.params)
    return None


def _fail(study, trial, lock, message: str, state, call) -> None:
    def fail():
        with lock():
            trial.set_user_attr("error", message)
            study.tell(trial, state=state.FAIL, skip_if_finished=True)

    call("telling the study", fail)


def _note(text: str) -> None:
    """A line for the coordinator to show (a database that went away, came back)."""
    print(json.dumps({"note": text}), flush=True)


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
    except StorageLost as exc:
        print(str(exc), file=sys.stderr)
        return LOST_STATUS
    except ConfigError as exc:
        print(str(exc), file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
