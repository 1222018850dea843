"""The training core, by concern:

- `step/`: one optimizer step. The loss rule (`loss`), `TrainStep` (`train_step`), your own step
  (`own_step`), the CUDA-graph wrapper (`graphs`), and what the step decides from the model's first
  batch: precision (`precision_gate`) and memory layout (`layout`); recompute (`recompute`) and the
  state a step carries to the next (`carried_state`).
- `optim/`: the step's optimizers: built from a TrainConfig (`build`), several by name for your own
  step (`by_name`), and the two per-step calls without the profiler's host time (`calls`).
- `evaluation/`: the loss, accuracy and metrics over an eval set (`evaluate`), when a run evaluates
  (`points`), and `evaluate`/`predict` for a trained model (`inference`).
- `loop/`: the trainer's setup and loop around one step (`trainer`, `loop_pass`), `fit`, the run's state
  (`state`), callbacks with EarlyStopping and EMA, stop signals, health guards, compile, startup costs,
  and what a run says about itself (`run_summary`).
- `modes`: the train/eval modes the user set, kept by the loop and by evaluation alike.

Imports run one way (tests/test_layout.py): `loop` uses `evaluation`, `step` and `optim`;
`evaluation` uses `step`'s loss rule; `step` uses `optim`; `optim` none of them. Nothing here imports
workloads, bench or diagnostics.
"""

from gputrain.train.loop.fit import fit, fit_workload
from gputrain.train.loop.trainer import Trainer

__all__ = ["Trainer", "fit", "fit_workload"]
