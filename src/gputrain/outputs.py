"""What a model returned, whatever its shape: its loss and what metrics should see (its logits).

Models return a tensor, an object with `.loss` / `.logits` (a Hugging Face `ModelOutput`), a
Mapping with "loss" / "logits", or a tuple or list with one scalar tensor among its elements (the
loss: nanoGPT's `(logits, loss)`, a Hugging Face model's `(loss, logits, ...)` with
`return_dict=False`). Training (train/step/loss.py), evaluation, inference and export read outputs
through these functions.
"""

from __future__ import annotations

import collections.abc
from typing import Any

import torch


def _is_scalar(value: Any) -> bool:
    return isinstance(value, torch.Tensor) and value.dim() == 0


def scalar_positions(outputs: Any) -> list[int]:
    """Positions of the 0-dim floating-point tensors in a tuple or list (not a namedtuple's fields)."""
    if not isinstance(outputs, (tuple, list)):
        return []
    return [i for i, v in enumerate(outputs) if _is_scalar(v) and v.is_floating_point()]


def loss_of(outputs: Any) -> torch.Tensor | None:
    """The loss a model returned: a scalar tensor, `.loss`, `["loss"]`, or the one scalar tensor of a
    tuple or list; None when there is none (or a tuple holds several scalars: which is unknown)."""
    if isinstance(outputs, torch.Tensor):
        return outputs if outputs.dim() == 0 else None
    if isinstance(outputs, collections.abc.Mapping):
        value = outputs.get("loss")
    elif isinstance(outputs, (tuple, list)) and not hasattr(outputs, "loss"):
        positions = scalar_positions(outputs)
        return outputs[positions[0]] if len(positions) == 1 else None
    else:
        value = getattr(outputs, "loss", None)
    return value if _is_scalar(value) else None


def where_loss(outputs: Any) -> str:
    """Where `loss_of` found the loss, for the run log: "its .loss", "element [1] of the tuple it returned"."""
    if isinstance(outputs, torch.Tensor):
        return "the scalar tensor it returned"
    if isinstance(outputs, collections.abc.Mapping) and not hasattr(outputs, "loss"):
        return "its ['loss']"
    if isinstance(outputs, (tuple, list)) and not hasattr(outputs, "loss"):
        positions = scalar_positions(outputs)
        return f"element [{positions[0]}] of the {type(outputs).__name__} it returned (its one scalar tensor)" \
            if len(positions) == 1 else "no element"
    return f"its .loss ({type(outputs).__name__})"


def describe_outputs(outputs: Any, limit: int = 6) -> str:
    """What a model returned, for an error: "tuple of 2: [0] (8, 35, 100) float32, [1] (8, 35) float32"."""
    def one(v: Any) -> str:
        if isinstance(v, torch.Tensor):
            return f"{tuple(v.shape)} {str(v.dtype).replace('torch.', '')}"
        return type(v).__name__
    if isinstance(outputs, (tuple, list)):
        parts = [f"[{i}] {one(v)}" for i, v in enumerate(outputs[:limit])]
        more = ", ..." if len(outputs) > limit else ""
        return f"{type(outputs).__name__} of {len(outputs)}: " + ", ".join(parts) + more
    if isinstance(outputs, collections.abc.Mapping):
        keys = list(outputs.keys())
        more = ", ..." if len(keys) > limit else ""
        return f"{type(outputs).__name__} with keys {', '.join(map(repr, keys[:limit]))}{more}"
    if isinstance(outputs, torch.Tensor):
        return f"a tensor {one(outputs)}"
    return type(outputs).__name__


def logits_of(outputs: Any) -> Any:
    """What a metric should see of the outputs: `.logits` / `["logits"]` where there are some; for a
    tuple or list with one scalar loss, its first other tensor (nanoGPT's logits)."""
    if isinstance(outputs, torch.Tensor):
        return outputs
    if isinstance(outputs, collections.abc.Mapping):
        return outputs.get("logits", outputs)
    if isinstance(outputs, (tuple, list)) and not hasattr(outputs, "logits") and len(scalar_positions(outputs)) == 1:
        return next((v for v in outputs if isinstance(v, torch.Tensor) and v.dim() > 0), outputs)
    return getattr(outputs, "logits", outputs)
