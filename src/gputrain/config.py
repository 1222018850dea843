"""TrainConfig: every setting of a training run, typed and validated in one place."""

from __future__ import annotations

import dataclasses
import warnings
from dataclasses import InitVar, dataclass
from typing import Any

from gputrain.errors import ConfigError
from gputrain.runtime.precision import CHOICES as PRECISIONS

LOGGERS = ("csv", "tensorboard", "mlflow", "wandb")  # the experiment trackers (report/trackers.py)
DEFAULT_LOGGERS = ("csv", "tensorboard")


@dataclass
class TrainConfig:
    # where and how precisely
    device: str = "auto"  # "auto" | "cpu" | "cuda" | "cuda:N" | "mps"
    precision: str = "auto"  # "auto" | "fp32" | "tf32" | "bf16" | "fp16"
    # how much
    batch_size: int = 64  # micro-batch per optimizer micro-step (per process under DDP)
    epochs: int | None = None  # one of epochs / steps; steps wins when both are given
    steps: int | None = None  # optimizer steps in the whole run
    accumulate: int = 1  # micro-batches per optimizer step (effective batch = batch_size * accumulate)
    lr: float = 1e-3
    weight_decay: float = 0.0
    weight_decay_groups: bool = True  # no weight decay on biases and normalization weights (1-D); False: on all
    max_grad_norm: float | None = None  # clip when set
    schedule: str = "constant"  # "constant" | "cosine" | "linear" | "onecycle" (fit(scheduler=...) for your own)
    warmup_steps: int = 0
    # reporting
    log_every: int = 50  # optimizer steps between reads of the loss (the only host syncs)
    # optimizer steps between evaluations (each one a log point too), and at the run's end; None: at
    # each epoch end and the run's end; at every log point where an epoch is shorter than log_every
    # (a full-batch run) or the data have no length (no epoch ends)
    eval_every: int | None = None
    # which way a metric improves, where gputrain's rule (gputrain/metric_direction.py) would guess:
    # {"eval_margin": "min"}; a key without "ema_" covers its EMA twin (eval_ema_margin) too
    metric_modes: dict[str, str] | None = None
    progress: bool = False  # rich progress bar (the CLI turns it on for terminals)
    seed: int = 0
    # files
    name: str | None = None  # the run's name in summaries and reports (fit_workload: the workload's)
    run_dir: str | None = None  # metrics, plots, checkpoints; None: nothing written
    checkpoint_every: int | None = None  # optimizer steps; the last step is always saved when run_dir is set
    resume: bool | str = False  # True: the newest verified checkpoint in run_dir; a str: that file
    stop_at_step: int | None = None  # stop early (checkpointing first), as an interrupted run would
    keep_last: int = 2  # checkpoints kept in run_dir/checkpoints (plus the best by best_metric)
    best_metric: str | None = None  # e.g. "eval_accuracy": its best checkpoint is kept too
    best_mode: str = "auto"  # "auto" (gputrain/metric_direction.py's rule) | "max" | "min" for best_metric
    # "auto": every rank writes its part with torch.distributed.checkpoint (a step-N.dcp folder) when
    # there are several processes, one file (step-N.pt) for one process | "dcp" | "file"
    checkpoint_format: str = "auto"
    async_checkpoint: bool = False  # DCP's async_save: training goes on while the files are written
    full_checkpoints: bool = False  # a frozen base's weights too; False: its fingerprint (checkpoint/frozen.py)
    stop_signals: tuple[str, ...] = ("SIGTERM", "SIGINT", "SIGUSR1")  # finish the step, checkpoint, exit
    # experiment trackers fed at every log point (rank 0 only): "csv" (metrics.csv + metrics.jsonl),
    # "tensorboard" (event files in run_dir), "mlflow", "wandb" (report/trackers.py); a tracker that
    # fails is a warning, never a stop. The one switch for each of them, TensorBoard's included
    loggers: tuple[str, ...] = DEFAULT_LOGGERS
    # speed switches ("auto" decides from the device and the model)
    data_on_device: str | bool = "auto"  # keep the whole dataset on the device when it fits
    device_memory_fraction: float = 0.5  # the share of free device memory device-resident data may take
    channels_last: str | bool = "auto"
    cudnn_benchmark: str | bool = "auto"
    fused_optimizer: str | bool = "auto"
    compile: bool | str = False  # True: the whole model; "regional": its repeated block once (runtime/compile_regions.py)
    compile_cache: str | bool | None = None  # compiled artifacts' folder; None: $GPUTRAIN_COMPILE_CACHE or RUN_DIR/compile_cache; False: none
    compile_mode: str | None = None  # torch.compile mode, e.g. "max-autotune-no-cudagraphs"
    cuda_graphs: str | bool = "auto"  # capture the whole step; falls back to eager with a logged reason
    num_workers: int | None = None  # DataLoader workers when data stays on the host; None: from CPU count
    # your own DataLoader over a map-style dataset: rebuilt with gputrain's sampler (sharded by rank,
    # seeded by the run, resumable mid-epoch), over an IterableDataset: as a StatefulDataLoader.
    # False: used as is (a resume reads up to its position; several processes see every batch)
    rebuild_loader: bool = True
    # memory
    # recompute blocks in backward instead of storing their activations (torch.utils.checkpoint):
    # True = the model's repeated blocks, or a list of module names
    recompute: bool | list[str] = False
    oom_recovery: bool = True  # halve the micro-batch and double accumulation on OOM
    # non-finite values and loss spikes (checked at log points, never per step)
    on_nan: str = "stop"  # "stop": error naming the steps and the last good checkpoint | "skip": skip such steps
    spike_ratio: float | None = 4.0  # a log point's loss above ratio x the median of the last window: a spike
    spike_window: int = 10  # log points in the rolling median
    spike_patience: int = 3  # consecutive spikes before the action
    on_spike: str = "warn"  # "warn" | "stop"
    # distributed
    shard: bool = False  # FSDP2 (fully_shard) instead of DDP when world size > 1
    # old names, still accepted with a DeprecationWarning (not fields: not saved)
    checkpointing: InitVar[bool | list[str] | None] = None  # `recompute`
    tensorboard: InitVar[bool | None] = None  # False: `loggers` without "tensorboard" (tensorboard_loggers)

    def __post_init__(self, checkpointing: bool | list[str] | None = None, tensorboard: bool | None = None) -> None:
        if checkpointing is not None:
            warnings.warn("TrainConfig(checkpointing=...) is deprecated: the field is now `recompute` "
                          "(recomputing activations in backward, not run checkpoints); use TrainConfig(recompute=...)",
                          DeprecationWarning, stacklevel=3)
            self.recompute = checkpointing
        if tensorboard is not None:
            self.loggers = tensorboard_loggers(self.loggers, tensorboard)
            warnings.warn("TrainConfig(tensorboard=...) is deprecated: TensorBoard is one of the loggers, on when "
                          f"`loggers` names 'tensorboard'; for these settings use TrainConfig(loggers={self.loggers!r})",
                          DeprecationWarning, stacklevel=3)
        self.validate()

    def validate(self) -> None:
        def positive(name: str, allow_none: bool = False) -> None:
            value = getattr(self, name)
            if value is None and allow_none:
                return
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ConfigError(f"{name} must be a positive integer, got {value!r}")

        positive("batch_size")
        positive("accumulate")
        positive("log_every")
        positive("epochs", allow_none=True)
        positive("steps", allow_none=True)
        positive("eval_every", allow_none=True)
        positive("checkpoint_every", allow_none=True)
        positive("stop_at_step", allow_none=True)
        if self.precision not in PRECISIONS:
            raise ConfigError(f"unknown precision {self.precision!r}: choose one of {', '.join(PRECISIONS)}")
        if not (self.lr > 0):
            raise ConfigError(f"lr must be > 0, got {self.lr!r}")
        if self.schedule not in ("constant", "cosine", "linear", "onecycle"):
            raise ConfigError(f"unknown schedule {self.schedule!r}: choose constant, cosine, linear or onecycle")
        self.loggers = check_loggers(self.loggers)
        if not (0 < self.device_memory_fraction <= 1):
            raise ConfigError(f"device_memory_fraction must be in (0, 1], got {self.device_memory_fraction!r}")
        if self.resume and not self.run_dir and not isinstance(self.resume, str):
            raise ConfigError("resume=True needs run_dir (where the checkpoint is); or pass a checkpoint path")
        if self.on_nan not in ("stop", "skip"):
            raise ConfigError(f"on_nan must be 'stop' or 'skip', got {self.on_nan!r}")
        if self.on_spike not in ("warn", "stop"):
            raise ConfigError(f"on_spike must be 'warn' or 'stop', got {self.on_spike!r}")
        if self.spike_ratio is not None and not self.spike_ratio > 1:
            raise ConfigError(f"spike_ratio must be > 1 (or None to switch spike detection off), got {self.spike_ratio!r}")
        positive("spike_window")
        positive("keep_last")
        if self.best_mode not in ("auto", "max", "min"):
            raise ConfigError(f"best_mode must be 'auto', 'max' or 'min', got {self.best_mode!r}")
        if self.metric_modes is not None and not (isinstance(self.metric_modes, dict) and all(
                isinstance(k, str) and v in ("min", "max") for k, v in self.metric_modes.items())):
            raise ConfigError("metric_modes must be a dict {metric: 'min' or 'max'}, e.g. {'eval_margin': 'min'}, "
                              f"got {self.metric_modes!r}")
        if self.checkpoint_format not in ("auto", "dcp", "file"):
            raise ConfigError(f"checkpoint_format must be 'auto', 'dcp' or 'file', got {self.checkpoint_format!r}")
        if self.async_checkpoint and self.checkpoint_format == "file":
            raise ConfigError("async_checkpoint needs checkpoint_format 'dcp' or 'auto' (the one-file format is "
                              "written by rank 0 while training waits)")
        import signal as _signal

        for name in self.stop_signals:
            if not hasattr(_signal, str(name)):
                raise ConfigError(f"unknown signal {name!r} in stop_signals: use names like 'SIGTERM'")
        positive("spike_patience")
        for name in ("rebuild_loader", "weight_decay_groups", "full_checkpoints"):
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(f"{name} must be True or False, got {getattr(self, name)!r}")
        if self.compile not in (True, False, "regional"):
            raise ConfigError(f"compile must be True, False or 'regional', got {self.compile!r}")
        if not isinstance(self.compile_cache, (str, bool, type(None))):
            raise ConfigError(f"compile_cache must be a folder (a string), True or False, got {self.compile_cache!r}")
        for name in ("data_on_device", "channels_last", "cudnn_benchmark", "fused_optimizer", "cuda_graphs"):
            value = getattr(self, name)
            if value not in ("auto", True, False):
                raise ConfigError(f"{name} must be 'auto', True or False, got {value!r}")

    def replace(self, **changes: Any) -> "TrainConfig":
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict[str, Any]:
        """Every field by name; a list or dict value is copied (the rest are immutable), so the dict can
        be changed without changing the config. (dataclasses.asdict deep-copies each value: ~0.3 ms.)"""
        return {f.name: list(v) if isinstance(v := getattr(self, f.name), list) else dict(v) if isinstance(v, dict)
                else v for f in dataclasses.fields(self)}

    @classmethod
    def field_names(cls) -> list[str]:
        return [f.name for f in dataclasses.fields(cls)]


def tensorboard_loggers(loggers: Any, tensorboard: Any) -> tuple[str, ...]:
    """The loggers as the old `tensorboard` switch leaves them: False drops "tensorboard", True keeps
    them as they are (TensorBoard when they name it, as before: the switch could only turn it off).
    What TrainConfig(tensorboard=...), [train] tensorboard in a config file and `fit --no-tensorboard`
    mean."""
    if not isinstance(tensorboard, bool):
        raise ConfigError(f"tensorboard must be True or False, got {tensorboard!r}")
    return tuple(n for n in check_loggers(loggers) if tensorboard or n != "tensorboard")


def check_loggers(names: Any) -> tuple[str, ...]:
    """The logger names as a tuple, each one of LOGGERS; raises ConfigError naming a bad one."""
    if isinstance(names, str):
        names = [names]
    try:
        out = tuple(dict.fromkeys(str(n).strip().lower() for n in names))
    except TypeError:
        raise ConfigError(f"loggers must be a list of names ({', '.join(LOGGERS)}), got {names!r}") from None
    for n in out:
        if n not in LOGGERS:
            raise ConfigError(f"unknown logger {n!r}: choose from {', '.join(LOGGERS)}")
    return out
