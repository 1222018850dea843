"""A run as one typed tree, and the one function that trains it.

spec.py: the tree (RunSpec: the workload and its options, TrainConfig, RunSettings) and its TOML
text; stated.py: what one source states (RunConfig: a config file read and checked, merged over
another source); flags.py: the command line generated from the tree's fields; resolve.py: from what a source
states (a file, the command line, a sweep's trial, Python) to a checked RunSpec; train.py:
`train_spec`, which `gputrain fit`, a sweep's trial and `fit_config` call; ray_run.py: a spec trained
on a Ray cluster (`--launcher ray`: TorchTrainer, each worker through `train_spec`).

    flags or file or trial -> RunConfig (stated) -> resolve -> RunSpec -> train_spec -> RunResult
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Sequence

__all__ = ["fit_config"]


def fit_config(config: "str | Path | dict[str, Any] | None" = None, *, workload: str | None = None,
               callbacks: Sequence[Any] = (), **train: Any):
    """Train a run described as `gputrain fit --config` takes it; returns its History.

    config: a TOML file (RUN_DIR/config.toml repeats that run), the same tree as a dict
    ({"workload": ..., "options": {...}, "train": {...}, "fit": {...}}), or None (the defaults).
    workload: overrides the file's. train: TrainConfig fields over the file's (lr=0.01,
    run_dir="runs/x"), checked as a file's values are. callbacks: added to the run's own.
    Raises ConfigError (one line) for a value any field refuses, before anything is written.
    """
    from gputrain.errors import ConfigError
    from gputrain.io.toml_file import TomlFile
    from gputrain.runs.stated import RunConfig, check_tree, check_value, load_run_config, merge
    from gputrain.runs.resolve import resolve
    from gputrain.runs.train import train_spec

    if config is None:
        base = RunConfig()
    elif isinstance(config, dict):
        base = check_tree(TomlFile("the config", dict(config)))
    else:
        base = load_run_config(config, what="fit_config")
    over = RunConfig(workload=workload, train={k: check_value("train", k, v) for k, v in train.items()})
    spec, built = resolve(merge(base, over))
    if (spec.fit.nproc or 1) > 1:
        raise ConfigError("fit_config trains in this process: start several with `gputrain fit --nproc N` or "
                          "torchrun, or drop nproc")
    return train_spec(spec, built, callbacks=callbacks).history
