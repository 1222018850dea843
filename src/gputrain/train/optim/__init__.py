"""The step's optimizers.

- `build`: the optimizer and learning-rate schedule built from a TrainConfig.
- `by_name`: several optimizers and schedulers by name, for a step of your own.
- `calls`: `step()` and `zero_grad()` without the host time torch adds for a profiler that is off; which
  optimizers step with a closure (LBFGS).
- `intervals`: when the scheduler steps, after every optimizer step or after each epoch.
"""
