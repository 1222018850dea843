"""Nested batches: move them, count them, split, cut and tile them, flatten them; check their devices.

A batch is any nesting of Mappings (dict, OrderedDict, a Hugging Face `BatchEncoding`), lists,
tuples, namedtuples and dataclasses whose leaves are tensors or plain values. Everything here walks
that structure with `torch.utils._pytree`, registering Mapping and dataclass types it has not seen
(once, process-wide, as torch itself registers its containers), so the trainer, the data loaders,
the CUDA-graph buffers and OOM splitting all agree on one notion of "a batch".

`move` walks nested containers so that users never write `.to(device)` per field. `check_devices`
turns PyTorch's "Expected all tensors to be on the same device" into a message naming the tensors.
"""

from __future__ import annotations

import collections.abc
import copy
import dataclasses
import threading
from typing import Any, Callable, Iterator, Protocol, TypeVar

import torch
from torch import nn

from gputrain.errors import DataError, DeviceError
from gputrain.torch_compat import pytree

_register_lock = threading.Lock()


def _register(obj: Any) -> None:
    """Teach pytree a Mapping or dataclass type it does not know yet (a no-op for known types)."""
    cls = type(obj)
    if cls in pytree.SUPPORTED_NODES or isinstance(obj, torch.Tensor):
        return
    if isinstance(obj, collections.abc.Mapping):
        def flatten_mapping(m):
            keys = list(m.keys())
            return [m[k] for k in keys], keys

        def unflatten_mapping(values, keys, cls=cls):
            data = dict(zip(keys, values))
            try:
                return cls(data)  # dict subclasses, UserDict, BatchEncoding(data)
            except Exception:
                return data

        kind = (flatten_mapping, unflatten_mapping)
    elif dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        names = [f.name for f in dataclasses.fields(obj) if f.init]

        def flatten_dc(d, names=names):
            return [getattr(d, n) for n in names], names

        def unflatten_dc(values, names, cls=cls):
            return cls(**dict(zip(names, values)))

        kind = (flatten_dc, unflatten_dc)
    else:
        return
    with _register_lock:
        if cls not in pytree.SUPPORTED_NODES:
            pytree.register_pytree_node(cls, kind[0], kind[1])


def _register_all(obj: Any) -> None:
    """Register every unknown container type inside `obj` (walks plain Python containers)."""
    if isinstance(obj, torch.Tensor):
        return
    if isinstance(obj, collections.abc.Mapping):
        _register(obj)
        for v in obj.values():
            _register_all(v)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            _register_all(v)
    elif dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        _register(obj)
        for f in dataclasses.fields(obj):
            _register_all(getattr(obj, f.name))


def flatten(batch: Any) -> tuple[list[Any], pytree.TreeSpec]:
    """(leaves, structure) of a nested batch; `unflatten(leaves, structure)` rebuilds it."""
    _register_all(batch)
    return pytree.tree_flatten(batch)


def unflatten(leaves: list[Any], spec: pytree.TreeSpec) -> Any:
    return pytree.tree_unflatten(leaves, spec)


def map_tensors(fn: Callable[[torch.Tensor], Any], batch: Any) -> Any:
    """The batch with `fn` applied to every tensor leaf; other leaves pass through."""
    if (type(batch) is tuple or type(batch) is list) and all(isinstance(x, torch.Tensor) for x in batch):
        # The common (inputs, targets) pair, without the pytree walk (per step: ~5 us on the CPU).
        return type(batch)([fn(x) for x in batch])
    leaves, spec = flatten(batch)
    return unflatten([fn(x) if isinstance(x, torch.Tensor) else x for x in leaves], spec)


def tensor_leaves(batch: Any) -> list[torch.Tensor]:
    return [x for x in flatten(batch)[0] if isinstance(x, torch.Tensor)]


def batch_size(batch: Any) -> int:
    """Samples in a batch: dim 0 of its first tensor leaf that has one (host metadata, no sync)."""
    first = batch[0] if (type(batch) is tuple or type(batch) is list) and batch else batch
    if type(batch) is dict and batch:
        first = next(iter(batch.values()))  # a dict of columns: its first value is the first leaf
    if isinstance(first, torch.Tensor) and first.dim() > 0:
        return int(first.shape[0])  # a tensor or a pair of them: the first leaf, without the pytree walk
    for x in flatten(batch)[0]:
        if isinstance(x, torch.Tensor) and x.dim() > 0:
            return int(x.shape[0])
    raise DataError(f"a batch needs at least one tensor with a batch dimension; got {describe(batch)}")


def split(batch: Any, parts: int) -> list[Any]:
    """Split a batch into up to `parts` micro-batches along dim 0 (accumulation, OOM recovery).

    Every tensor leaf whose dim 0 equals the batch size is cut; other leaves (scalars, per-batch
    constants, plain values) are shared by all parts. Returns fewer parts when the batch is smaller.
    """
    n = batch_size(batch)
    parts = max(1, min(parts, n))
    if parts == 1:
        return [batch]
    leaves, spec = flatten(batch)
    cut = [x.tensor_split(parts) if isinstance(x, torch.Tensor) and x.dim() > 0 and x.shape[0] == n else None
           for x in leaves]
    return [unflatten([c[i] if c is not None else x for c, x in zip(cut, leaves)], spec) for i in range(parts)]


def _map_samples(fn: Callable[[torch.Tensor], torch.Tensor], batch: Any) -> Any:
    """`fn` applied to every tensor leaf carrying the batch dimension (dim 0 of the batch's size)."""
    n = batch_size(batch)
    return map_tensors(lambda t: fn(t) if t.dim() > 0 and t.shape[0] == n else t, batch)


def head(batch: Any, n: int) -> Any:
    """The batch's first `n` samples (every leaf with the batch dimension is cut; others are shared)."""
    return _map_samples(lambda t: t[:n], batch)


def tile(batch: Any, rows: int) -> Any:
    """The batch repeated along dim 0 to exactly `rows` samples (leaves without it are shared)."""
    def one(t: torch.Tensor) -> torch.Tensor:
        return t.repeat(-(-rows // t.shape[0]), *([1] * (t.dim() - 1)))[:rows]

    return _map_samples(one, batch)


def signature(batch: Any) -> tuple:
    """A hashable key of a batch's structure and every leaf's shape and dtype (tensors) or value.

    Two batches with equal signatures can be fed to one captured CUDA graph.
    """
    leaves, spec = flatten(batch)
    key = []
    for x in leaves:
        if isinstance(x, torch.Tensor):
            key.append((tuple(x.shape), x.dtype, x.device))
        else:
            try:
                hash(x)
                key.append(("value", x))
            except TypeError:
                key.append(("object", id(x)))
    return (str(spec), tuple(key))


def describe(batch: Any, limit: int = 6) -> str:
    """A short description of a batch for error messages, e.g. "dict with keys input_ids, labels"."""
    if isinstance(batch, torch.Tensor):
        return f"a tensor of shape {tuple(batch.shape)}"
    if isinstance(batch, collections.abc.Mapping):
        keys = list(batch.keys())
        more = ", ..." if len(keys) > limit else ""
        return f"{type(batch).__name__} with keys {', '.join(map(str, keys[:limit]))}{more}"
    if isinstance(batch, (list, tuple)):
        return f"{type(batch).__name__} of length {len(batch)}"
    return type(batch).__name__


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
    if isinstance(obj, collections.abc.Mapping):
        moved = {k: _move(v, device, non_blocking) for k, v in obj.items()}
        if type(obj) is dict:
            return moved
        out = copy.copy(obj)  # keeps OrderedDict / defaultdict / UserDict / BatchEncoding and their extras
        if isinstance(out, collections.abc.MutableMapping):
            out.update(moved)
            return out
        return moved
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
    to = getattr(obj, "to", None)
    if callable(to) and not isinstance(obj, type):  # anything else that moves itself (torchmetrics, ...)
        try:
            return to(device)
        except TypeError:
            return obj
    return obj


class OptimizerLike(Protocol):
    """An optimizer as its state is moved and checkpointed: torch's `Optimizer`, or several named
    ones that act as one (a step of your own's, train/optim/by_name.py's `OptimizerSet`)."""

    @property
    def param_groups(self) -> list[dict[str, Any]]: ...

    @property
    def state(self) -> Any: ...

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state_dict: dict[str, Any], /) -> None: ...


_Optimizer = TypeVar("_Optimizer", bound=OptimizerLike)


def torch_optimizers(optimizer: OptimizerLike) -> torch.optim.Optimizer | list[torch.optim.Optimizer]:
    """What torch.distributed.checkpoint's state-dict functions take for `optimizer`: the optimizer
    itself, or a named set's optimizers, in the order they were named."""
    if isinstance(optimizer, torch.optim.Optimizer):
        return optimizer
    return list(getattr(optimizer, "optimizers").values())


def needs_closure(optimizer: Any) -> bool:
    """Whether `optimizer.step` requires a closure (LBFGS's `step(closure)`, and any optimizer whose
    step takes one without a default): the step then calls it with one that evaluates the loss and
    its gradients again (train/step/train_step.py); CUDA graphs refuse such a step (runtime/speed.py)."""
    import inspect

    try:
        params = inspect.signature(type(optimizer).step).parameters
    except (TypeError, ValueError):  # a builtin or otherwise unreadable signature: called as it is
        return False
    closure = params.get("closure")
    return closure is not None and closure.default is inspect.Parameter.empty \
        and closure.kind in (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)


def move_optimizer_state(optimizer: _Optimizer, device: torch.device | str) -> _Optimizer:
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
    elif isinstance(obj, collections.abc.Mapping):
        for k, v in obj.items():
            yield from iter_tensors(v, f"{prefix}[{k!r}]")
    elif isinstance(obj, tuple) and (fields := getattr(obj, "_fields", None)) is not None:  # namedtuple
        for name, v in zip(fields, obj):
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
