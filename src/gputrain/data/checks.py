"""Bad data, said clearly: a batch whose structure or dtype changes, and what a failed first step saw.

`BatchCheck` compares every batch from a host-fed source (a DataLoader, an iterable) with the first
one: the same nesting and keys, and for each tensor leaf the same dtype and number of dimensions
(sizes may change: the last partial batch, padded sequences). A change raises a DataError naming
the batch and the leaf. Cost: one pytree flatten per batch, next to a DataLoader's collation.

`first_step_note` is added to an error raised by the first training step (a label out of range, a
float target for a classification loss, a feature size the model does not take): PyTorch's own
message stays, the note shows the batch's leaves, the label range and the model's first and last
layers in the order the forward ran them (run again on the batch without gradients, with hooks that
note each layer as it starts: the last layer is the one that produced the output, or the one the
forward failed in), which is usually enough to see the mismatch. Before all that it names the
choices that change the step (channels_last, autocast, CUDA graphs), each with its switch: an
autocast the user requested too (torch refuses some ops under autocast; an automatic one that the
first step refuses is undone before any note: train/step/autocast_decider.py).
"""

from __future__ import annotations

import collections.abc
import dataclasses
from typing import Any, Callable, Sequence

import torch
from torch import nn

from gputrain import batch as batches
from gputrain.errors import DataError
from gputrain.runtime.speed import REQUESTED


def _kind(x: Any) -> str:
    if isinstance(x, torch.Tensor):
        return f"{str(x.dtype).replace('torch.', '')} with {x.dim()} dim{'s' if x.dim() != 1 else ''}"
    return type(x).__name__


def _signature(batch: Any) -> tuple:
    """(structure, kind of each leaf): what must not change from batch to batch.

    A flat dict (or other Mapping), tuple or list of tensors (the usual batch) is read without the
    pytree walk (0.8 us for a plain dict of two, per batch, against ~90 us for the walk); a value
    without a tensor's dtype and dim() (a string, a nested container) sends it down the walk. Plain
    dicts, tuples and lists are told by their type, without isinstance checks (with them: 1.7 us)."""
    kind = type(batch)
    try:
        if kind is dict or (kind is not tuple and kind is not list and isinstance(batch, collections.abc.Mapping)):
            return kind, tuple(batch.keys()), tuple([(v.dtype, v.dim()) for v in batch.values()])
        if kind is tuple or kind is list or isinstance(batch, (tuple, list)):
            return kind, len(batch), tuple([(v.dtype, v.dim()) for v in batch])
    except (AttributeError, TypeError):
        pass  # a leaf that is not a tensor: the walk below
    leaves, spec = batches.flatten(batch)
    return spec, tuple((x.dtype, x.dim()) if isinstance(x, torch.Tensor) else type(x) for x in leaves)


def _leaf_paths(batch: Any, prefix: str = "batch") -> list[str]:
    """Readable names of a batch's leaves, in flatten order: batch['x'], batch[0], batch.field."""
    if isinstance(batch, torch.Tensor):
        return [prefix]
    if isinstance(batch, collections.abc.Mapping):
        return [p for k, v in batch.items() for p in _leaf_paths(v, f"{prefix}[{k!r}]")]
    fields = getattr(batch, "_fields", None) if isinstance(batch, tuple) else None  # a namedtuple
    if fields is not None:
        return [p for name, v in zip(fields, batch) for p in _leaf_paths(v, f"{prefix}.{name}")]
    if isinstance(batch, (list, tuple)):
        return [p for i, v in enumerate(batch) for p in _leaf_paths(v, f"{prefix}[{i}]")]
    if dataclasses.is_dataclass(batch) and not isinstance(batch, type):
        return [p for f in dataclasses.fields(batch) if f.init
                for p in _leaf_paths(getattr(batch, f.name), f"{prefix}.{f.name}")]
    return [prefix]


class BatchCheck:
    """Raises DataError when a batch's structure or a tensor leaf's dtype / dims differ from the first batch's."""

    def __init__(self, source: str = "the data"):
        self.source = source
        self.first: tuple | None = None
        self.first_batch: Any = None  # kept to name the leaves when a later batch differs
        self.where = ""

    def __call__(self, batch: Any, epoch: int, index: int) -> None:
        seen = _signature(batch)
        if self.first is None:
            self.first, self.first_batch, self.where = seen, batch, f"batch {index} of epoch {epoch}"
            return
        if seen != self.first:
            self._raise(batch, epoch, index)

    def _raise(self, batch: Any, epoch: int, index: int) -> None:
        leaves0, spec0 = batches.flatten(self.first_batch)
        leaves1, spec1 = batches.flatten(batch)
        paths0, paths1 = _leaf_paths(self.first_batch), _leaf_paths(batch)
        if spec0 != spec1:
            what = (f"its structure changed: {self.where} had leaves {', '.join(paths0)}, "
                    f"this one has {', '.join(paths1)}")
        else:
            what = "; ".join(f"{p} was {_kind(a)} and is now {_kind(b)}"
                             for p, a, b in zip(paths1, leaves0, leaves1) if _kind(a) != _kind(b))
        raise DataError(f"batch {index} of epoch {epoch} from {self.source} differs from the first batch: {what}. "
                        "Every batch must have the same structure and dtypes (the step, CUDA graphs and the "
                        "loss rely on it): fix the dataset or the collate_fn (e.g. cast labels to one dtype, "
                        "return the same keys every time)")


def describe_leaves(batch: Any, limit: int = 8) -> str:
    """'batch[0]: (8, 7) float32, batch[1]: (8,) int64' (tensors), plain leaves by type."""
    leaves, _ = batches.flatten(batch)
    paths = _leaf_paths(batch)
    paths += [f"leaf {i}" for i in range(len(paths), len(leaves))]  # a container of its own kind
    parts = []
    for p, x in list(zip(paths, leaves))[:limit]:
        if isinstance(x, torch.Tensor):
            parts.append(f"{p}: {tuple(x.shape)} {str(x.dtype).replace('torch.', '')}")
        else:
            parts.append(f"{p}: {type(x).__name__}")
    more = f", ... ({len(leaves)} leaves)" if len(leaves) > limit else ""
    return ", ".join(parts) + more


def _targets(batch: Any) -> torch.Tensor | None:
    if isinstance(batch, (tuple, list)) and len(batch) == 2 and isinstance(batch[1], torch.Tensor):
        return batch[1]
    if isinstance(batch, collections.abc.Mapping):
        labels = batch.get("labels")
        return labels if isinstance(labels, torch.Tensor) else None
    return None


def label_range(batch: Any) -> str | None:
    """'labels int64 in [0, 5]' for the pair's targets or batch['labels'] (None when there are none)."""
    y = _targets(batch)
    if y is None or y.numel() == 0:
        return None
    y = y.detach()
    if y.is_floating_point():
        return f"targets {str(y.dtype).replace('torch.', '')} in [{y.min().item():.4g}, {y.max().item():.4g}] " \
               "(a classification loss such as CrossEntropyLoss wants int64 class indices)"
    return f"targets {str(y.dtype).replace('torch.', '')} in [{int(y.min().item())}, {int(y.max().item())}]"


def _layers(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """Modules holding parameters of their own, in registration order."""
    return [(name, m) for name, m in model.named_modules() if any(True for _ in m.parameters(recurse=False))]


def _layer(name: str, m: nn.Module) -> str:
    return f"{name or '(the model)'}: {type(m).__name__}({m.extra_repr()})"


def layers_run(model: nn.Module, run: Callable[[], Any]) -> tuple[list[tuple[str, nn.Module]], bool]:
    """(the layers `run()` started, in the order it first started each; whether it raised): `run`
    goes through `model` once more, without gradients, in eval mode (the mode is given back), with a
    forward pre-hook on every layer holding parameters; its error, if any, is swallowed."""
    names = {m: name for name, m in _layers(model)}
    order: list[tuple[str, nn.Module]] = []
    seen: set[int] = set()

    def note(module: nn.Module, args: Any) -> None:
        if id(module) not in seen:
            seen.add(id(module))
            order.append((names[module], module))

    handles = [m.register_forward_pre_hook(note) for m in names]
    modes, failed = [(m, m.training) for m in model.modules()], False  # each module's own mode, given back
    try:
        model.eval()
        with torch.no_grad():
            run()
    except Exception:
        failed = True
    finally:
        for h in handles:
            h.remove()
        for m, training in modes:
            m.training = training
    return order, failed


def model_ends(model: nn.Module, run: Callable[[], Any] | None = None) -> str | None:
    """"first layer 0: Linear(in_features=6, ...); last layer 2: Linear(..., out_features=3)": in the
    order `run()` ran them (the last one produced the output, or is the last to start before the
    error), or in registration order without `run` (or when it ran none)."""
    layers, failed = layers_run(model, run) if run is not None else ([], False)
    order = "in the order the forward ran them"
    if not layers:
        layers, failed, order = _layers(model), False, "in registration order"
    if not layers:
        return None
    first = "first layer " + _layer(*layers[0])
    order += ", the last one the last to start before the error" if failed else ""
    return (first if len(layers) == 1 else first + "; last layer " + _layer(*layers[-1])) + f" ({order})"


def first_step_note(batch: Any, model: nn.Module, call: Callable[[nn.Module, Any], Any] | None = None,
                    choices: Sequence[str] = ()) -> str:
    """The note for an error in the first training step: first the choices gputrain made that change
    the step (layout, dtype, graphs; `choices`, each with its switch; a requested autocast too, so
    marked), then the batch's leaves, its
    label range, the model's first and last layers (in the order `call(model, batch)` runs them)."""
    from gputrain.data.deferred import materialize

    parts = []
    if choices:  # REQUESTED marks the user's own (runtime/speed.py's choices_made)
        whose = "a choice you made" if all(REQUESTED in c for c in choices) else "choices gputrain made for you"
        parts.append(f"it ran under {whose}, which may be the cause: " + "; ".join(choices) + " (turn each off to see)")
    try:
        batch = materialize(batch)
        parts.append(f"the batch: {describe_leaves(batch)}")
        labels = label_range(batch)
        if labels:
            parts.append(labels)
    except Exception:  # describing must never hide the error itself
        pass
    ends = model_ends(model, (lambda: call(model, batch)) if call is not None else None)
    if ends:
        parts.append(f"the model's {ends}")
    return ("gputrain: the first training step failed; " + "; ".join(parts)
            + ". Check that the inputs' feature size matches the first layer, that targets are int64 class "
              "indices below the number of outputs (or floats for a regression loss), and the loss you pass")
