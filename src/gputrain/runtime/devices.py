"""Finding, describing, choosing and validating devices (cuda / mps / cpu).

`pick_device` is the one place where a device is decided; everything else takes a torch.device.
The probes below (`_cuda_built`, `_cuda_count`, ...) are module-level functions so that tests can
fake a machine (a GPU without a CUDA build, two GPUs, MPS) on a CPU-only box.
"""

from __future__ import annotations

import functools
import os
import platform
from typing import Any

import torch

from gputrain.errors import DeviceError

GiB = 1024**3

# ---------------------------------------------------------------- probes (patched in tests)


def _cuda_built() -> bool:
    return torch.version.cuda is not None or getattr(torch.version, "hip", None) is not None


def _cuda_available() -> bool:
    return torch.cuda.is_available()


def _cuda_count() -> int:
    return torch.cuda.device_count() if _cuda_available() else 0


def _cuda_name(index: int) -> str:
    return torch.cuda.get_device_name(index)


def _mps_built() -> bool:
    return bool(getattr(torch.backends, "mps", None)) and torch.backends.mps.is_built()


def _mps_available() -> bool:
    return _mps_built() and torch.backends.mps.is_available()


def _probe(device: torch.device) -> None:
    """A tiny allocation: the cheapest proof that the device really works."""
    torch.empty(1, device=device)


# ---------------------------------------------------------------- choosing

_SPEC_HELP = "use 'auto', 'cpu', 'cuda', 'cuda:N' or 'mps'"


def _cuda_list() -> str:
    n = _cuda_count()
    names = ", ".join(f"cuda:{i} {_cuda_name(i)}" for i in range(n))
    return f"{n} CUDA device{'s' if n != 1 else ''}" + (f" ({names})" if n else "")


def pick_device(spec: str | torch.device | None = "auto") -> torch.device:
    """Choose and validate a device.

    spec: "auto" (cuda > mps > cpu), "cpu", "cuda", "cuda:N", "mps", or a torch.device.
    Returns a torch.device with an explicit index for CUDA ("cuda" means the current device).
    Raises DeviceError naming what was asked, what exists and the fix.
    """
    if spec is None:
        spec = "auto"
    if isinstance(spec, torch.device):
        device = spec
    elif isinstance(spec, str):
        text = spec.strip().lower()
        if text == "auto":
            if _cuda_available() and _cuda_count() > 0:
                device = torch.device("cuda", torch.cuda.current_device())
            elif _mps_available():
                device = torch.device("mps")
            else:
                device = torch.device("cpu")
        elif text == "gpu":
            raise DeviceError(f"unknown device 'gpu': {_SPEC_HELP} (an NVIDIA GPU is 'cuda')")
        else:
            try:
                device = torch.device(text)
            except (RuntimeError, ValueError):
                raise DeviceError(f"unknown device {spec!r}: {_SPEC_HELP}") from None
    else:
        raise DeviceError(f"a device must be a string or torch.device, not {type(spec).__name__}: {_SPEC_HELP}")

    if device.type == "cpu":
        return torch.device("cpu")
    if device.type == "cuda":
        return _validate_cuda(device)
    if device.type == "mps":
        return _validate_mps(device)
    raise DeviceError(f"device type {device.type!r} is not supported by gputrain: {_SPEC_HELP}")


def _validate_cuda(device: torch.device) -> torch.device:
    asked = str(device)
    if not _cuda_built():
        raise DeviceError(
            f"{asked} requested, but this PyTorch build has no CUDA support (torch {torch.__version__}): "
            "install a CUDA build of PyTorch (pip install torch --index-url https://download.pytorch.org/whl/cu126, "
            "or see pytorch.org/get-started), or use device 'cpu'"
        )
    if not _cuda_available() or _cuda_count() == 0:
        hidden = os.environ.get("CUDA_VISIBLE_DEVICES")
        why = (
            f"CUDA_VISIBLE_DEVICES={hidden!r} hides every GPU" if hidden is not None and hidden.strip() in ("", "-1")
            else "no usable NVIDIA GPU or driver was found"
        )
        raise DeviceError(
            f"{asked} requested, but CUDA is not available ({why}): run `gputrain doctor` to see why, or use device 'cpu'"
        )
    n = _cuda_count()
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index >= n:
        raise DeviceError(
            f"{asked} requested, but this machine has {_cuda_list()}: use one of cuda:0..cuda:{n - 1}"
        )
    device = torch.device("cuda", index)
    try:
        _probe(device)
    except RuntimeError as exc:  # e.g. out of memory, busy/prohibited compute mode, driver mismatch
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise DeviceError(
            f"{device} ({_cuda_name(index)}) exists but a test allocation failed: {first}. "
            "Check `nvidia-smi` for other processes, or run `gputrain doctor`"
        ) from None
    return device


def _validate_mps(device: torch.device) -> torch.device:
    if not _mps_built():
        raise DeviceError(
            f"MPS requested, but this PyTorch build has no MPS support (torch {torch.__version__}): "
            "MPS needs PyTorch for macOS on Apple silicon; use 'cpu' or 'auto'"
        )
    if not _mps_available():
        raise DeviceError(
            "MPS requested, but this machine has no usable MPS device (it needs an Apple-silicon Mac "
            "with macOS 12.3 or newer): use 'cpu' or 'auto'"
        )
    device = torch.device("mps")
    try:
        _probe(device)
    except RuntimeError as exc:
        raise DeviceError(f"mps exists but a test allocation failed: {exc}") from None
    return device


# ---------------------------------------------------------------- describing


def cuda_capability_flags(major: int, minor: int) -> dict[str, bool]:
    """Hardware features that follow from the compute capability.

    bf16 tensor cores and TF32 arrived with Ampere (8.0).
    """
    return {"bf16": major >= 8, "tf32": major >= 8}


def describe_cuda(index: int) -> dict[str, Any]:
    """One CUDA device: name, memory (bytes), capability, SM count, bf16/TF32 support."""
    props = torch.cuda.get_device_properties(index)
    try:
        free, total = torch.cuda.mem_get_info(index)
    except RuntimeError:
        free, total = None, props.total_memory
    flags = cuda_capability_flags(props.major, props.minor)
    return {
        "index": index,
        "device": f"cuda:{index}",
        "name": props.name,
        "total_memory_bytes": int(total),
        "free_memory_bytes": None if free is None else int(free),
        "compute_capability": f"{props.major}.{props.minor}",
        "multiprocessors": props.multi_processor_count,
        "bf16": flags["bf16"],
        "tf32": flags["tf32"],
    }


def seed_run(seed: int, device: torch.device) -> None:
    """Seed what a run on `device` draws from (dropout, initialization made after this, sampling).

    An accelerator run takes `torch.manual_seed` (the CPU and every device). A CPU run seeds the
    CPU generator only: that is all it draws from, and `torch.manual_seed` also queues a seed for
    each accelerator type not initialized yet, recording the caller's stack for each (~0.5 ms a call
    on the CPU machine, a third of fit's setup there).
    """
    if device.type == "cpu":
        torch.default_generator.manual_seed(seed)
    else:
        torch.manual_seed(seed)


@functools.cache
def cpu_model_name() -> str:
    """The CPU's model name (read once per process: /proc/cpuinfo is long on many-core hosts)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.lower().startswith(("model name", "hardware", "cpu model")):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown CPU"


def device_name(device: torch.device) -> str:
    """The hardware behind `device`: 'NVIDIA H100 80GB HBM3', 'Apple MPS', the CPU's model name."""
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    if device.type == "mps":
        return "Apple MPS"
    if device.type == "cpu":
        return cpu_model_name()
    return str(device)


def device_label(device: torch.device) -> str:
    """`device` and its hardware, for run logs and summaries: 'cuda:0 (NVIDIA H100 80GB HBM3)',
    'cpu (AMD EPYC 7B13, 2 threads)'."""
    if device.type == "cpu":
        return f"cpu ({cpu_model_name()}, {torch.get_num_threads()} threads)"
    if device.type == "cuda":
        return f"{device} ({device_name(device)})"
    return str(device)


def describe_cpu() -> dict[str, Any]:
    import psutil

    vm = psutil.virtual_memory()
    return {
        "device": "cpu",
        "name": cpu_model_name(),
        "architecture": platform.machine(),
        "physical_cores": psutil.cpu_count(logical=False),
        "logical_cores": psutil.cpu_count(logical=True),
        "torch_threads": torch.get_num_threads(),
        "total_memory_bytes": int(vm.total),
        "available_memory_bytes": int(vm.available),
    }


def describe_mps() -> dict[str, Any]:
    return {
        "built": _mps_built(),
        "available": _mps_available(),
        "fallback_to_cpu": os.environ.get("PYTORCH_ENABLE_MPS_FALLBACK") == "1",
    }


def torch_build() -> dict[str, Any]:
    cudnn = None
    if _cuda_built():
        try:
            cudnn = torch.backends.cudnn.version()
        except Exception:  # cuDNN missing from a broken install: report, don't fail
            cudnn = None
    return {
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "hip": getattr(torch.version, "hip", None),
        "cudnn": cudnn,
        "cuda_arch_list": torch.cuda.get_arch_list() if _cuda_built() else [],
        "build": "CUDA" if torch.version.cuda else ("ROCm" if getattr(torch.version, "hip", None) else "CPU-only"),
    }


def describe_devices() -> dict[str, Any]:
    """Every device this process can see, as plain data (JSON-serializable)."""
    cuda = []
    cuda_error = None
    if _cuda_built():
        try:
            cuda = [describe_cuda(i) for i in range(_cuda_count())]
        except RuntimeError as exc:
            cuda_error = str(exc).strip().splitlines()[0]
    return {
        "cuda": cuda,
        "cuda_error": cuda_error,
        "mps": describe_mps(),
        "cpu": describe_cpu(),
    }


def synchronizer(device: torch.device):
    """A function that waits for the device's queued work; a no-op on the CPU (bound once)."""
    if device.type == "cuda":
        return lambda: torch.cuda.synchronize(device)
    if device.type == "mps":
        return torch.mps.synchronize
    return lambda: None


def take_peak_memory(device: torch.device) -> int | None:
    """Bytes: CUDA's peak allocated since the last call (the peak is reset for the next interval);
    MPS's driver allocation now; None on the CPU (no allocator statistics)."""
    if device.type == "cuda":
        peak = torch.cuda.max_memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        return int(peak)
    if device.type == "mps":
        return int(torch.mps.driver_allocated_memory())
    return None
