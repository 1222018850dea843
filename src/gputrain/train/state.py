"""The run's state in one object: where training is, saved in and restored from checkpoints."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any


@dataclass
class RunState:
    """Everything about a run's position that an exact resume needs (besides model and optimizer).

    step: optimizer steps done; epoch / batch_in_epoch: the data stream's next batch;
    samples_seen: samples over all processes; splits: OOM micro-batch splits in force (1 = none);
    loss_since_log: the loss summed (host float) over the steps_since_log steps since the last log
    point, so that a resumed run logs the same loss as an uninterrupted one; nonfinite_steps: steps
    with a non-finite loss or gradient so far; stopped_by: why a callback ended the run early ("" when
    none did): a resumed run that was stopped so trains no further.
    """

    step: int = 0
    epoch: int = 0
    batch_in_epoch: int = 0
    samples_seen: int = 0
    splits: int = 1
    loss_since_log: float = 0.0
    steps_since_log: int = 0
    nonfinite_steps: int = 0
    stopped_by: str = ""

    def state_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_state_dict(cls, state: dict[str, Any]) -> "RunState":
        """From `state_dict()`, or from the flat keys of checkpoints written before RunState existed."""
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: type(getattr(cls, k))(v) for k, v in state.items() if k in names})
