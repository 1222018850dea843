"""Recognizing and recovering from out-of-memory errors.

- `is_oom(exc)`: whether an exception is an out-of-memory error (CUDA, MPS, the CPU allocator,
  cuBLAS/cuDNN workspaces).
- `free_after_oom(device)`: release what a failed step left behind.

Runtime, not diagnostics: the training core (the trainer's OOM handling) and the max-batch search
both use these, and the training core must not import the diagnostics package.
"""

from __future__ import annotations

import gc

import torch

_OOM_MESSAGES = (
    "out of memory",  # CUDA ("CUDA out of memory"), MPS ("MPS backend out of memory"), HIP
    "can't allocate memory",  # the CPU allocator (DefaultCPUAllocator)
    "CUBLAS_STATUS_ALLOC_FAILED",
    "CUDNN_STATUS_ALLOC_FAILED",
    "CUDNN_STATUS_NOT_ENOUGH_WORKSPACE",
)


def is_oom(exc: BaseException) -> bool:
    """Whether `exc` is an out-of-memory error (CUDA, MPS, CPU allocator, cuBLAS/cuDNN workspace)."""
    if isinstance(exc, (torch.OutOfMemoryError, MemoryError)):
        return True
    if isinstance(exc, RuntimeError):
        text = str(exc)
        return any(m.lower() in text.lower() for m in _OOM_MESSAGES)
    return False


def free_after_oom(device: torch.device | str | None = None) -> None:
    """Release what a failed step left behind: collect garbage, then return cached blocks to the driver.

    Call it after the `except` block has ended: the exception's traceback holds the failed step's
    frames, and with them its tensors.
    """
    gc.collect()
    kind = torch.device(device).type if device is not None else None
    if kind in (None, "cuda") and torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.empty_cache()
    if kind == "mps":
        torch.mps.empty_cache()

