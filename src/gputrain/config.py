"""TrainConfig: every setting of a training run, typed and validated in one place."""

from __future__ import annotations

import argparse
import dataclasses
import signal
import warnings
from dataclasses import InitVar, dataclass
from typing import Any, Mapping

from gputrain.errors import ConfigError
from gputrain.fields import (Flag, boolean, check_fields, integer, number, one_of, positive_float_arg, positive_int,
                             positive_int_arg, setting, tri_arg)
from gputrain.runtime.precision import CHOICES as PRECISIONS

LOGGERS = ("csv", "tensorboard", "mlflow", "wandb")  # the experiment trackers (report/trackers.py)
DEFAULT_LOGGERS = ("csv", "tensorboard")
SCHEDULES = ("constant", "cosine", "linear", "onecycle")
DEVICE_TYPES = ("cpu", "cuda", "mps")  # what runtime/devices.pick_device validates
MAX_SEED = 2**63 - 1  # torch.manual_seed takes a 64-bit integer
# Samples per micro-batch: torch's sizes and indices are 64-bit integers (a batch beyond the data set's
# size takes the whole set, so no larger value means anything).
MAX_BATCH_SIZE = 2**63 - 1
# Micro-batches in one optimizer step: each is held until the step ends, so a count beyond any data
# set's batches grows memory without end instead of training (a larger effective batch is batch_size).
MAX_ACCUMULATE = 2**16
_ACCUMULATE_WHY = " (micro-batches per optimizer step; for a larger effective batch raise batch_size)"
UNCATCHABLE = ("SIGKILL", "SIGSTOP")  # no process can handle these: a run cannot checkpoint on them


# ---------------------------------------------------------------- the checks and flag values of fields


def _device(name: str, value: Any) -> None:
    """"auto", or a device string torch parses whose type gputrain runs on ("cuda:7" on a machine
    without it passes here: runtime/devices.pick_device says what exists)."""
    if value == "auto":
        return
    if isinstance(value, str) and value.strip().lower() not in ("", "gpu"):
        import torch

        try:
            if torch.device(value.strip().lower()).type in DEVICE_TYPES:
                return
        except (RuntimeError, ValueError):
            pass
    hint = " (an NVIDIA GPU is 'cuda')" if value == "gpu" else ""
    raise ConfigError(f"unknown device {value!r}: use 'auto', 'cpu', 'cuda', 'cuda:N' or 'mps'{hint}")


def _precision(name: str, value: Any) -> None:
    if value not in PRECISIONS:
        raise ConfigError(f"unknown precision {value!r}: choose one of {', '.join(PRECISIONS)}")


SCHEDULER_INTERVALS = ("step", "epoch")


def _monitor(name: str, value: Any) -> None:
    if not isinstance(value, str) or not value.strip():
        raise ConfigError(f"{name} must name a metric the run reports (eval_loss, eval_accuracy, loss, ...), got "
                          f"{value!r}")


def _schedule(name: str, value: Any) -> None:
    if value not in SCHEDULES:
        raise ConfigError(f"unknown schedule {value!r}: choose constant, cosine, linear or onecycle")


def _tri(name: str, value: Any) -> None:
    if value not in ("auto", True, False):
        raise ConfigError(f"{name} must be 'auto', True or False, got {value!r}")


def _compile(name: str, value: Any) -> None:
    if not (isinstance(value, bool) or (isinstance(value, str) and value == "regional")):
        raise ConfigError(f"{name} must be True, False or 'regional', got {value!r}")


# --compile-scope's values: the whole model (what --compile does) or its repeated block once
COMPILE_SCOPES = {"whole": True, "regional": "regional"}


def _compile_scope(value: str) -> bool | str:
    """--compile-scope's value as the compile field holds it: whole -> True, regional -> "regional"."""
    if value not in COMPILE_SCOPES:
        raise argparse.ArgumentTypeError(f"expected whole or regional, got {value!r}")
    return COMPILE_SCOPES[value]


def _compile_cache(name: str, value: Any) -> None:
    if not isinstance(value, (str, bool, type(None))):
        raise ConfigError(f"{name} must be a folder (a string), True or False, got {value!r}")
    if isinstance(value, str) and not value.strip():
        raise ConfigError(f"{name} is blank: give a folder (made if missing), or False for no compile cache")


def _metric_modes(name: str, value: Any) -> None:
    if value is not None and not (isinstance(value, dict) and all(
            isinstance(k, str) and v in ("min", "max") for k, v in value.items())):
        raise ConfigError("metric_modes must be a dict {metric: 'min' or 'max'}, e.g. {'eval_margin': 'min'}, "
                          f"got {value!r}")


def _best_metric(name: str, value: Any) -> None:
    """A key the run's records hold: loss or an evaluation's eval_* (which of them a workload
    reports is checked where the workload is known: gputrain/runs/spec.py)."""
    if value is None:
        return
    if not isinstance(value, str) or not (value == "loss" or value.startswith("eval_")):
        raise ConfigError(f"best_metric {value!r} is no value a run reports: name loss or an evaluation's eval_* "
                          "(eval_loss, eval_accuracy, eval_<your metric>)")


def _stop_signals(name: str, value: Any) -> None:
    for sig in value if isinstance(value, (list, tuple)) else [value]:
        if not isinstance(sig, str) or not isinstance(getattr(signal, sig, None), signal.Signals):
            raise ConfigError(f"unknown signal {sig!r} in stop_signals: use names like 'SIGTERM'")
        if sig in UNCATCHABLE:
            raise ConfigError(f"{sig} in stop_signals: no process can catch it (the run could not checkpoint); "
                              "use SIGTERM, SIGINT or SIGUSR1")


def _compile_mode(name: str, value: Any) -> None:
    """None, or a mode torch.compile knows (runtime/torch_compat.compile_modes)."""
    if value is None:
        return
    from gputrain.torch_compat import compile_modes

    modes = compile_modes()
    if value not in modes:
        raise ConfigError(f"unknown compile_mode {value!r}: torch.compile's modes are {', '.join(modes)}")


def _batch_size(value: str) -> int | str:
    """--batch-size: a positive integer, or "auto" (the largest that fits: the CLI's search)."""
    return "auto" if value.strip().lower() == "auto" else positive_int_arg(value)


def _batch_size_check(name: str, value: Any) -> None:
    positive_int()(name, value)
    if value > MAX_BATCH_SIZE:
        raise ConfigError(f"{name} must be at most {MAX_BATCH_SIZE} (torch's sizes are 64-bit integers; a batch "
                          f"larger than the data set takes the whole set), got {value!r}")


def _logger_names(value: str) -> list[str]:
    """--logger csv,tensorboard: the names (one flag may give several; the flag repeats)."""
    return [n for n in value.split(",") if n.strip()]


def _module_names(value: str) -> list[str]:
    """--recompute net.0,net.2: the module names."""
    return [s for s in value.split(",") if s]


@dataclass
class TrainConfig:
    """Every setting of a training run. Each field is declared once with its flag (`gputrain fit`),
    help and check (gputrain/fields.py); a value a field refuses is a ConfigError at construction."""

    # where and how precisely
    device: str = setting("auto", flag="--device", check=_device, help="auto (cuda > mps > cpu), cpu, cuda, cuda:N or mps")
    # "auto": bf16 autocast on CUDA GPUs that have it, fp16 with loss scaling on older ones, fp32 on the CPU
    # and MPS (an automatic autocast the first step refuses becomes fp32) | "fp32" | "tf32" | "bf16" | "fp16"
    precision: str = setting("auto", flag="--precision", choices=PRECISIONS, check=_precision)
    # how much
    batch_size: int = setting(  # micro-batch per optimizer micro-step (per process under DDP)
        64, flag="--batch-size", parse=_batch_size, check=_batch_size_check,
        help="samples per micro-batch (per process); 'auto' = the largest that fits on the GPU")
    epochs: int | None = setting(None, flag="--epochs", parse=positive_int_arg, group="length",
                                 check=positive_int(optional=True))  # one of epochs / steps; steps wins
    steps: int | None = setting(None, flag="--steps", parse=positive_int_arg, group="length",
                                check=positive_int(optional=True), help="optimizer steps for the whole run")
    accumulate: int = setting(  # micro-batches per optimizer step (effective batch = batch_size * accumulate)
        1, flag="--accumulate", parse=positive_int_arg, check=integer(1, MAX_ACCUMULATE, why=_ACCUMULATE_WHY),
        help="micro-batches per optimizer step")
    # the peak learning rate (reached after warmup_steps; the schedule moves it from there)
    lr: float = setting(1e-3, flag="--lr", parse=positive_float_arg, check=number(above=0, message="lr must be > 0 and finite"))
    # fit's AdamW's decoupled weight decay (0: none; torch's own AdamW defaults to 0.01)
    weight_decay: float = setting(0.0, flag="--weight-decay", parse=float, check=number(at_least=0))
    # no weight decay on biases and normalization weights (1-D); False: on all
    weight_decay_groups: bool = setting(True, check=boolean)
    max_grad_norm: float | None = setting(None, flag="--max-grad-norm", parse=positive_float_arg,  # clip when set
                                          check=number(above=0, optional=True), help="clip the gradient norm to this")
    # "constant" | "cosine" | "linear" | "onecycle" (fit(scheduler=...) for your own)
    schedule: str = setting("constant", flag="--schedule", choices=SCHEDULES, check=_schedule)
    warmup_steps: int = setting(0, check=integer(0))  # optimizer steps of linear warm-up from 0 to lr
    # when your scheduler (fit(scheduler=...)) steps: "step" (after every optimizer step) | "epoch" (after
    # each epoch, as the tutorials' `scheduler.step()` after each epoch; train/optim/intervals.py)
    scheduler_interval: str = setting(
        "step", flag="--scheduler-interval", choices=SCHEDULER_INTERVALS,
        check=one_of(SCHEDULER_INTERVALS, message="scheduler_interval must be 'step' or 'epoch'"),
        help="when your scheduler steps: after every optimizer step (step), or after each epoch (epoch)")
    # the record key ReduceLROnPlateau steps on (its newest value at each epoch's end)
    scheduler_monitor: str = setting("eval_loss", flag="--scheduler-monitor", check=_monitor, metavar="METRIC",
                                     help="the metric ReduceLROnPlateau steps on (default eval_loss)")
    # reporting
    log_every: int = setting(50, flag="--log-every", parse=positive_int_arg, check=positive_int(),
                             help="optimizer steps between loss reads")  # the only host syncs
    # optimizer steps between evaluations (each one a log point too), and at the run's end; None: at
    # each epoch end and the run's end; at every log point where an epoch is shorter than log_every
    # (a full-batch run) or the data have no length (no epoch ends)
    eval_every: int | None = setting(None, flag="--eval-every", parse=positive_int_arg, check=positive_int(optional=True))
    # which way a metric improves, where gputrain's rule (gputrain/metric_direction.py) would guess:
    # {"eval_margin": "min"}; a key without "ema_" covers its EMA twin (eval_ema_margin) too
    metric_modes: dict[str, str] | None = setting(None, check=_metric_modes)
    progress: bool = setting(False, flag="--progress", parse=tri_arg, metavar="{auto,on,off}", check=boolean,
                             help="progress bar (auto: only on a terminal)")  # the CLI's "auto": on for terminals
    # torch's generator is seeded with it at the run's start: the batch order, dropout, augmentation
    seed: int = setting(0, flag="--seed", parse=int, check=integer(0, MAX_SEED, why=" (torch.manual_seed's range)"))
    # files
    name: str | None = None  # the run's name in summaries and reports (fit_workload: the workload's)
    run_dir: str | None = setting(  # metrics, plots, checkpoints; None: nothing written
        None, flag="--run-dir", help="where metrics, plots and checkpoints go (default runs/WORKLOAD/TIME)")
    checkpoint_every: int | None = setting(None, flag="--checkpoint-every", parse=positive_int_arg,
                                           check=positive_int(optional=True),
                                           help="optimizer steps between checkpoints")  # the last is always saved
    resume: bool | str = setting(  # True: the newest verified checkpoint in run_dir; a str: that file
        False, flag="--resume", nargs="?", const=True,
        help="resume: a run dir or checkpoint file; alone, the latest run of this workload")
    stop_at_step: int | None = setting(  # stop early (checkpointing first), as an interrupted run would
        None, flag="--stop-at-step", parse=positive_int_arg, check=positive_int(optional=True),
        help="stop after this step (checkpointed)")
    keep_last: int = setting(2, check=positive_int())  # checkpoints kept in run_dir/checkpoints (plus the best)
    best_metric: str | None = setting(None, check=_best_metric)  # e.g. "eval_accuracy": its best checkpoint is kept too
    # "auto" (gputrain/metric_direction.py's rule) | "max" | "min" for best_metric
    best_mode: str = setting("auto", check=one_of(("auto", "max", "min"), message="best_mode must be 'auto', 'max' or 'min'"))
    # "auto": every rank writes its part with torch.distributed.checkpoint (a step-N.dcp folder) when
    # there are several processes, one file (step-N.pt) for one process | "dcp" | "file"
    checkpoint_format: str = setting(
        "auto", flag="--checkpoint-format", choices=("auto", "dcp", "file"),
        check=one_of(("auto", "dcp", "file"), message="checkpoint_format must be 'auto', 'dcp' or 'file'"),
        help="dcp: every process writes its part (torch.distributed.checkpoint, a step-N.dcp folder); "
             "file: one file written by rank 0; auto (default): dcp with several processes, else file")
    async_checkpoint: bool = setting(  # DCP's async_save: training goes on while the files are written
        False, flag="--async-checkpoint", action="store_true", check=boolean,
        help="write checkpoints in the background while training goes on (DCP's async_save)")
    full_checkpoints: bool = setting(False, check=boolean)  # a frozen base's weights too; False: its fingerprint
    # finish the step, checkpoint, exit (signals a process can catch: not SIGKILL or SIGSTOP)
    stop_signals: tuple[str, ...] = setting(("SIGTERM", "SIGINT", "SIGUSR1"), check=_stop_signals)
    # experiment trackers fed at every log point (rank 0 only): "csv" (metrics.csv + metrics.jsonl),
    # "tensorboard" (event files in run_dir), "mlflow", "wandb" (report/trackers.py); a tracker that
    # fails is a warning, never a stop. The one switch for each of them, TensorBoard's included
    loggers: tuple[str, ...] = setting(
        DEFAULT_LOGGERS, flag="--logger", action="append", metavar="NAME", parse=_logger_names,
        help="experiment trackers, repeatable or comma-separated: csv (metrics.csv/jsonl), tensorboard, "
             "mlflow, wandb (default: csv,tensorboard; naming any replaces the default)")
    # speed switches ("auto" decides from the device and the model)
    data_on_device: str | bool = setting("auto", flag="--data-on-device", parse=tri_arg, metavar="{auto,on,off}",
                                         check=_tri, help="keep the whole data set on the device when it fits; off: "
                                                          "copy each batch from pinned host memory")
    device_memory_fraction: float = setting(  # the share of free device memory device-resident data may take
        0.5, check=number(above=0, at_most=1, message="device_memory_fraction must be in (0, 1]"))
    # NHWC for 2-D conv nets: "auto" probes the first batch and keeps it where it runs, agrees and pays
    channels_last: str | bool = setting("auto", flag="--channels-last", parse=tri_arg, metavar="{auto,on,off}",
                                        check=_tri)
    cudnn_benchmark: str | bool = setting("auto", check=_tri)  # cuDNN's algorithm search: "auto" on CUDA conv nets
    fused_optimizer: str | bool = setting("auto", check=_tri)  # fit's AdamW's fused kernel: "auto" where torch has it
    # True: the whole model; "regional": its repeated block once (runtime/compile_regions.py)
    compile: bool | str = setting(
        False, flag="--compile", action="store_true", check=_compile,
        help="torch.compile the whole model (--compile-scope regional: its repeated block once)",
        also=[Flag(("--compile-scope",), parse=_compile_scope, metavar="{whole,regional}",
                   help="torch.compile the model: whole (the same as --compile) or regional (the repeated block of "
                        "a GPT, BERT or ViT compiled once for all its siblings: a shorter cold start; a model "
                        "without such blocks is compiled whole, with the reason in the decisions)")])
    # compiled artifacts' folder; None: $GPUTRAIN_COMPILE_CACHE or RUN_DIR/compile_cache; False: none
    compile_cache: str | bool | None = setting(None, check=_compile_cache)
    compile_mode: str | None = setting(None, flag="--compile-mode", check=_compile_mode,
                                       help="torch.compile mode, e.g. max-autotune-no-cudagraphs")
    # capture the whole step; falls back to eager with a logged reason
    cuda_graphs: str | bool = setting("auto", flag="--cuda-graphs", parse=tri_arg, metavar="{auto,on,off}", check=_tri)
    # DataLoader workers when data stays on the host; None: from CPU count
    num_workers: int | None = setting(None, check=integer(0, optional=True))
    # your own DataLoader over a map-style dataset: rebuilt with gputrain's sampler (sharded by rank,
    # seeded by the run, resumable mid-epoch), over an IterableDataset: as a StatefulDataLoader.
    # False: used as is (a resume reads up to its position; several processes see every batch)
    rebuild_loader: bool = setting(True, check=boolean)
    # memory
    # recompute blocks in backward instead of storing their activations (torch.utils.checkpoint):
    # True = the model's repeated blocks, or a list of module names
    recompute: bool | list[str] = setting(
        False, flag=("--recompute", "--checkpointing"), nargs="?", const=True, metavar="MODULES", parse=_module_names,
        help="recompute blocks in backward instead of storing their activations (torch.utils.checkpoint): alone = "
             "the model's repeated blocks; or comma-separated module names. --checkpointing is its old name, still "
             "accepted")
    oom_recovery: bool = setting(True, check=boolean)  # halve the micro-batch and double accumulation on OOM
    # non-finite values and loss spikes (checked at log points, never per step)
    # "stop": error naming the steps and the last good checkpoint | "skip": skip such steps
    on_nan: str = setting("stop", flag="--on-nan", choices=("stop", "skip"),
                          check=one_of(("stop", "skip"), message="on_nan must be 'stop' or 'skip'"),
                          help="a non-finite loss or gradient: stop with an error (default), or skip such steps")
    # a log point's loss above ratio x the median of the last window: a spike
    spike_ratio: float | None = setting(4.0, check=number(
        above=1, optional=True, message="spike_ratio must be > 1 (or None to switch spike detection off)"))
    spike_window: int = setting(10, check=positive_int())  # log points in the rolling median
    spike_patience: int = setting(3, check=positive_int())  # consecutive spikes before the action
    on_spike: str = setting("warn", flag="--on-spike", choices=("warn", "stop"),  # "warn" | "stop"
                            check=one_of(("warn", "stop"), message="on_spike must be 'warn' or 'stop'"),
                            help="a loss spike: warn (default) or stop")
    # distributed
    shard: bool = setting(False, flag="--shard", action="store_true", check=boolean,
                          help="FSDP2 (fully_shard) instead of DDP with several processes")
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
        """Every field's own check (declared beside it), then the checks between fields."""
        self.loggers = check_loggers(self.loggers)
        check_fields(self)
        if self.resume and not self.run_dir and not isinstance(self.resume, str):
            raise ConfigError("resume=True needs run_dir (where the checkpoint is); or pass a checkpoint path")
        if self.async_checkpoint and self.checkpoint_format == "file":
            raise ConfigError("async_checkpoint needs checkpoint_format 'dcp' or 'auto' (the one-file format is "
                              "written by rank 0 while training waits)")

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


def workload_config(workload: Any, stated: "TrainConfig | Mapping[str, Any] | None" = None,
                    full_batch: bool | None = None) -> TrainConfig:
    """The TrainConfig a workload trains with: each field from `stated`, else the workload's defaults
    (`workload.defaults`), else TrainConfig's own; the run named for the workload unless `stated`
    names it. The one place a workload's defaults are resolved: `gputrain fit` and every command
    that describes a run (gputrain/runs/resolve.py), `fit_workload` and the diagnostics.

    stated: the fields a source states; a TrainConfig states every field (the workload's defaults
    then add nothing). A stated steps drops the workload's epochs, and the other way round: they
    are one choice. full_batch: the step takes the whole training set (default: a full-batch
    workload whose batch size is not stated). Raises ConfigError for a value a field refuses.
    """
    if isinstance(stated, TrainConfig):
        config, given = stated, set(TrainConfig.field_names())
    else:
        given = set(stated or {})
        values = dict(workload.defaults)
        for one, other in (("steps", "epochs"), ("epochs", "steps")):
            if one in given:
                values.pop(other, None)
        values.update(stated or {})
        known = set(TrainConfig.field_names())
        config = TrainConfig(**{k: v for k, v in values.items() if k in known})
    if full_batch is None:
        full_batch = bool(workload.full_batch) and "batch_size" not in given
    if full_batch:
        config = config.replace(batch_size=workload.make_data().num_train)  # the whole training set per step
    if config.name is None:
        config = config.replace(name=workload.name)
    return config


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
