"""The built-in training step: `TrainStep.run` does one optimizer step on its micro-batches.

In order (the step contract of the design notes):
1. for each piece (train/step/micro.py: the micro-batches, cut finer after an out-of-memory error):
   forward under the run's precision, the loss (`LossRule`), backward of `loss * weight`, where
   weight is the piece's share of the step's samples (or items, with `num_items`); gradients sync
   (DDP/FSDP) on the last piece only;
2. unscale (fp16) and clip, the non-finite flag (on_nan="skip", train/step/nonfinite.py), the
   optimizer's step (through the scaler in fp16), zero_grad, then the device-only updates it was
   given (`after_step`: an EMA of the weights, say);
3. the detached loss, weighted the same way, into the device accumulators (train/step/totals.py);
   nothing is read on the host: the loop reads the sums at log points and before checkpoints
   (`read_totals`, the step's one host read).

The precision is one contract (runtime/precision.py's `RunPrecision`: forward, backward,
unscale_and_clip, step): no branch on the dtype here. A closure optimizer (LBFGS's `step(closure)`)
is one more way to call the optimizer's step: the closure clears the gradients and runs step 1
(and the clipping) again each time the optimizer evaluates it, and the loss of its first
evaluation is the step's, as the optimizer returns it.

`run(micro_batches)` is that body and nothing else: the CUDA-graph wrapper (train/step/graphs.py)
captures exactly it, so eager and graphed steps cannot drift apart. Its phases are marked on
`self.clock`: a no-op (`NO_CLOCK`) unless `gputrain profile` lends a timing one. `__call__` adds what
cannot be captured: the out-of-memory recovery.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import torch
from torch import nn

from gputrain.batch import needs_closure
from gputrain.runtime import distributed
from gputrain.runtime.precision import RunPrecision
from gputrain.runtime.timing import NO_CLOCK, PhaseClock
from gputrain.train.optim.calls import grad_clearer, optimizer_stepper
from gputrain.train.step.loss import LossRule
from gputrain.train.step.micro import MicroBatches
from gputrain.train.step.nonfinite import NonFiniteFlag
from gputrain.train.step.totals import StepTotals, TotalsRead


class TrainStep:
    """One optimizer step over a list of micro-batches (see the module docstring).

    model: the module to call (possibly DDP/FSDP-wrapped or compiled); params: what to clip.
    num_items: optional `batch -> count` (a tensor or int): the loss is averaged over those items
        (non-padding tokens, say) instead of samples; the model's loss must then be a mean over the
        micro-batch's items. skip_nonfinite: on_nan="skip" (train/step/nonfinite.py).
    loss_list: keep eager steps' losses in a list (True) or add each to the sum in place (False);
        None: by the device (train/step/totals.py).
    """

    def __init__(self, model: nn.Module, loss: LossRule, optimizer: torch.optim.Optimizer,
                 precision: RunPrecision, *, device: torch.device, max_grad_norm: float | None = None,
                 num_items: Callable[[Any], Any] | None = None, dist: distributed.DistInfo | None = None,
                 oom_recovery: bool = True, params: Sequence[nn.Parameter] | None = None,
                 skip_nonfinite: bool = False, after_step: Sequence[Callable[[], None]] = (),
                 loss_list: bool | None = None):
        self.model, self.loss, self.optimizer, self.precision = model, loss, optimizer, precision
        self.optimizers = [optimizer]
        self.params = list(params if params is not None else model.parameters())
        self.max_grad_norm, self.dist = max_grad_norm, dist
        # Device-only updates run after the optimizer step: part of the body, so a CUDA graph captures them.
        self.after_step = tuple(after_step)
        self.micro = MicroBatches(model, device, num_items=num_items, dist=dist, oom_recovery=oom_recovery)
        self.totals = StepTotals(device, self.params, self.optimizers, counted=skip_nonfinite, loss_list=loss_list)
        self.flag = NonFiniteFlag(precision, optimizer, self.params, self.totals.nonfinite, device) \
            if skip_nonfinite else None
        self.closure = needs_closure(optimizer)  # LBFGS: step(closure)
        self.clock: PhaseClock = NO_CLOCK  # marks forward, backward, optimizer (profile's breakdown)
        self._foreach = device.type == "cuda" or None  # the norms' foreach kernels (CUDA; None: torch's choice)
        self._step_optimizer = optimizer_stepper(optimizer)  # without torch's per-call profiler range
        self._zero_grad = grad_clearer(optimizer)

    def run(self, micro_batches: Sequence[Any]) -> None:
        """Forward, backward, clip, optimizer step, zero_grad; the loss into the device accumulators."""
        if self.closure:  # torch's stub types the closure's loss as a float; LBFGS takes the tensor (float() of it)
            step_loss = self.precision.step(self.optimizer, lambda: self.optimizer.step(
                lambda: self._evaluate(micro_batches)))  # pyright: ignore[reportCallIssue, reportArgumentType]
        else:
            step_loss = self.gradients(micro_batches)
            norm = self.precision.unscale_and_clip(self.optimizer, self.params, self.max_grad_norm, self._foreach)
            if self.flag is not None:
                step_loss = self.flag.check(step_loss, norm)
            self.precision.step(self.optimizer, self._step_optimizer)
        self._zero_grad()
        for update in self.after_step:
            update()
        self.totals.keep(step_loss)
        self.clock.mark("optimizer")

    def gradients(self, micro_batches: Sequence[Any]) -> torch.Tensor:
        """Forward, loss and backward of every piece, weighted by its share; the step's detached loss
        (in the loss's dtype for a step in one piece, else fp32)."""
        if self.micro.whole(micro_batches):  # weight 1, no gradient-sync context: no extra op
            loss, _ = self.precision.forward(self.loss, self.model, micro_batches[0])
            self.clock.mark("forward")
            self.precision.backward(loss)
            self.clock.mark("backward")
            return loss.detach()
        step_loss = None
        for piece, weight, last in self.micro.plan(micro_batches):
            with self.micro.held_back(not last):
                loss, _ = self.precision.forward(self.loss, self.model, piece)
                self.clock.mark("forward")
                self.precision.backward(loss * weight)
                self.clock.mark("backward")
            term = loss.detach() * weight
            term = term if term.dtype == torch.float32 else term.float()
            step_loss = term if step_loss is None else step_loss + term
        assert step_loss is not None  # plan() refuses a step without pieces
        return step_loss

    def _evaluate(self, micro_batches: Sequence[Any]) -> torch.Tensor:
        """A closure optimizer's evaluation: the gradients from scratch, clipped; the loss."""
        self._zero_grad()
        step_loss = self.gradients(micro_batches)
        self.precision.unscale_and_clip(self.optimizer, self.params, self.max_grad_norm, self._foreach)
        return step_loss

    def __call__(self, micro_batches: Sequence[Any]) -> None:
        """The eager step: `run`, cut finer after an out-of-memory error (train/step/micro.py)."""
        self.micro.run(self.run, micro_batches, self.zero_grad)
        self.totals.after_eager_step()

    def zero_grad(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)

    def capture_blocker(self) -> str | None:
        """Why a CUDA graph must not capture this step (its optimizer reads the host while it steps)."""
        if self.closure:
            return (f"{type(self.optimizer).__name__}.step(closure) evaluates the loss on the host while it steps, "
                    "which a captured graph cannot")
        return None

    def read_totals(self) -> TotalsRead:
        return read_totals(self.totals, self.dist)


def read_totals(totals: StepTotals, dist: distributed.DistInfo | None) -> TotalsRead:
    """The step's one host read: the totals since the last read (all ranks' mean: collective with
    several processes), judged (train/step/totals.py); resets the sums."""
    taken = totals.take()
    if dist is not None:
        taken = distributed.all_reduce_mean(taken, dist)
    return totals.judge(taken.tolist(), dist)
