"""on_nan="skip": a step whose loss or gradient is not finite leaves the weights as they were, decided
on the device every step (so that it works inside a captured graph too), and is counted.

In fp16 the GradScaler skips such steps itself (`RunPrecision.skips_nonfinite`); the flag only counts
them. Without a scaler, the flag is the `found_inf` a fused optimizer reads in its kernel to skip the
update (as GradScaler sets it), which needs a fused optimizer (`skips_nonfinite` refuses another).
The flag comes from the clipping norm when there is one, else from one GradScaler-style check of
the gradients and the loss (one kernel; exact, no norm to overflow).
"""

from __future__ import annotations

from typing import Sequence, cast

import torch
from torch import nn

from gputrain.errors import ConfigError
from gputrain import torch_compat
from gputrain.runtime.precision import RunPrecision


def skips_nonfinite(on_nan: str, scaler_skips: bool, optimizer, optimizer_desc: str) -> bool:
    """Whether the step skips non-finite steps (on_nan="skip"). Without a loss scaler that is decided
    on the device, which needs a fused optimizer (it reads a found_inf flag in its kernel): refused
    with a ConfigError for one that is not."""
    skip = on_nan == "skip"
    if skip and not scaler_skips and not all(g.get("fused", False) for g in optimizer.param_groups):
        raise ConfigError(
            f"on_nan='skip' decides on the device whether a step is applied, which needs a fused optimizer "
            f"(it reads a found_inf flag in its kernel); {optimizer_desc} is not fused: use the default "
            "optimizer (fused AdamW), create yours with fused=True, or use on_nan='stop'")
    return skip


class NonFiniteFlag:
    """Flags and counts the non-finite steps (see the module docstring); `count` into the totals'
    `nonfinite` scalar."""

    def __init__(self, precision: RunPrecision, optimizer: torch.optim.Optimizer, params: Sequence[torch.Tensor],
                 count: torch.Tensor, device: torch.device):
        self.precision, self.optimizer, self.params, self.count = precision, optimizer, list(params), count
        self.device = device
        self._foreach = device.type == "cuda" or None
        self.on_device = False  # the fused optimizer reads the flag (no scaler skips for it)
        self._found_inf = torch.zeros((), device=device, dtype=torch.float32)
        self._one = torch.ones((), device=device, dtype=torch.float32)
        # GradScaler's one-kernel check unless the gradients are sharded DTensors or on another
        # device, where a norm is reduced instead.
        self._grad_check = all(p.device == device and not callable(getattr(p, "to_local", None))
                               for p in self.params)
        self.follow_precision()

    def follow_precision(self) -> None:
        """Skip on the device once no scaler does (an automatic fp16 the first step turned into fp32:
        train/step/autocast_decider.py)."""
        if self.on_device or self.precision.skips_nonfinite:
            return
        self.on_device = True
        # Attributes Optimizer does not declare: torch's fused kernels read them with getattr, as
        # GradScaler sets them. The flag keeps its address (a captured graph writes it).
        setattr(self.optimizer, "grad_scale", None)
        setattr(self.optimizer, "found_inf", self._found_inf)

    def check(self, step_loss: torch.Tensor, norm: torch.Tensor | None) -> torch.Tensor:
        """Flag this step when its loss or a gradient is not finite, on the device, and count it;
        without a scaler the fused optimizer then skips the step and its loss stays out of the sum.
        Returns the loss to add to the sum."""
        if not self.on_device or norm is not None or not self._grad_check:
            if norm is None and not self.precision.skips_nonfinite:
                grads = [p.grad for p in self.params if p.grad is not None]
                norm = nn.utils.get_total_norm(grads, foreach=self._foreach) if grads else None
            # Non-finite loss or norm in three small kernels (isfinite alone is four: ==, abs, !=,
            # *): the sum is finite when both are (norm >= 0; a sum past fp32's max, ~3e38, counts
            # as non-finite), and x - x is NaN exactly when x is inf or NaN.
            probe = step_loss if norm is None else step_loss + _local(norm)
            bad = (probe - probe).ne(0)  # bool, shape ()
            if self.on_device:
                self._found_inf.copy_(bad)
        else:
            # GradScaler's check with a scale of 1, grouped by dtype so that every group takes the
            # multi-tensor kernel.
            found = self._found_inf.zero_()
            groups: dict[torch.dtype, list[torch.Tensor]] = {step_loss.dtype: [step_loss]}
            for p in self.params:
                if p.grad is not None:
                    groups.setdefault(p.grad.dtype, []).append(p.grad)
            for tensors in groups.values():
                torch_compat.non_finite_check_and_unscale_(tensors, found, self._one)
            bad = found.ne(0)
        self.count.add_(bad)  # float += bool: 1.0 per non-finite step
        return step_loss.masked_fill(bad, 0.0) if self.on_device else step_loss  # keep the mean finite


def _local(t: torch.Tensor) -> torch.Tensor:
    """A plain tensor from a norm over sharded (FSDP2 DTensor) gradients: the full value, on every rank."""
    full = getattr(t, "full_tensor", None)
    return cast(torch.Tensor, full()) if callable(full) else t  # DTensor.full_tensor() -> Tensor
