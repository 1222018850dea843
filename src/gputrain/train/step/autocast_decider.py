"""Precision decided from the model's own first step, like the layout (train/step/layout.py).

fit's automatic precision on a CUDA GPU is bf16 autocast (fp16 with loss scaling on older GPUs).
torch's CUDA autocast refuses some ops outright (`F.binary_cross_entropy` / `nn.BCELoss`: "unsafe to
autocast", as in pytorch/examples' DCGAN and VAE), and some code fails only with autocast's dtypes
(an in-place write of a bf16 result into an fp32 tensor). When the precision was chosen automatically
(precision="auto") and autocast is on, `AutocastDecider` is one of the first step's deciders
(train/step/first_step.py: snapshot, probe, retry once, fall back). If the first step raises
an error that autocast caused (torch's own "unsafe to autocast", or an error that the same batch does
not raise with autocast off: forward, loss and backward once more on a copy of the model, from the
same RNG state, as the layout probe runs them), the run trains in fp32 instead (no autocast, no loss
scaling, TF32 off as for fp32): one log line, and the precision decision's reason names the error and
the `file:line` of the user's code. The failed attempt leaves nothing behind: the gate puts back the
buffers (BatchNorm's statistics, copied once before the first step) and the RNG state and clears its
gradients. Everything that follows from the precision sees the change: the run's `RunPrecision`
changes in place (the step, the evaluator and the checkpoint's scaler part hold it; the step's
non-finite flag takes over from the scaler, `NonFiniteFlag.follow_precision`), graphs captured so far
(none yet at the first step) are dropped, and the layout is probed again under fp32. The step then
runs again on the same batches from the RNG state it started from, so the run is the one fp32 would
have given.

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
from typing import Any, Sequence

import torch
from torch import nn

from gputrain.data.deferred import materialize
from gputrain.errors import ConfigError
from gputrain.runtime.oom import is_oom
from gputrain.runtime.precision import AUTOCAST_REFUSED, RunPrecision, fp32_instead
from gputrain.train.step.first_step import FirstPass, Snapshot
from gputrain.train.step.layout import refusal
from gputrain.train.step.nonfinite import NonFiniteFlag, skips_nonfinite

log = logging.getLogger("gputrain")


class AutocastDecider:
    """An automatic autocast undone when the first step shows that it breaks the model's code (see
    the module docstring): a decider of train/step/first_step.py's gate.

    stepped: whether a step of your own had already stepped an optimizer when the error came (its
    weights have moved: no retry); flag: the step's on_nan="skip" flag, which takes over from the
    scaler (it needs a fused optimizer)."""

    late = False  # the first step's error only

    def __init__(self, *, precision: RunPrecision, module: nn.Module, first_pass: FirstPass,
                 flag: NonFiniteFlag | None = None, stepped: Any = None):
        self.precision, self.module, self.first_pass, self.flag = precision, module, first_pass, flag
        self.stepped = stepped if stepped is not None else (lambda: False)
        self.device = precision.device
        self.decided = False

    @property
    def open(self) -> bool:
        return not self.decided

    def probe(self, micro_batches: Sequence[Any]) -> None:
        pass

    def reopen(self) -> None:
        """The layout fell back on the first step (a GPU's automatic bf16 with NHWC forced): autocast has
        nothing to probe ahead; its own decision is taken when a step fails, in the retry too."""

    def caused(self, exc: Exception, micro_batches: Sequence[Any], snapshot: Snapshot | None) -> str | None:
        """The reason to leave autocast (the error and the user's `file:line`), or None to keep the error."""
        self.decided = True
        if snapshot is None or is_oom(exc) or not self._can_fall_back():
            return None
        said = refusal(exc, f"{self.precision.name} autocast")
        if AUTOCAST_REFUSED in str(exc):
            return said  # torch's own word: the op is refused under autocast
        try:  # the same batch without autocast, on a copy, from the same RNG state
            with torch.random.fork_rng(devices=[self.device] if snapshot.rng.cuda else []):
                self.first_pass(copy.deepcopy(self.module), materialize(micro_batches[0]), snapshot.rng,
                                lambda: torch.autocast(self.device.type, enabled=False))
        except Exception:  # noqa: BLE001 - it fails without autocast too (or the copy does not fit): not autocast's
            return None
        return f"{said} (the same batch runs without autocast)"

    def _can_fall_back(self) -> bool:
        if self.stepped():
            return False  # a step of your own called step.step(name) before the error: the weights have moved
        if self.precision.skips_nonfinite and self.flag is not None:
            try:  # on_nan="skip" without the scaler needs a fused optimizer
                skips_nonfinite("skip", False, self.flag.optimizer, "the optimizer")
            except ConfigError:
                return False
        return True

    def fall_back(self, why: str, micro_batches: Sequence[Any]) -> None:
        """fp32 for the rest of the run: the precision (and with it the step's autocast and scaler)."""
        failed = self.precision.precision
        self.precision.change(fp32_instead(failed, why))
        if self.flag is not None:
            self.flag.follow_precision()
        log.warning("precision: the first step failed under %s autocast, so this run trains in fp32 "
                    "(set precision='fp32' to start there): %s", failed.name, why)
        return None
