"""A run as one typed tree: the workload and its options, TrainConfig, and the run's own settings.

    RunSpec
      workload: WorkloadSpec   name (built-in or module:function) and its options
      train:    TrainConfig    what the trainer reads: [train], gputrain/config.py
      fit:      RunSettings    what is done around the trainer: [fit]

The rule that splits them: a field is TrainConfig's when the trainer reads it while one process
trains, so that `fit(model, data, config=TrainConfig(...))` means the same in Python as on the
command line (the device, the length, the optimizer's settings, on_nan, best_metric and
checkpoint retention, the speed switches). A field is RunSettings' when the run spec acts on it
before or around the trainer, where Python would pass an object or do it itself: where the
processes start (nproc, launcher, max_restarts, ray_storage: runs/launch.py), what is decided
before training and written into TrainConfig (autotune: the switches; no_save: no run directory),
and the callbacks the spec adds (early_stop, patience, min_delta: EarlyStopping; ema: EMA; in
Python, `fit(callbacks=[...])`). Presentation flags (--json, --quiet) say how the command shows the
run, not how it trains: each command declares its own (sweep, profile, memory, bench), and fit's
two sit in RunSettings, so that a run's file repeats it as it was shown (--print-config's output,
given to --config, prints JSON again); nothing below the command line reads them except to set the
run log's level (on Ray's workers too).

Each field is declared once, with its flag, default, help and check (gputrain/fields.py): the command
line is generated from the tree (runs/flags.py), a config file and a sweep trial are read into it
(gputrain/runs/stated.py: the same checks), and RUN_DIR/config.toml and --print-config are the tree
written out (`spec_text`), every field included, so that a repeat does not change when a default does.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from typing import Any

from gputrain.config import TrainConfig
from gputrain.errors import ConfigError
from gputrain.fields import (boolean, check_fields, integer, number, one_of, positive_float_arg, positive_int,
                             positive_int_arg, setting)
from gputrain.io.run_layout import CONFIG_FILE

DEFAULT_WORKLOAD = "mnist1d-cnn"  # trains in about a minute on 2 CPU cores and shows a real accuracy
AUTO_FIELDS = ("batch_size", "progress")  # TrainConfig fields a spec may state as "auto" (decided when it runs)
LAUNCHERS = ("torchrun", "ray")  # what starts a run's processes (Slurm's srun starts gputrain itself)


def _nproc(name: str, value: Any) -> None:
    """A count of processes (how many fit where: `RunSettings.__post_init__`, by launcher)."""
    if value is None:
        return
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ConfigError(f"{name} must be at least 1, got {value!r}")


def _check_cores(name: str, value: int | None) -> None:
    """torchrun's processes on this machine: at most one per CPU core (a GPU machine has more cores than
    GPUs; runtime/distributed.py checks the GPUs when the processes start). Ray's workers are checked
    against the cluster's room when it is reached (runtime/ray_train.py)."""
    cores = max(1, os.cpu_count() or 1)
    if value is not None and value > cores:
        raise ConfigError(f"{name} must be at most {cores} (the CPU cores of this machine: one process each), "
                          f"got {value!r}")


@dataclass
class WorkloadSpec:
    """The workload a run trains: a built-in name or module:function, and its options (as
    `--option KEY=VALUE` gives them). Open for more: whatever builds the run's model and step."""

    name: str = DEFAULT_WORKLOAD
    options: dict[str, Any] = field(default_factory=dict)
    # A workload with a step of its own: each named optimizer's settings ([optimizers.NAME]: lr, betas,
    # weight_decay, ...; train/optim/by_name.py), set after the workload builds it. Recorded as the
    # values the run used, the workload's defaults included.
    optimizers: dict[str, dict[str, Any]] = field(default_factory=dict)


@dataclass
class RunSettings:
    """What a run does around the trainer: [fit] in a config file, `gputrain fit`'s own flags."""

    nproc: int | None = setting(None, flag="--nproc", parse=positive_int_arg, check=_nproc,
                                help="start N processes on this machine with torchrun")
    max_restarts: int = setting(0, flag="--max-restarts", parse=int, check=integer(0),
                                help="with --nproc: torchrun restarts after a failure (--launcher ray: Ray Train's "
                                     "FailureConfig(max_failures=N))")
    launcher: str = setting("torchrun", flag="--launcher", choices=LAUNCHERS, check=one_of(LAUNCHERS),
                            help="what starts the --nproc processes: torchrun (this machine), or ray (Ray Train "
                                 "workers on a local Ray cluster, or the one RAY_ADDRESS names; pip install "
                                 "'gputrain[ray]')")
    ray_storage: str | None = setting(None, flag="--ray-storage", metavar="PATH",
                                      help="with --launcher ray: where Ray keeps its copies of the run's checkpoints "
                                           "(Ray Train's RunConfig(storage_path=...): a folder, or a URI such as "
                                           "s3://bucket/runs; shared storage on a cluster of several machines). "
                                           "Default: Ray's, ~/ray_results")
    autotune: bool = setting(False, flag="--autotune", action="store_true", check=boolean,
                             help="try graphs/compile/channels_last/precision for a few steps each, train with the "
                                  "fastest (cached per model, device and batch shape; the batch size is never changed)")
    autotune_force: bool = setting(False, flag="--autotune-force", action="store_true", check=boolean,
                                   help="with --autotune: measure again, ignore the cache")
    early_stop: str | None = setting(None, flag="--early-stop", metavar="METRIC",
                                     help="stop when METRIC (e.g. eval_loss, eval_accuracy) has not improved for "
                                          "--patience evaluations")
    patience: int = setting(3, flag="--patience", parse=positive_int_arg, check=positive_int(),
                            help="with --early-stop: evaluations without improvement")
    min_delta: float = setting(0.0, flag="--min-delta", parse=float, check=number(at_least=0),
                               help="with --early-stop: the smallest change that counts")
    ema: float | None = setting(None, flag="--ema", metavar="DECAY", parse=float,
                                check=number(above=0, below=1, optional=True, message="EMA decay must be in (0, 1)"),
                                help="keep an exponential moving average of the weights (e.g. 0.999), updated inside "
                                     "the step, evaluated as eval_ema_* and saved in checkpoints")
    json: bool = setting(False, flag="--json", action="store_true", check=boolean, help="print the summary as JSON")
    quiet: bool = setting(False, flag="--quiet", action="store_true", check=boolean, help="no run log")
    no_save: bool = setting(False, flag="--no-save", action="store_true", check=boolean, help="write nothing to disk")

    def __post_init__(self) -> None:
        check_fields(self)
        if self.launcher == "torchrun":
            _check_cores("nproc", self.nproc)
        if self.ray_storage is not None and self.launcher != "ray":
            raise ConfigError("--ray-storage says where Ray Train keeps its checkpoints: it needs --launcher ray "
                              "(torchrun's runs keep theirs in the run directory only)")
        if self.ray_storage is not None and not str(self.ray_storage).strip():
            raise ConfigError("--ray-storage is empty: give a folder or a URI (s3://bucket/path), or leave it out "
                              "for Ray's default, ~/ray_results")
        if (self.nproc or 1) > 1 and (self.autotune or self.autotune_force):
            raise ConfigError("--autotune runs its trials in one process: run it once without --nproc, then start "
                              "the job with --nproc and the switches it chose (--precision, --cuda-graphs, "
                              "--channels-last, --compile)")


@dataclass
class RunSpec:
    """One run, resolved: every setting it trains with (see the module docstring).

    auto: the TrainConfig fields stated as "auto" (batch_size: the largest that fits, searched when
    the run starts; progress: on a terminal), written back as "auto". run_dir_stated: whether the
    run directory was given (else it is the default one, written as a comment).
    """

    workload: WorkloadSpec = field(default_factory=WorkloadSpec)
    train: TrainConfig = field(default_factory=TrainConfig)
    fit: RunSettings = field(default_factory=RunSettings)
    auto: tuple[str, ...] = ()
    run_dir_stated: bool = False


def spec_text(spec: RunSpec, *, record: bool, workload_name: str | None = None) -> str:
    """The spec as TOML (what `gputrain fit --config` reads back).

    record=True: what RUN_DIR/config.toml holds: every setting the run trained with, but not where
    it wrote (run_dir and resume are comments, so that a repeat names its own run directory) and
    not autotune (the switches it chose are in [train]). record=False: what --print-config shows,
    with run_dir and resume when they were given. The run's name is left out when it is the
    workload's own (`workload_name`), so that a copy for another workload is named anew.
    """
    from gputrain.io.toml_file import dumps, value_text
    from gputrain.version import __version__

    config = spec.train
    train: dict[str, Any] = {}
    defaults = {f.name: f.default for f in dataclasses.fields(TrainConfig)}
    for key, value in config.to_dict().items():
        if key in ("run_dir", "resume") or (key == "name" and value == workload_name):
            continue
        if key in spec.auto and (key == "progress" or not record):
            value = "auto"
        if value is None and defaults.get(key) is not None:
            value = "none"  # TOML has no null: an optional field switched off (spike_ratio)
        train[key] = list(value) if isinstance(value, tuple) else value
    fit = {f.name: getattr(spec.fit, f.name) for f in dataclasses.fields(RunSettings)}
    notes = []
    if record:
        if fit["autotune"] or fit["autotune_force"]:
            notes.append("autotune chose the switches above (precision, cuda_graphs, channels_last, compile)")
        fit["autotune"] = fit["autotune_force"] = False
        if config.run_dir:
            notes.append(f"run_dir = {value_text(config.run_dir)}  (this run's; a repeat names its own: --run-dir)")
    else:
        if spec.run_dir_stated and config.run_dir:
            train["run_dir"] = config.run_dir
        elif config.run_dir:
            notes.append(f"run_dir = {value_text(config.run_dir)}  (the default: none was given)")
        if config.resume:
            train["resume"] = config.resume
    header = [f"gputrain {__version__}: the resolved config of a `gputrain fit` run of {spec.workload.name}",
              "(each setting from the command line, else a config file, else the workload's defaults, else TrainConfig's).",
              f"Repeat the run: gputrain fit --config {CONFIG_FILE if record else 'THIS_FILE'} --run-dir NEW_DIR"]
    tables: dict[str, dict[str, Any]] = {"options": dict(spec.workload.options)}
    if spec.workload.optimizers:
        tables["optimizers"] = {name: {k: list(v) if isinstance(v, tuple) else v for k, v in values.items()}
                                for name, values in spec.workload.optimizers.items()}
    return dumps({"workload": spec.workload.name}, {**tables, "train": train, "fit": fit},
                 header=header, notes={"train": notes})
