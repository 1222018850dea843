"""Numeric precision: a small validated value from a closed set, decided once per run.

"auto" resolves to bf16 on a CUDA GPU with bf16 tensor cores, fp16 (with a GradScaler) on older
CUDA GPUs and fp32 elsewhere, and records why. Impossible requests fail with a ConfigError. An
automatic autocast that the model's first step refuses becomes fp32 for the run (`fp32_instead`,
`RunPrecision.change`: train/step/autocast_decider.py).

`Precision` is the value; `RunPrecision` is the run's one object that owns what follows from it:
the autocast context (`Precision.autocast` is the only place gputrain enters autocast), the loss
scaler, and the process-wide TF32 settings, which it gives back when the run ends.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch
from torch import nn
# From its own module: torch 2.13's torch.amp lists it in __all__, 2.11's does not (a private import to the type gate).
from torch.amp.grad_scaler import GradScaler

from gputrain.errors import ConfigError

CHOICES = ("auto", "fp32", "tf32", "bf16", "fp16")
AUTOCAST_REFUSED = "unsafe to autocast"  # torch's message for the ops its CUDA autocast refuses (BCELoss)


@dataclass(frozen=True)
class Precision:
    name: str  # "fp32" | "tf32" | "bf16" | "fp16"
    autocast_dtype: torch.dtype | None  # None: no autocast
    use_scaler: bool  # fp16 only: gradients need loss scaling to not underflow
    tf32: bool  # allow TF32 tensor cores for fp32 matmuls/convs
    reason: str  # one line for the run log

    def autocast(self, device: torch.device):
        """The autocast context for a forward pass (a no-op context for fp32/tf32).

        The weight-cast cache is off: the same context is entered in eager steps and inside a CUDA
        graph capture, where cached casts would go stale, and a training step casts each weight
        once per forward anyway.
        """
        if self.autocast_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(device_type=device.type, dtype=self.autocast_dtype, cache_enabled=False)


def _cuda_bf16(device: torch.device) -> bool:
    major, _ = torch.cuda.get_device_capability(device)
    return major >= 8


def _cuda_capability(device: torch.device) -> str:
    major, minor = torch.cuda.get_device_capability(device)
    return f"{major}.{minor}"


def resolve_precision(spec: str, device: torch.device) -> Precision:
    """Turn a precision name into a Precision for `device`; raises ConfigError when impossible."""
    name = (spec or "auto").strip().lower()
    if name not in CHOICES:
        raise ConfigError(f"unknown precision {spec!r}: choose one of {', '.join(CHOICES)}")
    dev = device.type
    if name == "auto":
        if dev == "cuda":
            gpu = torch.cuda.get_device_name(device)
            if _cuda_bf16(device):
                return Precision("bf16", torch.bfloat16, False, True,
                                 f"auto: bf16 autocast, since {gpu} (capability {_cuda_capability(device)}) has bf16 tensor cores")
            return Precision("fp16", torch.float16, True, False,
                             f"auto: fp16 autocast with loss scaling, since {gpu} (capability {_cuda_capability(device)}) has no bf16")
        if dev == "mps":
            return Precision("fp32", None, False, False, "auto: fp32 on MPS (autocast there is still partial)")
        return Precision("fp32", None, False, False,
                         "auto: fp32 on the CPU (CPUs gain little from reduced precision, fp16 is not supported there)")
    if name == "fp32":
        return Precision("fp32", None, False, False, "fp32 as requested (TF32 off)")
    if name == "tf32":
        if dev != "cuda":
            raise ConfigError(f"precision tf32 needs an NVIDIA GPU with tensor cores (Ampere or newer), not {dev}: use fp32")
        if not _cuda_bf16(device):
            raise ConfigError(
                f"precision tf32 needs compute capability 8.0+, but {torch.cuda.get_device_name(device)} has "
                f"{_cuda_capability(device)}: use fp16 or fp32")
        return Precision("tf32", None, False, True, "tf32 as requested (fp32 storage, TF32 tensor-core matmuls)")
    if name == "bf16":
        if dev == "cuda" and not _cuda_bf16(device):
            raise ConfigError(
                f"precision bf16 needs compute capability 8.0+, but {torch.cuda.get_device_name(device)} has "
                f"{_cuda_capability(device)}: use fp16 (with loss scaling) or fp32")
        return Precision("bf16", torch.bfloat16, False, dev == "cuda", f"bf16 autocast as requested on {dev}")
    # fp16
    if dev == "cpu":
        raise ConfigError("precision fp16 is not supported on the CPU (no fast fp16 kernels there): use fp32 or bf16")
    return Precision("fp16", torch.float16, True, False, f"fp16 autocast with loss scaling as requested on {dev}")


def fp32_instead(failed: Precision, why: str) -> Precision:
    """fp32 (no autocast, no loss scaling, TF32 off as for fp32) for a run whose automatic `failed`
    precision the model's first step refused (train/step/autocast_decider.py); `why` names the error."""
    return Precision("fp32", None, False, False,
                     f"auto: fp32, since the first step failed under {failed.name} autocast and runs without it: {why}")


def make_scaler(precision: Precision, device: torch.device) -> GradScaler:
    """A GradScaler that is enabled only for fp16 (a disabled scaler passes everything through)."""
    return GradScaler(device.type if device.type in ("cuda", "mps") else "cpu",
                                enabled=precision.use_scaler)


def read_matmul_settings() -> dict:
    """The process-wide TF32 settings, to give back later.

    Read through get_float32_matmul_precision: reading the older allow_tf32 flags raises on recent
    PyTorch once a program has used the newer fp32_precision settings.
    """
    try:
        cudnn = torch.backends.cudnn.allow_tf32
    except RuntimeError:
        cudnn = None
    return {"matmul": torch.get_float32_matmul_precision(), "cudnn": cudnn}


def write_matmul_settings(saved: dict) -> None:
    torch.set_float32_matmul_precision(saved["matmul"])
    if saved.get("cudnn") is not None:
        torch.backends.cudnn.allow_tf32 = saved["cudnn"]


def apply_matmul_settings(precision: Precision, device: torch.device) -> None:
    """Set TF32 for matmuls and cuDNN convolutions to match the precision (process-wide, CUDA only)."""
    if device.type != "cuda":
        return
    torch.set_float32_matmul_precision("high" if precision.tf32 else "highest")
    torch.backends.cudnn.allow_tf32 = precision.tf32


@contextlib.contextmanager
def matmul_settings(precision: Precision, device: torch.device):
    """Apply a Precision's TF32 settings inside the block, then give back what was there."""
    saved = read_matmul_settings()
    apply_matmul_settings(precision, device)
    try:
        yield
    finally:
        write_matmul_settings(saved)


class RunPrecision:
    """A run's precision as one object: autocast, loss scaling, TF32 settings and their restore.

    The step's contract, the same for every precision (as Lightning Fabric's `Precision`), so that
    no caller branches on the dtype: `forward(fn, *args)` (under autocast where there is one),
    `no_autocast()` (a backward started inside a forward of yours), `backward(loss)` (through the
    loss scale in fp16), `unscale_and_clip(optimizer, params, max_norm)`, `step(optimizer, stepper)`
    (through the scaler in fp16, which skips a step with an inf/NaN gradient) and `update()` (the
    scale's update once a step's optimizers stepped). `apply()` sets the process-wide matmul
    settings once, `restore()` gives back what was there before (fit calls it when the run ends,
    also after an error). `precision` is the value decided (name, dtype, reason) for what reports it.
    """

    def __init__(self, precision: Precision, device: torch.device):
        self.device = device
        self._saved: dict | None = None
        self._set(precision)

    def _set(self, precision: Precision) -> None:
        self.precision = precision
        self.scaler = make_scaler(precision, self.device)
        # Decided once per precision, not per call: a forward under fp32 enters no context at all.
        self._autocast = precision.autocast_dtype is not None
        self._scaled = precision.use_scaler

    @property
    def name(self) -> str:
        return self.precision.name

    @property
    def reason(self) -> str:
        return self.precision.reason

    @property
    def scaled(self) -> bool:
        """Whether backward and the optimizer's step go through fp16's loss scaler."""
        return self._scaled

    @property
    def skips_nonfinite(self) -> bool:
        """Whether `step` itself skips a step whose gradients hold an inf or NaN (fp16's scaler does)."""
        return self._scaled

    def autocast(self):
        """The autocast context (a no-op one without autocast): evaluation and probes enter it."""
        return self.precision.autocast(self.device)

    def forward(self, fn: Callable[..., Any], *args: Any) -> Any:
        """`fn(*args)` under the run's autocast (called bare without one)."""
        if not self._autocast:
            return fn(*args)
        with self.precision.autocast(self.device):
            return fn(*args)

    def no_autocast(self):
        """Autocast off inside `forward` (a backward your step starts in its forward runs without it)."""
        if not self._autocast:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, enabled=False)

    def backward(self, loss: torch.Tensor, retain_graph: bool | None = None, create_graph: bool = False) -> None:
        """Backward of `loss` (times the loss scale in fp16)."""
        (self.scaler.scale(loss) if self._scaled else loss).backward(retain_graph=retain_graph,
                                                                      create_graph=create_graph)

    def unscale_and_clip(self, optimizer: torch.optim.Optimizer, params: Sequence[torch.Tensor],
                         max_norm: float | None, foreach: bool | None = None) -> torch.Tensor | None:
        """Unscale `optimizer`'s gradients (fp16) and clip `params`' to `max_norm`: their total norm
        before clipping (a device scalar), or None without `max_norm` (then nothing is unscaled here:
        the scaler's step does it)."""
        if max_norm is None:
            return None
        if self._scaled:
            self.scaler.unscale_(optimizer)
        return nn.utils.clip_grad_norm_(params, max_norm, foreach=foreach)

    def step(self, optimizer: torch.optim.Optimizer, stepper: Callable[[], Any] | None = None,
             update: bool = True) -> Any:
        """The optimizer's step: `stepper()` (its step without torch's per-call profiler range,
        train/optim/calls.py; default `optimizer.step()`), or in fp16 the scaler's step then the
        scale's update (`update=False` where several optimizers step from one backward: each steps,
        then `update()` once). Returns what the step returned (a closure optimizer's loss)."""
        if not self._scaled:
            return stepper() if stepper is not None else optimizer.step()
        out = self.scaler.step(optimizer)
        if update:
            self.scaler.update()
        return out

    def update(self) -> None:
        """The loss scale's update after a step's optimizers stepped (fp16; else nothing)."""
        if self._scaled:
            self.scaler.update()

    def change(self, precision: Precision) -> None:
        """The run's precision is `precision` from now on (in place: the step, the evaluator and the
        checkpoint hold this object): a new scaler, and the TF32 settings when they are applied."""
        self._set(precision)
        if self._saved is not None:
            apply_matmul_settings(precision, self.device)

    def apply(self) -> "RunPrecision":
        if self._saved is None:
            self._saved = read_matmul_settings()
        apply_matmul_settings(self.precision, self.device)
        return self

    def restore(self) -> None:
        if self._saved is not None:
            write_matmul_settings(self._saved)
            self._saved = None

    def state_dict(self) -> dict:
        return self.scaler.state_dict()

    def load_state_dict(self, state: dict) -> None:
        if not state and self.scaler.is_enabled():
            # Saved without loss scaling (an automatic fp16 that the first step turned into fp32,
            # train/step/autocast_decider.py): this run's scaler starts from its initial scale.
            return
        self.scaler.load_state_dict(state)
