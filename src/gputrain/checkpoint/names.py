"""The names of what RUN_DIR/checkpoints/ holds, and what each file holds (one place for all of them).

    step-000123.pt             a one-file checkpoint of step 123 (format.py)
    step-000123.pt.sha256      its sha256, "HEX  step-000123.pt" (digests.py; sha256sum's format)
    step-000123.dcp/           a sharded checkpoint of step 123 (sharded.py), a folder holding:
        .metadata              DCP's index of every tensor and chunk
        __R_0.distcp           rank R's model and optimizer tensors (DCP's own name and format)
        run-0000R.pt           rank R's run state (the one-file format, without model and optimizer)
        MANIFEST.sha256        the sha256 of every file above (digests.py), written last
    .step-000123.dcp.T.tmp     a sharded checkpoint being written (never read; the next save removes it)
    latest                     the name of the newest checkpoint written, one line (store.py)
    index.json                 which checkpoint is the best by a metric (store.py)

The run directory's own names (the `checkpoints` folder among them) are io/run_layout.py's.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

DCP_SUFFIX = ".dcp"
DCP_METADATA = ".metadata"  # DCP's own name for its index
MANIFEST = "MANIFEST.sha256"
SHA256_SUFFIX = ".sha256"
LATEST = "latest"
BEST_INDEX = "index.json"
_STEP_FILE = re.compile(r"^step-(\d+)\.pt$")
_STEP_DIR = re.compile(r"^step-(\d+)\.dcp$")


def step_file_name(step: int) -> str:
    """The one-file checkpoint of `step`: step-000123.pt."""
    return f"step-{step:06d}.pt"


def step_dir_name(step: int) -> str:
    """The sharded checkpoint (a folder) of `step`: step-000123.dcp."""
    return f"step-{step:06d}{DCP_SUFFIX}"


def staging_name(step: int, token: str) -> str:
    """The folder a sharded checkpoint is written into before its commit (a dot name: never a checkpoint)."""
    return f".{step_dir_name(step)}.{token}.tmp"


def run_state_name(rank: int) -> str:
    """The file of a sharded checkpoint that holds rank `rank`'s run state: run-0000R.pt."""
    return f"run-{rank:05d}.pt"


def sha256_sidecar(checkpoint: str | os.PathLike) -> Path:
    """The path of the .sha256 file beside a one-file checkpoint (which holds its digest)."""
    path = Path(checkpoint)
    return path.with_name(path.name + SHA256_SUFFIX)


def step_of(path: str | os.PathLike) -> int | None:
    """The step in a checkpoint's name (step-000123.pt or step-000123.dcp -> 123); None for other names."""
    name = Path(path).name
    match = _STEP_FILE.match(name) or _STEP_DIR.match(name)
    return int(match.group(1)) if match else None


def is_dcp(path: str | os.PathLike) -> bool:
    """A sharded checkpoint folder (by its name, and a folder; whether it verifies is digests.verify's question)."""
    path = Path(path)
    return path.name.endswith(DCP_SUFFIX) and path.is_dir()
