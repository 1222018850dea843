"""bf16 against float8 training of the GPT-mini through torchao (optional part (f) of `gpu_session.sh day`).

The hand loop of real_models.py's recipe (data on the device, fused AdamW, bf16 autocast, torch.compile'd), once
on the plain GPT-mini and once with its Linear layers swapped for torchao's Float8Linear
(`torchao.float8.convert_to_float8_training`, tensorwise scaling: the recipe torchao documents as
its default); interleaved rounds, medians. The tied output head and any Linear whose sizes are not
multiples of 16 stay in bf16 (float8 matmuls need them). A measured row, not a default of gputrain.

Status "not installed" when torchao is not importable (carry its wheel: gpu_session.sh), "not
applicable" without a CUDA GPU of compute capability 8.9 or higher (float8 tensor cores: Ada, Hopper).

    python -m benchmarks.gpu_day.float8 --device cuda --json float8.json
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import statistics
import sys
import time
import traceback
from pathlib import Path
from typing import Any

import torch

from benchmarks import real_models as rm
from benchmarks.contenders import Length, Spec, hand_loop
from benchmarks.result_files import write_json


def why_not(device: torch.device) -> tuple[str, str] | None:
    """(status, reason) when this part cannot run here, else None."""
    if importlib.util.find_spec("torchao") is None:
        return "not installed", "torchao is not importable (bring its wheel in .whl/, see gpu_session.sh)"
    if device.type != "cuda" or not torch.cuda.is_available():
        return "not applicable", "float8 training needs a CUDA GPU (compute capability 8.9 or higher)"
    if torch.cuda.get_device_capability(device) < (8, 9):
        return "not applicable", f"compute capability {torch.cuda.get_device_capability(device)} < (8, 9)"
    return None


def float8_spec(spec: Spec) -> Spec:
    """The same workload with the model's eligible Linear layers in float8 (torchao)."""
    from torchao.float8 import convert_to_float8_training

    def eligible(module: torch.nn.Module, fqn: str) -> bool:
        return (isinstance(module, torch.nn.Linear) and fqn != "head"
                and module.in_features % 16 == 0 and module.out_features % 16 == 0)

    def make() -> torch.nn.Module:
        return convert_to_float8_training(spec.make_model(), module_filter_fn=eligible)

    return dataclasses.replace(spec, make_model=make)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=20)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--budget", type=float, default=60, help="seconds; a round that does not fit is not started")
    ap.add_argument("--json", type=Path, required=True)
    args = ap.parse_args(argv)
    device = torch.device(args.device)
    result: dict[str, Any] = {"part": "float8", "device": str(device), "workload": "gpt-mini",
                              "recipe": "torchao convert_to_float8_training, tensorwise scaling, torch.compile",
                              "rows": {}}
    blocked = why_not(device)
    if blocked:
        result["status"], result["reason"] = blocked
        write_json(args.json, result)
        print(f"float8: {blocked[0]}: {blocked[1]}")
        return 0
    import torchao

    result["torchao"] = torchao.__version__
    end = time.monotonic() + args.budget
    spec = rm.make_spec("gpt-mini", False, 40)
    specs = {"bf16": spec, "float8": float8_spec(spec)}
    times: dict[str, list[float]] = {k: [] for k in specs}
    errors: dict[str, str] = {}
    last = 60.0  # a first compile
    for _ in range(args.repeats):
        for name, s in specs.items():
            if name in errors or time.monotonic() + last > end:
                continue
            t0 = time.monotonic()
            try:
                run = hand_loop(s, device, Length(args.steps, args.warmup), rm.RECIPE, compile=True)
                times[name].append(run.measured_s / run.measured_steps)
            except Exception as exc:  # float8 may fail on this torch/torchao pair: a row, not a crash
                traceback.print_exc()
                errors[name] = f"{type(exc).__name__}: {exc}"
            last = time.monotonic() - t0
            rm._free(device)
    for name in specs:
        t = times[name]
        result["rows"][name] = ({"status": "error", "reason": errors[name]} if name in errors else
                                {"status": "ok", "step_s": {"median": statistics.median(t), "min": min(t), "max": max(t),
                                                            "n": len(t)},
                                 "tokens_per_s": spec.batch * spec.tokens_per_sample / statistics.median(t)}
                                if t else {"status": "skipped: budget spent"})
    rows = result["rows"]
    if rows["bf16"]["status"] == rows["float8"]["status"] == "ok":
        result["float8_over_bf16"] = rows["float8"]["tokens_per_s"] / rows["bf16"]["tokens_per_s"]
    ran = any(times.values())
    result["status"] = "failures" if errors else ("ok" if ran else "skipped: budget spent")
    write_json(args.json, result)
    print(json.dumps(result, indent=2))
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
