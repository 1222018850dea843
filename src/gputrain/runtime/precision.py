"""Numeric precision: a small validated value from a closed set, decided once per run.

"auto" resolves to bf16 on a CUDA GPU with bf16 tensor cores, fp16 (with a GradScaler) on older
CUDA GPUs and fp32 elsewhere, and records why. Impossible requests fail with a ConfigError.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch

from gputrain.errors import ConfigError

CHOICES = ("auto", "fp32", "tf32", "bf16", "fp16")


@dataclass(frozen=True)
class Precision:
    name: str  # "fp32" | "tf32" | "bf16" | "fp16"
    autocast_dtype: torch.dtype | None  # None: no autocast
    use_scaler: bool  # fp16 only: gradients need loss scaling to not underflow
    tf32: bool  # allow TF32 tensor cores for fp32 matmuls/convs
    reason: str  # one line for the run log

    @property
    def label(self) -> str:
        return self.name


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


def autocast(precision: Precision, device: torch.device):
    """The autocast context for a forward pass; a no-op context for fp32/tf32."""
    if precision.autocast_dtype is None:
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, dtype=precision.autocast_dtype)


def make_scaler(precision: Precision, device: torch.device) -> torch.amp.GradScaler:
    """A GradScaler that is enabled only for fp16 (a disabled scaler passes everything through)."""
    return torch.amp.GradScaler(device.type if device.type in ("cuda", "mps") else "cpu",
                                enabled=precision.use_scaler)


def apply_matmul_settings(precision: Precision, device: torch.device) -> None:
    """Set TF32 for matmuls and cuDNN convolutions to match the precision (process-wide)."""
    if device.type != "cuda":
        return
    torch.backends.cuda.matmul.allow_tf32 = precision.tf32
    torch.backends.cudnn.allow_tf32 = precision.tf32
