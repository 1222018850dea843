"""The sharded checkpoint format: one folder per checkpoint, every process writes its own part.

A one-file checkpoint gathers the whole model and optimizer to rank 0 and writes them there, while
every other rank waits. This format writes with torch.distributed.checkpoint (DCP) instead: each
rank writes the tensors it holds (FSDP2 shards; under DDP, DCP spreads the replicated tensors over
the ranks), so a save costs the per-rank share of the bytes, in parallel. A checkpoint written by
N processes loads in M (DCP reshards on load), and in one process without a process group.

Layout of one checkpoint, RUN_DIR/checkpoints/step-000123.dcp/:

    .metadata           DCP's index of every tensor and chunk (written by rank 0)
    __R_0.distcp        rank R's tensors (model and optimizer state, DCP's format)
    run-0000R.pt        rank R's run state: everything of the one-file checkpoint but the model and
                        optimizer (step, data position, RNG of that rank, scaler, schedule, ...),
                        in the one-file format (torch.load(weights_only=True) reads it)
    MANIFEST.sha256     "HEX  NAME" for every file above (sha256sum's format: `sha256sum -c`)

A checkpoint is written into a staging folder `.step-000123.dcp.TOKEN.tmp` beside it; each rank
hashes the files it wrote, rank 0 gathers the digests and writes MANIFEST.sha256 last, and only
then renames the folder to its final name (the commit: `CheckpointStore.commit_dir`). So a
folder under a step name always holds every rank's files, the metadata and their hashes; a
writer killed before the rename leaves a staging folder that the next save removes.

This module holds the single-process pieces (writing a rank's run state, listing a rank's files,
reading); the names are names.py's, the hashing and the check against the manifest digests.py's, and
the collective orchestration (who writes, hashes, gathers, commits, optionally while training goes
on) is sharded_save.py's.
"""

from __future__ import annotations

import contextlib
import os
import re
import warnings
from pathlib import Path
from typing import Any

import torch
from torch import nn

from gputrain.checkpoint.format import load_checkpoint, write_checkpoint
from gputrain.checkpoint.names import DCP_METADATA, run_state_name
from gputrain.errors import CheckpointError
from gputrain import torch_compat

FORMAT = "gputrain-dcp"
_SHARD_FILE = re.compile(r"^__(\d+)_\d+\.distcp$")  # FileSystemWriter's per-rank files


# ---------------------------------------------------------------- writing (the pieces)


def write_run_state(folder: Path, rank: int, state: dict[str, Any]) -> tuple[str, str]:
    """Write this rank's run state into the staging `folder`; returns (file name, sha256).

    The state must be what a one-file checkpoint holds without "model" and "optimizer"; raises
    CheckpointError, before writing, for values a safe load would refuse.
    """
    name = run_state_name(rank)
    digest: list[str] = []
    write_checkpoint(folder / name, {"layout": FORMAT, **state}, before_replace=digest.append)
    return name, digest[0]


def own_files(folder: Path, rank: int) -> list[str]:
    """The DCP files this rank wrote into `folder`: its __RANK_*.distcp, and .metadata on rank 0."""
    names = []
    for entry in os.listdir(folder):
        match = _SHARD_FILE.match(entry)
        if match and int(match.group(1)) == rank:
            names.append(entry)
    if rank == 0:
        names.append(DCP_METADATA)
    return sorted(names)


# ---------------------------------------------------------------- reading


def read_run_state(path: str | os.PathLike, rank: int = 0) -> tuple[dict[str, Any], int]:
    """A rank's run state: (state, the rank whose file it is). Ranks the checkpoint has no file of
    (it was written by fewer processes) get rank 0's. Raises CheckpointError as load_checkpoint."""
    path = Path(path)
    file = path / run_state_name(rank)
    used = rank
    if not file.is_file():
        file, used = path / run_state_name(0), 0
    state = load_checkpoint(file)
    state.pop("layout", None)
    return state, used


def saved_model_shapes(path: str | os.PathLike) -> dict[str, torch.Tensor]:
    """The model entries of the checkpoint as empty meta tensors of their full shapes (for
    checkpoint.format.check_model_state), read from DCP's metadata without loading any tensor."""
    from torch.distributed.checkpoint.filesystem import FileSystemReader
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    metadata = FileSystemReader(str(path)).read_metadata()
    shapes = {}
    for key, item in metadata.state_dict_metadata.items():
        if key.startswith("model.") and isinstance(item, TensorStorageMetadata):
            shapes[key[len("model."):]] = torch.empty(tuple(item.size), device="meta")
    return shapes


def load_full(path: str | os.PathLike) -> dict[str, Any]:
    """The whole checkpoint in this process, as a one-file checkpoint would hold it: full CPU tensors
    under "model" and "optimizer" (keyed by parameter name) plus rank 0's run state. No process
    group or model needed (for tests, comparisons and conversions)."""
    # What torch.distributed.checkpoint.format_utils.dcp_to_torch_save does, without the file.
    with single_process_quiet(True):
        tensors = torch_compat.read_whole_dcp(path)
    state, _ = read_run_state(path, 0)
    return {**state, "model": tensors.get("model", {}), "optimizer": tensors.get("optimizer", {})}


# ---------------------------------------------------------------- model and optimizer through DCP


@contextlib.contextmanager
def single_process_quiet(no_dist: bool):
    """DCP warns on every call without a process group that it assumes one process: that is the
    intent here, so the warning is dropped (with no_dist only)."""
    with warnings.catch_warnings():
        if no_dist:
            warnings.filterwarnings("ignore", message=".*torch.distributed is disabled.*")
        yield


def weights_state(module: nn.Module, optimizer: torch.optim.Optimizer | list[torch.optim.Optimizer]) -> dict[str, Any]:
    """{"model", "optimizer"} as torch.distributed.checkpoint.state_dict.get_state_dict gives them:
    this rank's shards under FSDP2 (DTensors), the local tensors under DDP and in one process, keyed
    by parameter name. Pass the unwrapped module (no DDP or compile wrapper)."""
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model_state, optim_state = get_state_dict(module, optimizer)
    return {"model": model_state, "optimizer": optim_state}


def load_weights(path: str | os.PathLike, module: nn.Module, optimizer: torch.optim.Optimizer | list[torch.optim.Optimizer],
                 process_group=None, no_dist: bool = False) -> None:
    """Load the checkpoint's model and optimizer into `module` / `optimizer`, resharded to this job
    (a collective over `process_group` unless no_dist). Raises CheckpointError when they do not fit."""
    from torch.distributed.checkpoint.filesystem import FileSystemReader
    from torch.distributed.checkpoint.state_dict import set_state_dict
    from torch.distributed.checkpoint.state_dict_loader import load

    state = weights_state(module, optimizer)
    try:
        with single_process_quiet(no_dist):
            load(state, storage_reader=FileSystemReader(str(path)), process_group=process_group,
                     no_dist=no_dist)
    except dcp_errors() as exc:  # DCP raises CheckpointException / RuntimeError with its own words
        raise CheckpointError(f"{path}: cannot load the model and optimizer state: {dcp_cause(exc)}") from exc
    set_state_dict(module, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"])


def dcp_errors() -> tuple[type[BaseException], ...]:
    """What DCP's save and load raise: any error, and its CheckpointException (every rank's errors in one),
    which is a BaseException, not an Exception (an `except Exception` lets a full disk through)."""
    from torch.distributed.checkpoint.api import CheckpointException

    return (Exception, CheckpointException)


def dcp_cause(exc: BaseException) -> str:
    """The first line of what went wrong: for DCP's CheckpointException ("CheckpointException
    ranks:dict_keys([0])") the first failing rank's own error, e.g. "rank 0: [Errno 28] No space left
    on device"."""
    failures = getattr(exc, "failures", None)  # {rank: (the rank's exception, its stack)}
    if isinstance(failures, dict) and failures:
        rank, failure = min(failures.items())
        error = failure[0] if isinstance(failure, tuple) and failure else failure
        if isinstance(error, BaseException):
            return f"rank {rank}: {dcp_cause(error)}"
    text = str(exc).strip()
    return text.splitlines()[0][:300] if text else type(exc).__name__
