"""One optimizer step's micro-batches: how they are cut, how much each weighs, when gradients sync,
and the out-of-memory recovery that cuts them finer. Written once for the built-in step and your own.

A step's gradient is the mean over all of its samples however its micro-batches are cut: each
piece's loss is weighted by its share of the step's samples (host ints: no sync), or of its items
with `num_items` (device counts, summed over the processes when there are several). Gradients sync
(DDP's all-reduce, FSDP's reduce-scatter) on the last piece only. After an out-of-memory error every
micro-batch is cut in two (every leaf that carries the batch dimension) and the same step runs again:
the same effective batch, `splits` pieces a micro-batch from then on (saved in the checkpoints).
"""

from __future__ import annotations

import contextlib
import logging
import math
from typing import Any, Callable, Sequence

import torch
from torch import nn

from gputrain import batch as batches
from gputrain.errors import GputrainError
from gputrain.runtime import distributed
from gputrain.runtime.oom import free_after_oom, is_oom

log = logging.getLogger("gputrain")


class MicroBatches:
    """The pieces of a step and their weights (see the module docstring).

    model: what no_sync acts on (DDP/FSDP-wrapped or plain); num_items: optional `batch -> count`;
    oom_recovery: cut the micro-batches finer after an out-of-memory error (else it propagates).
    """

    def __init__(self, model: nn.Module, device: torch.device, *, num_items: Callable[[Any], Any] | None = None,
                 dist: distributed.DistInfo | None = None, oom_recovery: bool = True):
        self.model, self.device, self.num_items, self.dist = model, device, num_items, dist
        self.oom_recovery = oom_recovery
        self.splits = 1  # each micro-batch is cut into this many pieces after OOM recovery (1 = none)

    def whole(self, micro_batches: Sequence[Any]) -> bool:
        """The step in one piece of weight 1 (the common case: no weights, no sync context)."""
        return self.splits == 1 and len(micro_batches) == 1 and self.num_items is None

    def plan(self, micro_batches: Sequence[Any]) -> list[tuple[Any, Any, bool]]:
        """(piece, weight, is_last) for every piece of the step, in order; run each piece before the
        last inside `held_back()`, so that only the last one syncs its gradients."""
        pieces = micro_batches if self.splits == 1 else [p for mb in micro_batches for p in batches.split(mb, self.splits)]
        if not pieces:
            raise GputrainError("a training step needs at least one micro-batch; got none")
        last = len(pieces) - 1
        return [(piece, weight, i == last) for i, (piece, weight) in enumerate(zip(pieces, self.weights(pieces)))]

    def held_back(self, hold: bool = True) -> contextlib.AbstractContextManager:
        """The context of a piece whose gradients stay local (DDP/FSDP's no_sync); a no-op with one process."""
        return distributed.no_sync(self.model, sync=not hold)

    def weights(self, pieces: Sequence[Any]) -> list[Any]:
        """Each piece's share of the step: samples (host floats, no sync) or items (device tensors)."""
        if self.num_items is None:
            if len(pieces) == 1:
                return [1.0]  # the whole step: no batch size to read
            counts = [batches.batch_size(p) for p in pieces]
            total = sum(counts)
            return [c / total for c in counts]
        counts = [torch.as_tensor(self.num_items(p), device=self.device, dtype=torch.float32) for p in pieces]
        total = torch.stack(counts).sum()
        if self.dist is not None and self.dist.world_size > 1:
            # DDP averages gradients over ranks; scale so the result is the mean over all ranks' items.
            total = distributed.all_reduce_sum(total, self.dist) / self.dist.world_size
        return [c / total.clamp_min(1.0) for c in counts]

    def run(self, body: Callable[[Sequence[Any]], None], micro_batches: Sequence[Any],
            clear_grads: Callable[[], None]) -> None:
        """`body(micro_batches)`, run again with every micro-batch cut in two after an out-of-memory
        error (the failed attempt's gradients cleared), until it fits or a piece would hold no sample."""
        while True:
            try:
                body(micro_batches)
                return
            except Exception as exc:  # only OOM is handled; everything else propagates
                if not (self.oom_recovery and is_oom(exc)):
                    raise
                del exc
                self._halve(micro_batches, clear_grads)

    def _halve(self, micro_batches: Sequence[Any], clear_grads: Callable[[], None]) -> None:
        smallest = min(batches.batch_size(b) for b in micro_batches)
        if self.splits * 2 > smallest:
            raise GputrainError(
                f"out of memory on {self.device} even with micro-batches of {math.ceil(smallest / self.splits)} "
                "sample(s): use a smaller model, bf16, recompute (--recompute), or a device "
                "with more memory") from None
        clear_grads()
        free_after_oom(self.device)
        self.splits *= 2
        log.warning("out of memory: each micro-batch is now cut in %d (%d samples or fewer each), same effective "
                    "batch; retrying the same step", self.splits, math.ceil(smallest / self.splits))
