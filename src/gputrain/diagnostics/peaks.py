"""Peak dense throughput of common GPUs, for MFU and "% of peak" figures.

Values are NVIDIA's published dense (no 2:4 sparsity) tensor-core figures in TFLOP/s; GeForce cards
are listed at fp32 accumulation, which is what PyTorch uses. A device not in the table gets None:
no made-up peak.
"""

from __future__ import annotations

import re

# Matched in order against the device name; first match wins (more specific patterns first).
# Columns: fp32 (no tensor cores), tf32, bf16, fp16.
_PEAKS: list[tuple[str, str, dict[str, float]]] = [
    (r"H200", "H200", {"fp32": 66.9, "tf32": 494.7, "bf16": 989.4, "fp16": 989.4}),
    (r"H100.*(PCIe|PCIE)", "H100 PCIe", {"fp32": 51.2, "tf32": 378.0, "bf16": 756.0, "fp16": 756.0}),
    (r"H100.*NVL", "H100 NVL", {"fp32": 60.0, "tf32": 417.5, "bf16": 835.0, "fp16": 835.0}),
    (r"H100", "H100 SXM", {"fp32": 66.9, "tf32": 494.7, "bf16": 989.4, "fp16": 989.4}),
    (r"A100", "A100", {"fp32": 19.5, "tf32": 156.0, "bf16": 312.0, "fp16": 312.0}),
    (r"A10G", "A10G", {"fp32": 31.2, "tf32": 31.2, "bf16": 70.0, "fp16": 70.0}),
    (r"\bL40S\b", "L40S", {"fp32": 91.6, "tf32": 183.0, "bf16": 362.0, "fp16": 362.0}),
    (r"\bL4\b", "L4", {"fp32": 30.3, "tf32": 60.0, "bf16": 121.0, "fp16": 121.0}),
    (r"V100", "V100", {"fp32": 15.7, "fp16": 125.0}),
    (r"\bT4\b", "T4", {"fp32": 8.1, "fp16": 65.0}),
    (r"RTX 4090", "RTX 4090", {"fp32": 82.6, "tf32": 82.6, "bf16": 165.2, "fp16": 165.2}),
    (r"RTX 4080", "RTX 4080", {"fp32": 48.7, "tf32": 48.7, "bf16": 97.5, "fp16": 97.5}),
    (r"RTX 4070 Ti", "RTX 4070 Ti", {"fp32": 40.1, "tf32": 40.1, "bf16": 80.2, "fp16": 80.2}),
    (r"RTX 3090 Ti", "RTX 3090 Ti", {"fp32": 40.0, "tf32": 40.0, "bf16": 80.0, "fp16": 80.0}),
    (r"RTX 3090", "RTX 3090", {"fp32": 35.6, "tf32": 35.6, "bf16": 71.0, "fp16": 71.0}),
    (r"RTX 3080 Ti", "RTX 3080 Ti", {"fp32": 34.1, "tf32": 34.1, "bf16": 68.2, "fp16": 68.2}),
    (r"RTX 3080", "RTX 3080", {"fp32": 29.8, "tf32": 29.8, "bf16": 59.5, "fp16": 59.5}),
    (r"RTX 3070", "RTX 3070", {"fp32": 20.3, "tf32": 20.3, "bf16": 40.6, "fp16": 40.6}),
    (r"RTX 3060", "RTX 3060", {"fp32": 12.7, "tf32": 12.7, "bf16": 25.4, "fp16": 25.4}),
]


def lookup(device_name: str) -> tuple[str, dict[str, float]] | None:
    """(model label, {precision: TFLOP/s}) for a known GPU name, else None."""
    for pattern, label, peaks in _PEAKS:
        if re.search(pattern, device_name, flags=re.IGNORECASE):
            return label, dict(peaks)
    return None


def peak_tflops(device_name: str, precision: str) -> float | None:
    """Peak dense TFLOP/s of `device_name` at `precision` ("fp32"|"tf32"|"bf16"|"fp16"), or None."""
    found = lookup(device_name)
    if found is None:
        return None
    return found[1].get(precision)
