"""What the benchmarks that train take (`gputrain bench precision`, `bench memory`), each setting
declared once with its flag, default, help and check (gputrain/fields.py), as fit's are; the command
line is generated from them (gputrain/runs/flags.py). None: what the benchmark's `config_for` picks
(smaller with --quick). A list's check applies to each of its items (argparse checks one at a time);
a name outside the choices is refused with argparse's own line, as it always was.
"""

from __future__ import annotations

from dataclasses import dataclass

from gputrain.bench.cases import CASES
from gputrain.fields import one_of, positive_int, positive_int_arg, setting
from gputrain.runtime.precision import CHOICES

PRECISIONS = tuple(p for p in CHOICES if p != "auto")  # fp32, tf32, bf16, fp16: each one trained


@dataclass
class PrecisionBench:
    """`gputrain bench precision`: the same training run in each precision."""

    workloads: list[str] | None = setting(None, flag="--workloads", nargs="+", choices=CASES, choices_first=True,
                                          check=one_of(CASES),
                                          help="default: both")
    precisions: list[str] | None = setting(None, flag="--precisions", nargs="+", choices=PRECISIONS,
                                           choices_first=True, check=one_of(PRECISIONS), help="default: all four")
    steps: int | None = setting(None, flag="--steps", parse=positive_int_arg, check=positive_int(optional=True),
                                help="timed training steps per precision (default 60)")
    batch_size: int | None = setting(None, flag="--batch-size", parse=positive_int_arg,
                                     check=positive_int(optional=True), help="default 256")


@dataclass
class MemoryBench:
    """`gputrain bench memory`: memory against batch size, with and without recompute."""

    workload: str = setting("cifar-cnn", flag="--workload", choices=CASES, choices_first=True,
                             check=one_of(CASES))
    batch_sizes: list[int] | None = setting(None, flag="--batch-sizes", nargs="+", parse=positive_int_arg,
                                            metavar="B", check=positive_int(optional=True))
    max_batch: int | None = setting(None, flag="--max-batch", parse=positive_int_arg,
                                    check=positive_int(optional=True), help="CUDA: stop doubling here (default 2^20)")
