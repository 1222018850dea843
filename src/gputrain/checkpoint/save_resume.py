"""A training run's saves and its resume: writing the run's named parts (parts.py) into its store (store.py:
one file, or each rank its share with DCP, sharded_save.py), the exact resume with its checks (the
checkpoint read by read.py, found by the store), and the checkpoint written when a run stops on a signal
or fails in user code (with the note that says where it is).

The functions take what they read of the run as Protocols (`Saving`, `Resuming`, `Stopping`); the
Trainer passes itself.
"""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path
from typing import Any, Callable, Mapping, Protocol

import torch
from torch import nn

from gputrain.batch import move_optimizer_state
from gputrain.checkpoint import sharded
from gputrain.checkpoint.format import check_model_state, write_checkpoint
from gputrain.checkpoint.names import is_dcp, step_file_name
from gputrain.checkpoint.parts import RunCheckpoint, global_batch
from gputrain.checkpoint.read import read_checkpoint
from gputrain.checkpoint.sharded_save import DcpCheckpointer
from gputrain.checkpoint.store import CheckpointStore
from gputrain.config import TrainConfig
from gputrain.data.checks import first_step_note
from gputrain.data.stream import BatchStream
from gputrain.errors import CheckpointError, StopRequested, user_frame
from gputrain.io.history import History
from gputrain.io.preflight import preflight_run_dir
from gputrain.io.run_layout import LEGACY_CHECKPOINT, is_record
from gputrain.runtime import distributed
from gputrain.runtime.distributed import DistInfo
from gputrain.runtime.speed import choices_made

log = logging.getLogger("gputrain")


class Step(Protocol):
    """The run's position (train/loop/state.py's RunState): optimizer steps done."""

    step: int


class Waiting(Protocol):
    """What waiting for a save in flight needs: the writer, where to record what it committed, and the
    callbacks to tell (`hand_over`)."""

    last_checkpoint: str | None
    handed_over: str | None  # the last checkpoint told to the callbacks

    @property
    def checkpointer(self) -> DcpCheckpointer: ...
    @property
    def callbacks(self) -> Any: ...  # train/loop/callbacks.py's CallbackList: checkpoint(control, path)
    @property
    def control(self) -> Any: ...  # what the callbacks are given of the run


class Place(Protocol):
    """Where the run is: its folder, its step, its processes."""

    @property
    def run_dir(self) -> Path | None: ...
    @property
    def state(self) -> Step: ...
    @property
    def dist(self) -> DistInfo: ...


class Checkpointed(Place, Protocol):
    """What a save and a resume both read: the parts, the writer, the store, the weights."""

    @property
    def checkpoint(self) -> RunCheckpoint: ...
    @property
    def checkpointer(self) -> DcpCheckpointer: ...
    @property
    def store(self) -> CheckpointStore | None: ...
    @property
    def model(self) -> nn.Module: ...  # as trained: wrapped for DDP/FSDP or compiled
    @property
    def optimizer(self) -> Any: ...  # a torch optimizer, or named ones (train/optim/by_name.py)


class Saving(Waiting, Checkpointed, Protocol):
    """What a save reads of the run; it records the path written in `last_checkpoint`."""

    @property
    def history(self) -> History: ...  # the last record's eval metrics pick the best checkpoint
    @property
    def is_main(self) -> bool: ...

    def collect_step_totals(self) -> None:
        """Fold the loss still on the device into the run state (raises on a non-finite one)."""


class Resuming(Checkpointed, Protocol):
    """What a resume reads of the run besides (`total_steps` and `warnings`: to say that nothing is left)."""

    @property
    def config(self) -> TrainConfig: ...
    @property
    def device(self) -> torch.device: ...
    @property
    def module(self) -> nn.Module: ...  # the plain module
    @property
    def optimizer_desc(self) -> str: ...
    @property
    def batch_size(self) -> int | None: ...
    @property
    def total_steps(self) -> int: ...
    @property
    def warnings(self) -> list[str]: ...


class Stopping(Waiting, Place, Protocol):
    """What a stop (a signal, an error in user code) reads of the run: its `save_checkpoint` (the
    Trainer's calls `save_checkpoint` below) writes the checkpoint, which is waited for."""

    @property
    def total_steps(self) -> int: ...
    @property
    def stream(self) -> BatchStream: ...
    @property
    def module(self) -> nn.Module: ...
    @property
    def loss(self) -> Callable[[nn.Module, Any], Any]: ...  # train/step/loss.py's LossRule: the note's forward

    def save_checkpoint(self, path: Path | None = None) -> Path | None: ...


class Signals(Protocol):
    """The stop signal received (train/loop/signals.py's StopSignals)."""

    @property
    def name(self) -> str | None: ...
    @property
    def exit_code(self) -> int | None: ...
    @property
    def requested(self) -> int | None: ...


def save_checkpoint(t: Saving, path: Path | None = None) -> Path | None:
    """Write a checkpoint: into the run's store (retention, hash, `latest`), or to `path`.
    The sharded format (several processes, or asked for) goes to `_save_sharded`."""
    if path is None and t.checkpointer.uses_dcp:
        return _save_sharded(t)
    start = time.perf_counter()
    t.collect_step_totals()  # the loss still on the device goes into the run state; never a non-finite one
    state = t.checkpoint.state_dict()  # collective under DDP/FSDP: every rank takes part
    if t.is_main:
        try:
            if path is not None:
                write_checkpoint(path, state)
            else:
                last = t.history.records[-1] if t.history.records else {}
                metrics = {k: v for k, v in last.items() if k.startswith("eval_")}
                path = _store(t).save(state, t.state.step, metrics=metrics)
        except OSError as exc:  # a full disk, a vanished folder: the previous checkpoint is untouched
            where = path or _store(t).folder
            earlier = t.last_checkpoint or _newest_kept(t)  # a resumed run's own, before this run saved
            previous = f"the previous checkpoint {earlier} is intact" if earlier else \
                "no earlier checkpoint of this run exists"
            raise CheckpointError(f"could not write the checkpoint of step {t.state.step} to {where}: "
                                  f"{exc.strerror or exc}; {previous}. Free space (or choose another --run-dir) "
                                  f"and resume with --resume {t.run_dir}") from exc
    distributed.barrier(t.dist)
    if path is None:  # the other ranks: the file rank 0 wrote (by name, so that it is the same on every rank)
        path = _store(t).folder / step_file_name(t.state.step)
    t.last_checkpoint = str(path)
    t.checkpointer.record_file_save(t.state.step, time.perf_counter() - start)
    if t.store is not None and path == t.store.folder / step_file_name(t.state.step):  # the store's, not a path given
        hand_over(t)
    return path


def hand_over(t: Waiting) -> None:
    """Tell the callbacks (`on_checkpoint`) of a checkpoint newly committed to the run's store, with
    the same path on every rank, so that every rank calls them equally often (an asynchronous save is
    told once it is committed: at the next save or the end of the run)."""
    done = t.last_checkpoint
    if done is not None and done != t.handed_over:
        t.handed_over = done
        t.callbacks.checkpoint(t.control, Path(done))


def _newest_kept(t: Saving) -> Path | None:
    """The newest checkpoint file or folder already in the run's store (not verified), if any."""
    try:
        kept = t.store.list() if t.store is not None else []
    except OSError:
        return None
    return kept[-1] if kept else None


def _store(t: Saving | Resuming) -> CheckpointStore:
    if t.store is None:  # a run without a run directory writes a checkpoint only to a path it is given
        raise CheckpointError("this run has no run directory (run_dir) to keep checkpoints in; give a path to save to")
    return t.store


def _save_sharded(t: Saving) -> Path:
    """Every rank writes its part of the model and optimizer (DCP) and its run state; rank 0
    commits. Asynchronous when asked: returns once the state is staged, `wait_for_saves` commits."""
    t.collect_step_totals()
    state = t.checkpoint.state_dict(weights=False)  # collective: every rank takes part
    last = t.history.records[-1] if t.history.records else {}
    metrics = {k: v for k, v in last.items() if k.startswith("eval_")}
    path = t.checkpointer.save(_store(t), t.state.step, distributed.unwrap(t.model), t.optimizer, state, metrics)
    if t.checkpointer.last_committed is not None:
        t.last_checkpoint = str(t.checkpointer.last_committed)
        hand_over(t)
    return path


def wait_for_saves(t: Waiting) -> None:
    """The end of a run or a stop: an asynchronous save still writing is committed before going on."""
    committed = t.checkpointer.finish()
    if committed is not None:
        t.last_checkpoint = str(committed)
        hand_over(t)


def resume(t: Resuming) -> None:
    """Resume from `config.resume`: a checkpoint's path, or True for the run directory's newest that
    verifies (the store's order, every rank agreeing); check that it fits the model and the run, then
    load every part."""
    if isinstance(t.config.resume, str):
        path = Path(t.config.resume)
        state = _load_run_state(t, path)
    else:
        found = _find_checkpoint(t)
        if found is None:  # check_resume_target let it start: a restart, or a job's first start
            log.info("no checkpoint in %s: starting a new run", t.run_dir)
            return
        state, path = found
    in_shares = is_dcp(path)
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

def open_run_store(run_dir: Path, config: TrainConfig, best_mode: str, *, is_main: bool,
                   checkpoint_bytes: int) -> CheckpointStore:
    """The run's checkpoint store, its directory checked before anything is written there: a resume
    finds a checkpoint or refuses (`check_resume_target`); on the main process the directory is
    preflighted (created, writable, room for `keep_last` checkpoints of `checkpoint_bytes`, a resumed
    run's own counting as room already taken) and the store's files checked writable."""
    store = CheckpointStore(run_dir, keep_last=config.keep_last, best_metric=config.best_metric, best_mode=best_mode)
    if config.resume is True:
        check_resume_target(store)
    if is_main:
        preflight_run_dir(run_dir, checkpoint_bytes, config.keep_last, store.bytes_held())
        store.check_writable()
    return store


def check_resume_target(store: CheckpointStore, env: Mapping[str, str] = os.environ) -> None:
    """resume=True: refuse, before anything is written, a run directory that holds no checkpoint to
    resume from (a resume finds a checkpoint or refuses). Its files are listed, not verified (the
    resume verifies them: none verifying is refused there).

    A restarted start (torchrun's TORCHELASTIC_RESTART_COUNT or Slurm's SLURM_RESTART_COUNT above 0)
    goes on from scratch: its first start stopped before its first checkpoint. The first start of a
    job a launcher may start again (torchrun's workers, a Slurm job: both pass --resume on every start)
    goes on in a new or empty run directory, never in one that holds an earlier run's records
    (history.json, config.toml, ...), which a new start would overwrite."""
    run_dir = store.run_dir
    if store.candidates() or (run_dir / LEGACY_CHECKPOINT).is_file() or _restart_count(env) > 0:
        return
    folder = store.folder
    where = (f"{folder} is a file, not a folder" if folder.exists() and not folder.is_dir()
             else f"{folder} is missing" if not folder.exists() else f"{folder} holds no checkpoint")
    held = sorted(p.name for p in run_dir.glob("*") if is_record(p.name))
    if held:
        named = ", ".join(held[:3]) + (f" and {len(held) - 3} more" if len(held) > 3 else "")
        raise CheckpointError(f"resume from {run_dir}: no checkpoint to resume from ({where}), and the run directory "
                              f"holds an earlier run ({named}) that a new start would overwrite: resume a run "
                              "directory that has checkpoints, or start a new run with another --run-dir and no "
                              "--resume")
    if env.get("TORCHELASTIC_RUN_ID") or env.get("SLURM_JOB_ID"):
        log.info("no checkpoint in %s: the first start of this job begins the run", run_dir)
        return
    raise CheckpointError(f"resume from {run_dir}: no checkpoint to resume from ({where}): drop --resume "
                          "(resume=True) to start a new run there, or resume a run directory (or checkpoint file) "
                          "that has one")


def _restart_count(env: Mapping[str, str]) -> int:
    counts = [env.get("TORCHELASTIC_RESTART_COUNT", ""), env.get("SLURM_RESTART_COUNT", "")]
    return max((int(c) for c in counts if c.strip().isdigit()), default=0)


def _model_state(t: Resuming, state: dict[str, Any], path: Path) -> dict[str, Any]:
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


def _check_decay_groups(t: Resuming, state: dict[str, Any], path: Path) -> None:
    """The default AdamW keeps biases and normalization weights in a group without weight decay
    (train/optim/build.py); a checkpoint written with one group for all (before that, or with
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


def _find_checkpoint(t: Resuming) -> tuple[dict[str, Any], Path] | None:
    """The newest checkpoint that verifies, with its state (a sharded one: this rank's run state)."""
    if not t.dist.enabled:
        return _store(t).load_latest()
    path = t.checkpointer.find(_store(t))  # collective: the ranks verify a sharded checkpoint's files in shares
    return None if path is None else (_load_run_state(t, path), path)


def _load_run_state(t: Resuming, path: Path) -> dict[str, Any]:
    """The checkpoint's state for this rank: a file's whole, a sharded folder's run state of this rank
    (its weights are read in shares by `resume`)."""
    return read_checkpoint(path, weights=False, rank=t.dist.rank)


def check_resumable(t: Resuming, state: dict, path: Path) -> None:
    """The data order depends on the seed and the global batch (per-process batch x accumulation x
    processes), so a run may resume with another process count if the global batch is kept."""
    saved_cfg = state.get("config", {})
    saved_global = (saved_cfg.get("batch_size", 0) * saved_cfg.get("accumulate", 1)
                    * int(state.get("world_size", 1)))
    run_global = t.config.batch_size * t.config.accumulate * t.dist.world_size
    if "global_batch" in state:  # the data's own batch size (a user DataLoader's), saved since it exists
        saved_global, run_global = state["global_batch"], global_batch(t.config, t.batch_size, t.dist.world_size)
    if saved_cfg and saved_global != run_global:
        raise CheckpointError(
            f"{path}: the checkpoint was trained with a global batch of {saved_global} "
            f"(batch_size x accumulate x processes) but this run has {run_global}; an exact resume needs "
            "the same global batch")
    if "seed" in saved_cfg and saved_cfg["seed"] != t.config.seed:
        raise CheckpointError(f"{path}: the checkpoint was trained with seed={saved_cfg['seed']} but this run "
                              f"has seed={t.config.seed}; an exact resume needs the same seed")


def checkpoint_after_error(t: Stopping, exc: BaseException) -> None:
    """An error in user code (model, loss, data) after the first step: checkpoint the last
    finished step when its state is finite, and add a line saying where and how to resume."""
    kept = len(getattr(exc, "__notes__", ()))
    try:
        _checkpoint_after_error(t, exc)
    except RuntimeError as late:
        if late is exc or not _lost_worker(late):
            raise
        # torch's SIGCHLD handler reports a dead DataLoader worker wherever the main process is, once:
        # after the error the death caused (the connection to the worker's queue reset mid-batch) it
        # can land in here, in a save (which then writes nothing: writes are whole or absent) or
        # anywhere else. Said with the error, and done again.
        if hasattr(exc, "__notes__"):
            del exc.__notes__[kept:]
        exc.add_note(f"gputrain: {str(late).splitlines()[0]}")
        _checkpoint_after_error(t, exc)


def _checkpoint_after_error(t: Stopping, exc: BaseException) -> None:
    st = t.state
    where = user_frame(exc)
    saved = None
    # Several processes: the other ranks are inside a collective of their own step, so a
    # checkpoint (itself collective) cannot be written; the periodic ones remain.
    if t.run_dir and st.step > 0 and t.dist.world_size == 1:
        try:
            saved = t.save_checkpoint()
        except Exception as save_exc:  # a non-finite state, a full disk: the error stays the first one
            if _lost_worker(save_exc):
                raise
            log.warning("no checkpoint after the error: %s", save_exc)
    how = (f"a checkpoint of step {st.step} is at {saved}: fix the cause and resume with --resume {t.run_dir}"
           if saved else "no checkpoint was written after the error"
           + (f" (resume from the last periodic one with --resume {t.run_dir})" if t.last_checkpoint else ""))
    t.stream.name_a_lost_worker(exc)
    exc.add_note(f"gputrain: training failed in step {st.step + 1} at {where}; {how}")
    if st.step == 0 and t.stream.load_error is not exc and t.stream.last_batch is not None:
        speed, precision = getattr(t, "speed", None), getattr(t, "precision", None)  # the Trainer's choices
        choices = choices_made(speed, precision.name, precision.precision.autocast_dtype,
                               getattr(getattr(t, "config", None), "precision", "auto")) \
            if speed is not None and precision is not None else []
        exc.add_note(first_step_note(t.stream.last_batch, t.module, t.loss, choices))  # data/checks.py


def _lost_worker(exc: BaseException) -> bool:
    """torch's report of a DataLoader worker that died (raised by its SIGCHLD handler)."""
    return isinstance(exc, RuntimeError) and "DataLoader worker" in str(exc) and "exited unexpectedly" in str(exc)


def stop_for_signal(t: Stopping, signals: Signals, any_rank: Callable[[bool], bool]) -> None:
    """A stop signal came: checkpoint (every rank takes part; rank 0 writes), requeue a Slurm job that
    asked for it, and raise StopRequested with how to resume. `any_rank(flag)`: whether any rank's flag
    is true (train/loop/signals.py's agree_to_stop, a collective with several processes)."""
    st = t.state
    name = signals.name or "a stop signal (on another rank)"
    code = signals.exit_code or 143
    path = t.save_checkpoint() if t.run_dir else None
    if path is not None:
        wait_for_saves(t)  # committed before the process leaves
        from gputrain.runtime.slurm import requeue_after_stop

        # Slurm's SIGUSR1 before the time limit (on any rank): rank 0 puts a requeuable job back in the queue
        requeue_after_stop(signals.requested, t.dist, any_rank=any_rank)
    resume = (f"resume with: gputrain fit ... --resume {t.run_dir} (from Python: the same fit(...) with "
              f"TrainConfig(..., run_dir={str(t.run_dir)!r}, resume=True))" if path
              else "nothing was saved (no run directory): set run_dir to make runs resumable")
    log.warning("%s: stopped after step %d%s", name, st.step, f", checkpoint {path}" if path else "")
    raise StopRequested(f"stopped by {name} after step {st.step} of {t.total_steps}; {resume}",
                        exit_code=code, step=st.step, checkpoint=str(path) if path else None)
