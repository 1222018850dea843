"""The training core, by concern:

- `step/`: one optimizer step, made of pieces: the loss rule (`loss`), the micro-batches and their
  weights (`micro`), the device totals (`totals`) and the non-finite flag (`nonfinite`), composed into
  the built-in step (`train_step`) and your own (`own_step`); the CUDA-graph wrapper (`graphs`); what
  the first step decides, one mechanism (`first_step`) with two deciders: the memory layout (`layout`)
  and an automatic autocast (`autocast_decider`); recompute (`recompute`) and the state a step
  carries to the next (`carried_state`).
- `optim/`: the step's optimizers: built from a TrainConfig (`build`), several by name for your own
  step (`by_name`), the two per-step calls without the profiler's host time and closure optimizers
  (`calls`), and when the scheduler steps (`intervals`).
- `evaluation/`: the loss, accuracy and metrics over an eval set (`evaluate`), when a run evaluates
  (`points`), and `evaluate`/`predict` for a trained model (`inference`).
- `loop/`: the run's parts built once (`build` into `parts`' RunParts) and the loop over them
  (`trainer`, `loop_pass`), `fit`, the run's state (`state`), callbacks with EarlyStopping and EMA,
  stop signals and how a run ends early (`signals`, `stops`), health guards, compile, startup costs,
  and what a run says about itself (`run_summary`).
- `modes`: the train/eval modes the user set, kept by the loop and by evaluation alike.

Imports run one way (tests/test_layout.py): `loop` uses `evaluation`, `step` and `optim`;
`evaluation` uses `step`'s loss rule; `step` uses `optim`; `optim` none of them. Nothing here imports
workloads, bench or diagnostics.
"""

from gputrain.train.loop.fit import fit, fit_workload
from gputrain.train.loop.trainer import Trainer

__all__ = ["Trainer", "fit", "fit_workload"]
