"""The conformance zoo: public models and their authors' own training steps, as data.

Each module holds one case: the model as its authors wrote it (our own copy, its origin in a comment),
the author's hand loop over a list of batches, and how the same code is handed to `gputrain.fit`
(`loss_fn`, `compute_loss` or `step_fn`, and the author's optimizer). tests/test_zoo.py runs each
through fit with default settings beside the hand loop on the same batches and compares. A case that
had to change the model's code to pass would be a failing case: the models here are as published.
A `Refusal` is a published model that fit cannot train faithfully as written (parameters in a Python
list, which no checkpoint would hold): fit must refuse it at the start in one line, writing nothing.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

from torch import nn


@dataclass
class Case:
    """make(): the model, as the author builds it (their own eval() calls included);
    batches(): the batches both runs see; hand(model, batches, amp): the author's loop, its forward
    inside `amp()` (the AMP recipe's autocast; a no-op in fp32); fit(model): fit's keyword arguments
    (the author's loss or step, the author's optimizer); config: TrainConfig fields that state what the
    author's loop does itself (e.g. its gradient clipping)."""

    name: str
    make: Callable[[], nn.Module]
    batches: Callable[[], list]
    hand: Callable[[nn.Module, list, Callable], None]
    fit: Callable[[nn.Module], dict[str, Any]]
    config: dict[str, Any] = field(default_factory=dict)


@dataclass
class Refusal:
    """A public model that fit must refuse at the start, as its authors wrote it: make() and batches() as
    in Case, fit(model): fit's keyword arguments as a user would give them, says: a regular expression
    that the one-line refusal matches (what is wrong and what to do)."""

    name: str
    make: Callable[[], nn.Module]
    batches: Callable[[], list]
    fit: Callable[[nn.Module], dict[str, Any]]
    says: str


def refusals() -> list[Refusal]:
    from zoo import mnist_forward_forward

    return [mnist_forward_forward.CASE]


def cases() -> list[Case]:
    from zoo import (blitz_cnn, dcgan, distill_teacher, frozen_bn_backbone, hf_bert, hf_gpt2, mnist, mnist_rnn_steplr,
                     nanogpt_block, plateau, rnn_hidden, reads_training, time_sequence_lbfgs, updates_buffer, vae,
                     wgan_gp, word_language_model)

    modules = (blitz_cnn, mnist, dcgan, vae, word_language_model, nanogpt_block, wgan_gp, frozen_bn_backbone,
               distill_teacher, reads_training, updates_buffer, rnn_hidden, hf_bert, hf_gpt2, time_sequence_lbfgs,
               mnist_rnn_steplr, plateau)
    return [m.CASE for m in modules]
