"""Hyperparameter sweeps on Optuna: `gputrain.sweep(...)` and `gputrain sweep`.

settings.py: the [sweep] table and its search space; storage.py: where the study lives (SQLite in
the sweep's folder, or a database server or journal file that several machines share); study.py:
the study, its identity and budget, and the SQLite locks; folder.py: the sweep's folder and its
sweep.toml; runner.py: the coordinator (plan, workers, report); trial.py: a worker (one trial after
another, each an ordinary run directory). Optuna is an optional extra: pip install 'gputrain[sweep]'
(and 'gputrain[postgres]' for PostgreSQL).
"""

from gputrain.sweeps.runner import SweepResult, sweep

__all__ = ["sweep", "SweepResult"]
