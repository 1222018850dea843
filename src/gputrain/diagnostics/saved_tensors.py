"""The bytes autograd saves for backward: what a forward pass holds until its backward frees it.

`SavedTensorMeter` counts them while it is active (saved_tensors_hooks), once per storage, and
attributes them to the block running when they were saved; `measure_saved` runs one forward and
loss under it, inside `side_effect_free` (BatchNorm statistics, mode and RNG put back). The memory
estimate and the step probe's host estimate measure activations with it; `gputrain bench` reports
them per batch size, a device-independent measure of activation memory.
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterable, Sequence

import torch
from torch import nn

from gputrain.runtime.precision import Precision
from gputrain.train.step.recompute import RecomputeUnit
from gputrain.train.step.loss import LossRule
from gputrain.train.modes import UserModes


def nbytes(t: torch.Tensor) -> int:
    """Bytes of a tensor's elements (its view, not its whole storage)."""
    return t.numel() * t.element_size()


def unique_parameters(model: nn.Module) -> list[nn.Parameter]:
    """The model's parameters, each once (tied weights count once)."""
    seen, out = set(), []
    for p in model.parameters():
        if id(p) not in seen:
            seen.add(id(p))
            out.append(p)
    return out


def parameter_storages(params: Iterable[torch.Tensor]) -> set[int]:
    """The storages of `params`, to pass as `skip_storages` (weights are not activations)."""
    return {p.untyped_storage().data_ptr() for p in params}


class SavedTensorMeter:
    """Counts the bytes autograd saves for backward while it is active, once per storage.

    Tensors saved several times (a weight and its transpose, an input kept by two ops) count once:
    per storage, the distinct (start, size) views are summed, capped at the storage's size.
    Storages in `skip_storages` (the parameters', see `parameter_storages`) are not counted.
    `by_unit` attributes each storage to the unit named last in `current_unit` (a stack the caller's
    module hooks push and pop) when it was first saved.

        meter = SavedTensorMeter(parameter_storages(model.parameters()))
        with meter.hooks():
            loss = loss_fn(model(x), y)
        meter.total_bytes
    """

    def __init__(self, skip_storages: Iterable[int] = ()):
        self._skip = set(skip_storages)
        self._views: dict[int, set[tuple[int, int]]] = {}
        self._cap: dict[int, int] = {}
        self._unit_of_storage: dict[int, str | None] = {}
        self.current_unit: list[str] = []

    def _pack(self, t: torch.Tensor):
        try:
            storage = t.untyped_storage()
            key, cap, ptr = storage.data_ptr(), storage.nbytes(), t.data_ptr()
        except (RuntimeError, NotImplementedError, TypeError):  # tensor subclasses without storage
            key, cap, ptr = id(t), nbytes(t), id(t)
        if key not in self._skip and key != 0:
            if key not in self._views:
                self._views[key] = set()
                self._cap[key] = cap
                self._unit_of_storage[key] = self.current_unit[-1] if self.current_unit else None
            self._views[key].add((ptr, nbytes(t)))
        return t

    @staticmethod
    def _unpack(t: torch.Tensor) -> torch.Tensor:
        return t

    def hooks(self):
        """The context inside which saved tensors are counted."""
        return torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)

    def _bytes(self, key: int) -> int:
        return min(self._cap[key], sum(size for _, size in self._views[key]))

    @property
    def total_bytes(self) -> int:
        return sum(self._bytes(k) for k in self._views)

    def by_unit(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for key, unit in self._unit_of_storage.items():
            if unit is not None:
                out[unit] = out.get(unit, 0) + self._bytes(key)
        return out


@contextlib.contextmanager
def side_effect_free(model: nn.Module, device: torch.device):
    """Measure without changing the model: its buffers (BatchNorm running stats), train/eval mode
    and the RNG (dropout) are put back afterwards. The model is in training mode inside, as fit
    trains it: submodules the user put in eval mode stay so (train/modes.py)."""
    buffers = {name: b.detach().clone() for name, b in model.named_buffers()}
    modes = UserModes(model)
    devices = [device] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices):
        try:
            modes.train()
            yield
        finally:
            modes.restore()
            with torch.no_grad():
                for name, b in model.named_buffers():
                    if name in buffers:
                        b.copy_(buffers[name])


def measure_saved(model: nn.Module, batch: Any, loss: LossRule, autocast_dtype: torch.dtype | None,
                  device: torch.device,
                  units: Sequence[RecomputeUnit] = ()) -> tuple[int, dict[str, int], dict[str, int]]:
    """One forward + loss under the meter: (saved bytes, saved bytes per unit, input bytes per unit).

    batch: on `device`; loss: how it becomes a loss (train/step/loss.py); autocast_dtype: the run's
    autocast (None: none); units: blocks (recompute.recompute_units) to attribute
    the bytes to, and whose inputs to count. The caller keeps it side-effect free (`side_effect_free`).
    """
    meter = SavedTensorMeter(parameter_storages(unique_parameters(model)))
    unit_inputs: dict[str, int] = {}
    handles = []
    for unit in units:
        for i, module in enumerate(unit.modules):
            first = i == 0

            def pre(mod, args, unit=unit, first=first):
                meter.current_unit.append(unit.name)
                if first:
                    unit_inputs[unit.name] = unit_inputs.get(unit.name, 0) + sum(
                        nbytes(a) for a in args if isinstance(a, torch.Tensor))

            def post(mod, args, out):
                if meter.current_unit:
                    meter.current_unit.pop()

            handles.append(module.register_forward_pre_hook(pre))
            handles.append(module.register_forward_hook(post))
    autocast = Precision(str(autocast_dtype), autocast_dtype, False, False, "").autocast(device)
    try:
        with torch.enable_grad(), meter.hooks(), autocast:
            value, _ = loss(model, batch)
            del value
    finally:
        for h in handles:
            h.remove()
    return meter.total_bytes, meter.by_unit(), unit_inputs
