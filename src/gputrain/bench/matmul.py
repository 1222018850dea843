"""Square matrix multiply C = A @ B on the CPU and each GPU: TFLOP/s, % of peak, GPU/CPU speed-up.

The tutorials' matmul benchmark done by the protocol: random (never zero) operands of the measured dtype,
the output buffer allocated once, warm-up, CUDA events, median of repeats. One n x n product is
2 n^3 floating-point operations (n^2 outputs, each n multiplies and n adds).
"""

from __future__ import annotations

from typing import Any

import torch

from gputrain.bench.common import accelerators, device_name, free_device_memory, matmul_precision, new_result
from gputrain.errors import ConfigError
from gputrain.diagnostics.peaks import peak_tflops
from gputrain.runtime.precision import resolve_precision
from gputrain.runtime.timing import measure

DTYPES = ("fp32", "tf32", "bf16", "fp16")
STORAGE = {"fp32": torch.float32, "tf32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
DEFAULT_SIZES = tuple(2**k for k in range(7, 14))  # 128 .. 8192
QUICK_SIZES = (64, 128, 256)
CPU_MAX_SIZE = 2048  # a 2048^3 fp32 product takes ~0.1-0.3 s on a few cores; 8192^3 would take ~64x that


def matmul_flops(n: int) -> int:
    """Floating-point operations of one (n x n) @ (n x n) product: 2 n^3."""
    return 2 * n**3


def not_applicable(dtype: str, device: torch.device) -> str | None:
    """Why `dtype` cannot be measured on `device` (resolve_precision's reason), or None."""
    try:
        resolve_precision(dtype, device)
    except ConfigError as exc:
        return f"n/a: {exc}"
    return None


def config_for(quick: bool = False, sizes: list[int] | None = None, dtypes: list[str] | None = None,
               cpu_max_size: int | None = None) -> dict[str, Any]:
    return {
        "sizes": sorted(set(sizes)) if sizes else list(QUICK_SIZES if quick else DEFAULT_SIZES),
        "dtypes": list(dtypes or DTYPES),
        "cpu_max_size": cpu_max_size or (max(QUICK_SIZES) if quick else CPU_MAX_SIZE),
        "warmup": 1 if quick else 3,
        "repeats": 3 if quick else 10,
        "min_sample_s": 2e-3 if quick else 20e-3,
        "budget_s": 1.0 if quick else 5.0,  # cap on one (device, dtype, size) measurement
        "quick": quick,
    }


def _time_matmul(n: int, dtype: str, device: torch.device, cfg: dict[str, Any]) -> dict[str, Any]:
    gen = torch.Generator(device=device).manual_seed(n)
    a = torch.randn(n, n, device=device, dtype=STORAGE[dtype], generator=gen)
    b = torch.randn(n, n, device=device, dtype=STORAGE[dtype], generator=gen)
    c = torch.empty(n, n, device=device, dtype=STORAGE[dtype])
    with matmul_precision(resolve_precision(dtype, device), device):
        t = measure(lambda: torch.mm(a, b, out=c), device, warmup=cfg["warmup"], repeats=cfg["repeats"],
                    min_sample_s=cfg["min_sample_s"], budget_s=cfg["budget_s"])
    return t


def run_matmul(device: str = "auto", quick: bool = False, sizes: list[int] | None = None,
               dtypes: list[str] | None = None, cpu_max_size: int | None = None) -> dict[str, Any]:
    """Measure every (size, dtype) on the CPU and each GPU. Returns a result dict whose rows are
    one per (device, dtype, size) and whose summary["speedup"] pairs GPU and CPU at the same dtype."""
    cfg = config_for(quick, sizes, dtypes, cpu_max_size)
    unknown = [d for d in cfg["dtypes"] if d not in DTYPES]
    if unknown:
        raise ConfigError(f"unknown dtype {unknown[0]!r} for bench matmul: choose from {', '.join(DTYPES)}")
    gpus, no_gpu = accelerators(device, every_gpu=True)
    dropped = [n for n in cfg["sizes"] if n > cfg["cpu_max_size"]] if not gpus else []
    if dropped and len(dropped) < len(cfg["sizes"]):  # nothing would run at those sizes
        cfg["sizes"] = [n for n in cfg["sizes"] if n <= cfg["cpu_max_size"]]
    else:
        dropped = []
    result = new_result("matmul", "Square matmul throughput (TFLOP/s) and GPU/CPU speed-up", cfg, gpus, no_gpu)
    cpu = torch.device("cpu")
    names = {str(d): device_name(d) for d in [cpu, *gpus]}
    rows = result["rows"]
    speedups = []
    for n in cfg["sizes"]:
        for dtype in cfg["dtypes"]:
            times: dict[str, float] = {}
            for dev in [cpu, *gpus]:
                row = {"device": str(dev), "device_name": names[str(dev)], "dtype": dtype, "size": n,
                       "flops": matmul_flops(n)}
                why = not_applicable(dtype, dev)
                if why is None and dev.type == "cpu" and n > cfg["cpu_max_size"]:
                    why = f"skipped: CPU sizes capped at {cfg['cpu_max_size']} (--cpu-max-size)"
                if why is not None:
                    rows.append({**row, "status": why})
                    continue
                t = _time_matmul(n, dtype, dev, cfg)
                peak = peak_tflops(names[str(dev)], dtype) if dev.type == "cuda" else None
                tflops = row["flops"] / t["median_s"] / 1e12
                rows.append({**row, "status": "measured", **t, "tflops": tflops,
                             "tflops_best": row["flops"] / t["min_s"] / 1e12, "peak_tflops": peak,
                             "pct_of_peak": 100.0 * tflops / peak if peak else None})
                times[str(dev)] = t["median_s"]
            for g in gpus or [None]:
                pair = {"size": n, "dtype": dtype, "gpu": str(g) if g is not None else None}
                if g is None:
                    speedups.append({**pair, "cpu_s": times.get("cpu"), "gpu_s": None, "speedup": None,
                                     "status": no_gpu})
                elif str(g) in times and "cpu" in times:
                    speedups.append({**pair, "cpu_s": times["cpu"], "gpu_s": times[str(g)],
                                     "speedup": times["cpu"] / times[str(g)], "status": "measured"})
                else:
                    missing = "GPU" if str(g) not in times else "CPU"
                    speedups.append({**pair, "cpu_s": times.get("cpu"), "gpu_s": times.get(str(g)), "speedup": None,
                                     "status": f"{missing} not measured at this size/dtype"})
            for dev in gpus:
                free_device_memory(dev)
    result["summary"]["speedup"] = speedups
    best = [r for r in rows if r["status"] == "measured"]
    result["summary"]["best"] = {
        f"{dev}/{dt}": max((r["tflops"] for r in best if r["device"] == dev and r["dtype"] == dt), default=None)
        for dev in names for dt in cfg["dtypes"]}
    result["notes"] += [
        "FLOPs per product: 2*n^3; TFLOP/s from the median time (tflops_best from the fastest sample).",
        f"CPU: fp32 and bf16 only; sizes above {cfg['cpu_max_size']} are skipped to keep the run short.",
        "Speed-up: CPU time / GPU time at the same size and dtype, measured side by side in this run.",
        "% of peak uses gputrain.diagnostics.peaks (dense tensor-core figures); an unknown device gets none.",
    ]
    if not gpus:
        result["notes"].append(f"GPU columns: {no_gpu}.")
    if dropped:
        result["notes"].append(f"Sizes {', '.join(map(str, dropped))} not run: above the CPU cap, and no GPU.")
    return result
