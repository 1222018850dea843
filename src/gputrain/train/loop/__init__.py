"""The loop around one step: setup, the passes, and what the run keeps and says.

- `trainer`: `Trainer`, its named setup parts and the loop; `loop_pass`: what one pass holds besides it.
- `fit`: the one call that trains a model (and a Workload).
- `state`: the run's position, saved in checkpoints; `signals`: stop requests; `guards`: health at log points.
- `callbacks`, `early_stopping`, `ema`: your code at log points, and the two built in.
- `compiling`: torch.compile for the trainer;
  `startup_costs`: where the time before the first step went; `run_summary`: decisions and summary.
"""
