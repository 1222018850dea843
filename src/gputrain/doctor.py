"""`gputrain doctor`: is this machine set up to train fast on its GPU? Checks, measurements, fixes.

The facts are gathered once into a `Probe` (so tests can fake any machine); `run_checks` turns
them into pass / warn / fail verdicts, each with a one-line fix; `measure` adds a short
host-to-device bandwidth test and a matmul throughput test against the device's peak.
"""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from gputrain import peaks

CUDA_WHEEL_FIX = ("install a CUDA build of PyTorch: pip install torch --index-url "
                  "https://download.pytorch.org/whl/cu126 (see pytorch.org/get-started)")


@dataclass
class Probe:
    """Everything the checks look at, gathered in one place."""

    torch_version: str
    torch_cuda: str | None  # CUDA version PyTorch was built with; None for a CPU-only build
    cuda_available: bool
    cuda_error: str | None
    nvidia_driver: bool  # an NVIDIA driver is loaded (NVML or /proc/driver/nvidia)
    driver_version: str | None
    driver_cuda: str | None  # newest CUDA the driver supports, "12.4"
    gpus: list[dict[str, Any]] = field(default_factory=list)  # devices.describe_cuda rows
    gpu_processes: dict[int, list[dict[str, Any]]] = field(default_factory=dict)  # index -> NVML processes
    tf32_matmul: bool = False
    mps_built: bool = False
    mps_available: bool = False
    mps_fallback: bool = False


@dataclass
class Check:
    name: str
    status: str  # "pass" | "warn" | "fail"
    message: str
    fix: str = ""


def gather_probe() -> Probe:
    from gputrain import devices, telemetry

    nvml = telemetry.nvml_snapshot()
    gpus, cuda_error = [], None
    available = False
    if devices._cuda_built():
        try:
            available = torch.cuda.is_available()
            if available:
                gpus = [devices.describe_cuda(i) for i in range(torch.cuda.device_count())]
            else:
                try:  # ask CUDA why: the first real call raises the driver's error text
                    torch.cuda.init()
                except Exception as exc:
                    cuda_error = str(exc).strip().splitlines()[0]
        except Exception as exc:
            available, cuda_error = False, str(exc).strip().splitlines()[0]
    procs = {g["index"]: g.get("processes", []) for g in nvml.get("gpus", [])} if nvml.get("available") else {}
    return Probe(
        torch_version=torch.__version__,
        torch_cuda=torch.version.cuda,
        cuda_available=available,
        cuda_error=cuda_error,
        nvidia_driver=bool(nvml.get("available")) or telemetry.nvidia_driver_present(),
        driver_version=nvml.get("driver"),
        driver_cuda=nvml.get("cuda_driver"),
        gpus=gpus,
        gpu_processes=procs,
        tf32_matmul=bool(torch.backends.cuda.matmul.allow_tf32) or torch.get_float32_matmul_precision() != "highest",
        mps_built=devices._mps_built(),
        mps_available=devices._mps_available(),
        mps_fallback=os.environ.get("PYTORCH_ENABLE_MPS_FALLBACK") == "1",
    )


def _version(text: str | None) -> tuple[int, int] | None:
    try:
        major, minor = (text or "").split(".")[:2]
        return int(major), int(minor)
    except ValueError:
        return None


def run_checks(p: Probe) -> list[Check]:
    checks: list[Check] = []
    # 1. The GPU and the PyTorch build.
    if p.nvidia_driver and p.torch_cuda is None:
        checks.append(Check("pytorch build", "fail",
                            f"an NVIDIA GPU is present (driver {p.driver_version or 'loaded'}) but PyTorch "
                            f"{p.torch_version} is a CPU-only build, so it can never use the GPU", CUDA_WHEEL_FIX))
    elif p.torch_cuda is None:
        checks.append(Check("pytorch build", "pass", f"PyTorch {p.torch_version}, CPU-only build (no NVIDIA GPU found)"))
    else:
        checks.append(Check("pytorch build", "pass", f"PyTorch {p.torch_version} built with CUDA {p.torch_cuda}"))
    # 2. CUDA initializes.
    if p.torch_cuda is not None and not p.cuda_available:
        why = p.cuda_error or ("no NVIDIA driver found" if not p.nvidia_driver else "the driver did not initialize")
        checks.append(Check("cuda", "fail", f"PyTorch has CUDA {p.torch_cuda} but CUDA is not available: {why}",
                            "check `nvidia-smi`; install or update the NVIDIA driver; check CUDA_VISIBLE_DEVICES"))
    elif p.cuda_available:
        names = ", ".join(f"cuda:{g['index']} {g['name']}" for g in p.gpus)
        checks.append(Check("cuda", "pass", f"{len(p.gpus)} CUDA device(s): {names}"))
    # 3. Driver new enough for the build.
    build, drv = _version(p.torch_cuda), _version(p.driver_cuda)
    if build and drv:
        if drv[0] < build[0]:
            checks.append(Check("driver", "fail",
                                f"driver {p.driver_version} supports CUDA up to {p.driver_cuda}, but PyTorch was built "
                                f"with CUDA {p.torch_cuda}",
                                f"update the NVIDIA driver, or install a PyTorch built for CUDA {drv[0]}.x"))
        elif drv < build:
            checks.append(Check("driver", "warn",
                                f"driver supports CUDA {p.driver_cuda}, older than PyTorch's {p.torch_cuda}: minor-version "
                                "compatibility usually works, but some kernels (JIT, newest features) may fail",
                                "update the NVIDIA driver"))
        else:
            checks.append(Check("driver", "pass", f"driver {p.driver_version} supports CUDA {p.driver_cuda}"))
    # 4. Memory held by other processes; 5. TF32; 6. bf16.
    for g in p.gpus:
        free, total = g.get("free_memory_bytes"), g.get("total_memory_bytes")
        others = p.gpu_processes.get(g["index"], [])
        if free is not None and total and free < 0.5 * total:
            held = sum(x.get("memory_bytes") or 0 for x in others)
            who = f" ({len(others)} other process(es) hold {held / 2**30:.1f} GiB)" if others else ""
            checks.append(Check(f"memory cuda:{g['index']}", "warn",
                                f"only {free / 2**30:.1f} of {total / 2**30:.1f} GiB free{who}",
                                "stop other jobs on this GPU (nvidia-smi lists them) or pick another with --device cuda:N"))
        elif free is not None:
            checks.append(Check(f"memory cuda:{g['index']}", "pass", f"{free / 2**30:.1f} of {total / 2**30:.1f} GiB free"))
        if g.get("tf32") and not p.tf32_matmul:
            checks.append(Check(f"tf32 cuda:{g['index']}", "warn",
                                f"{g['name']} has TF32 tensor cores but fp32 matmuls in this process do not use them",
                                "torch.set_float32_matmul_precision('high') in your code; gputrain fit turns it on "
                                "for bf16/tf32 runs"))
        if not g.get("bf16"):
            checks.append(Check(f"bf16 cuda:{g['index']}", "warn",
                                f"{g['name']} (capability {g['compute_capability']}) has no bf16 tensor cores: "
                                "mixed precision uses fp16 with loss scaling", "nothing to do; gputrain picks fp16"))
    # 7. CPU only.
    if not p.cuda_available and not p.mps_available:
        checks.append(Check("accelerator", "warn",
                            "no usable GPU: training runs on the CPU, where mid-size conv nets train 10-100x slower "
                            "than on a current GPU (tiny models like iris are the exception)",
                            "on a machine with an NVIDIA GPU install its driver and a CUDA build of PyTorch"))
    # 8. MPS fallback.
    if p.mps_fallback:
        checks.append(Check("mps fallback", "warn",
                            "PYTORCH_ENABLE_MPS_FALLBACK=1: ops MPS lacks silently run on the CPU, with copies each way",
                            "unset it to see which ops fall back, then avoid them or accept the cost knowingly"))
    return checks


def measure(device: torch.device, budget_s: float = 1.0) -> tuple[dict[str, Any], list[Check]]:
    """A short bandwidth test (pinned vs pageable) and a matmul test against the device's peak."""
    from gputrain.bench.common import measure as timeit

    results: dict[str, Any] = {"device": str(device)}
    checks: list[Check] = []
    if device.type == "cuda":
        nbytes = 64 * 2**20
        src = torch.randint(0, 255, (nbytes,), dtype=torch.uint8)
        pinned = src.pin_memory()
        dst = torch.empty(nbytes, dtype=torch.uint8, device=device)
        bw = {}
        for label, host in (("pageable", src), ("pinned", pinned)):
            r = timeit(lambda h=host: dst.copy_(h, non_blocking=True), device, warmup=2, repeats=5, budget_s=budget_s)
            bw[label] = nbytes / r["median_s"] / 1e9
        results["h2d_gb_per_s"] = bw
        ratio = bw["pinned"] / bw["pageable"]
        checks.append(Check("host-to-device", "pass" if ratio >= 1.2 else "warn",
                            f"64 MiB copies: pinned {bw['pinned']:.1f} GB/s, pageable {bw['pageable']:.1f} GB/s "
                            f"({ratio:.1f}x)",
                            "" if ratio >= 1.2 else "pinned memory should be faster; check the PCIe link (lspci -vv)"))
        name = torch.cuda.get_device_name(device)
        n = 4096
        tf = {}
        for prec, dtype in (("bf16", torch.bfloat16), ("fp32", torch.float32)):
            a = torch.randn(n, n, device=device, dtype=dtype)
            b = torch.randn(n, n, device=device, dtype=dtype)
            r = timeit(lambda: a @ b, device, warmup=3, repeats=10, budget_s=budget_s)
            tf[prec] = 2 * n**3 / r["median_s"] / 1e12
        results["matmul_tflops"] = tf
        fp32_as = "tf32" if torch.backends.cuda.matmul.allow_tf32 else "fp32"
        parts = []
        for prec, value in tf.items():
            peak = peaks.peak_tflops(name, prec if prec != "fp32" else fp32_as)
            parts.append(f"{prec} {value:.0f} TFLOP/s" + (f" ({value / peak:.0%} of {peak:.0f} peak)" if peak else ""))
        peak_bf16 = peaks.peak_tflops(name, "bf16")
        low = peak_bf16 is not None and tf["bf16"] < 0.4 * peak_bf16
        checks.append(Check("matmul", "warn" if low else "pass", f"{n}^3 matmul on {name}: " + ", ".join(parts)
                            + ("" if peak_bf16 else " (no peak known for this GPU)"),
                            "well below peak: check clocks and power limits (nvidia-smi -q -d CLOCK,POWER) and "
                            "other jobs" if low else ""))
    else:
        n = 512
        a, b = torch.randn(n, n), torch.randn(n, n)
        r = timeit(lambda: a @ b, device, warmup=2, repeats=5, budget_s=budget_s)
        gflops = 2 * n**3 / r["median_s"] / 1e9
        results["matmul_gflops_fp32"] = gflops
        checks.append(Check("matmul", "pass", f"{n}^3 fp32 matmul on the CPU: {gflops:.1f} GFLOP/s "
                            f"({torch.get_num_threads()} threads)"))
        results["h2d_gb_per_s"] = None
        checks.append(Check("host-to-device", "pass", "skipped: no GPU to copy to"))
    return results, checks


def doctor(run_measurements: bool = True, probe: Probe | None = None) -> dict[str, Any]:
    """All checks (and measurements); returns plain data with `ok` False when any check failed."""
    probe = probe or gather_probe()
    checks = run_checks(probe)
    measurements = None
    if run_measurements:
        device = torch.device("cuda", 0) if probe.cuda_available and probe.gpus else torch.device("cpu")
        try:
            measurements, more = measure(device)
            checks += more
        except Exception as exc:  # a measurement must never hide the checks
            checks.append(Check("measurements", "warn", f"could not measure on {device}: {exc}"))
    return {
        "ok": not any(c.status == "fail" for c in checks),
        "checks": [asdict(c) for c in checks],
        "measurements": measurements,
        "probe": asdict(probe),
    }
