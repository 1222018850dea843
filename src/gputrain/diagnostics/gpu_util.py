"""GPU utilization as NVML reports it, sampled in a background thread while a workload runs.

`GpuUtilSampler(device)`: a context manager; `result()` gives mean/median/max percent, or None
where NVML is absent (no nvidia-ml-py, no driver, not a CUDA device).
"""

from __future__ import annotations

import statistics
import threading
from typing import Any

import torch

from gputrain import torch_compat


class GpuUtilSampler:
    """Samples NVML's GPU utilization (% of time a kernel ran) in a background thread.

    `result()` is None where NVML is absent (no nvidia-ml-py, no driver, not CUDA).
    """

    def __init__(self, device: torch.device, interval_s: float = 0.02):
        self.device, self.interval_s = device, interval_s
        self.samples: list[int] = []
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.error: str | None = None

    def __enter__(self) -> "GpuUtilSampler":
        if self.device.type != "cuda":
            self.error = "not a CUDA device"
            return self
        try:
            import pynvml

            pynvml.nvmlInit()
            index = torch_compat.nvml_device_index(self.device)  # honours CUDA_VISIBLE_DEVICES
            handle = pynvml.nvmlDeviceGetHandleByIndex(index)
            pynvml.nvmlDeviceGetUtilizationRates(handle)
        except Exception as exc:  # noqa: BLE001 - NVML missing or unusable: report None
            self.error = f"NVML unavailable: {exc}"
            return self

        def run():
            while not self._stop.is_set():
                try:
                    self.samples.append(int(pynvml.nvmlDeviceGetUtilizationRates(handle).gpu))
                except Exception:  # noqa: BLE001
                    break
                self._stop.wait(self.interval_s)

        self._thread = threading.Thread(target=run, name="gputrain-nvml", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=2)

    def result(self) -> dict[str, Any] | None:
        if not self.samples:
            return None
        return {"mean_pct": statistics.fmean(self.samples), "median_pct": statistics.median(self.samples),
                "max_pct": max(self.samples), "samples": len(self.samples)}
