"""A run's checkpoints: the trainer's named parts (checkpoint/parts.py), writing them into the
run's verified store (one file, or each rank its share with DCP), an exact resume with its checks,
and the checkpoint of the last finished step when user code fails (with the note that says so).

Functions of the Trainer `t`: they need its store, run directory and the path of its last checkpoint.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any

import torch

from gputrain.batch import move_optimizer_state
from gputrain.data.checks import first_step_note
from gputrain.errors import CheckpointError, StopRequested, user_frame
from gputrain.checkpoint import sharded
from gputrain.runtime import distributed
from gputrain.checkpoint.frozen import FrozenBase
from gputrain.train.signals import agree_to_stop
from gputrain.checkpoint.parts import (CallbacksPart, DataPart, HistoryPart, ModelPart, OptimizerPart,
                                             RngPart, RunCheckpoint, RunPart)

log = logging.getLogger("gputrain")


def run_checkpoint(t) -> RunCheckpoint:
    """The trainer's checkpoint contents from its named parts (checkpoint/parts.py)."""
    frozen = FrozenBase.decide(t.module, full_checkpoints=t.config.full_checkpoints, sharded=t.checkpointer.uses_dcp,
                               fsdp=t.config.shard and t.dist.enabled)  # what the checkpoints hold of a frozen base
    parts = {
        "model": ModelPart(t.model, t.module, t.dist, frozen),
        "optimizer": OptimizerPart(t.model, t.optimizer, t.dist, t.device),
        "scaler": t.precision,
        "scheduler": t.scheduler,
        "rng": RngPart(t.device),
        "run": RunPart(t.state, t.stream, t.train_step),
        "data": DataPart(t.stream),
        "history": HistoryPart(t.history),
        "callbacks": CallbacksPart(t.callbacks, t.control),
    }
    return RunCheckpoint(parts, t.dist, lambda: {"global_batch": _global_batch(t), "world_size": t.dist.world_size,
                                                 "config": t.config.to_dict(),
                                                 **({"frozen": frozen.header()} if frozen.trainable_only else {})})


def save_checkpoint(t, path: Path | None = None) -> Path | None:
    """Write a checkpoint: into the run's store (retention, hash, `latest`), or to `path`.
    The sharded format (several processes, or asked for) goes to `_save_sharded`."""
    from gputrain.checkpoint.format import save_checkpoint

    if path is None and t.checkpointer.uses_dcp:
        return _save_sharded(t)
    start = time.perf_counter()
    t.collect_step_totals()  # the loss still on the device goes into the run state; never a non-finite one
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
    t.collect_step_totals()
    state = t.checkpoint.state_dict(weights=False)  # collective: every rank takes part
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
    from gputrain.checkpoint.format import check_model_state

    if isinstance(t.config.resume, str):
        path = Path(t.config.resume)
        state = _load_run_state(t, path)
    else:
        found = _find_checkpoint(t)
        if found is None:
            log.info("no checkpoint in %s: starting a new run", t.run_dir)
            return
        state, path = found
    in_shares = sharded.is_dcp(path)
    check_model_state(sharded.saved_model_shapes(path) if in_shares else _model_state(t, state, path), t.module,
                      path=str(path))
    check_resumable(t, state, path)
    if in_shares:  # each rank reads its share, resharded to this job's process count
        t.checkpointer.load_weights(path, distributed.unwrap(t.model), t.optimizer)
        move_optimizer_state(t.optimizer, t.device)
    t.checkpoint.load_state_dict(state, weights=not in_shares)
    log.info("resumed from %s at step %d", path, t.state.step)
    if t.state.step >= t.total_steps:
        done = (f"the checkpoint {path} is at step {t.state.step}, which already reaches this run's "
                f"{t.total_steps} steps: there is nothing to train (give more steps= or epochs= to train on)")
        log.warning("%s", done)
        t.warnings.append(done)

def _model_state(t, state: dict[str, Any], path: Path) -> dict[str, Any]:
    """The checkpoint's weights as the model takes them: a trainable-only checkpoint's (checkpoint/frozen.py)
    with the frozen base filled in from the model, once its fingerprint matched. Also refuses an
    optimizer state whose parameter groups are another weight-decay layout than this run's."""
    if "frozen" not in state:
        _check_decay_groups(t, state, path)
        return state["model"]
    frozen = t.checkpoint.parts["model"].frozen
    if t.config.shard and t.dist.enabled:
        raise CheckpointError(f"{path}: the checkpoint holds only the trainable parameters (its frozen base left "
                              "out), which a sharded (FSDP) run cannot take: resume it without --shard (DDP or one "
                              "process)")
    frozen.check(state["frozen"], str(path))
    _check_decay_groups(t, state, path)
    return frozen.complete(state["model"])


def _check_decay_groups(t, state: dict[str, Any], path: Path) -> None:
    """The default AdamW keeps biases and normalization weights in a group without weight decay
    (train/optim.py); a checkpoint written with one group for all (before that, or with
    weight_decay_groups=False) resumes only with the same layout, and the other way round."""
    saved = (state.get("optimizer") or {}).get("param_groups") if isinstance(state.get("optimizer"), dict) else None
    live = t.optimizer.param_groups if isinstance(t.optimizer, torch.optim.Optimizer) else None
    if not isinstance(saved, list) or live is None or len(saved) == len(live) or not t.config.weight_decay:
        return
    if sum(len(g.get("params", ())) for g in saved) != sum(len(g["params"]) for g in live):
        return  # other parameters, not another layout: OptimizerPart says so
    if not t.optimizer_desc.startswith("AdamW ("):  # the default optimizer only: yours has your groups
        return
    one = len(saved) == 1
    raise CheckpointError(
        f"{path}: the checkpoint's optimizer has {len(saved)} parameter group(s) and this run's {len(live)}: it was "
        + ("written with weight decay on every parameter (before gputrain kept it off biases and normalization "
           "weights, or with weight_decay_groups=False); resume with weight_decay_groups=False" if one else
           "written with no weight decay on biases and normalization weights; resume with weight_decay_groups=True"))


def _find_checkpoint(t) -> tuple[dict[str, Any], Path] | None:
    """The newest checkpoint that verifies, with its state (a sharded one: this rank's run state)."""
    if not t.dist.enabled:
        return t.store.load_latest()
    path = t.checkpointer.find(t.store)  # collective: the ranks verify a sharded checkpoint's files in shares
    return None if path is None else (_load_run_state(t, path), path)


def _load_run_state(t, path: Path) -> dict[str, Any]:
    from gputrain.checkpoint.format import load_checkpoint

    if not sharded.is_dcp(path):
        return load_checkpoint(path)
    state, used = sharded.read_run_state(path, t.dist.rank)
    if used != t.dist.rank:  # written by fewer processes than this job has
        log.debug("%s has no run state of rank %d: it takes rank %d's (random-number state included)",
                  path, t.dist.rank, used)
    return state


def _global_batch(t) -> int | None:
    """Samples per optimizer step over all processes (the data's own batch size: a user DataLoader's);
    None for an iterable whose batches are its own."""
    batch = getattr(t, "batch_size", t.config.batch_size)
    return None if batch is None else batch * t.config.accumulate * t.dist.world_size


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


def checkpoint_after_error(t, exc: BaseException) -> None:
    """An error in user code (model, loss, data) after the first step: checkpoint the last
    finished step when its state is finite, and add a line saying where and how to resume."""
    st = t.state
    where = user_frame(exc)
    saved = None
    # Several processes: the other ranks are inside a collective of their own step, so a
    # checkpoint (itself collective) cannot be written; the periodic ones remain.
    if t.run_dir and st.step > 0 and t.dist.world_size == 1:
        try:
            saved = t.save_checkpoint()
        except Exception as save_exc:  # a non-finite state, a full disk: the error stays the first one
            log.warning("no checkpoint after the error: %s", save_exc)
    how = (f"a checkpoint of step {st.step} is at {saved}: fix the cause and resume with --resume {t.run_dir}"
           if saved else "no checkpoint was written after the error"
           + (f" (resume from the last periodic one with --resume {t.run_dir})" if t.last_checkpoint else ""))
    t.stream.name_a_lost_worker(exc)
    exc.add_note(f"gputrain: training failed in step {st.step + 1} at {where}; {how}")
    if st.step == 0 and t.stream.load_error is not exc and t.stream.last_batch is not None:
        exc.add_note(first_step_note(t.stream.last_batch, t.module, t.loss))  # data/checks.py


def stop_for_signal(t, signals) -> None:
    """A stop signal came: checkpoint (every rank takes part; rank 0 writes), requeue a Slurm job that
    asked for it, and raise StopRequested with how to resume."""
    st = t.state
    name = signals.name or "a stop signal (on another rank)"
    code = signals.exit_code or 143
    path = t.save_checkpoint() if t.run_dir else None
    if path is not None:
        wait_for_saves(t)  # committed before the process leaves
        from gputrain.runtime.slurm import requeue_after_stop

        # Slurm's SIGUSR1 before the time limit (on any rank): rank 0 puts a requeuable job back in the queue
        requeue_after_stop(signals.requested, t.dist, any_rank=lambda flag: agree_to_stop(flag, t.dist))
    resume = (f"resume with: gputrain fit ... --resume {t.run_dir} (from Python: the same fit(...) with "
              f"TrainConfig(..., run_dir={str(t.run_dir)!r}, resume=True))" if path
              else "nothing was saved (no run directory): set run_dir to make runs resumable")
    log.warning("%s: stopped after step %d%s", name, st.step, f", checkpoint {path}" if path else "")
    raise StopRequested(f"stopped by {name} after step {st.step} of {t.total_steps}; {resume}",
                        exit_code=code, step=st.step, checkpoint=str(path) if path else None)
