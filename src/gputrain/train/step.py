"""The training step, written once: `TrainStep` runs one optimizer step on its micro-batches.

In order (the step contract of the design notes):
1. for each micro-batch: forward under the run's precision, the loss (`LossRule`), backward of
   `loss * weight`, where weight is the micro-batch's share of the step's samples (or of its items,
   with `num_items`), so that the step's gradient is the mean over all of its samples however the
   micro-batches are cut; gradient sync (DDP/FSDP) only on the last micro-batch;
2. clip (after unscaling, fp16), optimizer step through the scaler, scaler update, zero_grad;
3. the detached loss, weighted the same way, is added to a device accumulator, and a device flag
   counts steps whose loss or gradient norm was not finite. Nothing is read on the host: the
   trainer reads both at log points.

`run(micro_batches)` is that body and nothing else: the CUDA-graph wrapper (train/graphs.py)
captures exactly it, so eager and graphed steps cannot drift apart. `__call__` adds what cannot be
captured: OOM recovery, which splits every micro-batch in two (every leaf carrying the batch
dimension) and retries the same step with the same effective batch.
"""

from __future__ import annotations

import logging
import math
from typing import Any, Callable, Sequence, cast

import torch
from torch import nn

from gputrain import batch as batches
from gputrain.errors import GputrainError
from gputrain.runtime import distributed
from gputrain.runtime.oom import free_after_oom, is_oom
from gputrain.runtime.precision import RunPrecision
from gputrain.train.loss import LossRule

log = logging.getLogger("gputrain")


class TrainStep:
    """One optimizer step over a list of micro-batches (see the module docstring).

    model: the module to call (possibly DDP/FSDP-wrapped or compiled); params: what to clip.
    num_items: optional `batch -> count` (a tensor or int): the loss is averaged over those items
        (non-padding tokens, say) instead of samples; the model's loss must then be a mean over the
        micro-batch's items.
    world_size: processes whose gradients DDP averages; with num_items the global item count is
        summed across them on the device.
    """

    def __init__(self, model: nn.Module, loss: LossRule, optimizer: torch.optim.Optimizer,
                 precision: RunPrecision, *, device: torch.device, max_grad_norm: float | None = None,
                 num_items: Callable[[Any], Any] | None = None, dist: distributed.DistInfo | None = None,
                 oom_recovery: bool = True, params: Sequence[nn.Parameter] | None = None,
                 skip_nonfinite: bool = False):
        self.model = model
        self.loss = loss
        self.optimizer = optimizer
        self.precision = precision
        self.device = device
        self.max_grad_norm = max_grad_norm
        self.num_items = num_items
        self.dist = dist
        self.oom_recovery = oom_recovery
        self.params = list(params if params is not None else model.parameters())
        # on_nan="skip": a step whose loss or gradient norm is not finite leaves parameters and
        # optimizer state as they were, decided on the device (fused optimizers read `found_inf` in
        # their kernel, as GradScaler uses it), so it works inside a captured graph too.
        self.skip_nonfinite = skip_nonfinite and not precision.precision.use_scaler  # fp16: the scaler skips
        # Device accumulators whose storage never changes (a captured graph writes to their address).
        self.loss_sum = torch.zeros((), device=device, dtype=torch.float32)  # sum of step losses since read
        self.nonfinite = torch.zeros((), device=device, dtype=torch.float32)  # steps with a non-finite loss/grad
        self.splits = 1  # each micro-batch is cut into this many pieces after OOM recovery (1 = none)

    # ------------------------------------------------------------ the body (captured as is)

    def _weights(self, pieces: list[Any]) -> list[Any]:
        """Each piece's share of the step: samples (host ints, no sync) or items (device tensors)."""
        if self.num_items is None:
            counts = [batches.batch_size(p) for p in pieces]
            total = sum(counts)
            return [c / total for c in counts]
        counts = [torch.as_tensor(self.num_items(p), device=self.device, dtype=torch.float32) for p in pieces]
        total = torch.stack(counts).sum()
        if self.dist is not None and self.dist.world_size > 1:
            # DDP averages gradients over ranks; scale so the result is the mean over all ranks' items.
            total = distributed.all_reduce_sum(total, self.dist) / self.dist.world_size
        return [c / total.clamp_min(1.0) for c in counts]

    def run(self, micro_batches: Sequence[Any], clock=None) -> None:
        """Forward, backward, clip, optimizer step, zero_grad; losses into the device accumulators.

        clock: an optional phase clock (`mark("forward" | "backward" | "optimizer")`) with which
        `gputrain profile` splits an eager step into phases; the trainer and the graphs pass none.
        """
        pieces = [p for mb in micro_batches for p in (batches.split(mb, self.splits) if self.splits > 1 else [mb])]
        weights = self._weights(pieces)
        last = len(pieces) - 1
        step_loss = None
        for i, (piece, weight) in enumerate(zip(pieces, weights)):
            with distributed.no_sync(self.model, sync=(i == last)):
                with self.precision.autocast():
                    loss, _ = self.loss(self.model, piece)
                if clock is not None:
                    clock.mark("forward")
                # A whole step in one piece has weight 1.0 (a host float): no multiply kernel.
                whole = isinstance(weight, float) and weight == 1.0
                self.precision.backward(loss if whole else loss * weight)
                if clock is not None:
                    clock.mark("backward")
            term = loss.detach().float()  # .float(): no kernel when the loss is already fp32
            term = term if whole else term * weight
            step_loss = term if step_loss is None else step_loss + term
        if step_loss is None:
            raise GputrainError("a training step needs at least one micro-batch; got none")
        norm = None
        if self.max_grad_norm is not None:
            self.precision.unscale_(self.optimizer)
            norm = nn.utils.clip_grad_norm_(self.params, self.max_grad_norm, foreach=self.device.type == "cuda" or None)
        elif not self.precision.precision.use_scaler:  # fp16: the scaler checks (and skips) itself
            # A finite loss can still give non-finite gradients (an inf input through a saturated
            # tanh: 0 x inf in backward). One norm over the gradients, on the device, no host read.
            grads = [p.grad for p in self.params if p.grad is not None]
            if grads:
                norm = nn.utils.get_total_norm(grads, foreach=self.device.type == "cuda" or None)
        # Non-finite loss or norm, in three small kernels (isfinite alone is four: ==, abs, !=, *):
        # the sum is finite when both are (norm >= 0; a sum past fp32's max, ~3e38, counts as
        # non-finite), and x - x is NaN exactly when x is inf or NaN.
        probe = step_loss if norm is None else step_loss + _local(norm)
        bad = (probe - probe).ne(0)  # bool, shape ()
        if self.skip_nonfinite:
            # Attributes Optimizer does not declare: torch's fused kernels read them with getattr, as
            # GradScaler sets them.
            setattr(self.optimizer, "grad_scale", None)
            setattr(self.optimizer, "found_inf", bad.float())
            step_loss = step_loss.masked_fill(bad, 0.0)  # keep the mean finite
        self.precision.step(self.optimizer)
        self.optimizer.zero_grad(set_to_none=True)
        self.loss_sum.add_(step_loss)
        self.nonfinite.add_(bad)  # float += bool: 1.0 per non-finite step
        if clock is not None:
            clock.mark("optimizer")

    # ------------------------------------------------------------ eager entry: OOM recovery

    def __call__(self, micro_batches: Sequence[Any]) -> None:
        while True:
            try:
                self.run(micro_batches)
                return
            except Exception as exc:  # only OOM is handled; everything else propagates
                if not (self.oom_recovery and is_oom(exc)):
                    raise
                del exc
                self._halve(micro_batches)

    def _halve(self, micro_batches: Sequence[Any]) -> None:
        smallest = min(batches.batch_size(b) for b in micro_batches)
        if self.splits * 2 > smallest:
            raise GputrainError(
                f"out of memory on {self.device} even with micro-batches of {math.ceil(smallest / self.splits)} "
                "sample(s): use a smaller model, bf16, activation checkpointing (--checkpointing), or a device "
                "with more memory") from None
        self.optimizer.zero_grad(set_to_none=True)
        free_after_oom(self.device)
        self.splits *= 2
        log.warning("out of memory: each micro-batch is now cut in %d (%d samples or fewer each), same effective "
                    "batch; retrying the same step", self.splits, math.ceil(smallest / self.splits))

    # ------------------------------------------------------------ reading the accumulators

    def take_totals(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(loss sum, non-finite step count) since the last call, as device tensors; resets both."""
        totals = torch.stack([self.loss_sum, self.nonfinite])  # a copy: the accumulators keep their storage
        self.loss_sum.zero_()
        self.nonfinite.zero_()
        return totals[0], totals[1]


def _local(t: torch.Tensor) -> torch.Tensor:
    """A plain tensor from a norm over sharded (FSDP2 DTensor) gradients: the full value, on every rank."""
    full = getattr(t, "full_tensor", None)
    return cast(torch.Tensor, full()) if callable(full) else t  # DTensor.full_tensor() -> Tensor
