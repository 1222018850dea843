"""MLflow behind the tracker interface (report/trackers.py), through MLflow's own client.

Where: MLFLOW_TRACKING_URI when set (a server, Databricks, a database); otherwise a SQLite store in
the run directory (`RUN_DIR/mlflow.db`, artifacts in `RUN_DIR/mlflow-artifacts/`), which
`mlflow ui --backend-store-uri sqlite:///RUN_DIR/mlflow.db` shows. The experiment is
MLFLOW_EXPERIMENT_NAME, else the run's name (the workload), else "gputrain".

What: the TrainConfig as params; every number of each log point as metrics at its step (train loss,
lr, samples/s, and the evaluations); at the end the summary (numbers as `summary/<key>` metrics,
all of it as summary.json) and report.html, curves.png and history.json as artifacts. A resumed run
continues its MLflow run (the id is kept in RUN_DIR/trackers.json).

A server that does not answer is found before training starts (GET /health, 5 s), not by MLflow's
retries during it.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from pathlib import Path
from typing import Any, Iterator

from gputrain.report.tracker_base import (Tracker, TrackerUnavailable, numbers_at_step, numeric, require, resumed_id,
                                          run_name, write_id)

INSTALL_HINT = "pip install 'gputrain[track]' (mlflow-skinny, sqlalchemy, alembic)"
HEALTH_TIMEOUT_S = 5.0
_BATCH = 100  # MLflow's log_batch takes at most 100 params and 1000 metrics per call


class MLflowTracker(Tracker):
    name = "mlflow"

    def __init__(self, run_dir: Path, config: dict[str, Any], start_step: int):
        require("mlflow", INSTALL_HINT)
        from mlflow.tracking import MlflowClient
        self.run_dir = Path(run_dir)
        uri = os.environ.get("MLFLOW_TRACKING_URI") or default_uri(self.run_dir)
        check_reachable(uri)
        with _quiet_setup():
            self.client = MlflowClient(tracking_uri=uri)
            experiment = os.environ.get("MLFLOW_EXPERIMENT_NAME") or config.get("name") or "gputrain"
            found = self.client.get_experiment_by_name(experiment)
            if found is not None:
                experiment_id = found.experiment_id
            else:
                local = None if os.environ.get("MLFLOW_TRACKING_URI") else \
                    (self.run_dir / "mlflow-artifacts").resolve().as_uri()
                experiment_id = self.client.create_experiment(experiment, artifact_location=local)
        self.uri = uri
        previous = resumed_id(self.run_dir, self.name, start_step)
        if previous:
            self.run_id = previous
            self.client.update_run(previous, status="RUNNING")
        else:
            run = self.client.create_run(experiment_id, run_name=run_name(self.run_dir, config),
                                         tags={"gputrain.run_dir": str(self.run_dir.resolve())})
            self.run_id = run.info.run_id
            self._log_params(config)
            write_id(self.run_dir, self.name, self.run_id)

    def _log_params(self, config: dict[str, Any]) -> None:
        from mlflow.entities import Param

        params = [Param(k, _param_value(v)) for k, v in sorted(config.items())]
        for i in range(0, len(params), _BATCH):
            self.client.log_batch(self.run_id, params=params[i:i + _BATCH])

    def log(self, record: dict[str, Any]) -> None:
        from mlflow.entities import Metric

        step, values = numbers_at_step(record)
        now = int(time.time() * 1000)
        metrics = [Metric(k, x, now, step) for k, x in values.items()]
        if metrics:
            self.client.log_batch(self.run_id, metrics=metrics)

    def finish(self, summary: dict[str, Any], files: list[Path]) -> None:
        from mlflow.entities import Metric

        step = int(summary.get("steps") or 0)
        now = int(time.time() * 1000)
        metrics = [Metric(f"summary/{k}", x, now, step) for k, v in summary.items() if (x := numeric(v)) is not None]
        if metrics:
            self.client.log_batch(self.run_id, metrics=metrics)
        self.client.log_dict(self.run_id, _plain(summary), "summary.json")
        for path in files:
            if path.is_file():
                self.client.log_artifact(self.run_id, str(path))
        self.client.set_terminated(self.run_id, "FINISHED")

    def fail(self, error: BaseException) -> None:
        from gputrain.errors import StopRequested

        stopped = isinstance(error, (StopRequested, KeyboardInterrupt))
        self.client.set_terminated(self.run_id, "KILLED" if stopped else "FAILED")


def default_uri(run_dir: Path) -> str:
    """A SQLite store in the run directory (MLflow's file store is in maintenance mode since 3.x)."""
    try:
        import alembic  # noqa: F401  (MLflow creates the SQLite schema with it)
        import sqlalchemy  # noqa: F401
    except ImportError as exc:
        raise TrackerUnavailable(f"MLflow's local SQLite store needs sqlalchemy and alembic ({exc}): {INSTALL_HINT}; "
                                 "or set MLFLOW_TRACKING_URI to a tracking server") from None
    run_dir.mkdir(parents=True, exist_ok=True)
    return f"sqlite:///{(run_dir / 'mlflow.db').resolve()}"


def check_reachable(uri: str) -> None:
    """For an http(s) tracking server: its /health answers within HEALTH_TIMEOUT_S, or TrackerUnavailable."""
    if not uri.startswith(("http://", "https://")):
        return
    import urllib.error
    import urllib.request

    url = uri.rstrip("/") + "/health"
    try:
        with urllib.request.urlopen(url, timeout=HEALTH_TIMEOUT_S):
            pass
    except urllib.error.HTTPError:
        return  # it answered (a server without /health, or one that wants a token): let MLflow talk to it
    except (OSError, ValueError) as exc:
        reason = getattr(exc, "reason", exc)
        raise TrackerUnavailable(f"the MLflow server at {uri} does not answer ({reason})") from None


@contextlib.contextmanager
def _quiet_setup() -> Iterator[None]:
    """Keep MLflow's and alembic's INFO lines (creating the SQLite schema) out of the run log."""
    loggers = [logging.getLogger(n) for n in ("mlflow", "alembic")]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.WARNING)
    try:
        yield
    finally:
        for lg, level in zip(loggers, levels):
            lg.setLevel(level)


def _param_value(value: Any) -> str:
    import json

    text = value if isinstance(value, str) else json.dumps(value, default=str)
    return text if len(text) <= 6000 else text[:5997] + "..."  # MLflow's limit on a param value


def _plain(value: Any) -> Any:
    """JSON-safe: numbers, strings, lists and dicts; anything else as its str."""
    import json

    return json.loads(json.dumps(value, default=str))
