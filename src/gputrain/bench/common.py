"""What every benchmark shares: choosing devices, saved-activation bytes, the environment record, files.

Timing is runtime/timing.py's (warm-up, CUDA events or a synchronized host clock, the median of
repeats). A result is a plain dict (JSON-serializable): the environment, the exact config, the
rows, a summary and notes. Rendering lives in gputrain.commands.bench.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import json
import math
import os
import platform
import re
import sys
from pathlib import Path
from typing import Any, Callable

import torch

from gputrain.diagnostics.saved_tensors import SavedTensorMeter, parameter_storages
from gputrain.io.atomic import write_text
from gputrain.runtime.devices import cpu_model_name, device_name, pick_device, torch_build
from gputrain.runtime.precision import matmul_settings

NO_GPU = "no GPU"  # what a GPU cell says when there is no GPU to measure


# ---------------------------------------------------------------- devices


def accelerators(spec: str = "auto", every_gpu: bool = False) -> tuple[list[torch.device], str | None]:
    """The non-CPU devices to measure against the CPU, and why there are none (else None).

    spec "auto": the current CUDA device (every CUDA device when `every_gpu`), else MPS, else none.
    spec "cpu": none. Anything else is validated by pick_device (a bad spec raises DeviceError).
    """
    text = (spec or "auto").strip().lower()
    if text == "cpu":
        return [], f"{NO_GPU}: --device cpu was asked for"
    if text != "auto":
        return [pick_device(text)], None
    device = pick_device("auto")
    if device.type == "cpu":
        return [], f"{NO_GPU}: {why_no_gpu()}"
    if device.type == "cuda" and every_gpu:
        return [torch.device("cuda", i) for i in range(torch.cuda.device_count())], None
    return [device], None


def why_no_gpu() -> str:
    if torch.version.cuda is None and getattr(torch.version, "hip", None) is None:
        return f"no CUDA device (this PyTorch {torch.__version__} is a CPU-only build)"
    return "no CUDA device visible (CUDA build, but no usable GPU or driver)"


def device_slug(device: torch.device | None) -> str:
    """A file-name-safe device label: 'cpu', 'nvidia-h100-80gb-hbm3', ..."""
    if device is None or device.type == "cpu":
        return "cpu"
    slug = re.sub(r"[^a-z0-9]+", "-", device_name(device).lower()).strip("-")
    return slug or device.type


def reference_slug(gpus: list[torch.device]) -> str:
    """The device part of a result file name: the (first) GPU measured, else 'cpu'."""
    return device_slug(gpus[0]) if gpus else "cpu"


# ---------------------------------------------------------------- activation bytes


def saved_tensor_bytes(step: Callable[[], Any], exclude: list[torch.Tensor] | tuple = ()) -> int:
    """Bytes of the tensors autograd saves for backward while `step` runs (each storage once).

    A device-independent measure of activation memory: what a forward pass holds until its backward
    frees it. Storages shared with `exclude` (pass the model's parameters) are not counted, so
    weights are not mistaken for activations. With activation recomputation, only each region's
    inputs are saved (what is computed inside is recomputed in backward): the figure shows the saving.
    """
    meter = SavedTensorMeter(skip_storages=parameter_storages(exclude))
    with meter.hooks():
        step()
    return int(meter.total_bytes)


# ---------------------------------------------------------------- environment and results


def nvml_driver() -> str | None:
    """The NVIDIA driver version via NVML (nvidia-ml-py), or None without it or without a driver."""
    try:
        import pynvml
    except ImportError:
        return None
    try:
        pynvml.nvmlInit()
    except Exception:  # no driver / no GPU: NVML raises its own error classes
        return None
    try:
        version = pynvml.nvmlSystemGetDriverVersion()
        return version.decode() if isinstance(version, bytes) else str(version)
    except Exception:
        return None
    finally:
        try:
            pynvml.nvmlShutdown()
        except Exception:
            pass


def _command_line() -> str:
    argv = list(sys.argv)
    if argv and Path(argv[0]).name in ("gputrain", "__main__.py"):
        argv[0] = "gputrain"
    return " ".join(argv)


def environment(devices: list[torch.device]) -> dict[str, Any]:
    """Where and with what a result was measured: devices, driver, versions, date, command."""
    now = dt.datetime.now(dt.timezone.utc).astimezone()
    build = torch_build()
    return {
        "date": now.date().isoformat(),
        "time": now.isoformat(timespec="seconds"),
        "command": _command_line(),
        "devices": [{"device": str(d), "name": device_name(d)} for d in devices],
        "cpu": cpu_model_name(),
        "cpu_threads": torch.get_num_threads(),
        # Other processes busy on the CPU skew CPU timings (and starve the GPU's launching thread).
        "load_average_1min": os.getloadavg()[0] if hasattr(os, "getloadavg") else None,
        "driver": nvml_driver(),
        "torch": build["torch"],
        "cuda": build["cuda"],
        "cudnn": build["cudnn"],
        "python": platform.python_version(),
        "platform": platform.platform(),
    }


def new_result(name: str, title: str, config: dict[str, Any], gpus: list[torch.device],
               gpu_status: str | None) -> dict[str, Any]:
    """The skeleton every benchmark fills: environment, config, rows, summary, notes."""
    env = environment([torch.device("cpu"), *gpus])
    notes = []
    load, cores = env["load_average_1min"], os.cpu_count() or 1
    if load is not None and load > 0.5 * cores:
        notes.append(f"Warning: the CPU was busy when this run started (load average {load:.1f} on {cores} cores): "
                     "CPU timings are unreliable (threads wait for cores); rerun on an idle machine.")
    return {
        "benchmark": name,
        "title": title,
        "environment": env,
        "config": config,
        "gpu": {"available": bool(gpus), "devices": [str(d) for d in gpus],
                "status": "measured" if gpus else gpu_status},
        "device_slug": reference_slug(gpus),
        "rows": [],
        "summary": {},
        "notes": notes,
        "files": {},
    }


def result_stem(result: dict[str, Any]) -> str:
    """<name>_<device>_<yyyy-mm-dd>, the name of a result's JSON file (and prefix of its plots)."""
    return f"{result['benchmark']}_{result['device_slug']}_{result['environment']['date']}"


def _jsonable(value):
    if isinstance(value, float) and not math.isfinite(value):
        return None if math.isnan(value) else ("inf" if value > 0 else "-inf")
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if isinstance(value, (torch.device, torch.dtype, Path)):
        return str(value)
    return value


def to_json(result: dict[str, Any]) -> str:
    return json.dumps(_jsonable(result), indent=2)


def write_json(result: dict[str, Any], out_dir: str | os.PathLike) -> Path:
    """Write the result to out_dir/<stem>.json (and record the file in result['files'])."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"{result_stem(result)}.json"
    result["files"]["json"] = path.name
    return write_text(path, to_json(result) + "\n")


def on_device(device: torch.device):
    """Make `device` the current CUDA device inside the block (streams, events, graphs); else a no-op."""
    return torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()


def free_device_memory(device: torch.device) -> None:
    import gc

    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def matmul_precision(precision, device: torch.device):
    """Apply a Precision's TF32 setting for CUDA matmuls/convs inside the block, then restore it."""
    return matmul_settings(precision, device)
