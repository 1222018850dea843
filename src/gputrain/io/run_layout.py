"""The names of what a run directory holds, in one place.

RUN_DIR/ (a run of `gputrain fit`, or `fit(..., TrainConfig(run_dir=...))`):

    checkpoints/            the checkpoint store (checkpoint/store.py; the names inside it: checkpoint/names.py)
    checkpoint.pt           the one checkpoint runs wrote before the store existed (read, never written)
    config.toml             the resolved run spec the run trained with (runs/spec.py): repeats the run
    workload.json           the workload and its options, for eval / predict / export (workloads/from_run.py)
    history.json            the run's History, written at its end (io/history.py)
    metrics.jsonl           one JSON object per log point, appended (report/metrics_log.py)
    metrics.csv             the same as CSV
    curves.png              the loss and metric curves (report/plots.py)
    events.out.tfevents.*   TensorBoard's event files (report/tensorboard.py)
    report.html             the run's page (report/html.py), written by `fit` and `gputrain report`
    profile_summary.json    what `gputrain profile --out RUN_DIR` found (diagnostics/profile.py), shown
                            by the report; trace.json beside it is the profiler's Chrome trace

A sweep's folder (sweeps/runner.py) holds its own page under the same name, REPORT_FILE.

Here only names: which of them a later command must not write over is io/preflight.py's `run_held`.
"""

from __future__ import annotations

CHECKPOINTS_DIR = "checkpoints"
LEGACY_CHECKPOINT = "checkpoint.pt"
CONFIG_FILE = "config.toml"
WORKLOAD_FILE = "workload.json"
HISTORY_FILE = "history.json"
METRICS_JSONL = "metrics.jsonl"
METRICS_CSV = "metrics.csv"
CURVES_FILE = "curves.png"
TENSORBOARD_PREFIX = "events.out.tfevents"
REPORT_FILE = "report.html"
PROFILE_SUMMARY = "profile_summary.json"
PROFILE_TRACE = "trace.json"

# The records `gputrain fit` writes in a run directory (besides its checkpoints and TensorBoard's files):
# what tells that a folder holds a run, and what a later command must never write over.
RECORDS = (HISTORY_FILE, WORKLOAD_FILE, CONFIG_FILE, METRICS_CSV, METRICS_JSONL, CURVES_FILE)


def is_record(name: str) -> bool:
    """Whether a file named `name` directly in a run directory is one of the run's records (RECORDS, or
    one of TensorBoard's event files)."""
    return name in RECORDS or name.startswith(TENSORBOARD_PREFIX)
