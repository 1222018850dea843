"""State a step carries from one step to the next, saved with the run's checkpoints: an RNN's hidden
state (truncated backpropagation through time), a counter, a memory bank, a queue of negatives.

One mapping by name, the run's `CarriedState`: `step.state` in a step of your own (train/step/own_step.py),
and the mapping given as `fit(..., state=...)` (which the built-in loss rule's `compute_loss` or
`loss_fn` reads and writes: the run keeps that very dict). Lightning keeps such state in its
`state_dict` / `on_save_checkpoint` hooks; here each value is one of two kinds:

- a Stateful object (`state_dict()` and `load_state_dict(state)`: a module, a small class of
  yours): its state_dict is saved, and a resume loads it back into the object registered under
  that name: at once when it was registered before the resume (`fit(state={"bank": bank})`), or
  when `step.state["bank"] = bank` registers it later;
- any other value: tensors, numbers, strings, None and lists / tuples / dicts of them (what a
  checkpoint holds, loadable with `weights_only=True`): saved as it is, its tensors copied to the
  host, and put back under its name on resume, its tensors on the run's device.

A value replaced every step (the detached hidden state) is simply assigned again; nothing is read
on the host per step. That is Python run every step, which a CUDA graph would run once, at capture:
a run with carried state is not captured (`graph_blocker`), and its decisions say why. Several
processes: each rank's carried state is its own, and a resume gives each rank its own back (a
resume with another process count cannot, and says so).
"""

from __future__ import annotations

from collections.abc import MutableMapping
from typing import Any, Iterator, Mapping

import torch

from gputrain.batch import iter_tensors, map_tensors, move
from gputrain.checkpoint.format import check_plain
from gputrain.errors import CheckpointError, ConfigError


def is_stateful(value: Any) -> bool:
    """Whether `value` saves and loads its own state (torch.distributed.checkpoint's Stateful)."""
    return callable(getattr(value, "state_dict", None)) and callable(getattr(value, "load_state_dict", None))


def check_entry(name: Any, value: Any, said: str) -> None:
    """Refuse, where it is given (fit's state= at the start, `step.state[name] = value` in the step),
    an entry the checkpoints could not save or a resume give back: a name that is not a non-empty
    string, a value neither Stateful nor plain data, a tensor without data (the meta device). said:
    how the user wrote it ("state=", "step.state")."""
    if not isinstance(name, str) or not name.strip():
        example = "state={'hidden': None}" if said == "state=" else "step.state['hidden'] = h"
        raise ConfigError(f"{said} names must be non-empty strings (they name checkpoint entries), got {name!r}: "
                          f"e.g. {example}")
    if is_stateful(value):
        return
    where = f"{said}[{name!r}]" if said != "state=" else f"state={{{name!r}: ...}}"
    try:
        check_plain(value, where)
    except CheckpointError as exc:  # said where the value is given, not at the first checkpoint
        raise ConfigError(f"{exc}, or objects with state_dict() and load_state_dict() (a module, a class of yours) "
                          "whose state is saved") from None
    for path, tensor in iter_tensors(value, where):
        if tensor.is_meta:
            raise ConfigError(f"{path} is a tensor on the meta device (a shape without data), which a checkpoint "
                              "cannot save: make it on the run's device, e.g. torch.zeros(shape, device=...)")


def _to_host(value: Any) -> Any:
    """A copy of `value` with every tensor detached and on the host (what a checkpoint holds)."""
    return map_tensors(lambda t: t.detach().to("cpu", copy=True), value)


class CarriedState(MutableMapping):
    """The run's state carried between steps, by name (see the module docstring).

    values: the mapping to keep (fit's `state=`, updated in place on resume), or None for a new one.
    device: where a resume puts the saved tensors.
    """

    per_rank = True  # checkpoint/parts.py: every rank's own is saved, and each rank takes its own back

    def __init__(self, values: MutableMapping[str, Any] | None, device: torch.device):
        if values is not None and not isinstance(values, MutableMapping):
            raise ConfigError(f"state= is a {type(values).__name__}: give a dict of what your steps carry from one "
                              "step to the next, e.g. state={'hidden': None} or state={'bank': bank} (an object "
                              "with state_dict() and load_state_dict())")
        for name, value in (values or {}).items():  # the dict is known now: refused before the run starts
            check_entry(name, value, "state=")
        self.held: MutableMapping[str, Any] = values if values is not None else {}
        self.device = device
        self._pending: dict[str, Any] = {}  # saved states of objects not registered yet (a resume came first)
        self.given = values is not None  # fit's state=: the loss rule's Python carries it
        self.written = False  # a step assigned an entry (step.state[name] = ...)

    def graph_blocker(self) -> str | None:
        """Why a CUDA graph must not capture the run's steps: their Python carries this state from
        step to step, and a captured step runs its Python once, at capture (a replay would read the
        state the capture read, and assign nothing). None while nothing is carried."""
        if self.given:
            return ("fit(state=...) was given: your loss carries that state from step to step in Python, which a "
                    "captured step runs once, at capture")
        if self.written:
            return ("your step_fn writes step.state, state carried from step to step in Python, which a captured "
                    "step runs once, at capture")
        return None

    # ------------------------------------------------------------ the mapping (what a step reads and writes)

    def __getitem__(self, name: str) -> Any:
        return self.held[name]

    def __setitem__(self, name: str, value: Any) -> None:
        check_entry(name, value, "step.state")
        self.written = True
        if name in self._pending and is_stateful(value):
            value.load_state_dict(self._pending.pop(name))  # registered after the resume: its saved state now
        self.held[name] = value

    def __delitem__(self, name: str) -> None:
        del self.held[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self.held)

    def __len__(self) -> int:
        return len(self.held)

    # ------------------------------------------------------------ the checkpoint's part

    def state_dict(self) -> dict[str, Any]:
        """{"values": plain values (tensors on the host), "objects": each Stateful's state_dict};
        states loaded from a checkpoint whose object was never registered are kept."""
        objects = dict(self._pending)
        values: dict[str, Any] = {}
        for name, value in self.held.items():
            if is_stateful(value):
                objects[name] = _to_host(value.state_dict())
            else:
                values[name] = _to_host(value)
        return {"values": values, "objects": objects}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Put the saved values back (on the run's device) and load each object's state into the
        object registered under its name (later, for one registered later)."""
        for name, value in (state.get("values") or {}).items():
            self.held[name] = move(value, self.device)
        for name, saved in (state.get("objects") or {}).items():
            if is_stateful(self.held.get(name)):
                self.held[name].load_state_dict(saved)
            else:
                self._pending[name] = saved

    def load_shared(self, state: Mapping[str, Any]) -> None:
        """Another process count's checkpoint: each rank's carried state was its own, and no rank of
        this run has one saved; an empty one resumes."""
        if state.get("values") or state.get("objects"):
            names = sorted(str(n) for n in (*(state.get("values") or {}), *(state.get("objects") or {})))
            raise CheckpointError(f"the checkpoint holds each process's carried state ({', '.join(names)}), saved "
                                  "by another number of processes than this run has: resume with the same number "
                                  "of processes")
