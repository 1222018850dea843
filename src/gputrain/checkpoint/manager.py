"""A run's checkpoints as one object, built once with the states it saves (torchtitan's
`CheckpointManager(states=...)`): `CheckpointManager.save`, `wait`, `resume`.

It holds the run's named parts (parts.py's `RunCheckpoint`: model, optimizer, scaler, scheduler, rng,
run state, data position, history, callbacks, carried), the store (store.py: one file a checkpoint,
retention, `latest`, the best) and the writer of the sharded format (sharded_save.py: each rank its
share with DCP, asynchronous when asked). What it needs of the run besides is given as plain calls:
`step()` (the optimizer steps done) and `on_commit(path)` (the callbacks told of a checkpoint newly
committed to the store, with the same path on every rank). Its caller folds the loss still on the
device into the run state first (the loop's `save_checkpoint`: a non-finite one raises there, so no
checkpoint holds a non-finite state).

A resume (`resume`) finds the checkpoint (a path, or the run directory's newest that verifies, every
rank agreeing), checks that it fits the model and the run (`ResumeRules`: the same global batch and
seed, the weight-decay layout of the default optimizer, a frozen base's fingerprint) and loads every
part. `open_run_store` checks the run directory before anything is written there.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Mapping

import torch
from torch import nn

from gputrain.batch import move_optimizer_state, torch_optimizers
from gputrain.checkpoint import sharded
from gputrain.checkpoint.format import check_model_state, write_checkpoint
from gputrain.checkpoint.names import is_dcp, step_file_name
from gputrain.checkpoint.parts import ModelPart, OptimizerPart, RunCheckpoint, global_batch
from gputrain.checkpoint.read import read_checkpoint
from gputrain.checkpoint.sharded_save import DcpCheckpointer
from gputrain.checkpoint.store import CheckpointStore
from gputrain.config import TrainConfig
from gputrain.errors import CheckpointError
from gputrain.io.history import History
from gputrain.io.preflight import preflight_run_dir
from gputrain.io.run_layout import LEGACY_CHECKPOINT, is_record
from gputrain.runtime import distributed

log = logging.getLogger("gputrain")


@dataclass
class ResumeRules:
    """What a checkpoint must agree with to resume this run: the run's config (resume, seed, batch,
    accumulate, shard), the plain module, the data's own batch size per process (a user
    DataLoader's; None for an iterable's own batches) and whether the optimizer is the default AdamW
    (its weight-decay groups are gputrain's, so a checkpoint with another layout is named)."""

    config: TrainConfig
    module: nn.Module
    batch_size: int | None
    default_optimizer: bool


class CheckpointManager:
    """The run's checkpoints (see the module docstring)."""

    def __init__(self, states: RunCheckpoint, *, store: CheckpointStore | None, writer: DcpCheckpointer,
                 records: History, is_main: bool, step: Callable[[], int], on_commit: Callable[[Path], None]):
        self.states, self.store, self.writer, self.records = states, store, writer, records
        self.dist, self.is_main = states.dist, is_main
        self.step, self.on_commit = step, on_commit
        model, optimizer = states.parts["model"], states.parts["optimizer"]
        assert isinstance(model, ModelPart) and isinstance(optimizer, OptimizerPart)
        self.model_part, self.optimizer_part = model, optimizer
        self.last: str | None = None  # the last checkpoint this run committed
        self.handed_over: str | None = None  # the last one told to `on_commit`

    @property
    def run_dir(self) -> Path | None:
        return self.store.run_dir if self.store is not None else None

    def state_dict(self) -> dict[str, Any]:
        """The checkpoint's contents as they stand (no device value folded in first: `save` does that)."""
        return self.states.state_dict()

    # ------------------------------------------------------------ saving

    def save(self, path: Path | None = None) -> Path | None:
        """Write a checkpoint: into the run's store (retention, hash, `latest`), or to `path`.
        The sharded format (several processes, or asked for) is each rank's share. Collective."""
        if path is None and self.writer.uses_dcp:
            return self._save_sharded()
        start = time.perf_counter()
        state = self.states.state_dict()  # collective under DDP/FSDP: every rank takes part
        step = self.step()
        if self.is_main:
            try:
                if path is not None:
                    write_checkpoint(path, state)
                else:
                    path = self._store().save(state, step, metrics=self._metrics())
            except OSError as exc:  # a full disk, a vanished folder: the previous checkpoint is untouched
                where = path or self._store().folder
                earlier = self.last or self._newest_kept()  # a resumed run's own, before this run saved
                previous = f"the previous checkpoint {earlier} is intact" if earlier else \
                    "no earlier checkpoint of this run exists"
                raise CheckpointError(f"could not write the checkpoint of step {step} to {where}: "
                                      f"{exc.strerror or exc}; {previous}. Free space (or choose another --run-dir) "
                                      f"and resume with --resume {self.run_dir}") from exc
        distributed.barrier(self.dist)
        if path is None:  # the other ranks: the file rank 0 wrote (by name, so that it is the same on every rank)
            path = self._store().folder / step_file_name(step)
        self.last = str(path)
        self.writer.record_file_save(step, time.perf_counter() - start)
        if self.store is not None and path == self.store.folder / step_file_name(step):  # the store's, not a path given
            self._hand_over()
        return path

    def _save_sharded(self) -> Path:
        """Every rank writes its part of the model and optimizer (DCP) and its run state; rank 0
        commits. Asynchronous when asked: returns once the state is staged, `wait` commits."""
        state = self.states.state_dict(weights=False)  # collective: every rank takes part
        path = self.writer.save(self._store(), self.step(), distributed.unwrap(self.model_part.model),
                                torch_optimizers(self.optimizer_part.optimizer), state, self._metrics())
        if self.writer.last_committed is not None:
            self.last = str(self.writer.last_committed)
            self._hand_over()
        return path

    def wait(self) -> None:
        """The end of a run or a stop: an asynchronous save still writing is committed before going on."""
        committed = self.writer.finish()
        if committed is not None:
            self.last = str(committed)
            self._hand_over()

    def _hand_over(self) -> None:
        """Tell `on_commit` of a checkpoint newly committed to the store, with the same path on every
        rank, so that every rank calls the callbacks equally often (an asynchronous save is told once
        it is committed: at the next save or the end of the run)."""
        if self.last is None or self.last == self.handed_over:
            return
        self.handed_over = self.last
        self.on_commit(Path(self.last))

    def _metrics(self) -> dict[str, Any]:
        """The last record's eval metrics: what picks the best checkpoint."""
        last = self.records.records[-1] if self.records.records else {}
        return {k: v for k, v in last.items() if k.startswith("eval_")}

    def _newest_kept(self) -> Path | None:
        """The newest checkpoint file or folder already in the run's store (not verified), if any."""
        try:
            kept = self.store.list() if self.store is not None else []
        except OSError:
            return None
        return kept[-1] if kept else None

    def _store(self) -> CheckpointStore:
        if self.store is None:  # a run without a run directory writes a checkpoint only to a path it is given
            raise CheckpointError("this run has no run directory (run_dir) to keep checkpoints in; give a path to "
                                  "save to")
        return self.store

    # ------------------------------------------------------------ resuming

    def resume(self, rules: ResumeRules) -> Path | None:
        """Resume from `config.resume`: a checkpoint's path, or True for the run directory's newest that
        verifies (the store's order, every rank agreeing); check that it fits the model and the run, then
        load every part. The checkpoint loaded, or None when the run directory holds none yet (a
        launcher's first start)."""
        if isinstance(rules.config.resume, str):
            path = Path(rules.config.resume)
            state = self._load_run_state(path)
        else:
            found = self._find()
            if found is None:  # check_resume_target let it start: a restart, or a job's first start
                log.info("no checkpoint in %s: starting a new run", self.run_dir)
                return None
            state, path = found
        in_shares = is_dcp(path)
        check_model_state(sharded.saved_model_shapes(path) if in_shares else self._model_state(rules, state, path),
                          rules.module, path=str(path))
        check_resumable(rules.config, rules.batch_size, state, path, self.dist.world_size)
        optimizer = self.optimizer_part.optimizer
        if in_shares:  # each rank reads its share, resharded to this job's process count
            self.writer.load_weights(path, distributed.unwrap(self.model_part.model), torch_optimizers(optimizer))
            move_optimizer_state(optimizer, self.optimizer_part.device)
        self.states.load_state_dict(state, weights=not in_shares)
        log.info("resumed from %s at step %d", path, self.step())
        return path

    def _find(self) -> tuple[dict[str, Any], Path] | None:
        """The newest checkpoint that verifies, with its state (a sharded one: this rank's run state)."""
        if not self.dist.enabled:
            return self._store().load_latest()
        path = self.writer.find(self._store())  # collective: the ranks verify a sharded checkpoint's files in shares
        return None if path is None else (self._load_run_state(path), path)

    def _load_run_state(self, path: Path) -> dict[str, Any]:
        """The checkpoint's state for this rank: a file's whole, a sharded folder's run state of this rank
        (its weights are read in shares by `resume`)."""
        return read_checkpoint(path, weights=False, rank=self.dist.rank)

    def _model_state(self, rules: ResumeRules, state: dict[str, Any], path: Path) -> dict[str, Any]:
        """The checkpoint's weights as the model takes them: a trainable-only checkpoint's (frozen.py)
        with the frozen base filled in from the model, once its fingerprint matched. Also refuses an
        optimizer state whose parameter groups are another weight-decay layout than this run's."""
        if "frozen" not in state:
            _check_decay_groups(rules, state, path, self.optimizer_part.optimizer)
            return state["model"]
        frozen = self.model_part.frozen
        if rules.config.shard and self.dist.enabled:
            raise CheckpointError(f"{path}: the checkpoint holds only the trainable parameters (its frozen base left "
                                  "out), which a sharded (FSDP) run cannot take: resume it without --shard (DDP or "
                                  "one process)")
        assert frozen is not None  # a run with trainable-only checkpoints decided its frozen base
        frozen.check(state["frozen"], str(path))
        _check_decay_groups(rules, state, path, self.optimizer_part.optimizer)
        return frozen.complete(state["model"])


def _check_decay_groups(rules: ResumeRules, state: dict[str, Any], path: Path, optimizer: Any) -> None:
    """The default AdamW keeps biases and normalization weights in a group without weight decay
    (train/optim/build.py); a checkpoint written with one group for all (before that, or with
    weight_decay_groups=False) resumes only with the same layout, and the other way round."""
    saved = (state.get("optimizer") or {}).get("param_groups") if isinstance(state.get("optimizer"), dict) else None
    live = optimizer.param_groups if isinstance(optimizer, torch.optim.Optimizer) else None
    if not isinstance(saved, list) or live is None or len(saved) == len(live) or not rules.config.weight_decay:
        return
    if sum(len(g.get("params", ())) for g in saved) != sum(len(g["params"]) for g in live):
        return  # other parameters, not another layout: OptimizerPart says so
    if not rules.default_optimizer:  # the default optimizer only: yours has your groups
        return
    one = len(saved) == 1
    raise CheckpointError(
        f"{path}: the checkpoint's optimizer has {len(saved)} parameter group(s) and this run's {len(live)}: it was "
        + ("written with weight decay on every parameter (before gputrain kept it off biases and normalization "
           "weights, or with weight_decay_groups=False); resume with weight_decay_groups=False" if one else
           "written with no weight decay on biases and normalization weights; resume with weight_decay_groups=True"))


def check_resumable(config: TrainConfig, batch_size: int | None, state: Mapping[str, Any], path: Path,
                    world_size: int) -> None:
    """The data order depends on the seed and the global batch (per-process batch x accumulation x
    processes), so a run may resume with another process count if the global batch is kept.
    batch_size: the data's own per-process batch size (a user DataLoader's; None: an iterable's own)."""
    saved_cfg = state.get("config", {})
    saved_global = (saved_cfg.get("batch_size", 0) * saved_cfg.get("accumulate", 1)
                    * int(state.get("world_size", 1)))
    run_global = config.batch_size * config.accumulate * world_size
    if "global_batch" in state:  # the data's own batch size (a user DataLoader's), saved since it exists
        saved_global, run_global = state["global_batch"], global_batch(config, batch_size, world_size)
    if saved_cfg and saved_global != run_global:
        raise CheckpointError(
            f"{path}: the checkpoint was trained with a global batch of {saved_global} "
            f"(batch_size x accumulate x processes) but this run has {run_global}; an exact resume needs "
            "the same global batch")
    if "seed" in saved_cfg and saved_cfg["seed"] != config.seed:
        raise CheckpointError(f"{path}: the checkpoint was trained with seed={saved_cfg['seed']} but this run "
                              f"has seed={config.seed}; an exact resume needs the same seed")


# ------------------------------------------------------------ the run directory, before anything is written


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


def check_resume_before_start(config: TrainConfig, world_size: int) -> None:
    """From the process that starts a run's processes (torchrun's, Ray's) and trains in none of them:
    refuse, before they start, the resume each would refuse at its start: a checkpoint of another
    global batch (with `world_size` processes) or seed. A run directory without a checkpoint is left
    to the processes (`check_resume_target`: the first start of a job its launcher may start again
    begins there), as is a checkpoint whose data made their own batches (a DataLoader of the user's:
    the processes know its batch size)."""
    if not config.resume or not config.run_dir:
        return
    if config.resume is True:
        store = CheckpointStore(Path(config.run_dir))
        if not store.candidates():
            return
        path = store.find_latest(warn=False)  # the one the processes will take
        if path is None:
            return
    else:
        path = Path(config.resume)
    state = read_checkpoint(path, weights=False)
    saved = state.get("config") or {}
    by_config = saved.get("batch_size", 0) * saved.get("accumulate", 1) * int(state.get("world_size", 1))
    if state.get("global_batch", by_config) == by_config:
        check_resumable(config, config.batch_size, state, path, world_size)


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
