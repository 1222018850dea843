"""Sharded checkpoints in a run: every rank writes its part with DCP, rank 0 commits, optionally
while training goes on; and the resume that finds the newest checkpoint all ranks verified.

One save, on every rank (checkpoint/sharded.py has the layout, digests.py the hashing):
  1. wait for the previous save (async: it may still be writing), so at most one is in flight;
  2. agree on a fresh staging folder (rank 0's token, broadcast) and write this rank's run state;
  3. torch.distributed.checkpoint.save of this rank's model and optimizer state (get_state_dict:
     FSDP2 shards, DDP's replicated tensors spread over the ranks by DCP), or async_save: the state
     is first copied to host memory (pinned on GPUs), then written by a background thread while
     the training loop goes on;
  4. each rank hashes the files it wrote; rank 0 gathers the digests, writes MANIFEST.sha256 and
     commits the folder (rename, `latest`, retention); a broadcast tells every rank it is done.
The collectives of a save run over a gloo group of their own (made on first use), so a background
write never interleaves with the training loop's collectives, and an NCCL job stages to the CPU.

Timings: `blocked_s` is how long the training loop stood still for a save, `written_s` how long
the save took until it was committed (what a blocking save would have cost the loop).
"""

from __future__ import annotations

import logging
import os
import statistics
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from gputrain.errors import CheckpointError, ConfigError
from gputrain.checkpoint import sharded
from gputrain.checkpoint.digests import files_sha256, verify, write_manifest
from gputrain.checkpoint.names import staging_name, step_dir_name
from gputrain import torch_compat
from gputrain.runtime.distributed import DistInfo

log = logging.getLogger("gputrain")

FORMATS = ("auto", "dcp", "file")
_ERROR = "?error"  # in a rank's digests: why that rank could not write or hash its part


def resolve_format(requested: str, world_size: int, async_save: bool) -> tuple[str, str]:
    """("dcp" | "file", why). auto: DCP with several processes (every rank writes its part), the
    one-file format for one process, DCP for one process only when an asynchronous save is asked."""
    if requested not in FORMATS:
        raise ConfigError(f"checkpoint_format must be one of {', '.join(FORMATS)}, got {requested!r}")
    if requested == "file" and async_save:
        raise ConfigError("async_checkpoint needs the sharded format (checkpoint_format='dcp' or 'auto'): the "
                          "one-file format is written by rank 0 in the training loop")
    if requested != "auto":
        return requested, "asked for"
    if world_size > 1:
        return "dcp", f"{world_size} processes: each writes its own part (torch.distributed.checkpoint)"
    if async_save:
        return "dcp", "one process, asynchronous save (DCP's async_save)"
    return "file", "one process: one file"


def _writer_that_signals(folder: Path, started: threading.Event):
    """DCP's FileSystemWriter into `folder`, which sets `started` when a save sets it up (in the save's
    own thread, once its opening checks and warnings are done)."""
    from torch.distributed.checkpoint.filesystem import FileSystemWriter

    class Writer(FileSystemWriter):
        def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
            started.set()
            super().set_up_storage_writer(is_coordinator, *args, **kwargs)

    return Writer(str(folder))


@dataclass
class SaveTiming:
    step: int
    format: str
    blocked_s: float = 0.0  # the training loop stood still this long
    written_s: float | None = None  # from the start of the save until it was committed
    started_s: float = 0.0  # time.perf_counter() at the start (this process's clock)
    done_s: float | None = None  # time.perf_counter() when it was committed


class DcpCheckpointer:
    """A run's checkpoint writer state: the format, the save in flight, the timings, the gloo group."""

    def __init__(self, info: DistInfo, device: torch.device, requested: str = "auto", async_save: bool = False):
        self.info = info
        self.device = device
        self.format, self.reason = resolve_format(requested, info.world_size, async_save)
        self.async_save = async_save
        self.timings: list[SaveTiming] = []
        self.last_committed: Path | None = None
        self.waited_at_end_s = 0.0
        self._group: Any = None
        self._made_group = False
        self._executor: ThreadPoolExecutor | None = None
        self._pending: Future | None = None
        self._stager: Any = None

    @property
    def uses_dcp(self) -> bool:
        return self.format == "dcp"

    @property
    def no_dist(self) -> bool:
        return not self.info.enabled

    def group(self):
        """The gloo group of the checkpoint collectives (a collective on first use: every rank
        calls save / find / load at the same points)."""
        if self.info.enabled and not self._made_group:
            self._group = dist.new_group(backend="gloo")
            self._made_group = True
        return self._group

    # ------------------------------------------------------------ saving

    def save(self, store, step: int, module: nn.Module, optimizer: torch.optim.Optimizer | list[torch.optim.Optimizer],
             run_state: dict[str, Any], metrics: dict[str, Any] | None) -> Path:
        """Write the checkpoint of `step` (every rank calls this); returns its path, committed unless
        asynchronous (then `wait` commits it). Raises CheckpointError when the previous asynchronous
        save failed or this one could not be written."""
        start = time.perf_counter()
        self.wait()
        timing = SaveTiming(step, "dcp", started_s=start)
        staging = store.folder / staging_name(step, self._token())
        digests: dict[str, str] = {}
        try:  # a rank that fails here still takes part in the collectives below, then all raise
            staging.mkdir(parents=True, exist_ok=True)
            name, digest = sharded.write_run_state(staging, self.info.rank, run_state)
            digests[name] = digest
        except OSError as exc:
            digests[_ERROR] = f"rank {self.info.rank}: {exc.strerror or exc}"
        weights = sharded.weights_state(module, optimizer)
        from torch.distributed.checkpoint.filesystem import FileSystemWriter
        from torch.distributed.checkpoint.state_dict_saver import AsyncSaveResponse, async_save, save

        if self.async_save:
            started = threading.Event()
            writer = _writer_that_signals(staging, started)
            # DCP's writer thread warns, as its save starts, that it assumes one process (the intent): the
            # warning filters are process-wide, so this thread keeps them scoped until the writer is past
            # that start (DCP sets up its storage writer after it), then puts them back.
            with sharded.single_process_quiet(self.no_dist):
                response = async_save(weights, storage_writer=writer, process_group=self.group(),
                                      async_stager=self._get_stager(), no_dist=self.no_dist)
                upload = response.upload_completion if isinstance(response, AsyncSaveResponse) else response
                while self.no_dist and not started.wait(0.005) and not upload.done():
                    pass
            if self._executor is None:
                self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="gputrain-checkpoint")
            self._pending = self._executor.submit(self._commit, upload, staging, step, digests, store, metrics,
                                                  timing, start)
            timing.blocked_s = time.perf_counter() - start
            self.timings.append(timing)
            return store.folder / step_dir_name(step)
        try:
            with sharded.single_process_quiet(self.no_dist):
                save(weights, storage_writer=FileSystemWriter(str(staging)), process_group=self.group(),
                     no_dist=self.no_dist)
        except sharded.dcp_errors() as exc:  # DCP wraps every rank's error in its CheckpointException
            raise self._failed(step, store, exc) from exc
        path = self._commit(None, staging, step, digests, store, metrics, timing, start)
        timing.blocked_s = time.perf_counter() - start
        self.timings.append(timing)
        return path

    def record_file_save(self, step: int, seconds: float) -> None:
        """The one-file format: the loop waits for the whole write."""
        now = time.perf_counter()
        self.timings.append(SaveTiming(step, "file", seconds, seconds, now - seconds, now))

    def wait(self) -> Path | None:
        """Wait for the save in flight, if any; returns the path of the last committed checkpoint.
        Raises CheckpointError when it failed."""
        pending, self._pending = self._pending, None
        if pending is not None:
            pending.result()
        return self.last_committed

    def finish(self) -> Path | None:
        """The end of a run or a stop: wait for the save in flight (timed as `waited_at_end_s`)."""
        start = time.perf_counter()
        try:
            return self.wait()
        finally:
            self.waited_at_end_s += time.perf_counter() - start

    def close(self) -> None:
        """Wait for a save in flight (an error is logged: the run's own error, if any, comes first)
        and free the staging buffers and the writer thread."""
        try:
            self.wait()
        except Exception as exc:  # noqa: BLE001
            log.warning("the last asynchronous checkpoint did not complete: %s", exc)
        if self._executor is not None:
            self._executor.shutdown(wait=True)
            self._executor = None
        if self._stager is not None:
            self._stager.close()
            self._stager = None

    def _get_stager(self):
        if self._stager is not None and not torch_compat.dcp_stager_reusable():
            self._stager.close()  # torch 2.11's stager stages once (see torch_compat): a new one each save
            self._stager = None
        if self._stager is None:
            from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

            cuda = self.device.type == "cuda"
            # Staging copies the state to host memory before the loop goes on (pinned on GPUs: a fast
            # device-to-host copy); synchronous, so the next optimizer step cannot change what is saved.
            self._stager = DefaultStager(StagingOptions(use_pinned_memory=cuda, use_shared_memory=False,
                                                        use_async_staging=False, use_non_blocking_copy=cuda))
        return self._stager

    def _token(self) -> str:
        token = f"{time.time_ns():x}-{os.getpid()}"
        if not self.info.enabled:
            return token
        box = [token if self.info.is_main else None]
        dist.broadcast_object_list(box, src=0, group=self.group())
        return str(box[0])

    def _commit(self, upload: Future | None, staging: Path, step: int, digests: dict[str, str], store,
                metrics: dict[str, Any] | None, timing: SaveTiming, start: float) -> Path:
        """Hash this rank's files, gather the digests on rank 0, which writes the manifest and
        commits; every rank learns the outcome. Runs in the writer thread when asynchronous."""
        failure: BaseException | None = None
        if upload is not None:
            try:
                upload.result()
            except BaseException as exc:  # noqa: BLE001 - DCP gives every rank the error: no commit
                raise self._failed(step, store, exc) from exc
        if _ERROR not in digests:
            try:
                digests.update(files_sha256(staging, sharded.own_files(staging, self.info.rank)))
            except OSError as exc:  # told to rank 0 with the digests: nothing is committed
                digests[_ERROR] = f"rank {self.info.rank}: cannot read back its files ({exc.strerror or exc})"
        everyone = self._gather(digests)
        errors = [part[_ERROR] for part in everyone if _ERROR in part]
        error: str | None = "; ".join(errors) if errors else None
        path = store.folder / step_dir_name(step)
        if self.info.is_main and error is None:
            try:
                merged = {name: digest for part in everyone for name, digest in part.items()}
                write_manifest(staging, merged)
                path = store.commit_dir(staging, step, metrics)
            except Exception as exc:  # noqa: BLE001 - told to every rank below, then raised
                error = f"{exc.strerror or exc}" if isinstance(exc, OSError) else f"{type(exc).__name__}: {exc}"
                failure = exc
        error = self._broadcast(error)
        timing.done_s = time.perf_counter()
        timing.written_s = timing.done_s - start
        if error is not None:
            raise self._failed(step, store, failure or RuntimeError(error))
        self.last_committed = path
        return path

    def _failed(self, step: int, store, exc: BaseException) -> CheckpointError:
        previous = (f"the previous checkpoint {self.last_committed} is intact" if self.last_committed
                    else "no earlier checkpoint of this run was written")
        return CheckpointError(f"could not write the checkpoint of step {step} to {store.folder}: "
                               f"{sharded.dcp_cause(exc)}; {previous}. "
                               f"Free space (or choose another --run-dir) and resume with --resume {store.run_dir}")

    def _gather(self, digests: dict[str, str]) -> list[dict[str, str]]:
        if not self.info.enabled:
            return [digests]
        out: list[Any] = [None] * self.info.world_size
        dist.all_gather_object(out, digests, group=self.group())
        return out

    def _broadcast(self, value: str | None) -> str | None:
        if not self.info.enabled:
            return value
        box = [value]
        dist.broadcast_object_list(box, src=0, group=self.group())
        return box[0]

    # ------------------------------------------------------------ resuming

    def find(self, store) -> Path | None:
        """The newest checkpoint every rank agrees verifies (rank 0's listing; each rank hashes its
        share of a sharded checkpoint's files); None when the run has none. Collective."""
        if not self.info.enabled:
            return store.find_latest()
        box: list[Any] = [store.candidates() if self.info.is_main else None]
        dist.broadcast_object_list(box, src=0, group=self.group())
        candidates: list[Path] = box[0]
        rank, world = self.info.rank, self.info.world_size

        def agreed(path: Path) -> bool | str:
            mine = verify(path, share=(rank, world))  # a folder's files in shares; a file by rank 0 alone
            reasons: list[Any] = [None] * world
            dist.all_gather_object(reasons, None if mine is True else str(mine), group=self.group())
            bad = [r for r in reasons if r]
            return True if not bad else bad[0]

        return store.find_latest(agreed, candidates, warn=self.info.is_main)

    def load_weights(self, path: Path, module: nn.Module, optimizer: torch.optim.Optimizer | list[torch.optim.Optimizer]) -> None:
        """Model and optimizer from a sharded checkpoint, resharded to this job (collective)."""
        sharded.load_weights(path, module, optimizer, process_group=self.group(), no_dist=self.no_dist)

    # ------------------------------------------------------------ reporting

    def summary(self) -> dict[str, Any]:
        """The summary's checkpoint entries: format, async, saves, and per-save medians (seconds)."""
        saves = self.timings
        written = [t.written_s for t in saves if t.written_s is not None]
        return {
            "checkpoint_format": self.format,
            "checkpoint_async": self.async_save,
            "checkpoint_saves": len(saves),
            "checkpoint_blocked_s_per_save": statistics.median([t.blocked_s for t in saves]) if saves else None,
            "checkpoint_write_s_per_save": statistics.median(written) if written else None,
            "checkpoint_wait_at_end_s": self.waited_at_end_s,
            "checkpoint_timings": [dict(t.__dict__) for t in saves],
        }
