"""The run's state in one object: where training is, saved in and restored from checkpoints."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Mapping


@dataclass
class RunState:
    """The run's own counters that an exact resume needs (besides the parts that hold theirs: the
    model, the optimizer, the data stream's position, the step's OOM splits; checkpoint/parts.py).

    step: optimizer steps done; samples_seen: samples over all processes; loss_since_log: the loss
    summed (host float) over the steps_since_log steps since the last log point, so that a resumed
    run logs the same loss as an uninterrupted one; nonfinite_steps: steps with a non-finite loss or
    gradient so far; stopped_by: why a callback ended the run early ("" when none did): a resumed
    run that was stopped so trains no further; named_since_log: a step of your own's named losses
    summed since the last log point (train/step/own_step.py), saved for the same reason, and
    named_steps_since_log: how many of those steps returned each (a loss returned on some steps only).
    """

    step: int = 0
    samples_seen: int = 0
    loss_since_log: float = 0.0
    steps_since_log: int = 0
    nonfinite_steps: int = 0
    stopped_by: str = ""
    named_since_log: dict[str, float] = dataclasses.field(default_factory=dict)
    named_steps_since_log: dict[str, float] = dataclasses.field(default_factory=dict)

    def state_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Set every counter from `state_dict()` (other keys are ignored), in place: the objects
        that read the run state (callbacks' RunControl, the loop) keep reading this one."""
        loaded = self.from_state_dict(state)
        for f in dataclasses.fields(self):
            setattr(self, f.name, getattr(loaded, f.name))

    @classmethod
    def from_state_dict(cls, state: Mapping[str, Any]) -> "RunState":
        """From `state_dict()`, or from the flat keys of checkpoints written before RunState existed."""
        names = {f.name for f in dataclasses.fields(cls)}
        values: dict[str, Any] = {}
        for k, v in state.items():
            if k in names:
                values[k] = dict(v) if k in ("named_since_log", "named_steps_since_log") else type(getattr(cls, k))(v)
        return cls(**values)
