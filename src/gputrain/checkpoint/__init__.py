"""A run's checkpoints, in one place.

What a checkpoint holds: the run's named parts (parts.py: model, optimizer, scaler, scheduler, rng,
run state, data position, history, callbacks), each a `state_dict()`; of a frozen base only its
fingerprint (frozen.py). Where it is written: RUN_DIR/checkpoints/ (store.py), as one file
step-N.pt (format.py: tensors and plain data, loadable with weights_only=True, written atomically)
or, with several processes or an asynchronous save, as a folder step-N.dcp/ in which every rank
writes its share (sharded.py; the collective and asynchronous save is sharded_save.py); run.py is a
run's save and resume. How it is verified: a file by the sha256 in its .sha256, a folder by its
MANIFEST.sha256 (verify.py, one path for both), each written before the checkpoint takes its final
name, so no checkpoint is ever seen without its hashes. How a resume finds it: the store tries the
checkpoint `latest` names, then the others from the highest step down, and takes the first that
verifies (a warning names each skipped); the resume then checks that it fits the model and the run
(same global batch and seed) before loading every part.

Layering: this package sits above io/, data/ and runtime/ and below train/; it imports nothing of
train/ (what it reads of the trainer is typed by the Protocols of parts.py and run.py).
"""

from gputrain.checkpoint.format import check_model_state, load_checkpoint, write_checkpoint
from gputrain.checkpoint.sharded import is_dcp, load_full
from gputrain.checkpoint.store import CheckpointStore, CheckpointWarning, step_of
from gputrain.checkpoint.verify import Damage, hash_path, verify

__all__ = ["CheckpointStore", "CheckpointWarning", "Damage", "check_model_state", "hash_path", "is_dcp",
           "load_checkpoint", "load_full", "step_of", "verify", "write_checkpoint"]
