"""A run as one typed tree, where it trains, and the one function that trains it.

spec.py: the tree (RunSpec: the workload and its options, TrainConfig, RunSettings) and its TOML
text; stated.py: what one source states (RunConfig: a config file read and checked, merged over
another source); flags.py: the command line generated from the tree's fields; resolve.py: from
what a source states (a file, the command line, a sweep's trial, Python) to a checked RunSpec;
launch.py: `launch`, where the run trains (this process, torchrun's processes, Ray's workers), which
`gputrain fit` and `fit_config` call; train.py: `train_spec`, which trains it in this process (a
sweep's trial calls it too); ray_run.py: a spec trained on a Ray cluster (`--launcher ray`:
TorchTrainer, each worker through `train_spec`).

    flags or file or trial -> RunConfig (stated) -> launch -> resolve -> RunSpec -> train_spec -> RunResult
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Sequence

__all__ = ["fit_config"]


def fit_config(config: "str | Path | dict[str, Any] | None" = None, *, workload: str | None = None,
               callbacks: Sequence[Any] = (), **settings: Any):
    """Train a run described as `gputrain fit --config` takes it, where its settings say (this
    process, torchrun's processes, Ray's workers: runs/launch.py); returns its History.

    config: a TOML file (RUN_DIR/config.toml repeats that run), the same tree as a dict
    ({"workload": ..., "options": {...}, "train": {...}, "fit": {...}}), or None (the defaults).
    workload: overrides the file's. settings: TrainConfig fields ([train]: lr=0.01, run_dir="runs/x")
    and the run's own ([fit]: nproc=2, ema=0.999) over the file's, checked as a file's values are.
    callbacks: added to the run's own (in this process only). With nproc above 1, torchrun's
    processes train it (their rank 0 prints the summary) and its History is read back from the run
    directory. Raises ConfigError (one line) for a value any field refuses, before anything is
    written; GputrainError when the processes fail (their output says why).
    """
    from gputrain.errors import GputrainError
    from gputrain.io.toml_file import TomlFile
    from gputrain.runs.launch import launch
    from gputrain.runs.stated import RunConfig, check_tree, check_value, field_types, load_run_config, merge

    if config is None:
        base = RunConfig()
    elif isinstance(config, dict):
        base = check_tree(TomlFile("the config", dict(config)))
    else:
        base = load_run_config(config, what="fit_config")
    fit_keys = field_types("fit")
    over = RunConfig(workload=workload,
                     train={k: check_value("train", k, v) for k, v in settings.items() if k not in fit_keys},
                     fit={k: check_value("fit", k, v) for k, v in settings.items() if k in fit_keys})
    result = launch(merge(base, over), callbacks=callbacks)
    if result.exit_code != 0:
        raise GputrainError(f"fit_config: the run's processes ended with exit status {result.exit_code} (their output "
                            "above says why)")
    return result.history
