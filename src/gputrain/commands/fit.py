"""`gputrain fit [WORKLOAD]`: train a built-in or user workload and report what happened."""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
from pathlib import Path
from typing import Any, Sequence

from gputrain.errors import ConfigError
from gputrain.commands.argtypes import positive_float as _positive_float, positive_int as _positive_int, tri as _tri
from gputrain.commands.argtypes import workload_options

DEFAULT_WORKLOAD = "mnist1d-cnn"  # trains in about a minute on 2 CPU cores and shows a real accuracy






def _batch_size(value: str):
    return "auto" if value.strip().lower() == "auto" else _positive_int(value)




def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("workload", nargs="?", default=None,
                   help=f"a built-in workload (see --list; default {DEFAULT_WORKLOAD}) or module:function returning a gputrain.Workload")
    p.add_argument("--list", action="store_true", help="list the built-in workloads and exit")
    p.add_argument("--config", default=None, metavar="FILE",
                   help="a TOML file of the run (workload, [options], [train]: TrainConfig's fields, [fit]: this "
                        "command's flags); flags given here override it. A run's own: RUN_DIR/config.toml")
    p.add_argument("--print-config", action="store_true",
                   help="print the resolved config of this command line (TOML, as RUN_DIR/config.toml) and exit")
    p.add_argument("--device", default="auto", help="auto (cuda > mps > cpu), cpu, cuda, cuda:N or mps")
    p.add_argument("--precision", default="auto", choices=["auto", "fp32", "tf32", "bf16", "fp16"])
    p.add_argument("--batch-size", type=_batch_size, default=None,
                   help="samples per micro-batch (per process); 'auto' = the largest that fits on the GPU")
    g = p.add_mutually_exclusive_group()
    g.add_argument("--epochs", type=_positive_int, default=None)
    g.add_argument("--steps", type=_positive_int, default=None, help="optimizer steps for the whole run")
    p.add_argument("--accumulate", type=_positive_int, default=None, help="micro-batches per optimizer step")
    p.add_argument("--lr", type=_positive_float, default=None)
    p.add_argument("--weight-decay", type=float, default=None)
    p.add_argument("--schedule", choices=["constant", "cosine", "linear", "onecycle"], default=None)
    p.add_argument("--log-every", type=_positive_int, default=None, help="optimizer steps between loss reads")
    p.add_argument("--eval-every", type=_positive_int, default=None)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--run-dir", default=None, help="where metrics, plots and checkpoints go (default runs/WORKLOAD/TIME)")
    p.add_argument("--no-save", action="store_true", help="write nothing to disk")
    p.add_argument("--no-tensorboard", action="store_true",
                   help="no TensorBoard event files: the loggers (--logger, or the default) without tensorboard")
    p.add_argument("--resume", nargs="?", const=True, default=False,
                   help="resume: a run dir or checkpoint file; alone, the latest run of this workload")
    p.add_argument("--checkpoint-every", type=_positive_int, default=None, help="optimizer steps between checkpoints")
    p.add_argument("--stop-at-step", type=_positive_int, default=None, help="stop after this step (checkpointed)")
    p.add_argument("--checkpoint-format", choices=["auto", "dcp", "file"], default=None,
                   help="dcp: every process writes its part (torch.distributed.checkpoint, a step-N.dcp folder); "
                        "file: one file written by rank 0; auto (default): dcp with several processes, else file")
    p.add_argument("--async-checkpoint", action="store_true",
                   help="write checkpoints in the background while training goes on (DCP's async_save)")
    p.add_argument("--data-on-device", type=_tri, default=None, metavar="{auto,on,off}")
    p.add_argument("--channels-last", type=_tri, default=None, metavar="{auto,on,off}")
    p.add_argument("--cuda-graphs", type=_tri, default=None, metavar="{auto,on,off}")
    p.add_argument("--compile", action="store_true", help="torch.compile the model")
    p.add_argument("--compile-mode", default=None, help="torch.compile mode, e.g. max-autotune-no-cudagraphs")
    p.add_argument("--recompute", "--checkpointing", dest="recompute", nargs="?", const=True, default=None,
                   metavar="MODULES",
                   help="recompute blocks in backward instead of storing their activations "
                        "(torch.utils.checkpoint): alone = the model's repeated blocks; or comma-separated module names. "
                        "--checkpointing is its old name, still accepted")
    p.add_argument("--shard", action="store_true", help="FSDP2 (fully_shard) instead of DDP with several processes")
    p.add_argument("--nproc", type=_positive_int, default=None, help="start N processes on this machine with torchrun")
    p.add_argument("--max-restarts", type=int, default=0, help="with --nproc: torchrun restarts after a failure")
    p.add_argument("--data-dir", default=None, help="folder of a local data set (cifar10-cnn, mnist-cnn)")
    p.add_argument("--option", action="append", default=[], metavar="KEY=VALUE",
                   help="a workload option, e.g. --option n=2000 for synthetic-cifar (repeatable)")
    p.add_argument("--progress", type=_tri, default="auto", metavar="{auto,on,off}",
                   help="progress bar (auto: only on a terminal)")
    p.add_argument("--max-grad-norm", type=_positive_float, default=None, help="clip the gradient norm to this")
    p.add_argument("--on-nan", choices=["stop", "skip"], default=None,
                   help="a non-finite loss or gradient: stop with an error (default), or skip such steps")
    p.add_argument("--on-spike", choices=["warn", "stop"], default=None, help="a loss spike: warn (default) or stop")
    p.add_argument("--autotune", action="store_true",
                   help="try graphs/compile/channels_last/precision for a few steps each, train with the fastest "
                        "(cached per model, device and batch shape; the batch size is never changed)")
    p.add_argument("--autotune-force", action="store_true", help="with --autotune: measure again, ignore the cache")
    p.add_argument("--logger", action="append", default=None, metavar="NAME",
                   help="experiment trackers, repeatable or comma-separated: csv (metrics.csv/jsonl), tensorboard, "
                        "mlflow, wandb (default: csv,tensorboard; naming any replaces the default)")
    p.add_argument("--early-stop", default=None, metavar="METRIC",
                   help="stop when METRIC (e.g. eval_loss, eval_accuracy) has not improved for --patience evaluations")
    p.add_argument("--patience", type=_positive_int, default=3, help="with --early-stop: evaluations without improvement")
    p.add_argument("--min-delta", type=float, default=0.0, help="with --early-stop: the smallest change that counts")
    p.add_argument("--ema", type=float, default=None, metavar="DECAY",
                   help="keep an exponential moving average of the weights (e.g. 0.999), updated inside the step, "
                        "evaluated as eval_ema_* and saved in checkpoints")
    p.add_argument("--json", action="store_true", help="print the summary as JSON")
    p.add_argument("--quiet", action="store_true", help="no run log")


def _setup_logging(quiet: bool, is_main: bool) -> None:
    logger = logging.getLogger("gputrain")
    if logger.handlers:
        return
    from rich.console import Console
    from rich.logging import RichHandler

    handler = RichHandler(console=Console(stderr=True), show_time=False, show_path=False, markup=False)
    logger.addHandler(handler)
    logger.setLevel(logging.WARNING if (quiet or not is_main) else logging.INFO)
    logger.propagate = False


def _list(as_json: bool) -> int:
    from gputrain.workloads import list_workloads

    rows = list_workloads()
    if as_json:
        print(json.dumps(rows, indent=2, default=str))
        return 0
    from rich.console import Console
    from rich.table import Table

    table = Table(title="gputrain workloads")
    for col in ("name", "description", "data", "parameters", "defaults"):
        table.add_column(col)
    for r in rows:
        defaults = ", ".join(f"{k}={v}" for k, v in (r.get("defaults") or {}).items())
        params = r.get("parameters")
        table.add_row(str(r.get("name")), str(r.get("description", "")), str(r.get("data", "")),
                      f"{params:,}" if isinstance(params, int) else str(params or ""), defaults)
    Console().print(table)
    return 0


def _latest_run(workload_name: str) -> Path | None:
    base = Path("runs") / _safe(workload_name)
    if not base.is_dir():
        return None
    runs = sorted(d for d in base.iterdir() if (d / "checkpoints").is_dir() or (d / "checkpoint.pt").exists())
    return runs[-1] if runs else None


def resumed_run_dir(path: Path) -> Path:
    """The run directory of a --resume target: the folder itself, or the run a checkpoint
    (RUN_DIR/checkpoints/step-N.pt or .dcp, or an older RUN_DIR/checkpoint.pt) belongs to."""
    if path.is_dir() and not path.name.endswith(".dcp"):
        return path
    return path.parent.parent if path.parent.name == "checkpoints" else path.parent


def _safe(name: str) -> str:
    return "".join(c if c.isalnum() or c in "-_." else "_" for c in name)


def build_config(args, workload):
    """TrainConfig from the workload's defaults overridden by the flags the user gave."""
    from gputrain.config import DEFAULT_LOGGERS, TrainConfig, tensorboard_loggers

    values = dict(workload.defaults)
    values.update(getattr(args, "config_train", None) or {})  # --config's [train] keys that no flag reads
    flag_map = {
        "device": args.device, "precision": args.precision, "epochs": args.epochs, "steps": args.steps,
        "accumulate": args.accumulate, "lr": args.lr, "weight_decay": args.weight_decay, "schedule": args.schedule,
        "log_every": args.log_every, "eval_every": args.eval_every, "seed": args.seed,
        "checkpoint_every": args.checkpoint_every, "stop_at_step": args.stop_at_step,
        "data_on_device": args.data_on_device, "channels_last": args.channels_last, "cuda_graphs": args.cuda_graphs,
        "compile_mode": args.compile_mode, "max_grad_norm": args.max_grad_norm, "on_nan": args.on_nan,
        "on_spike": args.on_spike, "checkpoint_format": args.checkpoint_format,
    }
    for key, value in flag_map.items():
        if value is not None:
            values[key] = value
    if args.steps is not None:
        values.pop("epochs", None)
    if args.epochs is not None:
        values.pop("steps", None)
    if isinstance(args.batch_size, int):
        values["batch_size"] = args.batch_size
    if args.compile:
        values["compile"] = True
    if args.logger:
        values["loggers"] = tuple(n for item in args.logger for n in item.split(",") if n.strip())
    if args.no_tensorboard:  # a shorthand: the loggers (--logger, the file's, the default) without tensorboard
        values["loggers"] = tensorboard_loggers(values.get("loggers", DEFAULT_LOGGERS), False)
    if args.shard:
        values["shard"] = True
    if args.async_checkpoint:
        values["async_checkpoint"] = True
    if args.recompute is not None:
        values["recompute"] = True if args.recompute is True else [s for s in args.recompute.split(",") if s]
    # Run directory and resume.
    if args.no_save:
        if args.resume:
            raise ConfigError("--resume needs a run directory: drop --no-save")
        values["run_dir"] = None
    else:
        run_dir = args.run_dir
        resume = args.resume
        if resume is True and run_dir is None:
            latest = _latest_run(workload.name)
            if latest is None:
                raise ConfigError(f"--resume: no earlier run of {workload.name} with a checkpoint under runs/; "
                                  "give the run directory or checkpoint file")
            run_dir = str(latest)
        elif isinstance(resume, str):
            path = Path(resume)
            if not path.exists():
                raise ConfigError(f"--resume {resume}: no such run directory or checkpoint file")
            if path.is_dir() and not path.name.endswith(".dcp"):
                resume = True
            run_dir = run_dir or str(resumed_run_dir(path))
        if run_dir is None:
            run_dir = str(Path("runs") / _safe(workload.name) / time.strftime("%Y%m%d-%H%M%S"))
        values["run_dir"] = run_dir
        values["resume"] = resume
    progress = args.progress
    values["progress"] = sys.stderr.isatty() if progress == "auto" else bool(progress)
    known = set(TrainConfig.field_names())
    return TrainConfig(**{k: v for k, v in values.items() if k in known})


def run(args, extra_callbacks: Sequence[Any] = ()) -> int:
    """Train as the flags (and --config's file) say. extra_callbacks: added to the run's own (a sweep's
    trial reports its evaluations through one)."""
    if args.list:
        return _list(args.json)
    if args.config:
        _apply_config_file(args)
    if args.nproc and args.nproc > 1 and (args.autotune or args.autotune_force) and not args.print_config:
        raise ConfigError("--autotune runs its trials in one process: run it once without --nproc, then start the "
                          "job with --nproc and the switches it chose (--precision, --cuda-graphs, --channels-last, "
                          "--compile)")
    if args.nproc and args.nproc > 1 and "LOCAL_RANK" not in os.environ and not args.print_config:
        from gputrain.runtime.distributed import launch_torchrun

        argv = _argv_without(getattr(args, "_argv", sys.argv[1:]), ("--nproc", "--max-restarts"))
        return launch_torchrun(args.nproc, argv, max_restarts=args.max_restarts)

    from gputrain.runtime.distributed import is_main_process

    is_main = is_main_process()
    _setup_logging(args.quiet or args.json, is_main)
    from gputrain.workloads import resolve_workload

    options = {"data_dir": args.data_dir} if args.data_dir else {}
    options.update(workload_options(args.option, example="--option n=2000"))
    name, options = _workload_to_train(args, options)
    workload = resolve_workload(name, **options)
    config = build_config(args, workload)
    if args.print_config:
        return _print_config(args, name, options, workload, config)
    if config.run_dir:
        _check_run_dir_owner(Path(config.run_dir), name, workload.name)
    full_batch = workload.full_batch and args.batch_size is None
    if args.batch_size == "auto":
        config = _auto_batch_size(workload, config)
        full_batch = False
    autotune_report = None
    if args.autotune or args.autotune_force:
        from gputrain.diagnostics.autotune import autotune, render_report
        from gputrain.train.fit import workload_config

        config, autotune_report = autotune(workload, workload_config(workload, config, full_batch),
                                           force=args.autotune_force)
        full_batch = False  # workload_config above already applied it
        if is_main and not args.json:
            from rich.console import Console

            render_report(autotune_report, Console())

    from gputrain.train import fit_workload
    from gputrain.train.fit import workload_config

    config, full_batch = workload_config(workload, config, full_batch), False  # the batch size it trains with
    callbacks = _callbacks(args) + list(extra_callbacks)
    run_dir = Path(config.run_dir) if config.run_dir and is_main else None
    made = _missing_folders(run_dir) if run_dir is not None else []

    def record() -> None:  # workload.json and config.toml: what the run is, and how to repeat it
        assert run_dir is not None
        _record_workload(run_dir, name, workload.name, options)
        _record_config(run_dir, name, options, workload, config, args)

    try:
        # Recorded once every check passed (a resume's checkpoint fits): a refused run writes nothing.
        history, _model = fit_workload(workload, config, full_batch=full_batch, callbacks=callbacks,
                                       on_ready=None if run_dir is None else record)
    except BaseException:
        _remove_if_empty(made)  # the folders a refused run made for itself (preflight creates the run directory)
        raise
    if not is_main:
        return 0
    summary = dict(history.summary)
    summary["workload"] = workload.name
    if config.run_dir:
        summary["run_dir"] = config.run_dir
    if args.json:
        out = {"summary": summary, "final": history.records[-1] if history.records else None}
        if autotune_report is not None:
            out["autotune"] = autotune_report
        print(json.dumps(out, indent=2, default=str))
    else:
        from rich.console import Console

        from gputrain.report.summary import render_summary

        render_summary(summary, Console())
    return 0


def _auto_batch_size(workload, config):
    """The largest micro-batch that fits on the GPU: a search, driven by out-of-memory errors, over the
    step this run will train with (diagnostics/probe.py: the Trainer's optimizer and switches)."""
    log = logging.getLogger("gputrain")
    from gputrain.runtime.devices import pick_device

    device = pick_device(config.device)
    if device.type != "cuda":
        log.warning("--batch-size auto needs a CUDA device (memory on %s is not bounded the same way): "
                    "using the workload's default %d", device.type, config.batch_size)
        return config
    import torch

    from gputrain.diagnostics.batch_search import batch_trial, find_max_batch
    from gputrain.diagnostics.probe import StepProbe, probe_batches
    from gputrain.train.loss import LossRule

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


def _argv_without(argv: list[str], flags: tuple[str, ...]) -> list[str]:
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
            continue
        if a in flags:
            skip = True
            continue
        if any(a.startswith(f + "=") for f in flags):
            continue
        out.append(a)
    return out


def _callbacks(args) -> list:
    """The callbacks the flags ask for: --early-stop METRIC (--patience, --min-delta), --ema DECAY."""
    callbacks: list = []
    if args.early_stop:
        from gputrain.train.early_stopping import EarlyStopping

        callbacks.append(EarlyStopping(args.early_stop, patience=args.patience, min_delta=args.min_delta))
    if args.ema is not None:
        from gputrain.train.ema import EMA

        callbacks.append(EMA(args.ema))
    return callbacks


def _workload_to_train(args, options: dict) -> tuple[str, dict]:
    """(workload spec, options) this command trains: as given, else (resuming a run) the run's own
    from its workload.json, else the default. A resume without --option keeps the run's options."""
    from gputrain.workloads.from_run import recorded_workload, stored_spec

    target = Path(args.run_dir) if args.run_dir else \
        resumed_run_dir(Path(args.resume)) if isinstance(args.resume, str) and Path(args.resume).exists() else None
    recorded = recorded_workload(target) if args.resume and target is not None else None
    name = args.workload or (recorded["workload"] if recorded else DEFAULT_WORKLOAD)
    if recorded and recorded["workload"] in (name, stored_spec(name)) and not options:
        options = dict(recorded["options"])
    return name, options


def _check_run_dir_owner(run_dir: Path, spec: str, name: str) -> None:
    """Refuse, before anything is written, a run directory that another workload's run owns (its
    workload.json says so): training or resuming there would mix two models' checkpoints."""
    from gputrain.workloads.from_run import WORKLOAD_FILE, recorded_workload, stored_spec

    recorded = recorded_workload(run_dir)
    if recorded is None or recorded["workload"] in (spec, stored_spec(spec)) or recorded.get("name") == name:
        return
    owner = recorded["workload"]
    raise ConfigError(f"{run_dir} belongs to a run of {owner} ({run_dir / WORKLOAD_FILE}), not {spec}: resume it with "
                      f"`gputrain fit {owner} --resume {run_dir}`, or start a new run of {spec} with another "
                      "--run-dir (or none, for one under runs/)")


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


def _record_workload(run_dir: Path, spec: str, name: str, options: dict) -> None:
    """RUN_DIR/workload.json: what `gputrain eval / predict / export RUN_DIR` rebuild the model from,
    and what tells a later `gputrain fit` whose run directory this is."""
    from gputrain.io.atomic import atomic_file
    from gputrain.workloads.from_run import WORKLOAD_FILE, stored_spec

    try:
        with atomic_file(run_dir / WORKLOAD_FILE, "w") as f:
            f.write(json.dumps({"workload": stored_spec(spec), "name": name, "options": options}, indent=2) + "\n")
    except OSError:
        return  # the run's preflight (io/preflight.py) says what is wrong with the directory, and how to fix it


# ---------------------------------------------------------------- --config and --print-config


def _apply_config_file(args) -> None:
    """Fill `args` from --config's file wherever the command line gave nothing (gputrain/run_config.py)."""
    from gputrain.run_config import apply_to_args, given_dests, load_run_config

    argv = list(getattr(args, "_argv", sys.argv[1:]))
    argv = argv[argv.index("fit") + 1:] if "fit" in argv else argv
    apply_to_args(args, load_run_config(args.config), given_dests(add_arguments, argv))


def _print_config(args, name: str, options: dict, workload, config) -> int:
    """--print-config: the resolved config of this command line on stdout; nothing trained or written."""
    from gputrain.run_config import resolved_text
    from gputrain.train.fit import workload_config

    full_batch = workload.full_batch and args.batch_size is None
    print(resolved_text(name, options, workload_config(workload, config, full_batch), args, record=False,
                        workload_name=workload.name), end="")
    return 0


def _record_config(run_dir: Path, name: str, options: dict, workload, config, args) -> None:
    """RUN_DIR/config.toml: the run's resolved config, which `gputrain fit --config` repeats."""
    from gputrain.run_config import record_config, resolved_text

    try:
        record_config(run_dir, resolved_text(name, options, config, args, record=True, workload_name=workload.name))
    except OSError:
        return  # as _record_workload: the run's preflight says what is wrong with the directory
