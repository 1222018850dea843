"""Precision decided from the model's own first step, like the layout (train/step/layout.py).

fit's automatic precision on a CUDA GPU is bf16 autocast (fp16 with loss scaling on older GPUs).
torch's CUDA autocast refuses some ops outright (`F.binary_cross_entropy` / `nn.BCELoss`: "unsafe to
autocast", as in pytorch/examples' DCGAN and VAE), and some code fails only with autocast's dtypes
(an in-place write of a bf16 result into an fp32 tensor). When the precision was chosen automatically
(precision="auto") and autocast is on, `PrecisionGate` wraps the run's step. If the first step raises
an error that autocast caused (torch's own "unsafe to autocast", or an error that the same batch does
not raise with autocast off: forward, loss and backward once more on a copy of the model, from the
same RNG state, as the layout probe runs them), the run trains in fp32 instead (no autocast, no loss
scaling, TF32 off as for fp32): one log line, and the precision decision's reason names the error and
the `file:line` of the user's code. The failed attempt leaves nothing behind: the buffers (BatchNorm's
statistics, copied once before the first step) and the RNG state are put back, its gradients
cleared. Everything that follows from the precision sees the change: the run's
`RunPrecision` changes in place (the evaluator and the checkpoint's scaler part hold it), the step
takes its autocast and scaler again (`TrainStep.follow_precision`), graphs captured so far (none yet
at the first step) are dropped, and the layout is probed again under fp32. The step then runs again
on the same batches from the RNG state it started from, so the run is the one fp32 would have given.

Not changed: a precision the user asked for (the error stays, and the note after it names the
autocast and `precision="fp32"` first: data/checks.py), an out-of-memory error, an error that fp32
raises too, a step of your own that had already called `step.step(name)` before the error (its
optimizer has moved the weights), and fp16 with on_nan="skip" and an optimizer that is not fused
(without the scaler, skipping needs a fused optimizer: train/loop/guards.py). Python state that the
user's forward or compute_loss keeps between calls sees the failed call. The CPU's automatic
precision is fp32: no gate, nothing to pay.
"""

from __future__ import annotations

import copy
import logging
from typing import Any, Callable, Sequence

import torch
from torch import nn

from gputrain.data.deferred import materialize
from gputrain.errors import ConfigError
from gputrain.runtime.oom import is_oom
from gputrain.runtime.precision import AUTOCAST_REFUSED, RunPrecision, fp32_instead
from gputrain.runtime.speed import SpeedSwitches
from gputrain.train.step.train_step import skips_nonfinite
from gputrain.train.step.layout import probe_pass, refusal, run_optimizers
from gputrain.train.step.loss import LossRule

log = logging.getLogger("gputrain")

class PrecisionGate:
    """The run's step with an automatic autocast undone when the first step shows that autocast
    breaks the model's code (see the module docstring). Calls `step_fn(micro_batches)`."""

    def __init__(self, step_fn: Callable[[list], Any], *, precision: RunPrecision, module: nn.Module, loss: LossRule,
                 speed: SpeedSwitches, train_step: Any, optimizers: Sequence[torch.optim.Optimizer],
                 graphed: Any = None, own_step: Callable | None = None,
                 own_context: tuple[dict[str, Any], dict[str, Any]] = ({}, {})):
        self.step_fn, self.precision, self.module, self.loss = step_fn, precision, module, loss
        self.speed, self.train_step, self.optimizers, self.graphed = speed, train_step, list(optimizers), graphed
        self.own_step, self.own_context = own_step, own_context
        self.device = precision.device
        self.decided = False

    def __call__(self, micro_batches: list) -> Any:
        if self.decided:
            return self.step_fn(micro_batches)
        self.decided = True
        layout_probe = self.speed.layout_probe  # the layout gate probes on this first step
        rng = torch.get_rng_state()
        cuda_rng = torch.cuda.get_rng_state_all() if self.device.type == "cuda" else []
        # The buffers as they were: a forward that fails late has already updated BatchNorm's statistics.
        buffers = [(b, b.detach().clone()) for b in self.module.buffers()]
        try:
            return self.step_fn(micro_batches)
        except Exception as exc:
            why = self._autocast_caused(exc, micro_batches[0], rng, cuda_rng)
            if why is None:
                raise
        self.fall_back(why)
        with torch.no_grad():
            for b, saved in buffers:
                b.copy_(saved)
        torch.set_rng_state(rng)  # the step again as fp32 would have run it: the same random draws
        if cuda_rng:
            torch.cuda.set_rng_state_all(cuda_rng)
        self.speed.layout_probe = layout_probe  # its probe ran under autocast: again under fp32
        return self.step_fn(micro_batches)

    def _autocast_caused(self, exc: Exception, batch: Any, rng: torch.Tensor, cuda_rng: list) -> str | None:
        """The reason to leave autocast (the error and the user's `file:line`), or None to keep the error."""
        if is_oom(exc) or not self._can_fall_back():
            return None
        said = refusal(exc, f"{self.precision.name} autocast")
        if AUTOCAST_REFUSED in str(exc):
            return said  # torch's own word: the op is refused under autocast
        try:  # the same batch without autocast, on a copy, from the same RNG state
            with torch.random.fork_rng(devices=[self.device] if cuda_rng else []):
                probe_pass(copy.deepcopy(self.module), materialize(batch), rng, cuda_rng, loss=self.loss,
                           autocast=lambda: torch.autocast(self.device.type, enabled=False),
                           own_step=self.own_step, own_context=self.own_context)
        except Exception:  # noqa: BLE001 - it fails without autocast too (or the copy does not fit): not autocast's
            return None
        return f"{said} (the same batch runs without autocast)"

    def _can_fall_back(self) -> bool:
        context = getattr(self.train_step, "context", None)  # a step of your own's StepContext
        if context is not None and context.steps:
            return False  # it called step.step(name) before the error: the weights have moved
        if self.precision.precision.use_scaler and getattr(self.train_step, "count_nonfinite", False):
            try:  # on_nan="skip" without the scaler needs a fused optimizer
                skips_nonfinite("skip", False, self.train_step.optimizer, "the optimizer")
            except ConfigError:
                return False
        return True

    def fall_back(self, why: str) -> None:
        """fp32 for the rest of the run: the precision, the step's autocast and scaler, no captures,
        no gradients of the failed attempt."""
        failed = self.precision.precision
        self.precision.change(fp32_instead(failed, why))
        self.train_step.follow_precision()
        for opt in self.optimizers:
            opt.zero_grad(set_to_none=True)
        graphs = getattr(self.graphed, "graphs", None)
        if graphs:
            graphs.clear()  # captured under autocast: captured again in fp32
        log.warning("precision: the first step failed under %s autocast, so this run trains in fp32 "
                    "(set precision='fp32' to start there): %s", failed.name, why)


def gate_precision(t: Any, step_fn: Callable[[list], Any]) -> Callable[[list], Any]:
    """`step_fn` behind a PrecisionGate where the precision is automatic and autocast is on (decided
    on the first batch); else `step_fn` itself. `t`: the Trainer, its step and layout gate set up."""
    asked = (t.config.precision or "auto").strip().lower()
    if asked != "auto" or t.precision.precision.autocast_dtype is None:
        return step_fn
    own = (t.optimizer.optimizers, t.scheduler.schedulers if t.scheduler is not None else {}) \
        if t.own_step is not None else ({}, {})
    return PrecisionGate(step_fn, precision=t.precision, module=t.module, loss=t.loss, speed=t.speed,
                         train_step=t.train_step, optimizers=run_optimizers(t.optimizer), graphed=t.graphed,
                         own_step=t.own_step, own_context=own)
