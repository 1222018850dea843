"""Live telemetry: NVIDIA's NVML (through nvidia-ml-py) for GPUs, psutil for the host.

Everything returns plain dicts. A machine without NVML (no NVIDIA driver, or the package missing)
gets None and a reason: absence is information, never an error, and nothing here raises.
"""

from __future__ import annotations

import functools
import os
from typing import Any


def _text(value) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _safe(fn):
    """fn() or None: one unsupported NVML query (power on some boards, processes in a container)
    must not hide the others."""
    try:
        return fn()
    except Exception:
        return None


def nvml_telemetry() -> tuple[dict[str, Any] | None, str | None]:
    """(telemetry, None) from NVML, or (None, reason) when NVML is absent or fails.

    telemetry: {"driver": "560.35.03", "cuda_driver": "12.6" (newest CUDA the driver supports),
    "gpus": [{index, name, uuid, utilization_pct, memory_utilization_pct, temperature_c, power_w,
    power_limit_w, memory_used_bytes, memory_total_bytes, processes: [{pid, memory_bytes, this_process}],
    other_processes_memory_bytes}]}. Any single value NVML cannot give is None.
    """
    try:
        import pynvml
    except Exception as exc:  # nvidia-ml-py not installed, or broken
        return None, f"nvidia-ml-py is not importable ({type(exc).__name__}: {exc})"
    try:
        pynvml.nvmlInit()
    except Exception as exc:  # NVMLError_LibraryNotFound, _DriverNotLoaded, ...
        return None, f"NVML did not initialize (no NVIDIA driver?): {_text(exc)}"
    try:
        cuda = _safe(pynvml.nvmlSystemGetCudaDriverVersion)  # e.g. 12060 for 12.6
        out: dict[str, Any] = {
            "driver": _safe(lambda: _text(pynvml.nvmlSystemGetDriverVersion())),
            "cuda_driver": f"{cuda // 1000}.{(cuda % 1000) // 10}" if isinstance(cuda, int) else None,
            "gpus": [_gpu(pynvml, i) for i in range(pynvml.nvmlDeviceGetCount())],
        }
        return out, None
    except Exception as exc:
        return None, f"NVML query failed: {_text(exc)}"
    finally:
        _safe(pynvml.nvmlShutdown)


def _gpu(pynvml, index: int) -> dict[str, Any]:
    h = pynvml.nvmlDeviceGetHandleByIndex(index)
    mem = _safe(lambda: pynvml.nvmlDeviceGetMemoryInfo(h))
    util = _safe(lambda: pynvml.nvmlDeviceGetUtilizationRates(h))
    power = _safe(lambda: pynvml.nvmlDeviceGetPowerUsage(h))  # milliwatts
    limit = _safe(lambda: pynvml.nvmlDeviceGetEnforcedPowerLimit(h))  # milliwatts
    procs = _processes(pynvml, h)
    return {
        "index": index,
        "name": _safe(lambda: _text(pynvml.nvmlDeviceGetName(h))),
        "uuid": _safe(lambda: _text(pynvml.nvmlDeviceGetUUID(h))),
        "utilization_pct": getattr(util, "gpu", None),
        "memory_utilization_pct": getattr(util, "memory", None),
        "temperature_c": _safe(lambda: pynvml.nvmlDeviceGetTemperature(h, pynvml.NVML_TEMPERATURE_GPU)),
        "power_w": power / 1000 if isinstance(power, (int, float)) else None,
        "power_limit_w": limit / 1000 if isinstance(limit, (int, float)) else None,
        "memory_used_bytes": getattr(mem, "used", None),
        "memory_total_bytes": getattr(mem, "total", None),
        "processes": procs,
        # None when NVML lists no memory figures (containers often hide other PIDs' usage).
        "other_processes_memory_bytes": _sum_known(p["memory_bytes"] for p in procs if not p["this_process"]),
    }


def _processes(pynvml, handle) -> list[dict[str, Any]]:
    """Compute and graphics processes on one GPU, each pid once."""
    me = os.getpid()
    seen: dict[int, dict[str, Any]] = {}
    for query in ("nvmlDeviceGetComputeRunningProcesses", "nvmlDeviceGetGraphicsRunningProcesses"):
        fn = getattr(pynvml, query, None)  # None: an older pynvml without this query
        if fn is None:
            continue
        for p in _safe(functools.partial(fn, handle)) or []:
            used = getattr(p, "usedGpuMemory", None)
            # NVML reports "not available" as a huge sentinel or None.
            used = int(used) if isinstance(used, int) and 0 <= used < 2**60 else None
            seen.setdefault(p.pid, {"pid": p.pid, "memory_bytes": used, "this_process": p.pid == me})
    return list(seen.values())


def _sum_known(values) -> int | None:
    known = [v for v in values if v is not None]
    return sum(known) if known else None


def nvml_snapshot() -> dict[str, Any]:
    """nvml_telemetry() as one dict for reports: {"available": True, ...} or {"available": False, "reason": ...}."""
    data, reason = nvml_telemetry()
    if data is None:
        return {"available": False, "reason": reason}
    return {"available": True, **data}


def nvidia_driver_present() -> bool:
    """An NVIDIA kernel driver is loaded (Linux), whatever PyTorch or NVML say."""
    return os.path.exists("/proc/driver/nvidia")


def host_memory() -> dict[str, Any]:
    """Host RAM in bytes (psutil): total, available, and percent used."""
    import psutil

    vm = psutil.virtual_memory()
    return {"total_bytes": int(vm.total), "available_bytes": int(vm.available), "used_pct": float(vm.percent)}
