"""How many bytes a training step needs, piece by piece, and how that grows with the batch.

- `estimate_memory(model, sample_batch, ...)`: parameters + gradients + optimizer state (of the
  trainable parameters only: a frozen base, such as LoRA's, has neither) + activations (bytes the
  autograd graph saves for backward, measured with the saved-tensor meter at two batch sizes and
  fitted as fixed + per_sample * batch), per recomputable block too; on CUDA also the slope of the
  real step's peak (the step probe, probe.py, at two batch sizes).
- `activation_bytes_at`, `fixed_bytes`, `max_batch_from_estimate`: what an estimate predicts at
  another batch size, and the largest batch that fits a budget.

Everything returns plain data (dicts of bytes); `gputrain memory` renders it. Batches are cut with
batch.py and turned into a loss by train/step/loss.py's rule (probe.as_loss_rule).
"""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch import nn

from gputrain import batch as batches
from gputrain.diagnostics.probe import StepProbe, as_loss_rule
from gputrain.diagnostics.saved_tensors import measure_saved, nbytes, side_effect_free, unique_parameters
from gputrain.errors import ConfigError, DataError
from gputrain.runtime.precision import Precision
from gputrain.train.step.recompute import RecomputeUnit, recompute_units
from gputrain.train.step.loss import LossRule

# Optimizer state tensors per parameter (each the parameter's shape and dtype).
OPTIMIZER_STATES = {
    "adamw": 2,  # exp_avg, exp_avg_sq
    "adam": 2,
    "sgd": 1,  # momentum buffer (SGD without momentum keeps none: use "none")
    "rmsprop": 1,
    "adagrad": 1,
    "none": 0,
}
STEP_PROBE_BATCH = 256  # samples in the larger of the two measured CUDA steps
_AUTOCAST = {"fp32": None, "tf32": None, "bf16": torch.bfloat16, "fp16": torch.float16}


def precision_of(precision) -> tuple[str, torch.dtype | None]:
    """(name, autocast dtype) from a Precision, a name, or None (fp32)."""
    if precision is None:
        return "fp32", None
    if isinstance(precision, Precision):
        return precision.name, precision.autocast_dtype
    if precision not in _AUTOCAST:
        raise ConfigError(f"unknown precision {precision!r}: use fp32, tf32, bf16 or fp16 (or a Precision)")
    return precision, _AUTOCAST[precision]


def estimate_memory(model: nn.Module, sample_batch, optimizer_name: str = "adamw", precision=None,
                    batch_size: int | None = None, loss_fn: Callable | None = None,
                    loss=None, probe: StepProbe | None = None) -> dict[str, Any]:
    """Bytes one training step of `model` needs at `batch_size`, piece by piece.

    sample_batch: any batch (a pair (inputs, targets), one tensor, a dict, nested containers of
        tensors with the batch on dim 0), a few samples (>= 2 for a two-point fit), already
        transformed as the model sees them; moved to the model's device.
    optimizer_name: "adamw" | "adam" (2 state tensors per parameter) | "sgd" (momentum: 1) |
        "rmsprop" | "adagrad" | "none".
    precision: a Precision, "fp32"/"tf32"/"bf16"/"fp16" or None (fp32); the activations are measured
        under the matching autocast.
    batch_size: the batch to estimate for (default: the sample batch's size).
    loss, loss_fn: how a batch becomes a loss (`probe.as_loss_rule`): a LossRule or a callable
        (model, batch) -> loss; or loss_fn on pairs; without either, the model's own loss (a scalar,
        .loss or ["loss"]) or else the sum of its outputs is measured.
    probe: on CUDA, the step probe whose real steps give the slope of the peak (a `StepProbe` for
        `model`, as `gputrain memory` builds it); None: one with the default config.

    Activations are the bytes autograd saves for backward (saved_tensors_hooks, each storage once),
    measured at the sample batch and half of it and fitted as fixed + per_sample * batch: the
    fixed part holds what does not grow with the batch (autocast's low-precision weight copies).
    Not counted: temporaries freed within an op, cuDNN/cuBLAS workspaces, allocator fragmentation,
    the data set itself. Raises ConfigError for an unknown optimizer or precision.
    """
    opt = optimizer_name.lower()
    if opt not in OPTIMIZER_STATES:
        raise ConfigError(f"unknown optimizer {optimizer_name!r}: choose one of {', '.join(OPTIMIZER_STATES)}")
    prec_name, autocast_dtype = precision_of(precision)
    params = unique_parameters(model)
    trainable = [p for p in params if p.requires_grad]
    device = params[0].device if params else torch.device("cpu")
    param_bytes = sum(nbytes(p) for p in params)
    grad_bytes = sum(nbytes(p) for p in trainable)  # gradients take the parameter's dtype
    states = OPTIMIZER_STATES[opt]
    opt_bytes = states * grad_bytes  # state tensors are zeros_like(param)

    rule = as_loss_rule(loss, loss_fn)
    sample = batches.move(sample_batch, device)
    n = _samples(sample)
    batch = batch_size or n
    units = recompute_units(model, strict=False)
    fits = _activation_fits(model, sample, rule, autocast_dtype, device, units)
    per_sample, fixed = fits["all"]
    activation_bytes = int(round(fixed + per_sample * batch))
    step_fit = None
    if device.type == "cuda" and n >= 2:
        step_fit = _step_fit(model, sample, rule, opt, precision, probe)
    total = param_bytes + grad_bytes + opt_bytes + activation_bytes
    el = params[0].element_size() if params else 4
    n_params, n_trainable = sum(p.numel() for p in params), sum(p.numel() for p in trainable)
    full, half = fits["measured"]
    frozen_note = f" ({n_trainable:,} trainable, {n_params - n_trainable:,} frozen)" if n_trainable < n_params else ""
    arithmetic = [
        f"parameters: {n_params:,}{frozen_note} x {el} B = {param_bytes:,} B",
        f"gradients: {n_trainable:,} trainable x {el} B = {grad_bytes:,} B",
        f"optimizer state ({opt}): {states} x {grad_bytes:,} B = {opt_bytes:,} B",
        f"activations: {fixed:,.0f} B fixed + {per_sample:,.1f} B/sample x {batch:,} = {activation_bytes:,} B "
        f"(measured {full:,} B at batch {n}" + (f", {half:,} B at batch {n // 2})" if half is not None else ")"),
        f"total: {param_bytes:,} + {grad_bytes:,} + {opt_bytes:,} + {activation_bytes:,} = {total:,} B",
    ]
    bf16_fit = fits["bf16"]
    return {
        "batch_size": batch,
        "optimizer": opt,
        "precision": prec_name,
        "device": str(device),
        "parameters": n_params,
        "trainable_parameters": n_trainable,
        "frozen_parameters": n_params - n_trainable,  # no gradient, no optimizer state
        "parameter_bytes": param_bytes,
        "gradient_bytes": grad_bytes,
        "optimizer_states_per_parameter": states,
        "optimizer_state_bytes": opt_bytes,
        "activation_bytes": activation_bytes,
        "activation_bytes_per_sample": per_sample,
        "activation_bytes_fixed": fixed,
        "measured_batches": [n] + ([n // 2] if half is not None else []),
        "measured_activation_bytes": [full] + ([half] if half is not None else []),
        "bf16_activation_bytes_per_sample": None if bf16_fit is None else bf16_fit[0],
        "bf16_activation_bytes_fixed": None if bf16_fit is None else bf16_fit[1],
        # CUDA only: the measured peak of a whole step as fixed + per_sample * batch (None elsewhere)
        "step_peak_bytes_per_sample": None if step_fit is None else step_fit[0],
        "step_peak_bytes_fixed": None if step_fit is None else step_fit[1],
        "blocks": fits["blocks"],
        "total_bytes": total,
        "arithmetic": arithmetic,
        "not_counted": "op temporaries, cuDNN/cuBLAS workspaces, allocator fragmentation, the data set",
    }


def _samples(sample) -> int:
    try:
        return batches.batch_size(sample)
    except DataError:
        raise ConfigError("sample_batch must hold tensors with the batch on dim 0, "
                          f"got {type(sample).__name__}") from None


def _activation_fits(model: nn.Module, sample, rule: LossRule, autocast_dtype: torch.dtype | None,
                     device: torch.device, units: list[RecomputeUnit]) -> dict[str, Any]:
    """The saved bytes measured at the sample and half of it, and the lines fitted through them:
    {"all": (per_sample, fixed), "measured": (at n, at n/2 or None), "bf16": a fit under bf16
    autocast or None, "blocks": [{name, activation_bytes_per_sample, input_bytes_per_sample}]}."""
    n = batches.batch_size(sample)
    half_n = n // 2
    small = batches.head(sample, half_n) if half_n >= 1 else None  # one sample: the fit goes through zero
    with side_effect_free(model, device):
        full, full_units, full_inputs = measure_saved(model, sample, rule, autocast_dtype, device, units)
        half, half_units, half_inputs = (measure_saved(model, small, rule, autocast_dtype, device, units)
                                         if small is not None else (None, {}, {}))
        bf16_fit = None
        if autocast_dtype is None and _bf16_autocast_works(device):
            bf16_full = measure_saved(model, sample, rule, torch.bfloat16, device)[0]
            bf16_half = measure_saved(model, small, rule, torch.bfloat16, device)[0] if small is not None else None
            bf16_fit = _linear_fit(n, bf16_full, half_n, bf16_half)

    def fit(at_n: dict[str, int], at_half: dict[str, int], name: str) -> float:
        return _linear_fit(n, at_n.get(name, 0), half_n, at_half.get(name, 0) if half is not None else None)[0]

    blocks = [{"name": u.name, "activation_bytes_per_sample": fit(full_units, half_units, u.name),
               "input_bytes_per_sample": fit(full_inputs, half_inputs, u.name)} for u in units]
    return {"all": _linear_fit(n, full, half_n, half), "measured": (full, half), "bf16": bf16_fit,
            "blocks": blocks}


def _step_fit(model: nn.Module, sample, rule: LossRule, opt: str, precision,
              probe: StepProbe | None) -> tuple[float, float]:
    """(bytes per sample, fixed bytes) of the real step's peak on CUDA, measured at two batch sizes.

    The real step also holds what the saved tensors miss: gradients of activations during backward
    and cuDNN/cuBLAS workspaces, which for GEMM-based convolutions grow with the batch (an im2col
    buffer: 0.8 MB/sample for the CIFAR CNN's second conv in fp32, more than all its saved tensors).
    The batches are the sample tiled to STEP_PROBE_BATCH and half of it: at a handful of samples
    cuDNN's heuristics pick other (workspace-free) algorithms than at real batch sizes.
    """
    big = max(batches.batch_size(sample), STEP_PROBE_BATCH)
    tiled = batches.tile(sample, big)
    own = probe is None
    probe = probe or StepProbe(model, rule, optimizer=opt, precision=precision or "fp32")
    try:
        with side_effect_free(model, probe.device):
            peak_big = probe.measure(tiled)["peak_bytes"]
            peak_half = probe.measure(batches.head(tiled, big // 2))["peak_bytes"]
    finally:
        if own:
            probe.close()
    return _linear_fit(big, peak_big, big // 2, peak_half)


def _linear_fit(n: int, at_n: int, half_n: int, at_half: int | None) -> tuple[float, float]:
    """(bytes per sample, fixed bytes) through the points (half_n, at_half) and (n, at_n)."""
    if at_half is None or half_n == n:
        return at_n / max(n, 1), 0.0
    per = (at_n - at_half) / (n - half_n)
    fixed = at_n - per * n
    if per < 0 or fixed < 0:  # noise from ops that pick different algorithms per size
        return at_n / n, 0.0
    return per, fixed


def _bf16_autocast_works(device: torch.device) -> bool:
    if device.type == "cuda":
        # bf16 tensor cores (8.0+), the rule gputrain's bf16 follows; torch.cuda.is_bf16_supported()
        # says True on a V100/T4 too (emulated), where `--precision bf16` is refused.
        from gputrain.runtime.devices import cuda_capability_flags

        return cuda_capability_flags(*torch.cuda.get_device_capability(device))["bf16"]
    return device.type == "cpu"


def activation_bytes_at(estimate: dict[str, Any], batch_size: int, bf16: bool = False) -> int:
    """Activation bytes the estimate predicts at another batch size (optionally under bf16)."""
    if bf16 and estimate.get("bf16_activation_bytes_per_sample") is not None:
        per, fixed = estimate["bf16_activation_bytes_per_sample"], estimate["bf16_activation_bytes_fixed"]
    else:
        per, fixed = estimate["activation_bytes_per_sample"], estimate["activation_bytes_fixed"]
        if bf16:
            per, fixed = per / 2, fixed / 2
    return int(round(fixed + per * batch_size))


def fixed_bytes(estimate: dict[str, Any]) -> int:
    """Bytes that do not depend on the batch: parameters, gradients, optimizer state."""
    return estimate["parameter_bytes"] + estimate["gradient_bytes"] + estimate["optimizer_state_bytes"]


def max_batch_from_estimate(estimate: dict[str, Any], budget_bytes: int) -> int:
    """The largest batch whose estimated total fits in `budget_bytes` (0 when none does).

    On CUDA the measured step peaks (workspaces and backward temporaries included) set the slope
    when they grow faster than the saved tensors; elsewhere the saved-tensor estimate does.
    """
    room = budget_bytes - fixed_bytes(estimate) - estimate["activation_bytes_fixed"]
    per = estimate["activation_bytes_per_sample"]
    step_per = estimate.get("step_peak_bytes_per_sample")
    if step_per is not None and step_per > per:
        room = budget_bytes - estimate["step_peak_bytes_fixed"]
        per = step_per
    if room <= 0:
        return 0
    return int(room // per) if per > 0 else 2**31
