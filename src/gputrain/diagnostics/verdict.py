"""What bounds a training step, decided from recorded numbers (a pure function, no device needed).

`diagnose(metrics)` takes the figures `gputrain.diagnostics.profiling.profile_workload` records (or ones read
from an old summary JSON) and returns one verdict with the evidence behind it and what to try:

- input-bound: getting the batch (data wait + host-to-device copy) takes a large share of the step.
- launch-bound: the GPU is mostly idle and its kernels are short: the host cannot launch them as
  fast as the GPU finishes them (the iris-mlp workload).
- sync-bound: the host waits for the GPU every step (`.item()`, `print(loss)`, `.cpu()`), so the
  GPU runs dry while the host catches up.
- compute-bound: the GPU is busy; the remaining lever is doing less or cheaper arithmetic.
"""

from __future__ import annotations

from typing import Any

VERDICTS = ("input-bound", "launch-bound", "sync-bound", "compute-bound")

# Thresholds (shares are fractions of a step).
INPUT_SHARE = 0.30  # data wait + H2D above this: input-bound
IDLE_BUSY = 0.60  # GPU busy below this: something other than compute bounds the step
SHORT_KERNEL_US = 15.0  # median kernel shorter than this: launches (~5-10 us of host time each) cannot keep up
SYNC_WAIT_SHARE = 0.30  # host time blocked in synchronizing calls above this, with an idle GPU: sync-bound


def _share(metrics: dict[str, Any], phases: tuple[str, ...]) -> float | None:
    breakdown = metrics.get("breakdown_ms")
    if not breakdown:
        return None
    total = sum(v for v in breakdown.values() if v is not None)
    if total <= 0:
        return None
    return sum(breakdown.get(p) or 0.0 for p in phases) / total


def _pct(x: float) -> str:
    return f"{100 * x:.0f}%"


def diagnose(metrics: dict[str, Any]) -> dict[str, Any]:
    """The verdict for one profiled workload.

    metrics (any may be missing or None):
      device_type: "cuda" | "cpu" | "mps"
      step_ms: median wall time of a step
      breakdown_ms: {"data", "h2d", "forward", "backward", "optimizer", "logging": ms per step};
        or data_share: (data + h2d) / step
      kernels_per_step, median_kernel_us: from the profiler trace
      gpu_busy: fraction of the step with a kernel or copy running (trace); or gpu_util_pct (NVML)
      syncs_per_step: synchronizing calls per step; sync_wait_share: host time blocked in them / step
      host_reads_per_step: reads of device values on the host per step, counted at the dispatcher on
        any device (each a sync on a GPU); host_read_site: the most frequent one, "file:line (what)"
      mfu: model FLOP utilization (0..1) where the device's peak is known

    Returns {"verdict", "evidence": [str], "suggestions": [str], "also": [str] (other findings worth
    fixing), "numbers": {the figures used}}.
    """
    device = metrics.get("device_type") or "cuda"
    data_share = metrics.get("data_share")
    if data_share is None:
        data_share = _share(metrics, ("data", "h2d"))
    busy = metrics.get("gpu_busy")
    if busy is None and metrics.get("gpu_util_pct") is not None:
        busy = metrics["gpu_util_pct"] / 100.0
    kernel_us = metrics.get("median_kernel_us")
    kernels = metrics.get("kernels_per_step")
    syncs = metrics.get("syncs_per_step")
    sync_share = metrics.get("sync_wait_share")
    mfu = metrics.get("mfu")
    reads = metrics.get("host_reads_per_step")
    numbers = {"data_share": data_share, "gpu_busy": busy, "median_kernel_us": kernel_us,
               "kernels_per_step": kernels, "syncs_per_step": syncs, "sync_wait_share": sync_share, "mfu": mfu,
               "host_reads_per_step": reads, "step_ms": metrics.get("step_ms")}

    evidence: list[str] = []
    suggestions: list[str] = []
    also: list[str] = []

    def sync_advice() -> str:
        return ("remove per-step host reads: accumulate the loss on the device and call .item() every N "
                "steps (--log-every N); no print(loss), .cpu(), .tolist() or `if tensor:` "
                "in the loop; run `detect_syncs` to find each one's file and line")

    if data_share is not None and data_share >= INPUT_SHARE:
        verdict = "input-bound"
        evidence.append(f"getting the batch (data wait + host-to-device copy) takes {_pct(data_share)} of the step")
        suggestions += [
            "keep the data set on the device (TrainConfig(data_on_device=True)): batches become slices, no copies",
            "else more DataLoader workers, pin_memory=True and non_blocking copies, or a prefetcher on a side stream",
            "do per-sample CPU work (decoding, augmentation) once up front or on the GPU per batch",
        ]
    elif device != "cuda":
        verdict = "compute-bound"
        evidence.append(f"on {device} the host runs every op itself; the batch takes "
                        f"{_pct(data_share) if data_share is not None else 'little'} of the step")
        suggestions.append("a CUDA GPU, for a model and batch large enough to keep it busy (see `gputrain bench crossover`)")
        also.append("launch- and sync-bound need a CUDA GPU to be told apart; profile there to check")
    elif busy is not None and busy < IDLE_BUSY:
        short = kernel_us is not None and kernel_us < SHORT_KERNEL_US
        waits = syncs is not None and syncs > 0 and sync_share is not None and sync_share >= SYNC_WAIT_SHARE
        if (syncs and not short) or waits:
            verdict = "sync-bound"
            evidence.append(f"{syncs:g} synchronizing call(s) per step" +
                            (f" block the host for {_pct(sync_share)} of the step" if sync_share is not None else ""))
            evidence.append(f"the GPU is busy only {_pct(busy)} of the step: after each sync it waits for new work")
            suggestions.append(sync_advice())
            suggestions.append("then CUDA graphs (TrainConfig(cuda_graphs=True)) can replay the whole step at once")
        else:
            verdict = "launch-bound"
            if kernel_us is not None:
                evidence.append(f"the median kernel runs {kernel_us:.1f} us, about what launching one costs the host"
                                + (f"; {kernels:.0f} kernels per step" if kernels else ""))
            evidence.append(f"the GPU is busy only {_pct(busy)} of the step")
            suggestions += [
                "CUDA graphs (TrainConfig(cuda_graphs=True)) or torch.compile(mode='reduce-overhead'): one launch per step",
                "a larger batch: the same number of launches does more work each",
                "torch.compile fuses element-wise kernels: fewer launches",
                "for a model this small the CPU may simply be faster (iris-mlp trains faster on a desktop CPU than on a 3080 Ti)",
            ]
            if syncs:
                also.append(f"{syncs:g} sync(s) per step as well: {sync_advice()}")
    else:
        verdict = "compute-bound"
        if busy is not None:
            evidence.append(f"the GPU is busy {_pct(busy)} of the step")
        if mfu is not None:
            evidence.append(f"MFU {100 * mfu:.1f}% of the device's peak for this precision")
            if mfu < 0.3:
                suggestions.append("busy but far from peak: memory-bound kernels (element-wise, small convs) dominate; "
                                   "torch.compile fuses them, channels_last helps convolutions")
        else:
            evidence.append("MFU unknown (no peak figure for this device)")
        suggestions += [
            "bf16 autocast (TrainConfig(precision='bf16')) runs matmuls and convolutions on tensor cores",
            "torch.compile (TrainConfig(compile=True)) fuses element-wise work",
            "more speed now needs fewer FLOPs (a smaller model) or more GPUs",
        ]
        if syncs:
            also.append(f"{syncs:g} sync(s) per step: cheap while the GPU stays busy, but {sync_advice()}")

    if reads and not syncs:
        # Off CUDA (or where CUDA's detector saw none): what would sync on a GPU, from the dispatcher.
        site = metrics.get("host_read_site")
        also.append(f"{reads:g} host read(s) of device values per step" + (f", most at {site}" if site else "")
                    + (": free here, but each one is a sync on a GPU" if device != "cuda" else "")
                    + f"; {sync_advice()}")
    if verdict != "input-bound" and data_share is not None and data_share >= 0.10:
        also.append(f"getting the batch still takes {_pct(data_share)} of the step")
    return {"verdict": verdict, "evidence": evidence, "suggestions": suggestions, "also": also, "numbers": numbers}
