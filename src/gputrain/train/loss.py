"""How a batch becomes a loss: one rule, in a documented order.

1. `compute_loss(model, batch)` given: it returns the loss, or `(loss, outputs)` so that metrics can
   see the outputs.
2. A pair `(inputs, targets)` and a `loss_fn`: `loss_fn(model(inputs), targets)`.
3. Otherwise the model is called with the batch (`model(**batch)` for a Mapping, `model(*batch)` for
   a list or tuple, `model(batch)` else) and returns its own loss: a scalar tensor, an object with
   `.loss` (a Hugging Face `ModelOutput`), or a Mapping with `"loss"`.

`LossRule.__call__` returns `(loss, outputs)`; `targets(batch)` gives what a metric compares the
outputs with (the pair's second element, or `batch["labels"]`).
"""

from __future__ import annotations

import collections.abc
from typing import Any, Callable

import torch
from torch import nn

from gputrain.batch import describe
from gputrain.outputs import loss_of
from gputrain.errors import DataError

THE_THREE_WAYS = (
    "gputrain turns a batch into a loss in one of three ways: pass compute_loss=fn(model, batch) "
    "returning the loss (or (loss, outputs)); or give batches as pairs (inputs, targets) with "
    "loss_fn=...; or let the model compute its own loss from the batch (model(**batch) for a dict) "
    "and return a scalar tensor, an object with .loss, or a dict with 'loss'"
)


def is_pair(batch: Any) -> bool:
    kind = type(batch)
    if kind is tuple or kind is list:  # the usual case, without a subclass's checks (per step)
        return len(batch) == 2
    return isinstance(batch, (tuple, list)) and len(batch) == 2 and not hasattr(batch, "_fields")


def call_model(model: nn.Module, batch: Any) -> Any:
    """The model applied to a whole batch: **Mapping, *list/tuple, or the batch itself."""
    if type(batch) is dict or isinstance(batch, collections.abc.Mapping):  # a plain dict skips the ABC check
        return model(**batch)
    if isinstance(batch, (list, tuple)) and not hasattr(batch, "_fields"):
        return model(*batch)
    return model(batch)


class LossRule:
    """Turns (model, batch) into (loss, outputs) by the rule in the module docstring."""

    def __init__(self, loss_fn: Callable | None = None, compute_loss: Callable | None = None):
        if loss_fn is not None and not callable(loss_fn):
            raise DataError(f"loss_fn must be callable (outputs, targets) -> loss, got {type(loss_fn).__name__}")
        if compute_loss is not None and not callable(compute_loss):
            raise DataError(f"compute_loss must be callable (model, batch) -> loss, got {type(compute_loss).__name__}")
        self.loss_fn = loss_fn
        self.compute_loss = compute_loss

    @property
    def how(self) -> str:
        """One line for the run log."""
        if self.compute_loss is not None:
            return f"compute_loss={getattr(self.compute_loss, '__name__', type(self.compute_loss).__name__)}"
        if self.loss_fn is not None:
            return f"loss_fn(model(inputs), targets) with {getattr(self.loss_fn, '__name__', type(self.loss_fn).__name__)}"
        return "the model's own loss (model(**batch).loss)"

    def __call__(self, model: nn.Module, batch: Any) -> tuple[torch.Tensor, Any]:
        if self.compute_loss is not None:
            result = self.compute_loss(model, batch)
            if isinstance(result, tuple) and len(result) == 2 and isinstance(result[0], torch.Tensor):
                return result[0], result[1]
            if isinstance(result, torch.Tensor):
                return result, None
            raise DataError(f"compute_loss returned {type(result).__name__}: return the loss tensor or (loss, outputs)")
        if self.loss_fn is not None:
            if not is_pair(batch):
                raise DataError(f"loss_fn is set, so each batch must be a pair (inputs, targets), but got "
                                f"{describe(batch)}. {THE_THREE_WAYS}")
            inputs, targets = batch
            outputs = model(inputs)
            return self.loss_fn(outputs, targets), outputs
        outputs = call_model(model, batch)
        loss = loss_of(outputs)
        if loss is None:
            raise DataError(f"the model returned {type(outputs).__name__} with no scalar loss for a batch of "
                            f"{describe(batch)}. {THE_THREE_WAYS}")
        return loss, outputs

    def targets(self, batch: Any) -> Any:
        """What metrics compare the outputs with: the pair's targets or batch['labels'] (else None)."""
        if is_pair(batch):
            return batch[1]
        if isinstance(batch, collections.abc.Mapping):
            return batch.get("labels")
        return None
