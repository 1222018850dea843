"""Training speed on real models: ResNet-18 on CIFAR-sized images and a 6-layer GPT on characters.

For each workload the same model (fresh, same seed), data (random, device-sized), batch, number of
optimizer steps, optimizer (AdamW, same lr and weight decay) and precision (bf16 autocast) on
every side; run in one process, interleaved (A B C ... A B C ...), median over --repeats:

  hand-eager        a hand-tuned loop: data on the device once, randperm batches, bf16 autocast,
                    channels_last for the CNN, fused AdamW, no per-step host sync
  hand-compile      the same with torch.compile(model)
  gputrain          gputrain.fit with its defaults (precision bf16 asked for explicitly)
  gputrain-compile  gputrain.fit with compile=True
  gputrain-autotune gputrain.fit with autotune=True (a "not available" row when TrainConfig has
                    no autotune field)
  lightning-bf16    PyTorch Lightning Trainer(precision="bf16-mixed"), fed by a DataLoader with
                    workers and pinned memory (documented defaults otherwise: NCHW, its AdamW)
  accelerate-bf16   Hugging Face Accelerate (mixed_precision="bf16"), the same DataLoader

Lightning and Accelerate are skipped, with the reason recorded, where they are not importable.
The contenders are contenders.py's, with the recipe above (RECIPE).

Timing (BENCHMARKS.md): each run does --warmup steps, a synchronize, then --steps measured steps
and a synchronize; the figure is measured samples over measured seconds (tokens = samples x
context for the GPT). gputrain is timed from its own log points (log_every = --warmup, each log
point synchronizes): the window runs from the first log point to the last. Compile time is kept
apart (dynamo's own compile-time records, read by gputrain.runtime.recompiles, which also
counts recompilations and graph breaks). Setup (model, data to the device, DataLoader workers,
Trainer) is everything else of the call's wall time; each row says which fraction of the run it
took, and a note flags runs where it passes a tenth (give more --steps).

MFU: FLOPs of one training step (forward + backward) counted with torch.utils.flop_counter on the
device, times steps per second, over the bf16 matmul peak measured in this process (8192^3 GEMMs);
None on the CPU.

Usage:
  python -m benchmarks.real_models                      # GPU: both workloads, all contenders
  python -m benchmarks.real_models --workloads gpt-mini --repeats 3 --steps 1000
  python -m benchmarks.real_models --smoke              # CPU: tiny models, a few steps
A GPU run writes benchmarks/results/real_models_<device>_<date>.json; a CPU run prints the table
and writes its JSON to --out (default /tmp/real_models_cpu_<date>.json). On an H100 one workload
with every contender takes several minutes (first compiles are the slow part): run the workloads
in separate commands when each command has a time limit.
"""

from __future__ import annotations

import argparse
import functools
import gc
import statistics
import sys
import traceback
from typing import Any

import torch

from benchmarks.contenders import (Contender, Length, NotAvailable, Recipe, Run, Spec, accelerate_run, gputrain_run,
                                   hand_loop, lightning_run)
from benchmarks.result_files import results_path, write_json

LR = 1e-3
WEIGHT_DECAY = 0.05
# torch.compile's arguments for the compiled contenders; a CPU check of the code may set a cheaper
# backend here (Inductor's first compile of ResNet-18 takes minutes on 2 cores).
COMPILE_KW: dict[str, Any] = {}
CONTENDERS = ("hand-eager", "hand-compile", "gputrain", "gputrain-compile", "gputrain-autotune",
              "lightning-bf16", "accelerate-bf16")


# ---------------------------------------------------------------- workloads


def make_spec(name: str, smoke: bool, batches_per_epoch: int) -> Spec:
    from gputrain.workloads import datasets
    from gputrain.workloads import text as textdata
    from gputrain.workloads.real_models import GPTMini, ResNet18Cifar, next_token_loss

    if name == "resnet18-cifar":
        batch, width = (16, 8) if smoke else (256, 64)
        # A whole number of batches per epoch: every step has the same shape (no recompiles).
        data = datasets.make_synthetic_cifar(n=batch * batches_per_epoch, n_test=0, seed=0)
        return Spec(name, batch, data.train[0], data.train[1],
                    lambda: ResNet18Cifar(num_classes=10, width=width), torch.nn.CrossEntropyLoss(),
                    "classification", channels_last=True, mean=data.mean, std=data.std,
                    config={"width": width, "blocks": [2, 2, 2, 2], "input": [3, 32, 32], "classes": 10,
                            "data": "synthetic CIFAR-shaped uint8 noise, normalized on the device"})
    if name == "gpt-mini":
        if smoke:
            batch, size = 8, {"n_layer": 1, "n_embd": 32, "n_head": 2, "block_size": 32}
        else:
            batch, size = 64, {"n_layer": 6, "n_embd": 384, "n_head": 6, "block_size": 256}
        T = size["block_size"]
        corpus, floor = textdata.synthetic_corpus(batch * batches_per_epoch * T + 1, seed=0)
        x, y = textdata.windows(corpus.tokens, T)
        return Spec(name, batch, x, y,
                    lambda: GPTMini(corpus.vocab_size, dropout=0.1, **size), next_token_loss, "regression",
                    channels_last=False, tokens_per_sample=T,
                    config={**size, "vocab": corpus.vocab_size, "dropout": 0.1, "tied_embeddings": True,
                            "data": f"synthetic Markov-chain tokens (entropy rate {floor:.3f} nats/token)"})
    raise SystemExit(f"unknown workload {name!r}: choose resnet18-cifar or gpt-mini")


# ---------------------------------------------------------------- the contenders (contenders.py)

# Every side: bf16 autocast, fused AdamW with LR and WEIGHT_DECAY, the peers fed by a DataLoader with
# workers and pinned memory; the hand loop's torch.compile takes COMPILE_KW (the same dict).
RECIPE = Recipe(precision="bf16", lr=LR, weight_decay=WEIGHT_DECAY, fused=True, workers=True, compile_kw=COMPILE_KW)
FIT = {"precision": "bf16", "schedule": "constant"}  # gputrain asked for bf16, and a constant LR as the loops have


def contender_fns() -> dict[str, Contender]:
    ours = functools.partial(gputrain_run, recipe=RECIPE, **FIT)
    return {
        "hand-eager": functools.partial(hand_loop, recipe=RECIPE),
        "hand-compile": functools.partial(hand_loop, recipe=RECIPE, compile=True),
        "gputrain": ours,
        "gputrain-compile": functools.partial(ours, compile=True),
        "gputrain-autotune": functools.partial(ours, autotune=True),
        "lightning-bf16": functools.partial(lightning_run, recipe=RECIPE),
        "accelerate-bf16": functools.partial(accelerate_run, recipe=RECIPE),
    }


# ---------------------------------------------------------------- FLOPs and peak


def step_flops(spec: Spec, device: torch.device) -> int:
    """Forward + backward FLOPs of one bf16 training step at the benchmark's batch (matmuls,
    convolutions, attention: what FlopCounterMode counts; the optimizer's elementwise work is not)."""
    from torch.utils.flop_counter import FlopCounterMode

    torch.manual_seed(0)
    model = spec.make_model().to(device)
    if spec.channels_last:
        model = model.to(memory_format=torch.channels_last)
    x = spec.prepare(device)(spec.inputs[:spec.batch].to(device))
    y = spec.targets[:spec.batch].to(device)
    counter = FlopCounterMode(display=False)
    with counter:
        with torch.autocast(device.type, dtype=torch.bfloat16):
            loss = spec.loss_fn(model(x), y)
        loss.backward()
    del model
    return int(counter.get_total_flops())


def bf16_matmul_peak(device: torch.device, n: int = 8192, inner: int = 20, repeats: int = 5) -> float | None:
    """FLOP/s of n x n x n bf16 GEMMs measured here (best of `repeats` samples of `inner` calls)."""
    if device.type != "cuda":
        return None
    a = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    for _ in range(3):
        a @ b
    best = 0.0
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(inner):
            a @ b
        end.record()
        end.synchronize()
        seconds = start.elapsed_time(end) / 1e3 / inner
        best = max(best, 2 * n**3 / seconds)
    del a, b
    return best


# ---------------------------------------------------------------- the run


def _free(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def row_of(spec: Spec, contender: str, repeat: int, run: Run, flops: int, peak: float | None) -> dict[str, Any]:
    step_s = run.measured_s / run.measured_steps
    samples_per_s = spec.batch / step_s
    setup_s = max(0.0, run.wall_s - run.measured_s - (run.compile_s or 0.0))
    return {
        "workload": spec.name, "contender": contender, "repeat": repeat, "status": "ok",
        "batch": spec.batch, "warmup_steps": run.warmup_steps, "measured_steps": run.measured_steps,
        "step_ms": step_s * 1e3, "samples_per_s": samples_per_s,
        "tokens_per_s": samples_per_s * spec.tokens_per_sample if spec.tokens_per_sample > 1 else None,
        "mfu": (flops / step_s) / peak if peak else None,
        "peak_memory_bytes": run.peak_memory_bytes, "wall_s": run.wall_s, "measured_s": run.measured_s,
        "compile_s": run.compile_s, "setup_s": setup_s,
        # Setup share of the run, compile time apart (it has its own column).
        "setup_fraction": setup_s / max(1e-9, run.wall_s - (run.compile_s or 0.0)),
        "recompilations": run.recompilations, "graph_breaks": run.graph_breaks, "notes": run.notes,
    }


def run_once(fn: Contender, spec: Spec, name: str, repeat: int, device: torch.device, length: Length, flops: int,
             peak: float | None, missing: str = "not available") -> tuple[dict[str, Any], str | None]:
    """One run of a contender as its row, and why it is to run no more (it cannot run here, status
    `missing`; or it raised, status "error": one broken contender must not cost the others their
    figures), else None."""
    try:
        return row_of(spec, name, repeat, fn(spec, device, length), flops, peak), None
    except NotAvailable as exc:
        status, reason = missing, str(exc)
    except Exception as exc:
        traceback.print_exc()
        status, reason = "error", f"{type(exc).__name__}: {exc}"
    return {"workload": spec.name, "contender": name, "repeat": repeat, "status": status, "reason": reason}, reason


def run_workload(spec: Spec, device: torch.device, contenders: list[str], repeats: int, warmup: int,
                 steps: int, peak: float | None, result: dict) -> None:
    fns = contender_fns()
    flops = step_flops(spec, device)
    _free(device)
    result["workloads"][spec.name] = {"batch": spec.batch, "flops_per_step": flops, "model": spec.config,
                                      "samples": (warmup + steps) * spec.batch,
                                      "tokens_per_sample": spec.tokens_per_sample}
    skipped: set[str] = set()
    for r in range(repeats):  # interleaved: every contender once per round
        for name in contenders:
            if name in skipped:
                continue
            print(f"  {spec.name} {name} (round {r + 1}/{repeats})", file=sys.stderr, flush=True)
            row, stop = run_once(fns[name], spec, name, r, device, Length(steps, warmup), flops, peak)
            if stop:
                skipped.add(name)
            result["rows"].append(row)
            _free(device)


def _median(rows: list[dict], key: str):
    vals = [r[key] for r in rows if r.get(key) is not None]
    return statistics.median(vals) if vals else None


def summarize_results(result: dict) -> None:
    from gputrain.runtime.timing import summarize

    out = []
    for wl in result["workloads"]:
        rows = [r for r in result["rows"] if r["workload"] == wl]
        names = list(dict.fromkeys(r["contender"] for r in rows))
        meds = {}
        for name in names:
            ok = [r for r in rows if r["contender"] == name and r["status"] == "ok"]
            if not ok:
                bad = next(r for r in rows if r["contender"] == name)
                out.append({"workload": wl, "contender": name, "status": bad["status"], "reason": bad.get("reason")})
                continue
            steps = summarize([r["step_ms"] / 1e3 for r in ok])
            meds[name] = _median(ok, "samples_per_s")
            out.append({"workload": wl, "contender": name, "status": "ok",
                        "step_s": steps, "samples_per_s": meds[name], "tokens_per_s": _median(ok, "tokens_per_s"),
                        "mfu": _median(ok, "mfu"), "peak_memory_bytes": _median(ok, "peak_memory_bytes"),
                        "compile_s": _median(ok, "compile_s"), "setup_s": _median(ok, "setup_s"),
                        "setup_fraction": max(r["setup_fraction"] for r in ok),
                        "recompilations": max((r["recompilations"] or 0) for r in ok) if any(
                            r["recompilations"] is not None for r in ok) else None})
        for s in out:
            if s["workload"] == wl and s["status"] == "ok":
                for ref in ("hand-eager", "hand-compile"):
                    s[f"vs_{ref}"] = s["samples_per_s"] / meds[ref] if meds.get(ref) else None
    result["summary"] = out
    for s in out:
        if s["status"] == "ok" and s["setup_fraction"] > 0.1:
            result["notes"].append(f"{s['workload']} {s['contender']}: setup took {s['setup_fraction']:.0%} of a run "
                                   "(over a tenth): give more --steps")
        if s["status"] == "ok" and s.get("recompilations"):
            result["notes"].append(f"{s['workload']} {s['contender']}: {s['recompilations']} recompilation(s)")
        spread = s.get("step_s", {}).get("spread") if s["status"] == "ok" else None
        if spread is not None and spread > 0.05:
            result["notes"].append(f"{s['workload']} {s['contender']}: spread {spread:.0%} between repeats: "
                                   "differences below it are noise")


def print_table(result: dict) -> None:
    hdr = (f"{'workload':<15} {'contender':<18} {'samples/s':>11} {'tokens/s':>11} {'step ms':>9} {'spread':>7} "
           f"{'MFU':>6} {'peak MiB':>9} {'compile s':>9} {'setup':>6} {'vs a':>6} {'vs b':>6}")
    print(hdr)
    print("-" * len(hdr))

    def f(v, fmt):
        width = int("".join(ch for ch in fmt.split(",")[0].split(".")[0] if ch.isdigit()) or 0)
        return format(v, fmt) if v is not None else "-".rjust(width)

    for s in result["summary"]:
        if s["status"] != "ok":
            print(f"{s['workload']:<15} {s['contender']:<18} {s['status']}: {s.get('reason')}")
            continue
        mem = s["peak_memory_bytes"] / 2**20 if s["peak_memory_bytes"] else None
        print(f"{s['workload']:<15} {s['contender']:<18} {f(s['samples_per_s'], '11,.0f')} "
              f"{f(s['tokens_per_s'], '11,.0f')} {s['step_s']['median_s'] * 1e3:9.2f} {f(s['step_s']['spread'], '7.1%')} "
              f"{f(s['mfu'], '6.1%')} {f(mem, '9.0f')} {f(s['compile_s'], '9.1f')} {s['setup_fraction']:6.0%} "
              f"{f(s.get('vs_hand-eager'), '6.2f')} {f(s.get('vs_hand-compile'), '6.2f')}")
    for note in result["notes"]:
        print(f"note: {note}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--smoke", action="store_true", help="tiny models, few steps (a CPU check that everything runs)")
    p.add_argument("--device", default="auto", help="auto (cuda if present), cuda, cuda:N or cpu")
    p.add_argument("--workloads", default="resnet18-cifar,gpt-mini")
    p.add_argument("--contenders", default=",".join(CONTENDERS), help=f"comma-separated, from {', '.join(CONTENDERS)}")
    p.add_argument("--repeats", type=int, default=None, help="interleaved rounds (default 3; smoke 2)")
    p.add_argument("--warmup", type=int, default=None, help="steps before timing (default 50; smoke 2)")
    p.add_argument("--steps", type=int, default=None, help="measured steps per run (default 1000; smoke 4)")
    p.add_argument("--batches-per-epoch", type=int, default=None, help="data set size in batches (default 40; smoke 4)")
    p.add_argument("--out", default=None, help="JSON path (CPU runs; GPU runs go to benchmarks/results/)")
    args = p.parse_args(argv)

    from gputrain.bench.common import device_name, device_slug, environment

    device = torch.device("cuda" if args.device == "auto" and torch.cuda.is_available() else
                          ("cpu" if args.device == "auto" else args.device))
    repeats = args.repeats or (2 if args.smoke else 3)
    warmup = args.warmup or (2 if args.smoke else 50)
    steps = args.steps or (4 if args.smoke else 1000)
    per_epoch = args.batches_per_epoch or (4 if args.smoke else 40)
    if min(repeats, warmup, steps, per_epoch) < 1:
        raise SystemExit("--repeats, --warmup, --steps and --batches-per-epoch must be at least 1")
    contenders = [c.strip() for c in args.contenders.split(",") if c.strip()]
    unknown = sorted(set(contenders) - set(CONTENDERS))
    if unknown:
        raise SystemExit(f"unknown contenders {unknown}: choose from {', '.join(CONTENDERS)}")
    if device.type == "cuda":
        torch.backends.cudnn.benchmark = True  # every contender: fixed shapes (gputrain turns it on itself)

    peak = bf16_matmul_peak(device)
    result: dict[str, Any] = {
        "benchmark": "real_models",
        "environment": environment([torch.device("cpu")] + ([device] if device.type != "cpu" else [])),
        "device": device_name(device),
        "config": {"smoke": args.smoke, "repeats": repeats, "warmup_steps": warmup, "measured_steps": steps,
                   "batches_per_epoch": per_epoch, "contenders": contenders, "lr": LR,
                   "weight_decay": WEIGHT_DECAY, "optimizer": "AdamW (fused where the contender sets it)",
                   "precision": "bf16 autocast on every side", "schedule": "constant"},
        "bf16_matmul_peak_flops": peak,
        "workloads": {}, "rows": [], "summary": [], "notes": [
            "same model, seed, data, batch, number of steps, optimizer and bf16 autocast on every side",
            "interleaved rounds (every contender once per round); figures are medians over rounds",
            "compile_s: the first compile of a model in this process is cold; later ones (other rounds, other "
            "compiled contenders) hit Inductor's FX-graph and AOT-autograd caches and are shorter"],
    }
    for name in [w.strip() for w in args.workloads.split(",") if w.strip()]:
        spec = make_spec(name, args.smoke, per_epoch)
        run_workload(spec, device, contenders, repeats, warmup, steps, peak, result)
    summarize_results(result)
    print(f"device: {result['device']}; bf16 matmul peak: "
          f"{f'{peak / 1e12:.0f} TFLOP/s' if peak else 'not measured (no GPU)'}")
    print_table(result)

    date = result["environment"]["date"]
    if device.type == "cuda" and not args.smoke:
        out = results_path("real_models", device, date)
    else:
        out = args.out or f"/tmp/real_models_{device_slug(device)}_{date}.json"
    print(f"wrote {write_json(out, result)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
