"""Checkpoints, in one package; this docstring is its map.

What a checkpoint holds: the run's named parts (parts.py: model, optimizer, scaler, scheduler, rng,
run state, data position, history, callbacks, carried), each a `state_dict()`; of a frozen base only
its fingerprint (frozen.py); the random-number states (rng.py).
How it is written: as one file step-N.pt (format.py: tensors and plain data, loadable with
weights_only=True, written atomically) or, with several processes or an asynchronous save, as a folder
step-N.dcp/ in which every rank writes its share (sharded.py: the format; sharded_save.py: the
collective and asynchronous save, and the resume every rank agrees on).
Where: RUN_DIR/checkpoints/ (the name is io/run_layout.py's), kept by the store (store.py: retention,
`latest`, the best, the newest that verifies after any crash); every name inside it and what that file
holds is names.py's.
How it is verified: a file by the sha256 in its .sha256, a folder by its MANIFEST.sha256, each written
before the checkpoint takes its final name, so no checkpoint is ever seen without its hashes
(digests.py: every hash computed, written, read back and checked, one path for both formats).
How it is read: read.py, one reader for a file or a folder (whole, or a folder's run state only),
used by the resume, the store and a trained run's model (workloads/from_run.py).
How a run uses it: manager.py's `CheckpointManager`, built once with the states it saves, writes them
into the store and resumes exactly (the store tries the checkpoint `latest` names, then the others from
the highest step down, and takes the first that verifies, with a warning naming each skipped; then
checks that it fits the model and the run: same global batch and seed, before loading every part);
`open_run_store` checks the run directory before anything is written there.

Layering: this package sits above io/, data/ and runtime/ and below train/; it imports nothing of
train/ (the states that wrap the loop's own objects are built by train/loop/build.py).
"""

from gputrain.checkpoint.digests import Damage, verify
from gputrain.checkpoint.format import check_model_state, load_checkpoint, write_checkpoint
from gputrain.checkpoint.names import is_dcp, sha256_sidecar, step_of
from gputrain.checkpoint.read import read_checkpoint
from gputrain.checkpoint.sharded import load_full
from gputrain.checkpoint.store import CheckpointStore, CheckpointWarning

__all__ = ["CheckpointStore", "CheckpointWarning", "Damage", "check_model_state", "is_dcp", "load_checkpoint",
           "load_full", "read_checkpoint", "sha256_sidecar", "step_of", "verify", "write_checkpoint"]
