"""A sweep from Python: the file's search, with a budget of 4 trials; then Optuna's own API reads
the study from the sweep's SQLite file (`pip install 'gputrain[sweep]'`)."""

import optuna

import gputrain

result = gputrain.sweep("docs/examples/sweep.toml", sweep_dir="sweeps/iris-lr", trials=4)
print(f"best trial {result.best_trial}: eval_loss {result.best_value:.4f} with {result.best_params}")
print(f"its run directory: {result.best_run_dir}; every trial: sweeps/iris-lr/report.html")

study = optuna.load_study(study_name="gputrain", storage=result.storage)
print(f"{len(study.trials)} trials in the study; best params {study.best_params}")
