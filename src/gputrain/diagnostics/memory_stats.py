"""What is in a device's memory right now.

`memory_stats(device)`: allocated / reserved / peak / free / total bytes (CUDA's caching
allocator, MPS, or this process and the host on the CPU), as plain data for `gputrain memory`.
"""

from __future__ import annotations

import sys
from typing import Any

import torch

def memory_stats(device: torch.device | str) -> dict[str, Any]:
    """Memory of `device` in bytes: allocated, reserved, peak, free, total.

    CUDA: PyTorch's caching allocator (allocated = live tensors, reserved = held by the cache,
    peak = max_memory_allocated since the last reset) and the driver's free/total.
    MPS: current and driver-allocated memory; no peak counter exists.
    CPU: this process's resident memory (allocated), its high-water mark (peak) and the host's
    available/total memory. `kind` says which of these the numbers are.
    """
    device = torch.device(device)
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        return {
            "device": str(device),
            "kind": "cuda",
            "allocated_bytes": int(torch.cuda.memory_allocated(device)),
            "reserved_bytes": int(torch.cuda.memory_reserved(device)),
            "peak_bytes": int(torch.cuda.max_memory_allocated(device)),
            "peak_reserved_bytes": int(torch.cuda.max_memory_reserved(device)),
            "free_bytes": int(free),
            "total_bytes": int(total),
            "note": "PyTorch caching allocator; free/total from the driver",
        }
    import psutil

    vm = psutil.virtual_memory()
    if device.type == "mps":
        return {
            "device": "mps",
            "kind": "mps",
            "allocated_bytes": int(torch.mps.current_allocated_memory()),
            "reserved_bytes": int(torch.mps.driver_allocated_memory()),
            "peak_bytes": None,
            "free_bytes": int(vm.available),
            "total_bytes": int(vm.total),
            "note": "MPS shares the host's memory: free/total are the host's",
        }
    rss = psutil.Process().memory_info().rss
    return {
        "device": "cpu",
        "kind": "host",
        "allocated_bytes": int(rss),
        "reserved_bytes": None,
        "peak_bytes": max(_rss_high_water() or 0, int(rss)),
        "free_bytes": int(vm.available),
        "total_bytes": int(vm.total),
        "note": "CPU: this process's resident memory (peak = its high-water mark); free/total are the host's",
    }


def _rss_high_water() -> int | None:
    try:
        import resource
    except ImportError:  # Windows
        try:
            import psutil

            return int(getattr(psutil.Process().memory_info(), "peak_wset", 0)) or None
        except Exception:
            return None
    maxrss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(maxrss if sys.platform == "darwin" else maxrss * 1024)  # macOS: bytes, Linux: KiB
