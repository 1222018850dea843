"""How many bytes a training step needs, piece by piece, and how that grows with the batch.

- `estimate_memory(model, sample_batch, ...)`: parameters + gradients + optimizer state +
  activations (bytes the autograd graph saves for backward, measured with `SavedTensorMeter` at
  two batch sizes and fitted as fixed + per_sample * batch), per checkpointable block too.
- `measure_step_memory(model, batch, ...)`: the memory of a real training step (the allocator's
  peak on CUDA; elsewhere state + saved tensors at that batch). `_probe_step` is that step; the
  max-batch search (`batch_search.batch_trial`) runs it as well.
- `activation_bytes_at`, `fixed_bytes`, `max_batch_from_estimate`: what an estimate predicts at
  another batch size, and the largest batch that fits a budget.

Everything returns plain data (dicts of bytes); `gputrain memory` renders it.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterable

import torch
from torch import nn

from gputrain.errors import ConfigError
from gputrain.train.activation_checkpointing import _Unit, checkpoint_units

# Optimizer state tensors per parameter (each the parameter's shape and dtype).
OPTIMIZER_STATES = {
    "adamw": 2,  # exp_avg, exp_avg_sq
    "adam": 2,
    "sgd": 1,  # momentum buffer (SGD without momentum keeps none: use "none")
    "rmsprop": 1,
    "adagrad": 1,
    "none": 0,
}


def _unique_parameters(model: nn.Module) -> list[nn.Parameter]:
    seen, out = set(), []
    for p in model.parameters():
        if id(p) not in seen:
            seen.add(id(p))
            out.append(p)
    return out


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


class SavedTensorMeter:
    """Counts the bytes autograd saves for backward while it is active, once per storage.

    Tensors saved several times (a weight and its transpose, an input kept by two ops) count once:
    per storage, the distinct (start, size) views are summed, capped at the storage's size.
    Parameters' storages are skipped (they are counted as parameters). `by_unit` attributes each
    storage to the unit (see `unit_of`) running when it was first saved.
    """

    def __init__(self, skip_storages: Iterable[int] = ()):
        self._skip = set(skip_storages)
        self._views: dict[int, set[tuple[int, int]]] = {}
        self._cap: dict[int, int] = {}
        self._unit_of_storage: dict[int, str | None] = {}
        self.current_unit: list[str] = []

    def _pack(self, t: torch.Tensor):
        try:
            storage = t.untyped_storage()
            key, cap, ptr = storage.data_ptr(), storage.nbytes(), t.data_ptr()
        except (RuntimeError, NotImplementedError, TypeError):  # tensor subclasses without storage
            key, cap, ptr = id(t), _nbytes(t), id(t)
        if key not in self._skip and key != 0:
            if key not in self._views:
                self._views[key] = set()
                self._cap[key] = cap
                self._unit_of_storage[key] = self.current_unit[-1] if self.current_unit else None
            self._views[key].add((ptr, _nbytes(t)))
        return t

    @staticmethod
    def _unpack(t: torch.Tensor) -> torch.Tensor:
        return t

    def hooks(self):
        return torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)

    def _bytes(self, key: int) -> int:
        return min(self._cap[key], sum(size for _, size in self._views[key]))

    @property
    def total_bytes(self) -> int:
        return sum(self._bytes(k) for k in self._views)

    def by_unit(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for key, unit in self._unit_of_storage.items():
            if unit is not None:
                out[unit] = out.get(unit, 0) + self._bytes(key)
        return out


def _as_pair(sample_batch) -> tuple[Any, Any]:
    """(inputs, targets) of a pair batch; (batch, None) for any other batch (a dict, one tensor, ...)."""
    if isinstance(sample_batch, (tuple, list)) and len(sample_batch) == 2 and not hasattr(sample_batch, "_fields"):
        return sample_batch[0], sample_batch[1]
    return sample_batch, None


def _batch_len(x) -> int:
    """Samples in a (nested) batch: dim 0 of its first tensor leaf with a dimension."""
    from gputrain.batch import batch_size
    from gputrain.errors import DataError

    if x is None:
        raise ConfigError("sample_batch must hold tensors with the batch on dim 0, got None")
    try:
        return batch_size(x)
    except DataError:
        raise ConfigError(f"sample_batch must hold tensors with the batch on dim 0, got {type(x).__name__}") from None


def _map_batch_leaves(x, fn):
    """`fn` applied to every tensor leaf of `x` whose dim 0 is the batch (other leaves pass through)."""
    from gputrain.batch import map_tensors

    if x is None:
        return None
    if isinstance(x, torch.Tensor):
        return fn(x) if x.dim() > 0 else x
    try:
        n = _batch_len(x)
    except ConfigError:
        return x
    return map_tensors(lambda t: fn(t) if t.dim() > 0 and t.shape[0] == n else t, x)


def _slice(x, n: int):
    """The first `n` samples of a (nested) batch: every leaf with the batch dimension is cut."""
    return _map_batch_leaves(x, lambda t: t[:n])


def _to(x, device: torch.device):
    from gputrain.batch import map_tensors

    if x is None:
        return None
    if isinstance(x, torch.Tensor):
        return x.to(device)
    return map_tensors(lambda t: t.to(device), x)


def _call(model: nn.Module, x):
    if isinstance(x, dict):
        return model(**x)
    if isinstance(x, tuple):
        return model(*x)
    return model(x)


def _scalar_loss(result: Any) -> Any:
    """The loss of what a loss callable returned: the tensor of (loss, outputs), else the result as
    is (a loss tensor; the meter only needs it computed)."""
    if isinstance(result, tuple) and len(result) == 2 and isinstance(result[0], torch.Tensor):
        return result[0]
    return result


def _default_loss(model: nn.Module, batch, loss_fn):
    """What the estimate measures without a `loss`: loss_fn(model(x), y) for a pair with a loss_fn;
    the model's own loss (a scalar, `.loss` or ["loss"]) else, or the sum of its outputs (a
    stand-in for models whose loss is not given)."""
    from gputrain.batch import tensor_leaves
    from gputrain.train.loss import call_model, loss_of

    x, y = _as_pair(batch)
    if x is not batch:  # a pair (inputs, targets)
        out = _call(model, x)
        if loss_fn is not None and y is not None:
            return loss_fn(out, y)
    else:
        out = call_model(model, batch)
    own = loss_of(out)
    if own is not None:
        return own
    leaves = [t for t in tensor_leaves(out) if torch.is_floating_point(t)]
    return sum(t.float().sum() for t in leaves) if leaves else torch.zeros(())


def _loss_callable(loss, loss_fn) -> Callable:
    """(model, batch) -> loss tensor from `loss` (a LossRule or a callable (model, batch) -> loss or
    (loss, outputs)), or from the old `loss_fn` (a LossRule passed there counts as `loss`)."""
    from gputrain.train.loss import LossRule

    if loss is None and isinstance(loss_fn, LossRule):
        loss, loss_fn = loss_fn, None
    if loss is None:
        return lambda m, b: _default_loss(m, b, loss_fn)
    if isinstance(loss, LossRule):
        return lambda m, b: loss(m, b)[0]
    if not callable(loss):
        raise ConfigError(f"loss must be a LossRule or a callable (model, batch) -> loss, got {type(loss).__name__}")
    return lambda m, b: _scalar_loss(loss(m, b))


def _precision_of(precision) -> tuple[str, torch.dtype | None]:
    """(name, autocast dtype) from a Precision, a name, or None (fp32)."""
    if precision is None:
        return "fp32", None
    if isinstance(precision, str):
        table = {"fp32": None, "tf32": None, "bf16": torch.bfloat16, "fp16": torch.float16}
        if precision not in table:
            raise ConfigError(f"unknown precision {precision!r}: use fp32, tf32, bf16 or fp16 (or a Precision)")
        return precision, table[precision]
    return precision.name, precision.autocast_dtype


@contextlib.contextmanager
def _side_effect_free(model: nn.Module, device: torch.device):
    """Run a measuring forward without changing the model: restore buffers (BatchNorm running
    stats), train/eval mode and the RNG (dropout) afterwards."""
    buffers = {name: b.detach().clone() for name, b in model.named_buffers()}
    was_training = model.training
    devices = [device] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices):
        try:
            model.train()
            yield
        finally:
            model.train(was_training)
            with torch.no_grad():
                for name, b in model.named_buffers():
                    if name in buffers:
                        b.copy_(buffers[name])


def _measure_activations(model: nn.Module, batch, loss, autocast_dtype: torch.dtype | None,
                         device: torch.device, units: list[_Unit]) -> tuple[int, dict[str, int], dict[str, int]]:
    """One forward + loss under the meter: (saved bytes, saved bytes per unit, input bytes per unit).

    batch: any batch on `device`; loss: a callable (model, batch) -> loss tensor (`_loss_callable`).
    """
    skip = {p.untyped_storage().data_ptr() for p in _unique_parameters(model)}
    meter = SavedTensorMeter(skip)
    unit_inputs: dict[str, int] = {}
    handles = []
    for unit in units:
        for i, module in enumerate(unit.modules):
            first = i == 0

            def pre(mod, args, unit=unit, first=first):
                meter.current_unit.append(unit.name)
                if first:
                    unit_inputs[unit.name] = unit_inputs.get(unit.name, 0) + sum(
                        _nbytes(a) for a in args if isinstance(a, torch.Tensor))

            def post(mod, args, out):
                if meter.current_unit:
                    meter.current_unit.pop()

            handles.append(module.register_forward_pre_hook(pre))
            handles.append(module.register_forward_hook(post))
    ctx = _autocast(autocast_dtype, device)
    try:
        with torch.enable_grad(), meter.hooks(), ctx:
            value = loss(model, batch)
            del value
    finally:
        for h in handles:
            h.remove()
    return meter.total_bytes, meter.by_unit(), unit_inputs


def estimate_memory(model: nn.Module, sample_batch, optimizer_name: str = "adamw", precision=None,
                    batch_size: int | None = None, loss_fn: Callable | None = None,
                    loss=None) -> dict[str, Any]:
    """Bytes one training step of `model` needs at `batch_size`, piece by piece.

    sample_batch: any batch (a pair (inputs, targets), one tensor, a dict, nested containers of
        tensors with the batch on dim 0), a few samples (>= 2 for a two-point fit), already
        transformed as the model sees them; moved to the model's device.
    optimizer_name: "adamw" | "adam" (2 state tensors per parameter) | "sgd" (momentum: 1) |
        "rmsprop" | "adagrad" | "none".
    precision: a Precision, "fp32"/"tf32"/"bf16"/"fp16" or None (fp32); the activations are measured
        under the matching autocast.
    batch_size: the batch to estimate for (default: the sample batch's size).
    loss_fn: for pair batches, loss_fn(model(inputs), targets) is measured (its saved tensors count too).
    loss: how a batch becomes a loss: a `gputrain.train.loss.LossRule` or a callable
        (model, batch) -> loss (or (loss, outputs)). Without loss or loss_fn the model's own loss
        (a scalar, .loss or ["loss"]) or else the sum of its outputs is measured.

    Activations are the bytes autograd saves for backward (saved_tensors_hooks, each storage once),
    measured at the sample batch and half of it and fitted as fixed + per_sample * batch: the
    fixed part holds what does not grow with the batch (autocast's low-precision weight copies).
    Not counted: temporaries freed within an op, cuDNN/cuBLAS workspaces, allocator fragmentation,
    the data set itself. Raises ConfigError for an unknown optimizer or precision.
    """
    opt = optimizer_name.lower()
    if opt not in OPTIMIZER_STATES:
        raise ConfigError(f"unknown optimizer {optimizer_name!r}: choose one of {', '.join(OPTIMIZER_STATES)}")
    prec_name, autocast_dtype = _precision_of(precision)
    params = _unique_parameters(model)
    trainable = [p for p in params if p.requires_grad]
    device = params[0].device if params else torch.device("cpu")

    n_params = sum(p.numel() for p in params)
    n_trainable = sum(p.numel() for p in trainable)
    param_bytes = sum(_nbytes(p) for p in params)
    grad_bytes = sum(_nbytes(p) for p in trainable)  # gradients take the parameter's dtype
    states = OPTIMIZER_STATES[opt]
    opt_bytes = states * grad_bytes  # state tensors are zeros_like(param)

    sample = _to(sample_batch, device)
    loss_call = _loss_callable(loss, loss_fn)
    n = _batch_len(sample)
    batch = batch_size or n
    units = checkpoint_units(model, strict=False)
    with _side_effect_free(model, device):
        full, full_units, full_inputs = _measure_activations(model, sample, loss_call, autocast_dtype, device, units)
        half_n = n // 2
        # One sample: no second point, the fit goes through zero (half None).
        half: int | None = None
        half_units: dict[str, int] = {}
        half_inputs: dict[str, int] = {}
        if half_n >= 1:
            half, half_units, half_inputs = _measure_activations(
                model, _slice(sample, half_n), loss_call, autocast_dtype, device, units)
        bf16_fit = None
        if autocast_dtype is None and _bf16_autocast_works(device):
            bf16_full = _measure_activations(model, sample, loss_call, torch.bfloat16, device, [])[0]
            bf16_half = (_measure_activations(model, _slice(sample, half_n), loss_call,
                                              torch.bfloat16, device, [])[0] if half_n >= 1 else None)
            bf16_fit = _linear_fit(n, bf16_full, half_n, bf16_half)

    per_sample, fixed = _linear_fit(n, full, half_n, half)
    activation_bytes = int(round(fixed + per_sample * batch))
    # On CUDA the real step also holds what the saved tensors miss: gradients of activations during
    # backward and cuDNN/cuBLAS workspaces, which for GEMM-based convolutions grow with the batch
    # (an im2col buffer: 0.8 MB/sample for the CIFAR CNN's second conv in fp32, more than all its
    # saved tensors). Two measured steps give the slope the largest-batch prediction uses.
    # The probe batches are the sample tiled to STEP_PROBE_BATCH and half of it: at a handful of
    # samples cuDNN's heuristics pick other (workspace-free) algorithms than at real batch sizes.
    step_fit = None
    if device.type == "cuda" and half_n >= 1:
        big = max(n, STEP_PROBE_BATCH)
        tiled = _tile(sample, big)
        with _side_effect_free(model, device):
            peak_big = measure_step_memory(model, tiled, loss_fn, precision, opt, loss=loss)["peak_bytes"]
            peak_half = measure_step_memory(model, _slice(tiled, big // 2), loss_fn, precision, opt,
                                            loss=loss)["peak_bytes"]
        step_fit = _linear_fit(big, peak_big, big // 2, peak_half)
    blocks = []
    for unit in units:
        u_per, _ = _linear_fit(n, full_units.get(unit.name, 0), half_n,
                               half_units.get(unit.name, 0) if half is not None else None)
        i_per, _ = _linear_fit(n, full_inputs.get(unit.name, 0), half_n,
                               half_inputs.get(unit.name, 0) if half is not None else None)
        blocks.append({"name": unit.name, "activation_bytes_per_sample": u_per, "input_bytes_per_sample": i_per})

    total = param_bytes + grad_bytes + opt_bytes + activation_bytes
    el = params[0].element_size() if params else 4
    arithmetic = [
        f"parameters: {n_params:,} x {el} B = {param_bytes:,} B",
        f"gradients: {n_trainable:,} trainable x {el} B = {grad_bytes:,} B",
        f"optimizer state ({opt}): {states} x {grad_bytes:,} B = {opt_bytes:,} B",
        f"activations: {fixed:,.0f} B fixed + {per_sample:,.1f} B/sample x {batch:,} = {activation_bytes:,} B "
        f"(measured {full:,} B at batch {n}" + (f", {half:,} B at batch {half_n})" if half is not None else ")"),
        f"total: {param_bytes:,} + {grad_bytes:,} + {opt_bytes:,} + {activation_bytes:,} = {total:,} B",
    ]
    return {
        "batch_size": batch,
        "optimizer": opt,
        "precision": prec_name,
        "device": str(device),
        "parameters": n_params,
        "trainable_parameters": n_trainable,
        "parameter_bytes": param_bytes,
        "gradient_bytes": grad_bytes,
        "optimizer_states_per_parameter": states,
        "optimizer_state_bytes": opt_bytes,
        "activation_bytes": activation_bytes,
        "activation_bytes_per_sample": per_sample,
        "activation_bytes_fixed": fixed,
        "measured_batches": [n] + ([half_n] if half_n >= 1 else []),
        "measured_activation_bytes": [full] + ([half] if half is not None else []),
        "bf16_activation_bytes_per_sample": None if bf16_fit is None else bf16_fit[0],
        "bf16_activation_bytes_fixed": None if bf16_fit is None else bf16_fit[1],
        # CUDA only: the measured peak of a whole step as fixed + per_sample * batch (None elsewhere)
        "step_peak_bytes_per_sample": None if step_fit is None else step_fit[0],
        "step_peak_bytes_fixed": None if step_fit is None else step_fit[1],
        "blocks": blocks,
        "total_bytes": total,
        "arithmetic": arithmetic,
        "not_counted": "op temporaries, cuDNN/cuBLAS workspaces, allocator fragmentation, the data set",
    }


STEP_PROBE_BATCH = 256  # samples in the larger of the two measured CUDA steps


def _tile(t, rows: int):
    """`t` (a tensor or a nested batch: every leaf with the batch dimension) repeated along dim 0 to
    exactly `rows` rows."""

    def one(x: torch.Tensor) -> torch.Tensor:
        reps = -(-rows // x.shape[0])
        return x.repeat(reps, *([1] * (x.dim() - 1)))[:rows]

    return _map_batch_leaves(t, one)


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
        return torch.cuda.is_bf16_supported()
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


# ---------------------------------------------------------------- measuring a real step


def _optimizer_for_probe(model: nn.Module, optimizer_name: str) -> torch.optim.Optimizer | None:
    # lr=0: the probe creates the optimizer's state (its memory) without changing the weights.
    params = [p for p in _unique_parameters(model) if p.requires_grad]
    name = optimizer_name.lower()
    if name in ("adamw", "adam"):
        return torch.optim.AdamW(params, lr=0.0, weight_decay=0.0)
    if name == "sgd":
        return torch.optim.SGD(params, lr=0.0, momentum=0.9)
    if name == "rmsprop":
        return torch.optim.RMSprop(params, lr=0.0)
    if name == "adagrad":
        return torch.optim.Adagrad(params, lr=0.0)
    if name == "none":
        return None
    raise ConfigError(f"unknown optimizer {optimizer_name!r}: choose one of {', '.join(OPTIMIZER_STATES)}")


def _device_of(model: nn.Module) -> torch.device:
    p = next(model.parameters(), None)
    return p.device if p is not None else torch.device("cpu")


def _state_bytes(model: nn.Module, optimizer_name: str) -> int:
    params = _unique_parameters(model)
    trainable = sum(_nbytes(p) for p in params if p.requires_grad)
    return sum(_nbytes(p) for p in params) + trainable * (1 + OPTIMIZER_STATES[optimizer_name.lower()])


def _saved_bytes_at(model: nn.Module, batch, loss_fn, precision, loss=None) -> int:
    device = _device_of(model)
    with _side_effect_free(model, device):
        return _measure_activations(model, _to(batch, device), _loss_callable(loss, loss_fn),
                                    _precision_of(precision)[1], device, [])[0]


def measure_step_memory(model: nn.Module, batch, loss_fn: Callable | None = None, precision=None,
                        optimizer_name: str = "adamw", loss=None) -> dict[str, Any]:
    """The memory a training step of `model` on `batch` (any batch; see `estimate_memory` for
    `loss_fn` and `loss`) takes.

    CUDA: the allocator's peak (max_memory_allocated) over two full steps after a warm-up one
    (forward, backward, optimizer with lr=0 so the weights do not change); `measured` is True.
    Elsewhere nothing bounds the memory the same way, so this is an estimate: parameters,
    gradients and optimizer state plus the bytes saved for backward, measured at this batch
    (`measured` False). Returns {"peak_bytes", "measured", "method", "batch_size"}.
    """
    device = _device_of(model)
    n = _batch_len(batch)
    if device.type != "cuda":
        return {"peak_bytes": _state_bytes(model, optimizer_name)
                + _saved_bytes_at(model, batch, loss_fn, precision, loss=loss),
                "measured": False, "batch_size": n,
                "method": "estimate: parameters + gradients + optimizer state + tensors saved for backward at this batch"}
    torch.cuda.synchronize(device)
    # The allocator counts every live tensor of the process; what is neither the model nor the
    # batch (another model, a data set kept on the GPU, a caller's tensors) is not this step's.
    # Counted before the first step, which creates the optimizer state (the step's own memory).
    from gputrain.batch import tensor_leaves

    own = sum(_device_bytes(t, device) for t in (*model.parameters(), *model.buffers(), *tensor_leaves(batch)))
    own += sum(_device_bytes(p.grad, device) for p in model.parameters())
    others = max(0, torch.cuda.memory_allocated(device) - own)
    step = _probe_step(model, loss_fn, precision, optimizer_name, loss=loss)
    # One step first: with cudnn.benchmark on, a new shape tries several algorithms, each with its
    # own workspace; the steady steps that follow are the ones to measure.
    step(batch)
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)  # the peak restarts at what is allocated now
    for _ in range(2):
        step(batch)
    torch.cuda.synchronize(device)
    return {"peak_bytes": int(torch.cuda.max_memory_allocated(device)) - others, "measured": True, "batch_size": n,
            "method": "torch.cuda.max_memory_allocated over two training steps, less the process's other "
                      "tensors (the model, batch and workspaces included)"}


def _device_bytes(t, device: torch.device) -> int:
    """Bytes of tensor `t` held on `device` (0 for None, non-tensors and tensors elsewhere)."""
    if not isinstance(t, torch.Tensor) or t.device != device:
        return 0
    return t.untyped_storage().nbytes()


def _autocast(dtype: torch.dtype | None, device: torch.device):
    """The training step's autocast context for `dtype` (gputrain enters autocast in one place)."""
    from gputrain.runtime.precision import Precision

    return Precision(str(dtype), dtype, False, False, "").autocast(device)


def _probe_step(model: nn.Module, loss_fn, precision, optimizer_name: str, loss=None) -> Callable:
    """gputrain's TrainStep on `model` (what fit runs), as a `(batch) -> None` callable (the old
    `(x, y)` call still works: a y of None means x is the whole batch).

    The optimizer has lr=0 so the weights do not change. The loss: `loss` (a LossRule or a callable
    (model, batch) -> loss), else loss_fn on a pair, else the model's own loss or the sum of its
    outputs (a stand-in for models whose loss is not given).
    """
    from gputrain.runtime.precision import Precision, RunPrecision
    from gputrain.train.loss import LossRule
    from gputrain.train.step import TrainStep

    device = _device_of(model)
    optimizer = _optimizer_for_probe(model, optimizer_name)
    if optimizer is None:  # "none": gradients only
        optimizer = torch.optim.SGD([p for p in _unique_parameters(model) if p.requires_grad], lr=0.0)
    name, dtype = _precision_of(precision)
    prec = precision if isinstance(precision, Precision) else Precision(name, dtype, False, False, "")
    loss_call = _loss_callable(loss, loss_fn)
    rule = LossRule(compute_loss=lambda m, b: loss_call(m, b))
    step = TrainStep(model, rule, optimizer, RunPrecision(prec, device), device=device, oom_recovery=False)

    def run(batch, *rest) -> None:
        if rest:  # run(x, y)
            batch = batch if rest[0] is None else (batch, rest[0])
        step.run([_to(batch, device)])

    return run


def _fallback_loss(model: nn.Module, batch, loss_fn):
    return _default_loss(model, batch, loss_fn)
