"""gputrain: train PyTorch models on the GPU correctly and fast, and see why.

The public API is re-exported here; each name lives in a small module named for what it holds.
"""

from gputrain.errors import GputrainError, DeviceError, ConfigError, CheckpointError, DataError
from gputrain.runtime.devices import pick_device, describe_devices
from gputrain.batch import move, move_optimizer_state, check_devices

__version__ = "0.1.0"

# The trainer and the tools built on it import more of torch; load them on first use so that
# `import gputrain` and `gputrain info` stay fast.
_LAZY = {
    "fit": "gputrain.train",
    "fit_workload": "gputrain.train",
    "Trainer": "gputrain.train",
    "TrainConfig": "gputrain.config",
    "History": "gputrain.io.history",
    "Workload": "gputrain.workloads",
    "get_workload": "gputrain.workloads",
    "memory_stats": "gputrain.diagnostics.memory_stats",
}


def __getattr__(name):
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'gputrain' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(module), name)


__all__ = [
    "GputrainError", "DeviceError", "ConfigError", "CheckpointError", "DataError",
    "pick_device", "describe_devices", "move", "move_optimizer_state", "check_devices",
    *_LAZY,
]
