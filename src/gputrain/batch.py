"""Moving things to a device, and checking that a model and its inputs share one.

`move` walks nested containers so that users never write `.to(device)` per field. `check_devices`
turns PyTorch's "Expected all tensors to be on the same device" into a message naming the tensors.
"""

from __future__ import annotations

import copy
import dataclasses
from typing import Any, Iterator

import torch
from torch import nn

from gputrain.errors import DeviceError


def move(obj: Any, device: torch.device | str, non_blocking: bool = False) -> Any:
    """Move tensors and modules inside `obj` to `device`.

    Handles tensors, nn.Modules (moved in place, as `.to` does, and returned), dicts, lists,
    tuples, namedtuples and dataclass instances, nested to any depth. Other values are returned
    as they are. Returns the moved object; containers are rebuilt, never mutated.
    """
    device = torch.device(device)
    return _move(obj, device, non_blocking)


def _move(obj: Any, device: torch.device, non_blocking: bool) -> Any:
    if isinstance(obj, torch.Tensor):
        return obj.to(device, non_blocking=non_blocking)
    if isinstance(obj, nn.Module):
        return obj.to(device)
    if isinstance(obj, dict):
        moved = {k: _move(v, device, non_blocking) for k, v in obj.items()}
        if type(obj) is dict:
            return moved
        out = copy.copy(obj)  # keeps OrderedDict / defaultdict and their extras
        out.update(moved)
        return out
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):  # namedtuple
        return type(obj)(*(_move(v, device, non_blocking) for v in obj))
    if isinstance(obj, (list, tuple)):
        return type(obj)(_move(v, device, non_blocking) for v in obj)
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        changes = {
            f.name: _move(getattr(obj, f.name), device, non_blocking)
            for f in dataclasses.fields(obj)
            if f.init
        }
        return dataclasses.replace(obj, **changes)
    return obj


def move_optimizer_state(optimizer: torch.optim.Optimizer, device: torch.device | str) -> torch.optim.Optimizer:
    """Move an optimizer's state (e.g. Adam's moments) to follow its model; returns the optimizer.

    Scalar `step` counters stay where they are unless the optimizer is capturable/fused, whose
    kernels expect them on the parameter's device.
    """
    device = torch.device(device)
    for group in optimizer.param_groups:
        on_device_steps = group.get("capturable", False) or group.get("fused", False)
        for p in group["params"]:
            state = optimizer.state.get(p)
            if not state:
                continue
            for key, value in state.items():
                if not isinstance(value, torch.Tensor):
                    continue
                if key == "step" and value.dim() == 0 and not on_device_steps:
                    continue
                state[key] = value.to(device)
    return optimizer


def iter_tensors(obj: Any, prefix: str = "batch") -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (path, tensor) for every tensor in a nested structure, e.g. ("batch[0]", x)."""
    if isinstance(obj, torch.Tensor):
        yield prefix, obj
    elif isinstance(obj, dict):
        for k, v in obj.items():
            yield from iter_tensors(v, f"{prefix}[{k!r}]")
    elif isinstance(obj, tuple) and hasattr(obj, "_fields"):
        for name, v in zip(obj._fields, obj):
            yield from iter_tensors(v, f"{prefix}.{name}")
    elif isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            yield from iter_tensors(v, f"{prefix}[{i}]")
    elif dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        for f in dataclasses.fields(obj):
            yield from iter_tensors(getattr(obj, f.name), f"{prefix}.{f.name}")


def _same(a: torch.device, b: torch.device) -> bool:
    if a.type != b.type:
        return False
    if a.type == "cuda":
        return (a.index or 0) == (b.index or 0)
    return True


def check_devices(model: nn.Module, batch: Any) -> torch.device | None:
    """Check that the model's parameters/buffers and every tensor in `batch` share one device.

    Returns that device (None when there are no tensors at all). Raises DeviceError naming the
    first parameter or buffer and the first input on each side of a mismatch, with the fix.
    """
    named = [(f"parameter {n}", t) for n, t in model.named_parameters()]
    named += [(f"buffer {n}", t) for n, t in model.named_buffers()]
    inputs = list(iter_tensors(batch))

    model_devices: dict[str, tuple[str, torch.device]] = {}
    for name, t in named:
        model_devices.setdefault(_key(t.device), (name, t.device))
    if len(model_devices) > 1:
        (n1, d1), (n2, d2) = list(model_devices.values())[:2]
        raise DeviceError(
            f"the model is split across devices: {n1} is on {d1} but {n2} is on {d2}. "
            f"Move the whole model with gputrain.move(model, device) (or model.to(device))"
        )
    model_device = next(iter(model_devices.values()))[1] if model_devices else None

    first_by_device: dict[str, tuple[str, torch.device]] = {}
    for name, t in inputs:
        first_by_device.setdefault(_key(t.device), (name, t.device))
    if model_device is not None:
        for name, dev in first_by_device.values():
            if not _same(dev, model_device):
                first_param = next(n for n, t in named if _same(t.device, model_device))
                raise DeviceError(
                    f"the model and its inputs are on different devices: {first_param} is on {model_device} "
                    f"but input {name} is on {dev}. Move the batch with gputrain.move(batch, {str(model_device)!r}) "
                    f"before calling the model"
                )
        return model_device
    if len(first_by_device) > 1:
        (n1, d1), (n2, d2) = list(first_by_device.values())[:2]
        raise DeviceError(f"the inputs are on different devices: {n1} is on {d1} but {n2} is on {d2}")
    return next(iter(first_by_device.values()))[1] if first_by_device else None


def _key(device: torch.device) -> str:
    return f"{device.type}:{device.index or 0}" if device.type == "cuda" else device.type
