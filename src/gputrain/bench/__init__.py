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

cases: the models and data the precision and memory benchmarks train; plots: their figures; common:
what every benchmark shares (the environment, the JSON written by `write_json`); index: `bench all`.
"""

from gputrain.bench.crossover import run_crossover
from gputrain.bench.matmul import matmul_flops, run_matmul
from gputrain.bench.memory import run_memory
from gputrain.bench.precision import run_precision
from gputrain.bench.transfer import run_transfer

BENCHMARKS = {
    "matmul": run_matmul,
    "transfer": run_transfer,
    "crossover": run_crossover,
    "precision": run_precision,
    "memory": run_memory,
}

__all__ = ["BENCHMARKS", "matmul_flops", "run_matmul", "run_transfer", "run_crossover", "run_precision",
           "run_memory"]
