"""Hyperparameter sweeps on Optuna: `gputrain.sweep(...)` and `gputrain sweep`.

settings.py: the [sweep] table and its search space; study.py: the study in SQLite and its locks;
runner.py: the coordinator (plan, workers, report); trial.py: a worker (one trial after another,
each an ordinary run directory). Optuna is an optional extra: pip install 'gputrain[sweep]'.
"""

from gputrain.sweeps.runner import SweepResult, sweep

__all__ = ["sweep", "SweepResult"]
