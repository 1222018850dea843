"""Reading a checkpoint whichever its format: a step-N.pt file or a sharded step-N.dcp folder.

The one reader that the resume (save_resume.py), the store's `load_latest` (store.py) and a trained
run's model (workloads/from_run.py) all go through. It reads; whether the checkpoint verifies is asked
before (digests.verify), and whether it fits the model after (format.check_model_state).
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

import torch

from gputrain.checkpoint import sharded
from gputrain.checkpoint.format import load_checkpoint
from gputrain.checkpoint.names import is_dcp
from gputrain.errors import CheckpointError

log = logging.getLogger(__name__)


def read_checkpoint(path: str | os.PathLike, *, weights: bool = True, rank: int = 0,
                    map_location: str | torch.device = "cpu") -> dict[str, Any]:
    """The checkpoint at `path` as a one-file checkpoint holds it (its "model", "optimizer" and run state).

    A file is loaded whole (format.load_checkpoint, onto `map_location`). A sharded folder: with
    weights=True its every rank's part is gathered into full CPU tensors in this process (no process
    group needed); with weights=False only rank `rank`'s run state is read (rank 0's when the checkpoint
    was written by fewer processes), without "model" and "optimizer", which each rank of a job then
    reads its share of through DCP (sharded.load_weights). Raises CheckpointError naming the path and
    what is wrong.
    """
    path = Path(path)
    if not is_dcp(path):
        return load_checkpoint(path, map_location=map_location)
    if not weights:
        state, used = sharded.read_run_state(path, rank)
        if used != rank:  # written by fewer processes than this job has
            log.debug("%s has no run state of rank %d: it takes rank %d's (random-number state included)",
                      path, rank, used)
        return state
    try:
        return sharded.load_full(path)
    except CheckpointError:
        raise
    except Exception as exc:  # noqa: BLE001 - DCP's reader fails in its own words (CheckpointException, ...)
        raise CheckpointError(f"{path}: cannot read the sharded checkpoint ({sharded.dcp_cause(exc)}); choose "
                              "another (--checkpoint last, or another step)") from exc
