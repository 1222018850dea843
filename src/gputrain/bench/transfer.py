"""Host <-> device copy bandwidth: pageable vs pinned host memory, blocking vs non_blocking copies.

Why it matters: every `.to(device)` of a batch crosses PCIe. Pageable memory is
first staged by the driver through a pinned buffer; pinned (page-locked) memory is copied by DMA
directly and is the only kind for which non_blocking=True really overlaps with the host.

Each copy goes into a buffer allocated once; a non_blocking sample ends with the synchronize that
the timer adds, so every figure is the time until the data has really arrived. GB/s = bytes / s / 1e9.
A host-to-host memcpy is measured too, clearly labelled: it is not a device transfer, but it is the
ceiling of the staging copy that pageable transfers pay.
"""

from __future__ import annotations

from typing import Any

import psutil
import torch

from gputrain.bench.common import accelerators, device_name, free_device_memory, new_result
from gputrain.runtime.timing import measure

KiB, MiB, GiB = 1024, 1024**2, 1024**3
DEFAULT_SIZES = tuple(4 * KiB * 4**k for k in range(10))  # 4 KiB, 16 KiB, ... 256 MiB, 1 GiB
QUICK_SIZES = (4 * KiB, 64 * KiB, 1 * MiB)
DIRECTIONS = ("h2d", "d2h")
MEMORY = ("pageable", "pinned")
MODES = ("blocking", "non_blocking")
HOST_MEMCPY = "host memcpy (CPU to CPU, not a device transfer)"


def config_for(quick: bool = False, sizes: list[int] | None = None) -> dict[str, Any]:
    return {
        "sizes_bytes": sorted(set(sizes)) if sizes else list(QUICK_SIZES if quick else DEFAULT_SIZES),
        "warmup": 1 if quick else 3,
        "repeats": 3 if quick else 10,
        "min_sample_s": 2e-3 if quick else 20e-3,
        "budget_s": 0.5 if quick else 3.0,
        "quick": quick,
    }


def _random_bytes(nbytes: int, device: torch.device) -> torch.Tensor:
    gen = torch.Generator(device=device).manual_seed(nbytes)
    return torch.randint(0, 256, (nbytes,), dtype=torch.uint8, device=device, generator=gen)


def _row(label: str, device: torch.device, direction: str, memory: str, mode: str, nbytes: int) -> dict[str, Any]:
    return {"label": label, "device": str(device), "direction": direction, "memory": memory, "mode": mode,
            "bytes": nbytes}


def _timed(row: dict[str, Any], dst: torch.Tensor, src: torch.Tensor, non_blocking: bool,
           clock_device: torch.device, cfg: dict[str, Any]) -> dict[str, Any]:
    moved = dst.numel() * dst.element_size()  # bytes one copy moves (== row["bytes"])
    t = measure(lambda: dst.copy_(src, non_blocking=non_blocking), clock_device, warmup=cfg["warmup"],
                repeats=cfg["repeats"], min_sample_s=cfg["min_sample_s"], budget_s=cfg["budget_s"])
    return {**row, "bytes": moved, "status": "measured", **t, "gb_per_s": moved / t["median_s"] / 1e9,
            "gb_per_s_best": moved / t["min_s"] / 1e9}


def _gpu_rows(gpu: torch.device, nbytes: int, cfg: dict[str, Any]) -> list[dict[str, Any]]:
    rows = []
    cuda = gpu.type == "cuda"
    on_device = _random_bytes(nbytes, gpu)  # (nbytes,) uint8, the D2H source
    device_buf = torch.empty_like(on_device)  # the H2D destination
    host = {"pageable": on_device.cpu()}  # the H2D sources, same random bytes
    host_dst = {"pageable": torch.empty_like(host["pageable"])}  # the D2H destinations
    if cuda:
        host["pinned"] = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True).copy_(host["pageable"])
        host_dst["pinned"] = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    for direction in DIRECTIONS:
        for memory in MEMORY:
            for mode in MODES:
                row = _row(f"{direction} {memory} {mode}", gpu, direction, memory, mode, nbytes)
                if memory not in host:
                    rows.append({**row, "status": "n/a: pinned memory is a CUDA feature"})
                    continue
                dst, src = (device_buf, host[memory]) if direction == "h2d" else (host_dst[memory], on_device)
                rows.append(_timed(row, dst, src, mode == "non_blocking", gpu, cfg))
    del on_device, device_buf, host, host_dst
    free_device_memory(gpu)
    return rows


def run_transfer(device: str = "auto", quick: bool = False, sizes: list[int] | None = None) -> dict[str, Any]:
    """Measure H2D and D2H GB/s for each size, memory kind and copy mode, plus the host memcpy.

    Without a GPU the device rows carry status "no GPU ..." and no numbers; the host memcpy rows are
    still measured (labelled as such). Returns a result dict.
    """
    cfg = config_for(quick, sizes)
    gpus, no_gpu = accelerators(device)
    gpu = gpus[0] if gpus else None
    result = new_result("transfer", "Host <-> device copy bandwidth (GB/s)", cfg, gpus, no_gpu)
    cpu = torch.device("cpu")
    rows = result["rows"]
    for nbytes in cfg["sizes_bytes"]:
        if gpu is None:
            for direction in DIRECTIONS:
                for memory in MEMORY:
                    for mode in MODES:
                        rows.append({**_row(f"{direction} {memory} {mode}", cpu, direction, memory, mode, nbytes),
                                     "device": None, "status": no_gpu})
        else:
            rows += _gpu_rows(gpu, nbytes, cfg)
        row = _row(HOST_MEMCPY, cpu, "h2h", "pageable", "blocking", nbytes)
        if psutil.virtual_memory().available < 3 * nbytes:
            rows.append({**row, "status": "skipped: not enough free host memory for two buffers"})
            continue
        src = _random_bytes(nbytes, cpu)
        rows.append(_timed(row, torch.empty_like(src), src, False, cpu, cfg))
        del src
    measured = [r for r in rows if r["status"] == "measured"]
    result["summary"]["peak_gb_per_s"] = {
        label: max(r["gb_per_s"] for r in measured if r["label"] == label)
        for label in dict.fromkeys(r["label"] for r in measured)}
    if gpu is not None and gpu.type == "cuda":
        largest = max(cfg["sizes_bytes"])
        get = {(r["label"]): r.get("gb_per_s") for r in measured if r["bytes"] == largest}
        for direction in DIRECTIONS:
            pin, page = get.get(f"{direction} pinned non_blocking"), get.get(f"{direction} pageable blocking")
            if pin and page:
                result["summary"][f"{direction}_pinned_over_pageable"] = pin / page
    result["notes"] += [
        "GB/s = bytes / median seconds / 1e9; each copy writes into a buffer allocated once.",
        "non_blocking samples include the synchronize that ends them: the time until the data has arrived.",
        f"'{HOST_MEMCPY}' is a CPU-side copy for reference, not a transfer to or from a device.",
    ]
    if gpu is None:
        result["notes"].append(f"Device transfers: {no_gpu}; no device numbers are reported.")
    else:
        result["summary"]["device_name"] = device_name(gpu)
    return result
