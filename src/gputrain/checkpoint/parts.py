"""What a run's checkpoint holds, built from named parts.

In the manner of torchtitan's `CheckpointManager(states=...)`: every part is an object with
`state_dict()` and `load_state_dict(state)` (torch.distributed.checkpoint's `Stateful`), saved under
its name; `RunCheckpoint` composes them, in load order:

  model       the weights (gathered in full on rank 0 under DDP/FSDP); a frozen base's left out
              (checkpoint/frozen.py), its fingerprint saved as `frozen`
  optimizer   its state (likewise), moved to the run's device on load
  scaler      the precision's GradScaler state (`RunPrecision`)
  scheduler   the learning-rate schedule
  rng         every global random-number generator
  run         the run's state (train/loop/state.py: step, samples, loss since the last log point, ...), the stream's
              position and the step's OOM splits
  data        the data position (data/stream.py); each rank's own, also saved as `data_ranks`
  history     the log records so far
  callbacks   each callback's own state (EMA weights, ...)
  carried     what steps carry from one to the next (train/step/carried_state.py: fit's state=, step.state);
              each rank's own, also saved as `carried_ranks`

plus, for readers of the file, the run's `step`, `epoch`, `batch_in_epoch`, `samples_seen`,
`global_batch`, `world_size` and `config`. Taking the state has no side effect: the loss still on
the device since the last read is the loop's to fold in first (manager.py's `before_save`).
The format is the one earlier versions wrote, so their checkpoints still resume.

The parts that wrap the loop's own objects (the run state with the stream's position and the step's
OOM splits, the callbacks' states) are train/loop/build.py's, which builds the whole set; this
package needs nothing of train/'s types.
"""

from __future__ import annotations

from typing import Any, Callable, Mapping, Protocol

import torch
from torch import nn

from gputrain.batch import OptimizerLike, move_optimizer_state
from gputrain.checkpoint.frozen import FrozenBase
from gputrain.checkpoint.rng import capture_rng_state, restore_rng_state
from gputrain.config import TrainConfig
from gputrain.data.stream import BatchStream
from gputrain.errors import CheckpointError
from gputrain.io.history import History
from gputrain.runtime import distributed

WEIGHTS = ("model", "optimizer")  # the parts the sharded format (DCP) writes itself, each rank its share
POSITION_KEYS = ("step", "epoch", "batch_in_epoch", "samples_seen")  # copied to the top level for readers


class ModelPart:
    """The weights: the plain module's state_dict; under DDP/FSDP, gathered in full (collective).
    With a frozen base (`frozen.trainable_only`, checkpoint/frozen.py) the frozen weights are left out, and
    a checkpoint without them takes them from the module on load (its resume checked them first)."""

    def __init__(self, model: nn.Module, module: nn.Module, dist: distributed.DistInfo,
                 frozen: FrozenBase | None = None):
        self.model, self.module, self.dist = model, module, dist  # model: the wrapped one; module: the plain
        self.frozen = frozen

    def state_dict(self) -> dict[str, Any]:
        if self.frozen is not None and self.frozen.trainable_only:  # one process or DDP (checkpoint/frozen.py)
            if self.dist.enabled and not self.dist.is_main:
                return {}
            state = self.frozen.trainable_state(self.module.state_dict())
            return {k: v.detach().cpu() for k, v in state.items()} if self.dist.enabled else state
        if self.dist.enabled:
            return distributed.model_state_dict(self.model, self.dist)
        return self.module.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if self.frozen is not None and state and any(k not in state for k in self.frozen.keys):
            state = self.frozen.complete(state)
        if self.dist.enabled:
            distributed.load_model_state_dict(self.model, state, self.dist)
        else:
            self.module.load_state_dict(state)


class OptimizerPart:
    """The optimizer's state (gathered under DDP/FSDP), on the run's device after a load."""

    def __init__(self, model: nn.Module, optimizer: OptimizerLike, dist: distributed.DistInfo,
                 device: torch.device):
        self.model, self.optimizer, self.dist, self.device = model, optimizer, dist, device

    def state_dict(self) -> dict[str, Any]:
        if self.dist.enabled:
            return distributed.optimizer_state_dict(self.model, self.optimizer, self.dist)
        return self.optimizer.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if self.dist.enabled:
            distributed.load_optimizer_state_dict(self.model, self.optimizer, state, self.dist)
        else:
            try:
                self.optimizer.load_state_dict(state)
            except (ValueError, KeyError) as exc:
                raise CheckpointError(f"the checkpoint's optimizer state does not fit this optimizer: {exc}") from None
        move_optimizer_state(self.optimizer, self.device)


class RngPart:
    """Every global random-number state the run draws from (torch, the device's, numpy, Python)."""

    def __init__(self, device: torch.device):
        self.device = device

    def state_dict(self) -> dict[str, Any]:
        return capture_rng_state(self.device)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        restore_rng_state(state, self.device)


class Stateful(Protocol):
    """torch.distributed.checkpoint's Stateful: what every part is, and what a part of the run's own
    (its RunState, scheduler, precision) must be."""

    def state_dict(self) -> Any: ...

    def load_state_dict(self, state: Any, /) -> Any: ...


class DataPart:
    """The data position (data/stream.py). Each rank's own: with several processes every rank's is
    also saved (`data_ranks`), and a rank takes its own back where the process count is the same."""

    per_rank = True

    def __init__(self, stream: BatchStream):
        self.stream = stream

    def state_dict(self) -> dict[str, Any]:
        return self.stream.state_dict()

    def load_state_dict(self, position: Mapping[str, Any]) -> None:
        self.stream.load_state_dict(dict(position))

    def load_shared(self, position: Mapping[str, Any]) -> None:
        """Another rank's, or another process count's, position: the count without the loader's own
        state (which belongs to one rank's reader); the stream reads up to the position."""
        self.stream.load_state_dict({**position, "source": None})


class HistoryPart:
    """The log records so far (io/history.py), so that a resumed run's history is whole."""

    def __init__(self, history: History):
        self.history = history

    def state_dict(self) -> list[dict[str, Any]]:
        return list(self.history.records)

    def load_state_dict(self, records: list[dict[str, Any]]) -> None:
        self.history.records = list(records)


class RunCheckpoint:
    """A checkpoint's contents from named parts (see the module docstring).

    parts: name -> Stateful, in load order; header: the read-only facts saved beside them
    (global_batch, world_size, config), checked by the resume, not loaded.
    """

    def __init__(self, parts: Mapping[str, Stateful], dist: distributed.DistInfo,
                 header: Callable[[], dict[str, Any]]):
        self.parts = dict(parts)
        self.dist = dist
        self.header = header

    def state_dict(self, weights: bool = True) -> dict[str, Any]:
        """The checkpoint. weights=False: all but "model" and "optimizer", which the sharded format
        writes itself (each rank its part, no gathering). Collective with several processes."""
        state = {name: part.state_dict() for name, part in self.parts.items() if weights or name not in WEIGHTS}
        if self.dist.enabled:
            for name, part in self.parts.items():
                if getattr(part, "per_rank", False):
                    state[f"{name}_ranks"] = distributed.all_gather_object(state[name], self.dist)
        if "run" in state:
            state.update({k: state["run"][k] for k in POSITION_KEYS})
        state.update(self.header())
        return state

    def load_state_dict(self, state: Mapping[str, Any], weights: bool = True) -> None:
        """Load every part from `state` (weights=False: all but the weights, loaded by DCP). A part
        missing from an older checkpoint keeps its value; the run state of checkpoints written before
        RunState existed is read from the top level."""
        if "run" not in state:
            state = {**state, "run": state}
        if "data" not in state:  # written before the "data" key: the position the run state kept
            run = state["run"]
            state = {**state, "data": {"epoch": run.get("epoch", 0), "batch_in_epoch": run.get("batch_in_epoch", 0)}}
        for name, part in self.parts.items():
            if not weights and name in WEIGHTS:
                continue
            if getattr(part, "per_rank", False):
                self._load_per_rank(name, part, state)
            elif name in state:
                part.load_state_dict(state[name])

    def _load_per_rank(self, name: str, part, state: Mapping[str, Any]) -> None:
        ranks = state.get(f"{name}_ranks")
        if ranks and len(ranks) == self.dist.world_size:
            part.load_state_dict(ranks[self.dist.rank])
        elif name not in state:
            return  # a part an older checkpoint does not hold keeps its value (written before "carried")
        elif self.dist.world_size > 1 or int(state.get("world_size", 1)) != self.dist.world_size:
            part.load_shared(state[name])
        else:
            part.load_state_dict(state[name])


def global_batch(config: TrainConfig, batch_size: int | None, world_size: int) -> int | None:
    """Samples per optimizer step over all processes, from the data's own per-process batch size (a user
    DataLoader's); None for an iterable whose batches are its own."""
    return None if batch_size is None else batch_size * config.accumulate * world_size
