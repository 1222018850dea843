"""A run's checkpoints: what a checkpoint holds (model, optimizer, scaler, schedule, RNG, RunState,
config, history), writing it into the run's verified store, and an exact resume with its checks.

Functions of the Trainer `t` whose state they read and restore.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any

import torch

from gputrain.batch import move_optimizer_state
from gputrain.errors import CheckpointError
from gputrain.io import checkpoint_dcp
from gputrain.runtime import distributed
from gputrain.train.state import RunState

log = logging.getLogger("gputrain")


def state_dict(t, weights: bool = True) -> dict[str, Any]:
    """What a checkpoint holds. weights=False: all but "model" and "optimizer", which the sharded
    format writes itself (each rank its part): no gathering, this rank's RNG. Collective either way."""
    from gputrain.io.checkpoint import capture_rng_state

    model_state: dict[str, Any] = {}
    optim_state: dict[str, Any] = {}
    if not weights:
        pass
    elif t.dist.enabled:
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
    data = t.stream.state_dict()  # the data position, one object whatever the source (data/stream.py)
    # Each rank's: a rank's iterable has a loader state of its own (one collective when several processes).
    data_ranks = distributed.all_gather_object(data, t.dist) if t.dist.enabled else None
    run = t.state.state_dict()
    state: dict[str, Any] = {
        "model": model_state,
        "optimizer": optim_state,
        "scaler": t.precision.state_dict(),
        "scheduler": t.scheduler.state_dict(),
        "rng": capture_rng_state(t.device),
        "run": run,
        "data": data,
        **({"data_ranks": data_ranks} if data_ranks is not None else {}),
        **{k: run[k] for k in ("step", "epoch", "batch_in_epoch", "samples_seen")},  # for readers of the file
        "global_batch": _global_batch(t),
        "world_size": t.dist.world_size,
        "config": t.config.to_dict(),
        "history": list(t.history.records),
        "callbacks": t.callbacks.state_dict(t.control),  # each callback's own state (EMA weights, ...)
    }
    if not weights:
        del state["model"], state["optimizer"]
    return state

def save_checkpoint(t, path: Path | None = None) -> Path | None:
    """Write a checkpoint: into the run's store (retention, hash, `latest`), or to `path`.
    The sharded format (several processes, or asked for) goes to `_save_sharded`."""
    from gputrain.io.checkpoint import save_checkpoint

    if path is None and t.checkpointer.uses_dcp:
        return _save_sharded(t)
    start = time.perf_counter()
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
    t.checkpointer.record_file_save(t.state.step, time.perf_counter() - start)
    return path


def _save_sharded(t) -> Path:
    """Every rank writes its part of the model and optimizer (DCP) and its run state; rank 0
    commits. Asynchronous when asked: returns once the state is staged, `wait_for_saves` commits."""
    state = state_dict(t, weights=False)  # collective: every rank takes part
    last = t.history.records[-1] if t.history.records else {}
    metrics = {k: v for k, v in last.items() if k.startswith("eval_")}
    path = t.checkpointer.save(t.store, t.state.step, distributed.unwrap(t.model), t.optimizer, state, metrics)
    if t.checkpointer.last_committed is not None:
        t.last_checkpoint = str(t.checkpointer.last_committed)
    return path


def wait_for_saves(t) -> None:
    """The end of a run or a stop: an asynchronous save still writing is committed before going on."""
    committed = t.checkpointer.finish()
    if committed is not None:
        t.last_checkpoint = str(committed)

def resume(t) -> None:
    from gputrain.io.checkpoint import check_model_state, load_checkpoint, restore_rng_state

    if isinstance(t.config.resume, str):
        path = Path(t.config.resume)
        state = _load_run_state(t, path)
    else:
        found = _find_checkpoint(t)
        if found is None:
            log.info("no checkpoint in %s: starting a new run", t.run_dir)
            return
        state, path = found
    sharded = checkpoint_dcp.is_dcp(path)
    check_model_state(checkpoint_dcp.saved_model_shapes(path) if sharded else state["model"], t.module,
                      path=str(path))
    check_resumable(t, state, path)
    if sharded:  # each rank reads its share, resharded to this job's process count
        t.checkpointer.load_weights(path, distributed.unwrap(t.model), t.optimizer)
    elif t.dist.enabled:
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
    t.stream.load_state_dict(_data_position(t, state))
    t.history.records = list(state.get("history", []))
    t.callbacks.load_state_dict(t.control, state.get("callbacks", {}))
    log.info("resumed from %s at step %d", path, t.state.step)
    if t.state.step >= t.total_steps:
        done = (f"the checkpoint {path} is at step {t.state.step}, which already reaches this run's "
                f"{t.total_steps} steps: there is nothing to train (give more steps= or epochs= to train on)")
        log.warning("%s", done)
        t.warnings.append(done)

def _find_checkpoint(t) -> tuple[dict[str, Any], Path] | None:
    """The newest checkpoint that verifies, with its state (a sharded one: this rank's run state)."""
    if not t.dist.enabled:
        return t.store.load_latest()
    path = t.checkpointer.find(t.store)  # collective: the ranks verify a sharded checkpoint's files in shares
    return None if path is None else (_load_run_state(t, path), path)


def _load_run_state(t, path: Path) -> dict[str, Any]:
    from gputrain.io.checkpoint import load_checkpoint

    if not checkpoint_dcp.is_dcp(path):
        return load_checkpoint(path)
    state, used = checkpoint_dcp.read_run_state(path, t.dist.rank)
    if used != t.dist.rank:  # written by fewer processes than this job has
        log.debug("%s has no run state of rank %d: it takes rank %d's (random-number state included)",
                  path, t.dist.rank, used)
    return state


def _global_batch(t) -> int | None:
    """Samples per optimizer step over all processes (the data's own batch size: a user DataLoader's);
    None for an iterable whose batches are its own."""
    batch = getattr(t, "batch_size", t.config.batch_size)
    return None if batch is None else batch * t.config.accumulate * t.dist.world_size


def _data_position(t, state: dict) -> dict[str, Any]:
    """This rank's saved data position: its own where every rank's was saved with this process count;
    else the saved one without the loader's state (another rank's or another process count's: the
    stream then reads up to the position); for checkpoints older than the "data" key, the run state's."""
    ranks = state.get("data_ranks")
    if ranks and len(ranks) == t.dist.world_size:
        return ranks[t.dist.rank]
    if "data" in state:
        position = dict(state["data"])
        if t.dist.world_size > 1 or int(state.get("world_size", 1)) != t.dist.world_size:
            position["source"] = None
        return position
    return {"epoch": t.state.epoch, "batch_in_epoch": t.state.batch_in_epoch}


def check_resumable(t, state: dict, path: Path) -> None:
    """The data order depends on the seed and the global batch (per-process batch x accumulation x
    processes), so a run may resume with another process count if the global batch is kept."""
    saved_cfg = state.get("config", {})
    saved_global = (saved_cfg.get("batch_size", 0) * saved_cfg.get("accumulate", 1)
                    * int(state.get("world_size", 1)))
    global_batch = t.config.batch_size * t.config.accumulate * t.dist.world_size
    if "global_batch" in state:  # the data's own batch size (a user DataLoader's), saved since it exists
        saved_global, global_batch = state["global_batch"], _global_batch(t)
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
