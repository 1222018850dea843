"""Choices the model's own first step decides, one mechanism for all of them: `FirstStepGate`.

Some automatic choices cannot be proven harmless by looking at the model: channels_last (a `.view`
of a convolution's output refuses NHWC; train/step/layout.py) and an automatic autocast (torch's CUDA
autocast refuses BCELoss; train/step/autocast_decider.py). Each is a `Decider`; the gate wraps the
run's step and, for every decider still open:

1. probe: before the first step, what can be decided ahead (the layout's two-copy probe);
2. snapshot: before the first step, the RNG states and the buffers (a forward that fails late has
   already updated BatchNorm's statistics); the weights have not moved when a step fails before its
   optimizer step, and a decider refuses to undo a step of yours that already stepped one;
3. the step; when it raises, each decider in turn is asked whether its choice caused the error
   (`caused`, which may probe a copy of the model from the snapshot's RNG state);
4. fall back: the first that says so takes its choice back (`fall_back`, one log line; the reason
   names the error and the user's `file:line`), the failed attempt's gradients are cleared, graphs
   captured so far dropped, the snapshot put back, the other deciders probe again, and the step runs
   once more (retry once per decider). Anything else propagates unchanged.
On later steps only a decider that can still fail late (the layout: a data-dependent path) stays
open; its retry runs without a snapshot (taking one every step would cost a copy of every buffer).
Once every decider is settled the gate is one attribute test per step.

`FirstPass` is the probes' one forward + loss + backward on a copy of the model: the built-in loss
rule, or a step of your own with `_ProbeStep` (its optimizer steps do nothing: both sides compute
from the same weights).
"""

from __future__ import annotations

import logging
from typing import Any, Callable, Protocol, Sequence

import torch
from torch import nn

from gputrain.train.step.loss import LossRule

log = logging.getLogger("gputrain")


class RngState:
    """torch's RNG state, and every CUDA device's on CUDA, to start a pass from again."""

    def __init__(self, device: torch.device):
        self.cpu = torch.get_rng_state()
        self.cuda = torch.cuda.get_rng_state_all() if device.type == "cuda" else []

    def restore(self) -> None:
        torch.set_rng_state(self.cpu)
        if self.cuda:
            torch.cuda.set_rng_state_all(self.cuda)


class Snapshot:
    """The RNG states and the buffers of `module` before the first step, to put back."""

    def __init__(self, module: nn.Module, device: torch.device):
        self.rng = RngState(device)
        self.buffers = [(b, b.detach().clone()) for b in module.buffers()]

    def restore(self) -> None:
        with torch.no_grad():
            for b, saved in self.buffers:
                b.copy_(saved)
        self.rng.restore()


class Decider(Protocol):
    """One choice the first step decides (see the module docstring). late: whether it may still undo
    its choice after the first step (the layout, on a data-dependent path)."""

    late: bool

    @property
    def open(self) -> bool:
        """Whether this decider may still act: probe, or undo its choice after a failure."""
        ...

    def probe(self, micro_batches: Sequence[Any]) -> None:
        """Before a step: decide what can be decided ahead (nothing for most)."""

    def caused(self, exc: Exception, micro_batches: Sequence[Any], snapshot: Snapshot | None) -> str | None:
        """Why this decider's choice caused `exc` (the reason to fall back), or None."""

    def fall_back(self, why: str, micro_batches: Sequence[Any]) -> Sequence[Any] | None:
        """Take the choice back for the rest of the run (one log line); the batches to retry with
        (None: the same)."""

    def reopen(self) -> None:
        """Another decider fell back on the first step: probe again before the retry."""


class FirstStepGate:
    """The run's step behind its deciders (see the module docstring). `clear` clears every
    optimizer's gradients; `graphs`: the CUDA-graph wrapper's captures, dropped at a fall back."""

    def __init__(self, step: Callable[[Sequence[Any]], Any], deciders: Sequence[Decider], *, module: nn.Module,
                 device: torch.device, clear: Callable[[], None], graphs: dict | None = None):
        self.step, self.deciders, self.module, self.device = step, list(deciders), module, device
        self.clear, self.graphs = clear, graphs
        self.late = [d for d in self.deciders if d.late]
        self.first = True

    def __call__(self, micro_batches: Sequence[Any]) -> Any:
        if self.first:
            return self._first(micro_batches)
        for d in self.late:
            if d.open:
                break
        else:  # every decider settled: the step itself
            return self.step(micro_batches)
        try:
            return self.step(micro_batches)
        except Exception as exc:
            return self._retry(exc, micro_batches, None, tried=[])

    def _first(self, micro_batches: Sequence[Any]) -> Any:
        self.first = False
        snapshot = Snapshot(self.module, self.device)
        self._probe(micro_batches)
        try:
            return self.step(micro_batches)
        except Exception as exc:
            return self._retry(exc, micro_batches, snapshot, tried=[])

    def _probe(self, micro_batches: Sequence[Any]) -> None:
        for d in self.deciders:
            if d.open:
                d.probe(micro_batches)

    def _retry(self, exc: Exception, micro_batches: Sequence[Any], snapshot: Snapshot | None,
               tried: list[Decider]) -> Any:
        for decider in self.deciders if snapshot is not None else self.late:
            if decider in tried or not decider.open:
                continue
            why = decider.caused(exc, micro_batches, snapshot)
            if why is None:
                continue
            tried.append(decider)
            retry = decider.fall_back(why, micro_batches)
            self.clear()  # the failed attempt's gradients
            if self.graphs:
                self.graphs.clear()  # captured under the old choice: captured again under the new one
            batches = micro_batches if retry is None else retry
            if snapshot is not None:  # the first step: again as the other choice would have run it
                snapshot.restore()
                for other in self.deciders:
                    if other is not decider:
                        other.reopen()
                self._probe(batches)
            try:
                return self.step(batches)
            except Exception as again:
                return self._retry(again, batches, snapshot, tried)
        raise exc


class _ProbeStep:
    """What a step of your own gets in a probe: backward is a plain backward on the copy, step()
    and zero_grad() leave the weights alone (both sides compute from the same weights)."""

    def __init__(self, model: nn.Module, optimizers: dict[str, Any], schedulers: dict[str, Any]):
        self.model, self.optimizers, self.schedulers = model, optimizers, schedulers
        self.is_last, self.weight = True, 1.0

    def backward(self, loss: torch.Tensor, retain_graph: bool | None = None, create_graph: bool = False) -> None:
        loss.backward(retain_graph=retain_graph, create_graph=create_graph)

    def step(self, name: str | None = None, closure: Callable[[], Any] | None = None) -> None:
        pass

    def zero_grad(self, name: str | None = None) -> None:
        pass


def losses_of(out: Any) -> list[float]:
    """The losses a step's forward gave, as host floats (a probe's only)."""
    if isinstance(out, tuple) and out and isinstance(out[0], torch.Tensor):
        out = out[0]  # compute_loss's (loss, outputs)
    values = out.values() if isinstance(out, dict) else [out]
    return [float(v.detach().float()) for v in values if isinstance(v, torch.Tensor)]


class FirstPass:
    """The probes' forward + loss + backward on a copy of the model (see the module docstring).

    own_step: a step of your own (fn(step, batch)); own_context: its optimizers and schedulers by name.
    """

    def __init__(self, loss: LossRule, own_step: Callable | None = None,
                 own_context: tuple[dict[str, Any], dict[str, Any]] = ({}, {})):
        self.loss, self.own_step, self.own_context = loss, own_step, own_context

    def __call__(self, model: nn.Module, batch: Any, rng: RngState, autocast: Callable[[], Any]) -> list[float]:
        """The pass from the RNG states `rng`, inside `autocast()`; its losses. The caller forks
        the RNG around it (the run's stream is left as it was)."""
        rng.restore()
        with autocast():
            if self.own_step is not None:
                return losses_of(self.own_step(_ProbeStep(model, *self.own_context), batch))
            value, _ = self.loss(model, batch)
        value.backward()
        return losses_of(value)
