"""gputrain: train PyTorch models on the GPU correctly and fast, and see why.

The public API is re-exported here; each name lives in a small module named for what it holds.

- Settings: config (`TrainConfig`), fields (a setting declared once: default, flag, help, check), runs/ (a
  run as one typed tree, and `train_spec`), sweeps/ (hyperparameter sweeps on Optuna).
- Training: train/ (the step, its optimizers, evaluation, the loop), data/ (feeding the device), checkpoint/
  (a run's checkpoints), runtime/ (devices, precision, processes, speed switches), batch (nested batches:
  move, count, split), outputs (a model's loss and logits), metric_direction (which way a metric improves),
  torch_compat (torch's private names, resolved once).
- Around a run: io/ (files written whole, read back checked), export (a trained model's weights as
  safetensors, Hugging Face or ONNX), report/ (what a run shows), diagnostics/
  (memory and time of the step), bench/ (where the GPU wins), workloads/ (built-in and user workloads).
- The command line: cli (`gputrain`), commands/ (one module per subcommand), __main__ (`python -m gputrain`).
- errors (gputrain's exceptions), version, import_clock (how long `import gputrain` took).
"""

from gputrain import import_clock as _import_clock  # first: `import gputrain`'s own duration starts here
from typing import TYPE_CHECKING

from gputrain.errors import GputrainError, DeviceError, ConfigError, CheckpointError, DataError
from gputrain.runtime.devices import pick_device, describe_devices
from gputrain.batch import move, move_optimizer_state, check_devices

if TYPE_CHECKING:  # the lazy names below, for type checkers (at run time __getattr__ imports them)
    from gputrain.config import TrainConfig
    from gputrain.data.tokens import count_tokens
    from gputrain.diagnostics.memory_stats import memory_stats
    from gputrain.io.history import History
    from gputrain.runs import fit_config
    from gputrain.sweeps import SweepResult, sweep
    from gputrain.train import Trainer, fit, fit_workload
    from gputrain.train.loop.callbacks import Callback, RunControl
    from gputrain.train.loop.early_stopping import EarlyStopping
    from gputrain.train.loop.ema import EMA
    from gputrain.train.evaluation.inference import evaluate, predict
    from gputrain.workloads import Workload, get_workload

from gputrain.version import __version__

# The trainer and the tools built on it import more of torch; load them on first use so that
# `import gputrain` and `gputrain info` stay fast.
_LAZY = {
    "fit": "gputrain.train",
    "fit_workload": "gputrain.train",
    "fit_config": "gputrain.runs",
    "Trainer": "gputrain.train",
    "TrainConfig": "gputrain.config",
    "History": "gputrain.io.history",
    "Workload": "gputrain.workloads",
    "get_workload": "gputrain.workloads",
    "memory_stats": "gputrain.diagnostics.memory_stats",
    "Callback": "gputrain.train.loop.callbacks",
    "RunControl": "gputrain.train.loop.callbacks",
    "EarlyStopping": "gputrain.train.loop.early_stopping",
    "EMA": "gputrain.train.loop.ema",
    "evaluate": "gputrain.train.evaluation.inference",
    "predict": "gputrain.train.evaluation.inference",
    "count_tokens": "gputrain.data.tokens",
    "sweep": "gputrain.sweeps",
    "SweepResult": "gputrain.sweeps",
}

_import_clock.stop()  # for a run's startup costs (train/loop/startup_costs.py)


def __getattr__(name):
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'gputrain' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(module), name)


__all__ = [
    "GputrainError", "DeviceError", "ConfigError", "CheckpointError", "DataError",
    "pick_device", "describe_devices", "move", "move_optimizer_state", "check_devices",
    # the names of _LAZY, spelled out so that type checkers can read the list
    "fit", "fit_workload", "fit_config", "Trainer", "TrainConfig", "History", "Workload", "get_workload", "memory_stats",
    "Callback", "RunControl", "EarlyStopping", "EMA", "evaluate", "predict", "count_tokens", "sweep", "SweepResult",
]
