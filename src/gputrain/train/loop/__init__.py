"""The run's parts and the loop around one step, and what the run keeps and says.

- `build`: the run's parts made once (`build_run`), into `parts`' typed `RunParts`.
- `trainer`: `Trainer`, the loop over the parts; `loop_pass`: what one pass of the loop holds besides.
- `fit`: the one call that trains a model (and a Workload).
- `state`: the run's position, saved in checkpoints; `signals`: stop requests; `stops`: a stop signal's
  and an error's ending (checkpoint, notes); `guards`: health at log points.
- `callbacks`, `early_stopping`, `ema`: your code at log points, and the two built in.
- `compiling`: torch.compile for a run; `startup_costs`: where the time before the first step went;
  `run_summary`: decisions and summary.
"""
