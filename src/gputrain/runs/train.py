"""Train a RunSpec: the one function below the command line that `gputrain fit`, a sweep's trial and
`gputrain.fit_config` call. It returns data (the history, a summary, autotune's report); the
command line renders them."""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

from gputrain.errors import ConfigError
from gputrain.io.run_layout import CONFIG_FILE, WORKLOAD_FILE
from gputrain.runs.spec import RunSpec, spec_text


@dataclass
class RunResult:
    """What a trained spec gives back. summary: the history's summary with the workload's name and
    the run directory; is_main: False on the other ranks of a multi-process run (they report
    nothing). A run in processes torchrun started (runs/launch.py) is `shown` (their rank 0 printed
    its summary: nothing more to show) and ends with their `exit_code` (0, 2 for a refusal they said,
    128 + N when signal N stopped them); its history is None when none could be read."""

    spec: RunSpec
    history: Any
    summary: dict[str, Any]
    autotune_report: dict[str, Any] | None
    is_main: bool
    shown: bool = False
    exit_code: int = 0


def decided(spec: RunSpec, workload: Any) -> tuple[Any, dict[str, Any] | None]:
    """(spec.train with what is decided as the run starts, autotune's report or None): batch_size
    "auto" searched (the largest that fits on CUDA), then the switches autotuned (fit.autotune), both
    on the device the trainer will take (runtime/distributed.process_device). Nothing is written."""
    from gputrain.runtime.distributed import process_device

    config, report = spec.train, None
    searched, tuned = "batch_size" in spec.auto, spec.fit.autotune or spec.fit.autotune_force
    # one device for both, as the trainer will decide it
    device = process_device(config.device) if searched or tuned else None
    if searched:
        config = _auto_batch_size(workload, config, device)
    if tuned:
        from gputrain.diagnostics.autotune import autotune

        config, report = autotune(workload, config, force=spec.fit.autotune_force, device=device)
    return config, report


def train_spec(spec: RunSpec, workload: Any = None, callbacks: Sequence[Any] = ()) -> RunResult:
    """Train `spec` (its Workload when the caller resolved it; else built from spec.workload).

    Before anything is written: the run directory is checked (another workload's run refuses), the
    batch size searched (batch_size "auto" on CUDA) and the switches autotuned (fit.autotune). Once
    the trainer is set up, every check passed and the first step done, RUN_DIR/workload.json and
    RUN_DIR/config.toml (the spec written out) are recorded; a refused run (at its first step too)
    leaves no folder it made. callbacks: added to the spec's own (fit.early_stop, fit.ema): a sweep's
    trial reports through one.
    """
    from gputrain.runtime.distributed import is_main_process
    from gputrain.train import fit_workload

    if workload is None:
        from gputrain.workloads import resolve_workload

        workload = resolve_workload(spec.workload.name, **spec.workload.options)
    if spec.train.run_dir:
        check_run_dir_owner(Path(spec.train.run_dir), spec.workload.name, workload.name)
    config, report = decided(spec, workload)
    named = named_optimizers(spec, workload)
    is_main = is_main_process()
    spec = RunSpec(spec.workload, config, spec.fit, tuple(k for k in spec.auto if k != "batch_size"),
                   spec.run_dir_stated)
    run_dir = Path(config.run_dir) if config.run_dir and is_main else None
    made = _missing_folders(run_dir) if run_dir is not None else []

    # workload.json and config.toml, once the run goes ahead: what it is, and how to repeat it
    record = None if run_dir is None else functools.partial(_record, run_dir, spec, named, workload.name)
    try:
        history, _model = fit_workload(workload, config, full_batch=False, callbacks=[*spec_callbacks(spec), *callbacks],
                                       on_ready=record, optimizers=named)
    except BaseException:
        _remove_if_empty(made)  # the folders a refused run made for itself (preflight creates the run directory)
        raise
    summary = dict(history.summary)
    summary["workload"] = workload.name
    if config.run_dir:
        summary["run_dir"] = config.run_dir
    return RunResult(_used_spec(spec, named), history, summary, report, is_main)


def read_result(spec: RunSpec) -> RunResult:
    """The result of `spec` trained in other processes (torchrun's, Ray's workers), as rank 0 wrote
    it in the run directory (history.json); GputrainError naming the file when it cannot be read."""
    from gputrain.io.history import History

    history = History.load(Path(spec.train.run_dir or ".") / "history.json")
    summary = dict(history.summary)
    summary["workload"] = spec.workload.name
    summary["run_dir"] = spec.train.run_dir
    return RunResult(spec, history, summary, None, True)


def named_optimizers(spec: RunSpec, workload: Any) -> Any:
    """The workload's named optimizers with the spec's settings ([optimizers.NAME]): a NamedOptimizers,
    None for a workload without a step of its own (or without optimizers by name)."""
    if workload.step_fn is None or workload.optimizers is None:
        return None
    from gputrain.train.optim.by_name import NamedOptimizers

    return NamedOptimizers(workload.optimizers, spec.workload.optimizers)


def spec_callbacks(spec: RunSpec) -> list:
    """The callbacks the run settings ask for: early_stop (patience, min_delta), ema."""
    callbacks: list = []
    if spec.fit.early_stop:
        from gputrain.train.loop.early_stopping import EarlyStopping

        callbacks.append(EarlyStopping(spec.fit.early_stop, patience=spec.fit.patience, min_delta=spec.fit.min_delta))
    if spec.fit.ema is not None:
        from gputrain.train.loop.ema import EMA

        callbacks.append(EMA(spec.fit.ema))
    return callbacks


def check_run_dir_owner(run_dir: Path, spec: str, name: str) -> None:
    """Refuse, before anything is written, a run directory that another workload's run owns (its
    workload.json says so): training or resuming there would mix two models' checkpoints."""
    from gputrain.workloads.from_run import recorded_workload, stored_spec

    recorded = recorded_workload(run_dir)
    if recorded is None or recorded["workload"] in (spec, stored_spec(spec)) or recorded.get("name") == name:
        return
    owner = recorded["workload"]
    raise ConfigError(f"{run_dir} belongs to a run of {owner} ({run_dir / WORKLOAD_FILE}), not {spec}: resume it with "
                      f"`gputrain fit {owner} --resume {run_dir}`, or start a new run of {spec} with another "
                      "--run-dir (or none, for one under runs/)")


def _auto_batch_size(workload, config, device):
    """The largest micro-batch that fits on the GPU (`device`, the run's): a search, driven by
    out-of-memory errors, over the step this run will train with (diagnostics/probe.py: the Trainer's
    optimizer and switches)."""
    log = logging.getLogger("gputrain")
    if device.type != "cuda":
        log.warning("--batch-size auto needs a CUDA device (memory on %s is not bounded the same way): "
                    "using the workload's default %d", device.type, config.batch_size)
        return config
    import torch

    from gputrain.diagnostics.batch_search import batch_trial, find_max_batch
    from gputrain.diagnostics.probe import StepProbe, probe_batches
    from gputrain.train.step.loss import LossRule

    model = workload.make_model().to(device)
    loss = LossRule(loss_fn=workload.loss_fn, compute_loss=workload.compute_loss)
    with StepProbe(model, loss, config) as probe:
        make_batch = probe_batches(workload.make_data(), probe)
        if make_batch is None:
            log.warning("--batch-size auto searches workloads whose data are tensor columns (a tuple of tensors or "
                        "a dict of tensors); %s trains on a Dataset or DataLoader: using the workload's default %d",
                        workload.name, config.batch_size)
            return config
        # Real training steps per trial, optimizer state included (AdamW's two moments).
        best = find_max_batch(batch_trial(probe, make_batch), start=config.batch_size, limit=make_batch.n,
                              device=device)
    model.to("cpu")
    del model, probe
    torch.cuda.empty_cache()
    log.info("--batch-size auto: %d is the largest micro-batch that fits (searched up to %d)", best, make_batch.n)
    return config.replace(batch_size=best)


def _missing_folders(path: Path) -> list[Path]:
    """`path` and its parents that do not exist yet, deepest first."""
    missing = []
    while not path.exists() and path != path.parent:
        missing.append(path)
        path = path.parent
    return missing


def _remove_if_empty(folders: list[Path]) -> None:
    for folder in folders:  # deepest first; rmdir refuses a folder that holds anything
        try:
            folder.rmdir()
        except OSError:
            return


def _used_spec(spec: RunSpec, named: Any) -> RunSpec:
    """`spec` with the optimizers' settings as they trained (the workload's defaults included)."""
    if named is None:
        return spec
    return dataclasses.replace(spec, workload=dataclasses.replace(spec.workload, optimizers=named.used))


def _record(run_dir: Path, spec: RunSpec, named: Any, name: str) -> None:
    """RUN_DIR/workload.json (what `gputrain eval / predict / export RUN_DIR` rebuild the model from,
    and what tells a later run whose directory this is) and RUN_DIR/config.toml (the spec as it
    trains, which `gputrain fit --config` repeats)."""
    from gputrain.io.atomic import write_text
    from gputrain.workloads.from_run import stored_spec

    spec = _used_spec(spec, named)
    try:
        write_text(run_dir / WORKLOAD_FILE, json.dumps({"workload": stored_spec(spec.workload.name), "name": name,
                                                        "options": spec.workload.options}, indent=2) + "\n")
        write_text(run_dir / CONFIG_FILE, spec_text(spec, record=True, workload_name=name))
    except OSError:
        return  # the run's preflight (io/preflight.py) says what is wrong with the directory, and how to fix it
