"""How a batch becomes a loss: one rule, in a documented order.

1. `compute_loss(model, batch)` given: it returns the loss, or `(loss, outputs)` so that metrics can
   see the outputs.
2. A pair `(inputs, targets)` and a `loss_fn`: `loss_fn(model(inputs), targets)`.
3. Otherwise the model is called with the batch (`model(**batch)` for a Mapping, `model(*batch)` for
   a list or tuple, `model(batch)` else) and returns its own loss: a scalar tensor, an object with
   `.loss` (a Hugging Face `ModelOutput`), a Mapping with `"loss"`, or a tuple with one scalar
   tensor (nanoGPT's `(logits, loss)`).

`LossRule.__call__` returns `(loss, outputs)`; `targets(batch)` gives what a metric compares the
outputs with (the pair's second element, or `batch["labels"]`). `how` names the call it made (known
after its first call for the model's own loss, which depends on the batch's type).
"""

from __future__ import annotations

import collections.abc
from typing import Any, Callable

import torch
from torch import nn

from gputrain.batch import describe
from gputrain.outputs import describe_outputs, loss_of, scalar_positions, where_loss
from gputrain.errors import DataError


THE_THREE_WAYS = (
    "gputrain turns a batch into a loss in one of three ways: pass compute_loss=fn(model, batch) "
    "returning the loss (or (loss, outputs)); or give batches as pairs (inputs, targets) with "
    "loss_fn=...; or let the model compute its own loss from the batch (model(**batch) for a dict) "
    "and return a scalar tensor, an object with .loss, a dict with 'loss', or a tuple with one scalar tensor"
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


def describe_call(batch: Any) -> str:
    """The call `call_model` makes for `batch`: "model(**batch) with input_ids, labels", "model(*batch)
    with 2 elements", "model(batch)"."""
    if isinstance(batch, collections.abc.Mapping):
        return f"model(**batch) with {', '.join(map(str, batch.keys()))}"
    if isinstance(batch, (list, tuple)) and not hasattr(batch, "_fields"):
        return f"model(*batch) with {len(batch)} element{'s' if len(batch) != 1 else ''}"
    return f"model(batch) with {type(batch).__name__}"


def _name(fn: Any) -> str:
    return getattr(fn, "__name__", type(fn).__name__)


class LossRule:
    """Turns (model, batch) into (loss, outputs) by the rule in the module docstring."""

    def __init__(self, loss_fn: Callable | None = None, compute_loss: Callable | None = None,
                 step_fn: Callable | None = None):
        if loss_fn is not None and not callable(loss_fn):
            raise DataError(f"loss_fn must be callable (outputs, targets) -> loss, got {type(loss_fn).__name__}")
        if compute_loss is not None and not callable(compute_loss):
            raise DataError(f"compute_loss must be callable (model, batch) -> loss, got {type(compute_loss).__name__}")
        if step_fn is not None and not callable(step_fn):
            raise DataError(f"step_fn must be a function fn(step, batch) that calls step.backward(loss) and "
                            f"step.step(), got {type(step_fn).__name__} {step_fn!r}: pass the function itself")
        self.loss_fn = loss_fn
        self.compute_loss = compute_loss
        self.step_fn = step_fn  # a step of your own (train/step/own_step.py): training does not use this rule
        self.made: str | None = None  # the model's own loss: the call made and where its loss was, once known

    @property
    def how(self) -> str:
        """One line for the run log and the summary: the call this rule makes."""
        if self.step_fn is not None:
            evaluated = (f"; evaluation by compute_loss={_name(self.compute_loss)}" if self.compute_loss is not None
                         else f"; evaluation by loss_fn {_name(self.loss_fn)}" if self.loss_fn is not None else "")
            return f"step_fn={_name(self.step_fn)}: your own step (its backward and optimizer steps){evaluated}"
        if self.compute_loss is not None:
            return f"compute_loss={_name(self.compute_loss)}"
        if self.loss_fn is not None:
            return f"loss_fn(model(x), y) with {_name(self.loss_fn)}"
        if self.made is not None:
            return self.made
        return "the model's own loss: model(**batch), model(*batch) or model(batch) by the batch's type"

    def _first_call(self, batch: Any, outputs: Any) -> None:
        self.made = f"the model's own loss: {describe_call(batch)}, the loss: {where_loss(outputs)}"

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
            raise DataError(f"{describe_call(batch)} returned {describe_outputs(outputs)}: {_no_loss(outputs)} "
                            f"(the batch: {describe(batch)}). {THE_THREE_WAYS}")
        if self.made is None:  # once: what the run log and the summary name
            self._first_call(batch, outputs)
        return loss, outputs

    def targets(self, batch: Any) -> Any:
        """What metrics compare the outputs with: the pair's targets or batch['labels'] (else None)."""
        if is_pair(batch):
            return batch[1]
        if isinstance(batch, collections.abc.Mapping):
            return batch.get("labels")
        return None


def _no_loss(outputs: Any) -> str:
    """Why `loss_of` found no loss in `outputs`."""
    if isinstance(outputs, (tuple, list)) and not hasattr(outputs, "loss"):
        scalars = scalar_positions(outputs)
        if len(scalars) > 1:
            return (f"elements {', '.join(f'[{i}]' for i in scalars)} are all scalar tensors, so which is the "
                    "loss is unknown: return it alone, or pass compute_loss")
        return "no element is a scalar (0-dim) floating-point tensor, the loss"
    if isinstance(outputs, torch.Tensor):
        return f"a tensor with {outputs.dim()} dims, not a scalar loss (reduce it, e.g. with .mean())"
    return "it has no scalar loss (.loss or ['loss'])"
