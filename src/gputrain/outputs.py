"""What a model returned, whatever its shape: its loss and what metrics should see (its logits).

Models return a tensor, an object with `.loss` / `.logits` (a Hugging Face `ModelOutput`), or a
Mapping with "loss" / "logits". Training (train/loss.py), evaluation, inference and export read
outputs through these two functions.
"""

from __future__ import annotations

import collections.abc
from typing import Any

import torch


def loss_of(outputs: Any) -> torch.Tensor | None:
    """The loss a model returned: a scalar tensor, `.loss`, or `["loss"]`; None when there is none."""
    if isinstance(outputs, torch.Tensor):
        return outputs if outputs.dim() == 0 else None
    if isinstance(outputs, collections.abc.Mapping):
        value = outputs.get("loss")
    else:
        value = getattr(outputs, "loss", None)
    return value if isinstance(value, torch.Tensor) and value.dim() == 0 else None


def logits_of(outputs: Any) -> Any:
    """What a metric should see of the outputs: `.logits` / `["logits"]` where there are some."""
    if isinstance(outputs, torch.Tensor):
        return outputs
    if isinstance(outputs, collections.abc.Mapping):
        return outputs.get("logits", outputs)
    return getattr(outputs, "logits", outputs)
