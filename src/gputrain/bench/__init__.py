"""Benchmarks that show why a GPU is, or is not, fast: each returns a result dict (rows + summary).

    from gputrain.bench import run_matmul
    result = run_matmul(quick=True)          # {"environment", "config", "rows", "summary", "notes", ...}

| module: function        | measures                                                                  |
|-------------------------|---------------------------------------------------------------------------|
| matmul: run_matmul      | square matmul TFLOP/s, % of peak, GPU/CPU speed-up (fp32/tf32/bf16/fp16)   |
| transfer: run_transfer  | host <-> device GB/s: pageable vs pinned, blocking vs non_blocking        |
| crossover: run_crossover| one MLP training step CPU vs GPU (eager, CUDA graph) over width x data    |
| precision: run_precision| training samples/s, memory, final loss per precision, vs fp32             |
| memory: run_memory      | memory vs batch size with/without recompute, largest batch               |

cases: the models and data the precision and memory benchmarks train; settings: what those two take
(their flags); plots: their figures; common: what every benchmark shares (the environment, the JSON written by `write_json`); index: `bench all`.
"""

from __future__ import annotations

import importlib
from typing import Any

# name -> module: loaded when first used, so that the command line's parser (which reads the
# benchmarks' settings, gputrain/bench/settings.py) stays as light as `--help` must
_LAZY = {"run_matmul": "matmul", "matmul_flops": "matmul", "run_transfer": "transfer",
         "run_crossover": "crossover", "run_precision": "precision", "run_memory": "memory"}
_ORDER = ("matmul", "transfer", "crossover", "precision", "memory")  # BENCHMARKS' order: `bench all` runs them so

__all__ = ["BENCHMARKS", "matmul_flops", "run_matmul", "run_transfer", "run_crossover", "run_precision",
           "run_memory"]


def __getattr__(name: str) -> Any:
    if name == "BENCHMARKS":
        return {b: getattr(importlib.import_module(f"gputrain.bench.{b}"), f"run_{b}") for b in _ORDER}
    if name in _LAZY:
        return getattr(importlib.import_module(f"gputrain.bench.{_LAZY[name]}"), name)
    raise AttributeError(f"module 'gputrain.bench' has no attribute {name!r}")
