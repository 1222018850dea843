"""A run's checkpoints: what a checkpoint holds (model, optimizer, scaler, schedule, RNG, RunState,
config, history), writing it into the run's verified store, and an exact resume with its checks.

Functions of the Trainer `t` whose state they read and restore.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import torch

from gputrain.batch import move_optimizer_state
from gputrain.data import BatchStream
from gputrain.errors import CheckpointError
from gputrain.runtime import distributed
from gputrain.train.state import RunState

log = logging.getLogger("gputrain")


def state_dict(t) -> dict[str, Any]:
    from gputrain.io.checkpoint import capture_rng_state

    if t.dist.enabled:
        model_state = distributed.model_state_dict(t.model, t.dist)
        optim_state = distributed.optimizer_state_dict(t.model, t.optimizer, t.dist)
    else:
        model_state = t.module.state_dict()
        optim_state = t.optimizer.state_dict()
    loss_total, bad = t._read_step_totals()  # folded into the run state, so nothing is lost
    t.state.nonfinite_steps += bad
    t.nonfinite.check(bad, t.state.step, t.last_checkpoint)  # never save a non-finite state
    t.state.loss_since_log += loss_total
    t.state.splits = t.train_step.splits
    t.state.epoch, t.state.batch_in_epoch = t.stream.epoch, t.stream.batch_in_epoch
    run = t.state.state_dict()
    return {
        "model": model_state,
        "optimizer": optim_state,
        "scaler": t.precision.state_dict(),
        "scheduler": t.scheduler.state_dict(),
        "rng": capture_rng_state(t.device),
        "run": run,
        **{k: run[k] for k in ("step", "epoch", "batch_in_epoch", "samples_seen")},  # for readers of the file
        "world_size": t.dist.world_size,
        "config": t.config.to_dict(),
        "history": list(t.history.records),
    }

def save_checkpoint(t, path: Path | None = None) -> Path | None:
    """Write a checkpoint: into the run's store (retention, hash, `latest`), or to `path`."""
    from gputrain.io.checkpoint import save_checkpoint

    state = t.state_dict()  # collective under DDP/FSDP: every rank takes part
    if t.is_main:
        try:
            if path is not None:
                save_checkpoint(path, state)
            else:
                last = t.history.records[-1] if t.history.records else {}
                metrics = {k: v for k, v in last.items() if k.startswith("eval_")}
                path = t.store.save(state, t.state.step, metrics=metrics)
        except OSError as exc:  # a full disk, a vanished folder: the previous checkpoint is untouched
            where = path or (t.run_dir / "checkpoints")
            previous = f"the previous checkpoint {t.last_checkpoint} is intact" if t.last_checkpoint else \
                "no earlier checkpoint of this run exists"
            raise CheckpointError(f"could not write the checkpoint of step {t.state.step} to {where}: "
                                  f"{exc.strerror or exc}; {previous}. Free space (or choose another --run-dir) "
                                  f"and resume with --resume {t.run_dir}") from exc
    distributed.barrier(t.dist)
    if path is None:
        path = t.store.latest_path()
    t.last_checkpoint = str(path)
    return path

def resume(t) -> None:
    from gputrain.io.checkpoint import check_model_state, load_checkpoint, restore_rng_state

    if isinstance(t.config.resume, str):
        path = Path(t.config.resume)
        state = load_checkpoint(path)
    else:
        found = t.store.load_latest()
        if found is None:
            log.info("no checkpoint in %s: starting a new run", t.run_dir)
            return
        state, path = found
    check_model_state(state["model"], t.module, path=str(path))
    check_resumable(t, state, path)
    if t.dist.enabled:
        distributed.load_model_state_dict(t.model, state["model"], t.dist)
        distributed.load_optimizer_state_dict(t.model, t.optimizer, state["optimizer"], t.dist)
    else:
        t.module.load_state_dict(state["model"])
        _load_optimizer_state(t.optimizer, state["optimizer"])
    move_optimizer_state(t.optimizer, t.device)
    t.precision.load_state_dict(state["scaler"])
    t.scheduler.load_state_dict(state["scheduler"])
    restore_rng_state(state["rng"], t.device)
    t.state = RunState.from_state_dict(state.get("run", state))
    t.train_step.splits = t.state.splits
    t.stream = BatchStream(t.train_loader, t.state.epoch, t.state.batch_in_epoch)
    t.history.records = list(state.get("history", []))
    log.info("resumed from %s at step %d", path, t.state.step)

def check_resumable(t, state: dict, path: Path) -> None:
    """The data order depends on the seed and the global batch (per-process batch x accumulation x
    processes), so a run may resume with another process count if the global batch is kept."""
    saved_cfg = state.get("config", {})
    saved_global = (saved_cfg.get("batch_size", 0) * saved_cfg.get("accumulate", 1)
                    * int(state.get("world_size", 1)))
    global_batch = t.config.batch_size * t.config.accumulate * t.dist.world_size
    if saved_cfg and saved_global != global_batch:
        raise CheckpointError(
            f"{path}: the checkpoint was trained with a global batch of {saved_global} "
            f"(batch_size x accumulate x processes) but this run has {global_batch}; an exact resume needs "
            "the same global batch")
    if "seed" in saved_cfg and saved_cfg["seed"] != t.config.seed:
        raise CheckpointError(f"{path}: the checkpoint was trained with seed={saved_cfg['seed']} but this run "
                              f"has seed={t.config.seed}; an exact resume needs the same seed")


def _load_optimizer_state(optimizer: torch.optim.Optimizer, state: dict) -> None:
    try:
        optimizer.load_state_dict(state)
    except (ValueError, KeyError) as exc:
        raise CheckpointError(f"the checkpoint's optimizer state does not fit this optimizer: {exc}") from None
