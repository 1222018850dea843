"""channels_last where it is safe, decided by rule and checked on the model's own first step.

`decide_speed` (runtime/speed.py) decides the layout by rule, never by a timing (a timing would make a
seeded run's numbers depend on the machine's load): forced, or off without 2-D convolutions or off
the GPU, or on CUDA (cuDNN's tensor-core NHWC kernels) once the first step has checked it
("check"). `LayoutDecider` is one of the first step's deciders (train/step/first_step.py); before the
first step it runs forward + loss + backward of the first batch on two copies of the model, one in the
layout the user gave (NCHW) and one in NHWC (weights and 4-D float inputs), in the modes fit trains in,
under the run's precision, from the same RNG state (the user's RNG stream is left as it was; Python
state that a compute_loss or step_fn keeps between calls sees the two calls). NHWC is kept only when
- it runs (no error: a `.view` of a convolution's output, `grad.view(n, -1)` in a gradient penalty,
  refuse NHWC; the reason names the error and the `file:line` of the user's code that raised it), and
- it gives the same loss within `loss_tolerance` (dropout's random draws follow the memory layout,
  so where the train-mode losses differ, the built-in loss is compared again in eval mode).
The probe's passes are not timed: on CUDA the first passes include cuDNN's algorithm search, and
`--autotune` is where a measurement may choose (its choice is written into the run).
A step that fails in NHWC (the first, or a later one on a data-dependent path) is retried once in the
user's layout, with one log line; an "unsafe to autocast" error is autocast's, not the layout's, and
where the autocast decider (train/step/autocast_decider.py) turns an automatic autocast off, the
layout is probed again in fp32. `MemoryFormats` gives every parameter and buffer back its own layout
after fit.
"""

from __future__ import annotations

import copy
import logging
from typing import Any, Sequence

import torch
from torch import nn

from gputrain import batch as batches
from gputrain.data.deferred import materialize
from gputrain.errors import user_frame_summary
from gputrain.runtime.oom import is_oom
from gputrain.runtime.precision import AUTOCAST_REFUSED, RunPrecision
from gputrain.runtime.speed import SpeedSwitches
from gputrain.train.modes import set_training
from gputrain.train.step.first_step import FirstPass, RngState, Snapshot, losses_of

log = logging.getLogger("gputrain")


def loss_tolerance(precision: RunPrecision) -> float:
    """Relative tolerance between the two layouts' losses: NHWC kernels sum in another order.
    fp32 1e-4; TF32 matmuls 1e-3; bf16/fp16 autocast 1e-2 (8 / 11 bits of mantissa)."""
    p = precision.precision
    if p.autocast_dtype is not None:
        return 1e-2
    return 1e-3 if p.name == "tf32" else 1e-4


def to_nhwc(batch: Any) -> Any:
    """The batch with its 4-D floating tensors in channels_last, as fit's transform makes them."""
    return batches.map_tensors(lambda t: t.contiguous(memory_format=torch.channels_last)
                               if t.dim() == 4 and t.is_floating_point() else t, batch)


def in_format(t: torch.Tensor, fmt: torch.memory_format) -> bool:
    """Whether `t` has exactly the strides of `fmt`. `is_contiguous(memory_format=...)` ignores the
    strides of size-1 dimensions, so a 1-channel NHWC tensor passes as contiguous, yet convolutions
    read its strides and keep producing NHWC."""
    return t.stride() == torch.empty(t.shape, memory_format=fmt, device="meta").stride()


def to_nchw(batch: Any) -> Any:
    """The batch with its 4-D tensors in the default (contiguous) layout."""
    return batches.map_tensors(lambda t: t.clone(memory_format=torch.contiguous_format)
                               if t.dim() == 4 and not in_format(t, torch.contiguous_format) else t,
                               materialize(batch))


def refusal(exc: BaseException, who: str = "NHWC") -> str:
    """'`x = x.view(-1, 400)` at model.py:42 (forward) raised RuntimeError: view size is not ...':
    the user's frame (gputrain/errors.py: the innermost outside torch and gputrain), the code that
    refused the layout or the precision (train/step/autocast_decider.py); `who` stands in for it
    where no frame is the user's."""
    where = user_frame_summary(exc)
    first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
    said = f"{type(exc).__name__}: {first[:200]}"
    hint = "; .reshape works in both layouts" if "view size" in first and "reshape" not in first else ""
    if where is None:
        return f"{who} raised {said}{hint}"
    return f"`{(where.line or '').strip()}` at {where.filename}:{where.lineno} ({where.name}) raised {said}{hint}"


class MemoryFormats:
    """The memory format of each 4-D parameter and buffer as the user gave it, by owner and name (moving
    a module replaces its buffers); `restore` puts it back in place through `.data` (the optimizer, EMA
    and graphs keep the same tensor objects), with the gradients and the matching optimizer state."""

    def __init__(self, module: nn.Module):
        self.formats = [(owner, name, torch.channels_last if in_format(t, torch.channels_last)
                         and not in_format(t, torch.contiguous_format) else torch.contiguous_format)
                        for owner in module.modules()
                        for name, t in [*owner._parameters.items(), *owner._buffers.items()]
                        if t is not None and t.dim() == 4]

    def restore(self, optimizers: Sequence[torch.optim.Optimizer] = ()) -> None:
        with torch.no_grad():
            for owner, name, fmt in self.formats:
                t = owner._parameters.get(name)
                t = owner._buffers.get(name) if t is None else t
                if t is None:
                    continue
                if not in_format(t, fmt):
                    t.data = t.data.clone(memory_format=fmt)
                if t.grad is not None and not in_format(t.grad, fmt):
                    t.grad = t.grad.clone(memory_format=fmt)
                for opt in optimizers:
                    state = opt.state.get(t) or {}
                    for key, value in list(state.items()):
                        if isinstance(value, torch.Tensor) and value.shape == t.shape and not in_format(value, fmt):
                            state[key] = value.clone(memory_format=fmt)


class LayoutDecider:
    """channels_last decided on the first batch, and a step that fails in NHWC retried once in the
    user's layout (see the module docstring): a decider of train/step/first_step.py's gate."""

    late = True  # a data-dependent path may fail in NHWC on a later step

    def __init__(self, *, module: nn.Module, speed: SpeedSwitches, first_pass: FirstPass, precision: RunPrecision,
                 device: torch.device, total_steps: int, optimizers: Sequence[torch.optim.Optimizer],
                 formats: MemoryFormats, loaders: Sequence[Any] = ()):
        self.module, self.speed, self.first_pass = module, speed, first_pass
        self.precision, self.device, self.total_steps = precision, device, total_steps
        self.optimizers = list(optimizers)
        self.formats = formats  # the user's layouts, recorded before fit changed any
        # The loaders' transforms put 4-D inputs in NHWC when channels_last is on (data/transforms.py).
        self.transforms = [t for t in (getattr(ld, "transform", None) for ld in loaders) if t is not None]
        self.mode = speed.layout_probe  # "check": what the probe (again, after a reopen) does
        self.retried = False

    @property
    def open(self) -> bool:
        return self.speed.layout_probe is not None or (self.speed.channels_last and not self.retried)

    def probe(self, micro_batches: Sequence[Any]) -> None:
        if self.speed.layout_probe is not None:
            self.decide(micro_batches[0])

    def reopen(self) -> None:
        """Probe again (in the precision the run falls back to) before the retry."""
        if self.mode is not None and not self.retried:
            self.speed.layout_probe = self.mode

    def caused(self, exc: Exception, micro_batches: Sequence[Any], snapshot: Snapshot | None) -> str | None:
        if not self.speed.channels_last or self.retried or not isinstance(exc, RuntimeError):
            return None
        if is_oom(exc) or AUTOCAST_REFUSED in str(exc):  # autocast's refusal, not NHWC's (autocast_decider.py)
            return None
        return refusal(exc)

    def fall_back(self, why: str, micro_batches: Sequence[Any]) -> Sequence[Any]:
        """NHWC off for the rest of the run: the user's layout back; the batches again in it."""
        self.retried = True
        self.speed.channels_last = False
        self.speed.reasons["channels_last"] = f"switched off during the run: {why}"
        self.formats.restore(self.optimizers)
        self._inputs(False)
        log.warning("a step failed in channels_last (NHWC) and runs again in your layout: %s", why)
        return [to_nchw(b) for b in micro_batches]

    def apply(self) -> None:
        """NHWC weights and inputs for the run. Each 4-D parameter and buffer is re-laid out through
        `.data`, never replaced (`Module.to` replaces buffers): the optimizer, EMA's average and
        anything else that holds these tensors keep following them."""
        with torch.no_grad():
            for t in (*self.module.parameters(), *self.module.buffers()):
                if t.dim() == 4 and not in_format(t, torch.channels_last):
                    t.data = t.data.contiguous(memory_format=torch.channels_last)
        self._inputs(True)

    def _inputs(self, nhwc: bool) -> None:
        for t in self.transforms:
            t.channels_last = nhwc

    def decide(self, batch: Any) -> None:
        self.speed.layout_probe = None
        devices = [self.device] if self.device.type == "cuda" else []
        with torch.random.fork_rng(devices=devices):
            keep, why = self._probe(materialize(batch))
        self.speed.channels_last = keep
        self.speed.reasons["channels_last"] = why
        if keep:
            self.apply()
        self._said()

    def _said(self) -> None:
        log.info("channels_last: %s (%s)", "on" if self.speed.channels_last else "off",
                 self.speed.reasons["channels_last"])

    def _pass(self, model: nn.Module, batch: Any, rng: RngState) -> list[float]:
        return self.first_pass(model, batch, rng, self.precision.autocast)

    def _eval_losses(self, models: tuple[nn.Module, nn.Module], batch: Any, nhwc: Any) -> tuple[list[float], list[float]]:
        out = []
        for model, b in zip(models, (batch, nhwc)):
            set_training(model, False)  # eval mode, also where the model's train() means something else
            with torch.no_grad(), self.precision.autocast():
                out.append(losses_of(self.first_pass.loss(model, b)[0]))
        return out[0], out[1]

    def _probe(self, batch: Any) -> tuple[bool, str]:
        rng = RngState(self.device)
        nchw_model = copy.deepcopy(self.module)
        # torch's stub of Module.to lists no memory_format keyword, which Module.to takes and applies to 4-D
        # tensors (run by tests/test_channels_last.py on the CPU): the ignore is for the stub only.
        nhwc_model = copy.deepcopy(self.module).to(memory_format=torch.channels_last)  # pyright: ignore[reportCallIssue]
        nhwc = to_nhwc(batch)
        try:
            plain = self._pass(nchw_model, batch, rng)
        except Exception as exc:  # noqa: BLE001 - the user's layout fails too: the step itself will say why
            return False, f"not probed: the first batch fails in your layout as well ({type(exc).__name__})"
        try:
            other = self._pass(nhwc_model, nhwc, rng)
        except Exception as exc:  # noqa: BLE001 - the reason for the decision
            return False, f"NHWC refused by your code: {refusal(exc)}"
        tol = loss_tolerance(self.precision)
        if not _agree(plain, other, tol) and self.first_pass.own_step is None:
            # Dropout draws its mask in memory order; without random draws the layouts must agree.
            evals = self._eval_losses((nchw_model, nhwc_model), batch, nhwc)
            if not _agree(*evals, tol):
                return False, f"NHWC changed the loss beyond the relative tolerance {tol:g}: {evals[0]} vs {evals[1]}"
            plain, other = evals
        elif not _agree(plain, other, tol):
            return False, f"NHWC changed the loss beyond the relative tolerance {tol:g}: {plain} vs {other}"
        return True, (f"the first batch's loss agrees within {tol:g}; the CUDA rule keeps NHWC (cuDNN's "
                      "tensor-core convolutions; not timed: the first passes include cuDNN's algorithm search)")


def _agree(a: list[float], b: list[float], rtol: float) -> bool:
    return len(a) == len(b) and all(abs(x - y) <= rtol * max(abs(x), abs(y), 1e-12) + 1e-7 for x, y in zip(a, b))
