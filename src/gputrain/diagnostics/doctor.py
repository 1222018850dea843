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

from gputrain.diagnostics import peaks
from gputrain import torch_compat

GiB = 2**30

CUDA_WHEEL_FIX = ("install a CUDA build of PyTorch: pip install torch --index-url "
                  "https://download.pytorch.org/whl/cu126 (see pytorch.org/get-started)")


@dataclass
class Probe:
    """Everything the checks look at, gathered in one place."""

    torch_version: str
    torch_cuda: str | None  # CUDA version PyTorch was built with; None for a CPU-only (or ROCm) build
    cuda_available: bool
    cuda_error: str | None
    nvidia_driver: bool  # an NVIDIA GPU and driver are there (NVML sees a GPU, or /proc/driver/nvidia exists)
    driver_version: str | None
    driver_cuda: str | None  # newest CUDA the driver supports, "12.4" (from NVML)
    gpus: list[dict[str, Any]] = field(default_factory=list)  # devices.describe_cuda rows
    # PyTorch CUDA index -> other processes NVML lists on that GPU; an index missing means unknown
    # (no NVML, or its GPU could not be matched to PyTorch's).
    gpu_processes: dict[int, list[dict[str, Any]]] = field(default_factory=dict)
    nvml_reason: str | None = None  # why NVML gave nothing, when it did not
    tf32_matmul: bool = False  # fp32 matmuls in this process may use TF32 tensor cores
    mps_built: bool = False
    mps_available: bool = False
    mps_fallback: bool = False
    torch_hip: str | None = None  # ROCm version of an AMD build (torch.cuda then drives AMD GPUs)
    # The private torch names gputrain uses (torch_compat.py) that this torch lacks: each then
    # runs its fallback. None: not looked up (a Probe built by hand).
    torch_fallbacks: list[str] | None = None


@dataclass
class Check:
    name: str
    status: str  # "pass" | "warn" | "fail"
    message: str
    fix: str = ""


def tf32_matmul_enabled() -> bool:
    """Whether fp32 CUDA matmuls in this process may use TF32 tensor cores.

    PyTorch has two APIs for this (allow_tf32 / set_float32_matmul_precision, and the newer
    fp32_precision); reading the old flag raises once the new one was used, so read the new one first.
    """
    matmul = torch.backends.cuda.matmul
    try:
        new = getattr(matmul, "fp32_precision", None)
        if new is not None:
            return new == "tf32"
        return bool(matmul.allow_tf32)
    except RuntimeError:
        return torch.get_float32_matmul_precision() != "highest"


def gather_probe() -> Probe:
    """Every fact the checks need, read once from this machine (tests build a Probe by hand)."""
    from gputrain.runtime import devices
    from gputrain.diagnostics import telemetry

    nvml, nvml_reason = telemetry.nvml_telemetry()
    gpus, cuda_error = [], None
    available = False
    if devices._cuda_built():
        try:
            available = devices._cuda_available() and devices._cuda_count() > 0
            if available:
                gpus = [devices.describe_cuda(i) for i in range(devices._cuda_count())]
            else:
                try:  # ask CUDA why: initializing raises the driver's own error text
                    torch.cuda.init()
                except Exception as exc:
                    cuda_error = _first_line(exc)
        except Exception as exc:
            available, cuda_error = False, _first_line(exc)
    uuids = {g["index"]: _cuda_uuid(g["index"]) for g in gpus}
    procs = processes_by_cuda_index(gpus, nvml["gpus"] if nvml else [], uuids)
    return Probe(
        torch_version=torch.__version__,
        torch_cuda=torch.version.cuda,
        torch_hip=getattr(torch.version, "hip", None),
        cuda_available=available,
        cuda_error=cuda_error,
        nvidia_driver=bool(nvml and nvml["gpus"]) or telemetry.nvidia_driver_present(),
        driver_version=nvml["driver"] if nvml else None,
        driver_cuda=nvml["cuda_driver"] if nvml else None,
        gpus=gpus,
        gpu_processes=procs,
        nvml_reason=nvml_reason,
        tf32_matmul=tf32_matmul_enabled(),
        mps_built=devices._mps_built(),
        mps_available=devices._mps_available(),
        mps_fallback=os.environ.get("PYTORCH_ENABLE_MPS_FALLBACK") == "1",
        torch_fallbacks=torch_compat.missing(),
    )


def _cuda_uuid(index: int) -> str | None:
    """The UUID of PyTorch's cuda:`index` ("8b7c1b5c-..."), or None when this PyTorch cannot say."""
    try:
        return str(torch.cuda.get_device_properties(index).uuid)
    except Exception:
        return None


def _bare_uuid(text: str | None) -> str | None:
    if not text:
        return None
    text = text.strip().lower()
    for prefix in ("gpu-", "mig-"):
        if text.startswith(prefix):
            text = text[len(prefix):]
    return text


def processes_by_cuda_index(gpus: list[dict[str, Any]], nvml_gpus: list[dict[str, Any]],
                            uuids: dict[int, str | None]) -> dict[int, list[dict[str, Any]]]:
    """Other processes on each of PyTorch's CUDA devices, from NVML's per-GPU process lists.

    NVML numbers every GPU of the machine in PCI bus order; PyTorch numbers only the visible ones
    (CUDA_VISIBLE_DEVICES), fastest first by default. So the indices need not agree: GPUs are
    matched by UUID, and by index only when that fails and every GPU is visible to PyTorch.
    Returns {cuda index: [{pid, memory_bytes, this_process: False}, ...]}; unmatched GPUs are absent.
    """
    by_uuid = {_bare_uuid(g.get("uuid")): g for g in nvml_gpus if g.get("uuid")}
    by_index = {g["index"]: g for g in nvml_gpus}
    all_visible = os.environ.get("CUDA_VISIBLE_DEVICES") is None and len(nvml_gpus) == len(gpus)
    out = {}
    for g in gpus:
        uuid = _bare_uuid(uuids.get(g["index"]))
        match = by_uuid.get(uuid) if uuid else None
        if match is None and all_visible:
            match = by_index.get(g["index"])
        if match is not None:
            out[g["index"]] = [x for x in match.get("processes", []) if not x.get("this_process")]
    return out


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def _version(text: str | None) -> tuple[int, int] | None:
    try:
        major, minor = (text or "").split(".")[:2]
        return int(major), int(minor)
    except ValueError:
        return None


def run_checks(p: Probe) -> list[Check]:
    """Verdicts on a Probe: pass / warn / fail, each with a one-line fix. Pure: no device is touched."""
    checks: list[Check] = []
    # 1. The GPU and the PyTorch build.
    kind = f"a ROCm {p.torch_hip} (AMD) build" if p.torch_hip else "a CPU-only build"
    if p.nvidia_driver and p.torch_cuda is None:
        checks.append(Check("pytorch build", "fail",
                            f"an NVIDIA GPU is present (driver {p.driver_version or 'loaded'}) but PyTorch "
                            f"{p.torch_version} is {kind}, so it can never use the GPU", CUDA_WHEEL_FIX))
    elif p.torch_hip:
        checks.append(Check("pytorch build", "pass", f"PyTorch {p.torch_version} built with ROCm {p.torch_hip}"))
    elif p.torch_cuda is None:
        checks.append(Check("pytorch build", "pass", f"PyTorch {p.torch_version}, CPU-only build (no NVIDIA GPU found)"))
    else:
        checks.append(Check("pytorch build", "pass", f"PyTorch {p.torch_version} built with CUDA {p.torch_cuda}"))
    if p.torch_fallbacks:
        checks.append(Check("torch internals", "warn",
                            f"PyTorch {p.torch_version} lacks {len(p.torch_fallbacks)} of the private names gputrain "
                            f"uses ({', '.join(p.torch_fallbacks)}): gputrain runs its tested fallback for each, "
                            "which may be slower or report less",
                            f"use a PyTorch release the suite was run on ({torch_compat.CHECKED})"))
    elif p.torch_fallbacks is not None:
        checks.append(Check("torch internals", "pass", f"every private name gputrain uses is in PyTorch {p.torch_version}"))
    # 2. CUDA initializes.
    if p.torch_hip and not p.cuda_available:
        checks.append(Check("cuda", "fail", f"PyTorch has ROCm {p.torch_hip} but no AMD GPU is usable: "
                            f"{p.cuda_error or 'no GPU or driver found'}",
                            "run `rocm-smi`; install the ROCm driver; check HIP_VISIBLE_DEVICES"))
    elif p.torch_cuda is not None and not p.cuda_available:
        why = p.cuda_error or ("no NVIDIA driver found" if not p.nvidia_driver else "the driver did not initialize")
        checks.append(Check("cuda", "fail", f"PyTorch has CUDA {p.torch_cuda} but CUDA is not available: {why}",
                            "run `nvidia-smi`; install or update the NVIDIA driver; check CUDA_VISIBLE_DEVICES"))
    elif p.cuda_available:
        names = ", ".join(f"cuda:{g['index']} {g['name']}" for g in p.gpus)
        checks.append(Check("cuda", "pass", f"{len(p.gpus)} CUDA device{'s' if len(p.gpus) != 1 else ''}: {names}"))
    # 3. Driver new enough for the build. Within one major version, CUDA's minor-version
    # compatibility usually lets an older driver run the build, so that is a warning.
    build, drv = _version(p.torch_cuda), _version(p.driver_cuda)
    if build and drv:
        if drv[0] < build[0]:
            checks.append(Check("driver", "fail",
                                f"driver {p.driver_version} supports CUDA up to {p.driver_cuda}, but PyTorch was built "
                                f"with CUDA {p.torch_cuda}",
                                f"update the NVIDIA driver, or install a PyTorch built for CUDA {drv[0]}.x"))
        elif drv < build:
            checks.append(Check("driver", "warn",
                                f"driver {p.driver_version} supports CUDA {p.driver_cuda}, older than PyTorch's "
                                f"{p.torch_cuda}: minor-version compatibility usually works, but some kernels "
                                "(JIT-compiled, newest features) may fail", "update the NVIDIA driver"))
        else:
            checks.append(Check("driver", "pass", f"driver {p.driver_version} supports CUDA {p.driver_cuda} "
                                f"(PyTorch needs {p.torch_cuda})"))
    # 4. Memory held by other processes; 5. TF32; 6. bf16.
    for g in p.gpus:
        checks += _gpu_checks(p, g)
    # 7. CPU only.
    if not p.cuda_available and not p.mps_available:
        checks.append(Check("accelerator", "warn",
                            "no usable GPU: training runs on the CPU, where mid-size conv nets and transformers train "
                            "10-100x slower than on a current GPU (tiny models like iris are the exception)",
                            "fix the failure above" if p.nvidia_driver else
                            "on a machine with an NVIDIA GPU, install its driver and a CUDA build of PyTorch"))
    # 8. MPS fallback.
    if p.mps_fallback:
        checks.append(Check("mps fallback", "warn",
                            "PYTORCH_ENABLE_MPS_FALLBACK=1: ops MPS lacks silently run on the CPU, with copies each way",
                            "unset it to see which ops fall back, then avoid them or accept the cost knowingly"))
    return checks


def _gpu_checks(p: Probe, g: dict[str, Any]) -> list[Check]:
    out = []
    dev = f"cuda:{g['index']}"
    free, total = g.get("free_memory_bytes"), g.get("total_memory_bytes")
    others = p.gpu_processes.get(g["index"])  # None: unknown
    if free is not None and total:
        if free < 0.5 * total:
            if others is None:
                who = ": NVML gives no process list for this GPU, so who holds it is unknown"
            elif others:
                held = sum(x.get("memory_bytes") or 0 for x in others)
                who = (f": {len(others)} other process{'es' if len(others) != 1 else ''} "
                       f"hold{'s' if len(others) == 1 else ''} {held / GiB:.1f} GiB "
                       f"(pids {', '.join(str(x['pid']) for x in others[:5])})")
            else:
                who = ": NVML lists no other process here (one in another container may hold it)"
            out.append(Check(f"memory {dev}", "warn", f"only {free / GiB:.1f} of {total / GiB:.1f} GiB free{who}",
                             "stop the other jobs on this GPU (nvidia-smi lists them) or pick another with --device cuda:N"))
        else:
            out.append(Check(f"memory {dev}", "pass", f"{free / GiB:.1f} of {total / GiB:.1f} GiB free"))
    if g.get("tf32") and not p.tf32_matmul:
        out.append(Check(f"tf32 {dev}", "warn",
                         f"{g['name']} (capability {g['compute_capability']}) has TF32 tensor cores, but fp32 matmuls "
                         "in this process run in full fp32, several times slower",
                         "gputrain fit turns TF32 on for its run when precision is bf16/tf32 (auto picks bf16 here); "
                         "in your own code call torch.set_float32_matmul_precision('high')"))
    if not g.get("bf16"):
        out.append(Check(f"bf16 {dev}", "warn",
                         f"{g['name']} (capability {g['compute_capability']}) has no bf16 tensor cores: mixed precision "
                         "there is fp16 with loss scaling", "nothing to do: gputrain's auto precision picks fp16"))
    return out


# ---------------------------------------------------------------- measurements

MATMUL_N = {"cuda": 4096, "cpu": 512}  # square matmul size per device type


def measure(device: torch.device, budget_s: float = 0.5) -> tuple[dict[str, Any], list[Check]]:
    """A short host-to-device bandwidth test (pinned vs pageable) and a matmul test against the peak.

    CUDA: 64 MiB copies, and 4096^3 matmuls in bf16, tf32 and fp32 timed with CUDA events (warm-up,
    median). CPU: a 512^3 fp32 matmul in GFLOP/s; no copy test. Each timing takes about `budget_s`.
    Returns (measurements as plain data, checks).
    """
    from gputrain.runtime.timing import measure as timeit

    results: dict[str, Any] = {"device": str(device)}
    if device.type != "cuda":
        n = MATMUL_N["cpu"]
        a, b = torch.randn(n, n), torch.randn(n, n)
        r = timeit(lambda: a @ b, device, warmup=2, repeats=5, budget_s=budget_s)
        gflops = 2 * n**3 / r["median_s"] / 1e9
        results.update(h2d_gb_per_s=None, matmul_gflops_fp32=gflops, matmul_n=n, threads=torch.get_num_threads())
        return results, [
            Check("host-to-device", "pass", "skipped: no GPU to copy to"),
            Check("matmul", "pass", f"{n}^3 fp32 matmul on the CPU: {gflops:.1f} GFLOP/s "
                                    f"({torch.get_num_threads()} threads); a current data-center GPU does hundreds of TFLOP/s in bf16"),
        ]

    nbytes = 64 * 2**20
    src = torch.randint(0, 255, (nbytes,), dtype=torch.uint8)
    dst = torch.empty(nbytes, dtype=torch.uint8, device=device)
    bw = {}
    for label, host in (("pageable", src), ("pinned", src.pin_memory())):
        r = timeit(lambda h=host: dst.copy_(h, non_blocking=True), device, warmup=2, repeats=5, budget_s=budget_s)
        bw[label] = nbytes / r["median_s"] / 1e9
    results["h2d_gb_per_s"] = bw
    checks = [transfer_check(bw)]

    name = torch.cuda.get_device_name(device)
    n = MATMUL_N["cuda"]
    tflops = {}
    saved = torch.get_float32_matmul_precision()
    try:
        for prec, dtype, fp32_mode in (("bf16", torch.bfloat16, "highest"), ("tf32", torch.float32, "high"),
                                       ("fp32", torch.float32, "highest")):
            torch.set_float32_matmul_precision(fp32_mode)
            a = torch.randn(n, n, device=device, dtype=dtype)
            b = torch.randn(n, n, device=device, dtype=dtype)
            r = timeit(lambda: a @ b, device, warmup=3, repeats=10, budget_s=budget_s)
            tflops[prec] = 2 * n**3 / r["median_s"] / 1e12
    finally:
        torch.set_float32_matmul_precision(saved)
    results.update(matmul_tflops=tflops, matmul_n=n, device_name=name,
                   peak_tflops={prec: peaks.peak_tflops(name, prec) for prec in tflops})
    checks.append(matmul_check(name, tflops, n))
    return results, checks


def transfer_check(gb_per_s: dict[str, float]) -> Check:
    """Verdict on pinned vs pageable host-to-device GB/s: pinned memory should be clearly faster."""
    pinned, pageable = gb_per_s["pinned"], gb_per_s["pageable"]
    ratio = pinned / pageable
    ok = ratio >= 1.2
    return Check("host-to-device", "pass" if ok else "warn",
                 f"64 MiB copies: pinned {pinned:.1f} GB/s, pageable {pageable:.1f} GB/s ({ratio:.1f}x); "
                 "gputrain's loaders use pinned memory",
                 "" if ok else "pinned copies should be faster: check the PCIe link width and speed (nvidia-smi -q)")


def matmul_check(name: str, tflops: dict[str, float], n: int) -> Check:
    """Verdict on measured matmul TFLOP/s per precision against the peak table.

    A GPU missing from the table gets no % figure (no made-up peak). Warns when bf16 reaches less
    than 40% of the peak: a throttled, power-capped or shared GPU.
    """
    parts = []
    for prec, value in tflops.items():
        peak = peaks.peak_tflops(name, prec)
        parts.append(f"{prec} {value:.0f}" + (f" ({value / peak:.0%} of {peak:.0f})" if peak else ""))
    peak_bf16 = peaks.peak_tflops(name, "bf16")
    low = peak_bf16 is not None and "bf16" in tflops and tflops["bf16"] < 0.4 * peak_bf16
    message = f"{n}^3 matmul on {name}, TFLOP/s: " + ", ".join(parts)
    if peaks.lookup(name) is None:
        message += " (no published peak known for this GPU)"
    return Check("matmul", "warn" if low else "pass", message,
                 "well below peak: check clocks, power limit and other jobs (nvidia-smi -q -d CLOCK,POWER)"
                 if low else "")


def doctor(run_measurements: bool = True, probe: Probe | None = None) -> dict[str, Any]:
    """All checks (and measurements) as plain data: {"ok", "checks", "measurements", "probe"}.

    `ok` is False when any check failed. A measurement that errors becomes a warning; it never
    hides the checks.
    """
    probe = probe or gather_probe()
    checks = run_checks(probe)
    measurements = None
    if run_measurements:
        device = torch.device("cuda", probe.gpus[0]["index"]) if probe.cuda_available and probe.gpus else torch.device("cpu")
        try:
            measurements, more = measure(device)
            checks += more
        except Exception as exc:
            checks.append(Check("measurements", "warn", f"could not measure on {device}: {_first_line(exc)}",
                                "run `gputrain bench matmul` for details"))
    return {
        "ok": not any(c.status == "fail" for c in checks),
        "checks": [asdict(c) for c in checks],
        "measurements": measurements,
        "probe": asdict(probe),
    }
