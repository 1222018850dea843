"""Where the benchmarks' results go and how they are written: one JSON writer, one file name rule.

A result is a plain dict; `write_json` writes it as gputrain's bench results are written (indented,
a NaN as null, an infinity as "inf"), whole or not at all (gputrain.io.atomic). The GPU day's driver
(gpu_day/day.py) and its smoke (gpu_day/smoke.py) write theirs with the json module alone: they
import no torch, so that a broken torch shows in their summary instead of stopping them.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch

from gputrain.bench.common import device_slug, to_json
from gputrain.io.atomic import write_text

RESULTS = Path(__file__).resolve().parent / "results"  # where the project keeps measured results


def results_path(benchmark: str, device: torch.device, date: str) -> Path:
    """benchmarks/results/<benchmark>_<device>_<yyyy-mm-dd>.json (device: 'cpu', 'nvidia-h100-80gb-hbm3', ...)."""
    return RESULTS / f"{benchmark}_{device_slug(device)}_{date}.json"


def write_json(path: str | os.PathLike, result: dict[str, Any]) -> Path:
    """Write `result` to `path` (its folder made if missing); returns the path."""
    return write_text(path, to_json(result) + "\n")
