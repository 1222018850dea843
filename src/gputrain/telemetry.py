"""Live telemetry: NVIDIA's NVML (through nvidia-ml-py) for GPUs, psutil for the host.

Everything returns plain dicts. A machine without NVML (no NVIDIA driver, or the package missing)
gets {"available": False, "reason": ...}: absence is information, never an error.
"""

from __future__ import annotations

from typing import Any


def _text(value) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def nvml_snapshot() -> dict[str, Any]:
    """Driver, CUDA driver version and per-GPU utilization, temperature, power and memory."""
    try:
        import pynvml
    except Exception as exc:  # nvidia-ml-py not installed
        return {"available": False, "reason": f"nvidia-ml-py is not importable ({type(exc).__name__})"}
    try:
        pynvml.nvmlInit()
    except Exception as exc:
        return {"available": False, "reason": f"NVML did not initialize (no NVIDIA driver?): {_text(exc)}"}
    try:
        out: dict[str, Any] = {"available": True, "driver": _safe(lambda: _text(pynvml.nvmlSystemGetDriverVersion()))}
        cuda = _safe(pynvml.nvmlSystemGetCudaDriverVersion)
        out["cuda_driver"] = f"{cuda // 1000}.{(cuda % 1000) // 10}" if isinstance(cuda, int) else None
        gpus = []
        for i in range(pynvml.nvmlDeviceGetCount()):
            h = pynvml.nvmlDeviceGetHandleByIndex(i)
            mem = _safe(lambda: pynvml.nvmlDeviceGetMemoryInfo(h))
            util = _safe(lambda: pynvml.nvmlDeviceGetUtilizationRates(h))
            power = _safe(lambda: pynvml.nvmlDeviceGetPowerUsage(h))  # milliwatts
            limit = _safe(lambda: pynvml.nvmlDeviceGetEnforcedPowerLimit(h))
            procs = _safe(lambda: pynvml.nvmlDeviceGetComputeRunningProcesses(h)) or []
            gpus.append({
                "index": i,
                "name": _safe(lambda: _text(pynvml.nvmlDeviceGetName(h))),
                "uuid": _safe(lambda: _text(pynvml.nvmlDeviceGetUUID(h))),
                "utilization_pct": getattr(util, "gpu", None),
                "memory_utilization_pct": getattr(util, "memory", None),
                "temperature_c": _safe(lambda: pynvml.nvmlDeviceGetTemperature(h, pynvml.NVML_TEMPERATURE_GPU)),
                "power_w": power / 1000 if isinstance(power, (int, float)) else None,
                "power_limit_w": limit / 1000 if isinstance(limit, (int, float)) else None,
                "memory_used_bytes": getattr(mem, "used", None),
                "memory_total_bytes": getattr(mem, "total", None),
                "processes": [{"pid": p.pid, "memory_bytes": getattr(p, "usedGpuMemory", None)} for p in procs],
            })
        out["gpus"] = gpus
        return out
    except Exception as exc:
        return {"available": False, "reason": f"NVML query failed: {_text(exc)}"}
    finally:
        _safe(pynvml.nvmlShutdown)


def _safe(fn):
    try:
        return fn()
    except Exception:
        return None


def nvidia_driver_present() -> bool:
    """An NVIDIA kernel driver is loaded (Linux), whatever PyTorch thinks."""
    import os

    return os.path.exists("/proc/driver/nvidia/version")


def host_memory() -> dict[str, Any]:
    import psutil

    vm = psutil.virtual_memory()
    return {"total_bytes": int(vm.total), "available_bytes": int(vm.available), "used_pct": float(vm.percent)}
