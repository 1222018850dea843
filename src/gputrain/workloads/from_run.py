"""A trained workload model back from its run directory, for `gputrain eval / predict / export RUN_DIR`.

The workload comes from RUN_DIR/workload.json (what `gputrain fit` was given: a built-in name or
module:function, and its --option values), else from the checkpoint's config name. Its model is
built fresh and takes the weights of the best checkpoint (by the run's best_metric) when there is
one, else the newest that verifies; the EMA weights when the run kept an average (`--ema`), unless
the raw ones are asked for.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from gputrain.errors import CheckpointError, ConfigError
from gputrain.workloads.base import Workload

EMA_KEY = "EMA"  # the EMA callback's state key in checkpoints (train/ema.py)


@dataclass
class TrainedRun:
    run_dir: Path
    workload: Workload
    model: nn.Module  # the workload's model with the chosen weights, on the CPU, in eval mode
    weights: str  # "ema" | "raw"
    checkpoint: Path
    step: int
    config: dict[str, Any]


def checkpoint_path(run_dir: Path, which: str = "best") -> Path:
    """The checkpoint file: `which` = "best" (falls back to the newest), "last", or a file path."""
    from gputrain.io.checkpoint_store import CheckpointStore

    candidate = Path(which)
    if which not in ("best", "last"):
        if not candidate.is_file():
            raise ConfigError(f"--checkpoint {which}: choose best, last, or an existing checkpoint file")
        return candidate
    if not run_dir.is_dir():
        raise ConfigError(f"{run_dir}: no such run directory")
    store = CheckpointStore(run_dir)
    if which == "best":
        best = store.best_path()
        if best is not None and store.verify(best) is True:
            return best
    path = store.find_latest()
    if path is None:
        raise CheckpointError(f"{run_dir}: the run has no checkpoint (was it trained with --no-save?)")
    if path.is_dir():
        raise CheckpointError(f"{path}: a sharded (DCP) checkpoint; eval / predict / export read one-file "
                              "checkpoints: train on one process, or convert it with torch.distributed.checkpoint")
    return path


def workload_spec(run_dir: Path, config: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    """(workload name or module:function, its options) the run was trained with."""
    try:
        data = json.loads((run_dir / "workload.json").read_text())
        return str(data["workload"]), dict(data.get("options") or {})
    except (OSError, ValueError, KeyError, TypeError):
        pass
    name = config.get("name")
    if not name:
        raise ConfigError(f"{run_dir}: cannot tell which workload trained this run (no workload.json, no name in "
                          "the checkpoint's config): pass --workload")
    return str(name), {}


def load_run(run_dir: str | Path, *, checkpoint: str = "best", weights: str = "auto", workload: str | None = None,
             options: dict[str, Any] | None = None) -> TrainedRun:
    """The run's workload and its model with trained weights.

    weights: "auto" (EMA when the run kept one, else raw), "ema" (an error when there is none) or "raw".
    workload / options: override what RUN_DIR/workload.json says.
    """
    from gputrain.io.checkpoint import check_model_state, load_checkpoint
    from gputrain.workloads import resolve_workload

    if weights not in ("auto", "ema", "raw"):
        raise ConfigError(f"weights must be auto, ema or raw, got {weights!r}")
    run_dir = Path(run_dir)
    path = checkpoint_path(run_dir, checkpoint)
    state = load_checkpoint(path)
    config = dict(state.get("config") or {})
    spec, saved_options = workload_spec(run_dir, config) if workload is None else (workload, {})
    wl = resolve_workload(spec, **{**saved_options, **(options or {})})
    model = wl.make_model()
    ema = (state.get("callbacks") or {}).get(EMA_KEY)
    if weights == "ema" and not ema:
        raise ConfigError(f"{path}: this run kept no EMA of its weights (train with --ema DECAY); use the raw weights")
    use_ema = bool(ema) and weights != "raw"
    weights_state = ema["weights"] if use_ema and ema is not None else state["model"]
    check_model_state(weights_state, model, path=str(path))
    model.load_state_dict(weights_state)
    model.eval()
    step = int(state.get("step", (state.get("run") or {}).get("step", 0)))
    return TrainedRun(run_dir, wl, model, "ema" if use_ema else "raw", path, step, config)


def run_data(run: TrainedRun, which: str) -> Any:
    """The data to evaluate or predict on: "test" / "train" (the workload's splits, with its
    normalization), or a file of tensors: .pt (torch.load, weights_only) or .npy (the inputs)."""
    from gputrain.data.splits import DataSplits

    if which in ("test", "train"):
        splits = run.workload.make_data()
        if which == "test":
            if splits.test is None:
                raise ConfigError(f"{run.workload.name} has no test split: use --data train or a file")
            return splits
        return DataSplits(train=splits.train, test=splits.train, mean=splits.mean, std=splits.std,
                          transform_key=splits.transform_key)
    path = Path(which)
    if not path.is_file():
        raise ConfigError(f"--data {which}: use test, train, or a .pt / .npy file of inputs")
    if path.suffix == ".npy":
        import numpy as np

        data: Any = torch.from_numpy(np.load(path))
    else:
        data = torch.load(path, map_location="cpu", weights_only=True)
    # Raw data in the workload's stored units (uint8 images, say) get its normalization.
    splits = run.workload.make_data() if isinstance(data, torch.Tensor) or isinstance(data, (tuple, list, dict)) else None
    if splits is not None and splits.mean is not None:
        return DataSplits(train=data, test=data, mean=splits.mean, std=splits.std, transform_key=splits.transform_key)
    return data
