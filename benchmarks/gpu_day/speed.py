"""The speed table of the GPU day (part (d) of `gpu_session.sh day`), side by side in one process.

Rows, cheapest first so that a run cut at its budget still has the small ones:

  seed-cnn     seed 000's CIFAR CNN (synthetic-cifar) at batch 64, one epoch, whole runs timed
               (train_speed.py's table): the seed tutorial's loop on the device vs a hand loop vs gputrain's
               defaults and its fastest switches
  iris         iris-mlp, 20000 full-batch epochs, gputrain's whole run (the goal is absolute: < 1.0 s)
  graphed      the graphed step's wall time per step over the GPU time of its replay alone
               (steady steps after the capture; step_probe.py's replay measurement)
  resnet18     ResNet-18 on CIFAR shapes and a 6-layer GPT-mini (real_models.py): bf16 on every side,
  gpt-mini     gputrain against a hand loop (eager and torch.compile'd), Lightning `bf16-mixed` and
               Accelerate `bf16`; a peer that is not installed is a "not installed" row
               (a failure with --require-peers), a contender whose every run raised an "error"
               row and a failure of the part (exit 1); each peer's forward is checked to run
               under bf16 autocast (contenders.AutocastSeen)

Median of --repeats interleaved rounds (A B C A B C ...). Every run is checked against the budget
before it starts (its last run's seconds, or a first-run guess): what does not fit is recorded as
skipped, with n < repeats where a row lost rounds. On the CPU (--device cpu) every row runs at tiny
sizes: it checks that the code runs, its figures mean nothing.

    python -m benchmarks.gpu_day.speed --device cuda --budget 210 --json speed.json
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
import traceback
from pathlib import Path
from typing import Any, Callable

import torch

from benchmarks import real_models as rm
from benchmarks import step_probe
from benchmarks import train_speed as ts
from benchmarks.contenders import Length
from benchmarks.result_files import write_json

REAL_CONTENDERS = ("hand-eager", "hand-compile", "gputrain", "lightning-bf16", "accelerate-bf16")
REAL_KEYS = {"resnet18-cifar": "resnet18", "gpt-mini": "gpt-mini"}  # workload -> its row's key
PEERS = ("lightning-bf16", "accelerate-bf16")


class Budget:
    """Seconds left for the part; `fits(guess)` before a run."""

    def __init__(self, seconds: float):
        self.end = time.monotonic() + seconds

    def left(self) -> float:
        return self.end - time.monotonic()

    def fits(self, guess: float) -> bool:
        return self.left() > guess


def sizes(cpu: bool) -> dict[str, Any]:
    """Run lengths: the GPU day's, or tiny ones that only check the code on the CPU."""
    if cpu:
        return {"seed_n": 128, "iris_epochs": 100, "graph_steps": 10, "graph_warmup": 5,
                "real_smoke": True, "real_warmup": 1, "real_steps": 2, "real_batches": 4}
    return {"seed_n": 10000, "iris_epochs": 20000, "graph_steps": 1000, "graph_warmup": 30,
            "real_smoke": False, "real_warmup": 20, "real_steps": 200, "real_batches": 40}


# ---------------------------------------------------------------- seed-cnn, iris (train_speed.py)


def whole_run_rows(case: ts.Case, who: list[str], device: torch.device, repeats: int, budget: Budget,
                   options: dict) -> dict[str, Any]:
    """train_speed's contenders on one case, interleaved, each run checked against the budget."""
    spec = ts.workload_spec(case.workload, case.batch_size, case.name, **options)
    n = spec.inputs.shape[0]
    table = ts.contenders(device, case)
    missing = [c for c in who if c not in table]
    times, skipped = ts.whole_runs({c: table[c] for c in who if c in table}, spec, case, device, repeats,
                                   fits=lambda name, t: budget.fits(max(t, default=1.0)))
    rows = {}
    for name, t in times.items():
        if t:
            med = statistics.median(t)
            rows[name] = {"status": "ok", "precision": ts.PRECISION.get(name), "median_s": med, "min_s": min(t),
                          "max_s": max(t), "n": len(t), "times_s": t, "samples_per_s": n * case.epochs / med}
        else:
            rows[name] = {"status": "skipped: budget spent"}
    for name in missing:
        rows[name] = {"status": f"not run on {device.type}"}
    ok = {k: r for k, r in rows.items() if r["status"] == "ok"}
    for name, r in ok.items():
        r["x_vs"] = {o: r["samples_per_s"] / ok[o]["samples_per_s"] for o in ok if o != name}
    return {"case": case.name, "workload": case.workload, "batch_size": spec.batch, "epochs": case.epochs,
            "samples": n * case.epochs, "timing": "whole run, setup included, synchronized at both ends",
            "runs_skipped_for_budget": skipped, "results": rows}


# ---------------------------------------------------------------- graphed step over its replay


def graphed_ratio(workload: str, batch: int | None, device: torch.device, warmup: int, steps: int,
                  repeats: int, budget: Budget) -> dict[str, Any]:
    """Wall time per steady step of gputrain's graphed step, and per replay of its graph alone."""
    from gputrain import TrainConfig
    from gputrain.train.loop.trainer import Trainer
    from gputrain.workloads import get_workload

    wl = get_workload(workload, **ts.workload_options(workload))
    splits = ts.train_only(wl.make_data())
    sync = lambda: torch.cuda.synchronize(device) if device.type == "cuda" else None  # noqa: E731
    walls, replays, status = [], [], None
    for _ in range(repeats):
        if not budget.fits(5.0):
            break
        torch.manual_seed(0)
        far = 10 * (warmup + steps)  # no log point inside the window
        cfg = TrainConfig(device=str(device), batch_size=batch or splits.num_train, steps=far, log_every=far,
                          lr=ts.LR, loggers=())
        trainer = Trainer(wl.make_model(), splits, loss_fn=wl.loss_fn, config=cfg)
        try:
            trainer.run_steps(warmup)
            sync()
            t0 = time.perf_counter()
            trainer.run_steps(steps)
            sync()
            walls.append((time.perf_counter() - t0) / steps * 1e6)
            status = trainer.graph_status()
            replay = step_probe.replay_only_us(trainer) if device.type == "cuda" else None
            if replay is not None:
                replays.append(replay)
        finally:
            trainer.close()
    row: dict[str, Any] = {"workload": workload, "batch_size": batch or "full", "steps": steps, "n": len(walls),
                           "graphs": status, "wall_us_per_step": _stats(walls), "replay_us": _stats(replays)}
    if walls and replays:
        row["wall_over_replay"] = statistics.median(walls) / statistics.median(replays)
        row["status"] = "ok"
    else:
        row["wall_over_replay"] = None
        row["status"] = "ok" if walls else "skipped: budget spent"
        row["note"] = f"no captured graph to replay (graphs {status})"
    return row


def _stats(values: list[float]) -> dict[str, Any] | None:
    if not values:
        return None
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "n": len(values)}


# ---------------------------------------------------------------- resnet18, gpt-mini (real_models.py)


def real_rows(names: list[str], device: torch.device, repeats: int, budget: Budget, size: dict,
              peak: float | None) -> dict[str, dict[str, Any]]:
    """real_models.py's contenders on each workload, interleaved: every round runs every workload's
    contenders (so that a budget spent early still leaves each workload a round), each run checked
    against the budget first (its last run's seconds, or a guess for a first run)."""
    specs = {n: rm.make_spec(n, size["real_smoke"], size["real_batches"]) for n in names}
    results: dict[str, dict[str, Any]] = {}
    for name, spec in specs.items():
        flops = rm.step_flops(spec, device)
        results[name] = {"case": name, "batch_size": spec.batch, "precision": "bf16 autocast on every side",
                         "bf16_matmul_peak_flops": peak, "warmup_steps": size["real_warmup"],
                         "measured_steps": size["real_steps"], "flops": flops,
                         "workloads": {name: {"batch": spec.batch, "flops_per_step": flops, "model": spec.config,
                                              "tokens_per_sample": spec.tokens_per_sample}},
                         "rows": [], "summary": [], "notes": []}
    fns = rm.contender_fns()
    last: dict[tuple[str, str], float] = {}
    given_up: set[tuple[str, str]] = set()
    for r in range(repeats):
        for name, spec in specs.items():
            result = results[name]
            for c in REAL_CONTENDERS:
                if (name, c) in given_up:
                    continue
                # A first compile is the slow one: guess a minute for it, 20 s for a first eager run.
                guess = last.get((name, c), 60.0 if "compile" in c and device.type == "cuda" else 20.0)
                if not budget.fits(guess):
                    result["rows"].append({"workload": name, "contender": c, "repeat": r,
                                           "status": "skipped: budget spent",
                                           "reason": f"{budget.left():.0f} s left, the run needs about {guess:.0f} s"})
                    continue
                print(f"  {name} {c} (round {r + 1}/{repeats})", flush=True)
                t0 = time.monotonic()
                row, stop = rm.run_once(fns[c], spec, c, r, device, Length(size["real_steps"], size["real_warmup"]),
                                        result["flops"], peak, missing="not installed")
                if stop:
                    given_up.add((name, c))
                last[(name, c)] = time.monotonic() - t0
                result["rows"].append(row)
                rm._free(device)
    for result in results.values():
        _summarize(result)
    return results


def _summarize(result: dict[str, Any]) -> None:
    """real_models' summary (medians, ratios to the hand loops) over the rows that ran, plus the
    ratios to the peers, and the contenders that never ran with the reason."""
    ran = [r for r in result["rows"] if r["status"] in ("ok", "not installed", "error")]
    result_ok = {**result, "rows": ran, "notes": []}
    rm.summarize_results(result_ok)
    summary = result_ok["summary"]
    result["notes"] += result_ok["notes"]
    seen = {s["contender"] for s in summary}
    for r in result["rows"]:
        if r["contender"] not in seen:
            seen.add(r["contender"])
            summary.append({"workload": r["workload"], "contender": r["contender"], "status": r["status"],
                            "reason": r.get("reason")})
    ok = {s["contender"]: s for s in summary if s["status"] == "ok"}
    for s in ok.values():
        s["n"] = s["step_s"]["n"]
        for peer in ("lightning-bf16", "accelerate-bf16"):
            s[f"vs_{peer}"] = s["samples_per_s"] / ok[peer]["samples_per_s"] if peer in ok else None
    result["summary"] = summary


def contender_failures(rows: dict[str, dict], require_peers: bool) -> list[str]:
    """The real models' contenders that failed, one line each: a run that raised ("error": a crash of
    gputrain, a hand loop or a peer, or a peer's forward outside bf16 autocast; the contender runs no
    more rounds), and with `require_peers` (the CPU rehearsal, whose venv has the peers extra) a peer
    that is not installed."""
    bad = []
    for key in REAL_KEYS.values():
        for r in rows.get(key, {}).get("rows") or []:
            if r["status"] == "error" or (require_peers and r["contender"] in PEERS and r["status"] == "not installed"):
                bad.append(f"{key} {r['contender']}: {r['status']}: {r.get('reason')}")
    return bad


# ---------------------------------------------------------------- the part


def run_rows(device: torch.device, repeats: int, budget: Budget, only: set[str] | None,
             write: Callable[[dict], None], require_peers: bool = False) -> dict[str, Any]:
    size = sizes(device.type == "cpu")
    def real() -> dict:
        return real_rows(["resnet18-cifar", "gpt-mini"], device, repeats, budget, size,
                         rm.bf16_matmul_peak(device))

    seed = "seed-gpu" if device.type != "cpu" else "seed-cpu"
    plan: list[tuple[str, Callable[[], dict]]] = [
        ("seed-cnn", lambda: whole_run_rows(ts.Case("synthetic-cifar@64", "synthetic-cifar", 64, 1),
                                            [seed, "hand", "gputrain-default", "gputrain-fast"], device, repeats,
                                            budget, {"n": size["seed_n"]})),
        ("iris", lambda: whole_run_rows(ts.Case("iris-mlp", "iris-mlp", None, size["iris_epochs"]),
                                        ["gputrain-default", "gputrain-fast"], device, repeats, budget, {})),
        ("graphed", lambda: {"case": "graphed", "rows": [
            graphed_ratio(w, b, device, size["graph_warmup"], size["graph_steps"], repeats, budget)
            for w, b in (("iris-mlp", None), ("synthetic-cifar", 64))]}),
        ("real", real),
    ]
    result: dict[str, Any] = {"part": "speed", "status": "ok", "device": str(device), "repeats": repeats,
                              "sizes": size, "compile": dict(rm.COMPILE_KW) or "torch.compile defaults (inductor)",
                              "rows": {}}
    for key, fn in plan:
        if only and key not in only:
            continue
        t0 = time.monotonic()
        # the real models come back as one row per workload (resnet18, gpt-mini), run interleaved
        keys = list(REAL_KEYS.values()) if key == "real" else [key]
        rows: dict[str, dict] = {k: {"status": "skipped: budget spent"} for k in keys}
        if budget.left() >= 5:
            print(f"{key} ...", flush=True)
            try:
                got = fn()
                for k, row in (got.items() if key == "real" else [(key, got)]):
                    rows[REAL_KEYS.get(k, k)] = {"status": "ok", **row}
            except Exception as exc:
                traceback.print_exc()
                rows = {k: {"status": "error", "error": f"{type(exc).__name__}: {exc}"} for k in keys}
                result["status"] = "failures"
        for k, row in rows.items():
            result["rows"][k] = {**row, "seconds": round(time.monotonic() - t0, 1)}
        if key == "real":
            failed = contender_failures(result["rows"], require_peers)
            if failed:
                result["status"] = "failures"
                result["failed_contenders"] = failed
                for line in failed:
                    print(f"failed: {line}", flush=True)
        write(result)
    return result


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--budget", type=float, default=210, help="seconds for the whole part (default 210)")
    ap.add_argument("--only", default=None, help="comma-separated rows: seed-cnn,iris,graphed,real (resnet18 and gpt-mini)")
    ap.add_argument("--json", type=Path, required=True, help="where the rows go (rewritten after each row)")
    ap.add_argument("--require-peers", action="store_true",
                    help="a peer (Lightning, Accelerate) that is not installed fails the part (the CPU rehearsal)")
    args = ap.parse_args(argv)
    import logging

    logging.getLogger("gputrain").setLevel(logging.WARNING)
    device = torch.device(args.device)
    if device.type == "cpu":
        # The CPU run checks the code: dynamo and AOT autograd trace the compiled contenders, without
        # Inductor's code generation (minutes for ResNet-18 on 2 cores).
        rm.COMPILE_KW["backend"] = "aot_eager"
    if device.type == "cuda":
        torch.backends.cudnn.benchmark = True  # every contender: fixed shapes (gputrain turns it on itself)

    def write(result: dict) -> None:
        write_json(args.json, result)

    result = run_rows(device, args.repeats, Budget(args.budget), set(args.only.split(",")) if args.only else None,
                      write, require_peers=args.require_peers)
    write(result)
    return 0 if result["status"] == "ok" else 1


if __name__ == "__main__":
    sys.exit(main())
