"""Counting the tokens a language-model loss averages over, for `fit(num_items=...)`.

A step's gradient is the mean over its items when `num_items` counts them (train/step/train_step.py), so the
count must be exactly the positions the model's loss averages over. For a causal language model
that shifts the labels itself (Hugging Face `*ForCausalLM`: position t predicts label t+1), the
first label of each row is never predicted: `(labels != -100).sum()` counts one token per row too
many, and micro-batches (accumulation, OOM splits) are then weighted wrongly. `shift=True` drops it.
"""

from __future__ import annotations

import collections.abc
from typing import Any

import torch

from gputrain.errors import DataError


def count_tokens(batch: Any, *, shift: bool = False, key: str = "labels", ignore_index: int = -100) -> torch.Tensor:
    """The number of target tokens in `batch` a token-mean loss averages over (a device tensor: no sync).

    batch: a dict with `key` (default "labels"), or a pair (inputs, labels). shift=True for a causal
    LM whose model shifts the labels inside (Hugging Face `*ForCausalLM`): the first position of each
    row is not a target. Positions equal to `ignore_index` (padding, prompts) are not counted.
    Use it as `fit(..., num_items=lambda b: gputrain.count_tokens(b, shift=True))`.
    """
    if isinstance(batch, collections.abc.Mapping):
        if key not in batch:
            raise DataError(f"count_tokens: the batch has no {key!r} (keys: {', '.join(map(str, batch.keys()))}); "
                            "pass key= for the labels' name")
        labels = batch[key]
    elif isinstance(batch, (tuple, list)) and len(batch) == 2:
        labels = batch[1]
    else:
        raise DataError(f"count_tokens needs a dict batch with {key!r} or a pair (inputs, labels), got "
                        f"{type(batch).__name__}")
    if not isinstance(labels, torch.Tensor):
        raise DataError(f"count_tokens: the labels are a {type(labels).__name__}, not a tensor")
    if shift:
        labels = labels[..., 1:]
    return (labels != ignore_index).sum()
