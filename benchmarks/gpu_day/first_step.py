"""Time to the first optimizer step, and the steady step: eager, whole-model compile, regional compile.

Each case runs in a fresh Python process (a cold start: imports, tracing, code generation and the
C++ build of inductor's kernels), with its own empty TORCHINDUCTOR_CACHE_DIR so that no case warms
another through inductor's on-disk caches; a case that names gputrain's compile cache folder runs
without one, as gputrain then keeps inductor's cache in that folder (runtime/compile_cache.py): its
first start finds the folder empty, its second start (another process, as on another machine) finds
only what the first start kept there. Measured per case:

  from command   the process's spawn (this script's clock) to the end of the first optimizer step
  from fit       the call of `fit()` (or the hand loop's first line) to the end of the first step
  steady ms      one step after the warm-up: gputrain's log points after the first (median of the
                 intervals' seconds per step), the hand loop's steps after the 4th (median)

gputrain's end of the first step is the run's own timestamp (summary "startup": `ended_at`, taken
after one device sync at the end of the first step, train/loop/startup_costs.py); the hand loop's is
its own clock after the first `optimizer.step()` (CPU: nothing is asynchronous).

Models (random data of the real shapes):
  gpt-mini   GPTMini of 12 blocks, vocabulary 65. On the CPU (tiny, for 2 cores, fp32): width 32, 2
             heads, context 32, batch 8 of 256 (--n-embd / --n-head change the width). On CUDA
             (`--device cuda`, the GPU day's part (e)): the GPT-mini of real_models.py with 12 blocks,
             width 384, 6 heads, context 256, batch 64 of 1024, fit's default precision (bf16 on an
             H100) and the hand loop under bf16 autocast
  resnet18   ResNet18Cifar, 3x32x32 float images, 10 classes: width 8 (the stages 8, 16, 32, 64
             channels), batch 8 of 256 on the CPU; width 64, batch 128 of 1024 on CUDA

Cases: gputrain `fit()` and a hand loop (the same model, data slices, fused AdamW, compiled the same
way: `torch.compile(model)` or `block.compile()` for each block) for eager / whole / regional;
`gputrain fit module:function` as a command (`--compile-scope regional`); a second start with the
first start's compile cache folder (named, as a sweep names SWEEP_DIR/compile_cache for its trials:
only what gputrain kept there can make it warm); the GPT's regional fit stops at step 8 (a
checkpoint) and is resumed in a new process with the same folder. ResNet-18 has no run of identical blocks holding most of its
weights: "regional" falls back to the whole model (the decision says so; a unit test checks it),
so it has no regional case here.

`--steady ROUNDS` measures the steady step alone, side by side in one process: the GPT-mini's hand
loop step eager, whole-compiled and regional-compiled (each built and warmed up first, inductor's
default cache), then ROUNDS rounds of one step of each in turn; median and min ms per step. A case
per process (above) meets a different machine load in each; this compares like with like.

`--repeats N` runs the whole plan N times, round after round (each round with its own empty cache
folders, so a first start is always cold), and reports each case's median; `--only REGEX` keeps the
cases whose names match; `--budget S` starts no case after S seconds (the rest: "skipped"); `--end S`
kills a case still running S seconds after the start (with its compile workers; "timed out", not an
error). The JSON is written again after every case.

Usage:
  python -m benchmarks.gpu_day.first_step                      # all cases, JSON to a temp folder
  python -m benchmarks.gpu_day.first_step --json out.json --models gpt-mini --repeats 3
  python -m benchmarks.gpu_day.first_step --steady 60          # the steady step only, interleaved
  python -m benchmarks.gpu_day.first_step --steady 30 --n-embd 192 --n-head 6
  python -m benchmarks.gpu_day.first_step --device cuda --budget 90 --json first_step.json   # the GPU day's (e)
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
MODULE = "benchmarks.gpu_day.first_step"  # this file, as the children import it (from ROOT)
STEPS, LOG_EVERY, STOP_AT = 16, 4, 8
# Sizes per device kind: the GPT's dimensions, the ResNet's width, the batch, the data's rows.
SIZES = {
    "cpu": {"gpt": {"vocab_size": 65, "block_size": 32, "n_layer": 12, "n_embd": 32, "n_head": 2, "dropout": 0.0},
            "resnet_width": 8, "batch": {"gpt-mini": 8, "resnet18": 8}, "rows": 256},
    "cuda": {"gpt": {"vocab_size": 65, "block_size": 256, "n_layer": 12, "n_embd": 384, "n_head": 6, "dropout": 0.0},
             "resnet_width": 64, "batch": {"gpt-mini": 64, "resnet18": 128}, "rows": 1024},
}


def sizes(device: str, n_embd: int | None = None, n_head: int | None = None) -> dict:
    size = json.loads(json.dumps(SIZES["cuda" if device.startswith("cuda") else "cpu"]))
    if n_embd:
        size["gpt"]["n_embd"] = n_embd
    if n_head:
        size["gpt"]["n_head"] = n_head
    return size


# ---------------------------------------------------------------- models and data (child side)

def make_model(name: str, size: dict):
    import torch

    from gputrain.workloads.real_models import GPTMini, ResNet18Cifar

    torch.manual_seed(0)
    return GPTMini(**size["gpt"]) if name == "gpt-mini" else ResNet18Cifar(num_classes=10, width=size["resnet_width"])


def make_data(name: str, size: dict):
    import torch

    g, n = torch.Generator().manual_seed(1), size["rows"]
    if name == "gpt-mini":
        gpt = size["gpt"]
        seq = torch.randint(0, gpt["vocab_size"], (n, gpt["block_size"] + 1), generator=g)
        return seq[:, :-1].contiguous(), seq[:, 1:].contiguous()
    return torch.randn(n, 3, 32, 32, generator=g), torch.randint(0, 10, (n,), generator=g)


def loss_fn(name: str):
    from torch import nn

    from gputrain.workloads.real_models import next_token_loss

    return next_token_loss if name == "gpt-mini" else nn.functional.cross_entropy


def gpt_workload():
    """The GPT-mini as a gputrain Workload, for `gputrain fit benchmarks.gpu_day.first_step:gpt_workload`
    (its sizes from $FIRST_STEP_SIZE, which the parent sets, else the CPU's)."""
    from gputrain.workloads.base import DataSplits, Workload

    size = json.loads(os.environ.get("FIRST_STEP_SIZE") or json.dumps(SIZES["cpu"]))
    return Workload("gpt-mini-12", "GPTMini of 12 blocks on random tokens",
                    lambda: DataSplits(make_data("gpt-mini", size)), lambda: make_model("gpt-mini", size),
                    loss_fn("gpt-mini"), task=None,
                    defaults={"batch_size": size["batch"]["gpt-mini"], "steps": STEPS, "log_every": LOG_EVERY})


def sync(device: str) -> None:
    """Wait for the device's queued work (CUDA runs asynchronously), so that the clock reads its end."""
    import torch

    if device.startswith("cuda"):
        torch.cuda.synchronize()


def child_fit(spec: dict) -> dict:
    from gputrain import TrainConfig, fit

    size, batch = spec["size"], spec["size"]["batch"][spec["model"]]
    model, data = make_model(spec["model"], size), make_data(spec["model"], size)
    compile_ = {"eager": False, "whole": True, "regional": "regional"}[spec["compile"]]
    cfg = TrainConfig(device=spec["device"], precision="fp32" if spec["device"] == "cpu" else "auto",
                      batch_size=batch, steps=STEPS, log_every=LOG_EVERY,
                      loggers=(), compile=compile_, run_dir=spec.get("run_dir"),
                      compile_cache=spec.get("compile_cache", False), stop_at_step=spec.get("stop_at"),
                      resume=bool(spec.get("resume")))
    t_fit = time.time()
    history = fit(model, data, loss_fn=loss_fn(spec["model"]), config=cfg)
    return {"t_fit": t_fit, **_from_summary(history.summary, history.records, batch)}


def _from_summary(summary: dict, records: list, batch: int) -> dict:
    rates = [r["samples_per_s"] for r in records if r.get("samples_per_s")][1:]
    startup = summary.get("startup") or {}
    decisions = {d["name"]: d for d in summary.get("decisions", [])}
    return {"first_end": startup.get("ended_at"), "steady_ms": 1000 * batch / statistics.median(rates)
            if rates else None, "startup": startup, "compile_decision": decisions.get("compile", {}).get("reason"),
            "precision": decisions.get("precision", {}).get("value")}


def hand_step(model, model_name: str, how: str, device: str, size: dict, x, y):
    """The hand loop's step: `model` (built, on the host) moved to `device` and compiled as `how`
    (eager / whole / regional), on `x`, `y` (on the device). Returns (step, precision): a function of
    no arguments that runs one step and waits for its end, and fit's default precision it runs in
    (bf16 autocast on a CUDA GPU, fp32 on the CPU)."""
    import contextlib

    import torch

    model, lf, batch = model.to(device), loss_fn(model_name), size["batch"][model_name]
    run = model
    if how == "whole":
        run = torch.compile(model)
    elif how == "regional":
        for block in model.blocks:
            block.compile()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    g = torch.Generator(device=device).manual_seed(0)
    cuda = device.startswith("cuda")

    def step() -> None:
        idx = torch.randint(0, len(x), (batch,), generator=g, device=device)
        with torch.autocast("cuda", torch.bfloat16) if cuda else contextlib.nullcontext():
            loss = lf(run(x.index_select(0, idx)), y.index_select(0, idx))
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        sync(device)  # measurement only: the step's end, not its launch

    return step, "bf16" if cuda else "fp32"


def child_loop(spec: dict) -> dict:
    device, size, name = spec["device"], spec["size"], spec["model"]
    model, (x, y) = make_model(name, size), make_data(name, size)
    t_fit = time.time()  # as for fit: the model and the data are built (on the host)
    x, y = x.to(device), y.to(device)
    step, precision = hand_step(model, name, spec["compile"], device, size, x, y)
    times, first_end = [], None
    for i in range(STEPS):
        t0 = time.perf_counter()
        step()
        times.append(time.perf_counter() - t0)
        if i == 0:
            first_end = time.time()
    return {"t_fit": t_fit, "first_end": first_end, "steady_ms": 1000 * statistics.median(times[4:]),
            "precision": precision}


def steady_side_by_side(rounds: int, device: str, size: dict) -> dict[str, dict[str, float]]:
    """The GPT-mini's hand-loop step eager / whole / regional, interleaved in this process: median
    and min ms per step over `rounds` rounds (after 4 warm-up steps each, which compile)."""
    import torch

    if device == "cpu":
        torch.set_num_threads(1)
    x, y = make_data("gpt-mini", size)
    x, y = x.to(device), y.to(device)
    steps = {}
    for how in ("eager", "whole", "regional"):
        steps[how] = hand_step(make_model("gpt-mini", size), "gpt-mini", how, device, size, x, y)[0]
        for _ in range(4):
            steps[how]()
    times: dict[str, list[float]] = {how: [] for how in steps}
    for _ in range(rounds):
        for how, step in steps.items():
            t0 = time.perf_counter()
            step()
            times[how].append(time.perf_counter() - t0)
    return {how: {"median_ms": 1000 * statistics.median(t), "min_ms": 1000 * min(t)} for how, t in times.items()}


# ---------------------------------------------------------------- the parent: cases in turn

def run_child(spec: dict, work: Path, timeout: float | None = None) -> dict:
    """One case in a fresh process with an empty inductor (and Triton) cache; its figures, or its error.
    A case still running after `timeout` seconds is killed with its process group (inductor's compile
    workers included) and reported as timed out."""
    env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=tempfile.mkdtemp(dir=work, prefix="inductor-"),
               FIRST_STEP_SIZE=json.dumps(spec["size"]),
               PYTHONPATH=os.pathsep.join([str(ROOT / "src"), str(ROOT), os.environ.get("PYTHONPATH", "")]))
    if spec["device"] == "cpu":
        # One thread: on the shared 2 cores, OpenMP threads spin-waiting for a core made small steps
        # many times slower (tests/conftest.py); both sides run with the same.
        env["OMP_NUM_THREADS"] = "1"
    for name in ("GPUTRAIN_COMPILE_CACHE", "TRITON_CACHE_DIR"):  # Triton's cache then follows inductor's
        env.pop(name, None)
    if spec.get("compile_cache"):  # a named folder: gputrain keeps inductor's cache in it (empty on a first start)
        env.pop("TORCHINDUCTOR_CACHE_DIR")
    if spec["kind"] == "cli":
        run_dir = Path(spec["run_dir"])
        cmd = [sys.executable, "-m", "gputrain", "fit", f"{MODULE}:gpt_workload", "--device", spec["device"],
               "--run-dir", str(run_dir), "--no-tensorboard", "--quiet"]
        if spec["device"] == "cpu":
            cmd += ["--precision", "fp32"]
        if spec["compile"] == "whole":
            cmd.append("--compile")
        elif spec["compile"] == "regional":
            cmd += ["--compile-scope", "regional"]
    else:
        cmd = [sys.executable, "-m", MODULE, "--child", json.dumps(spec)]
    t_spawn = time.time()
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        return {"timed_out": True, "error": [f"killed after {timeout:.0f} s: the end of --end"]}
    proc = subprocess.CompletedProcess(cmd, proc.returncode, stdout, stderr)
    t_exit = time.time()
    if proc.returncode != 0:
        return {"error": (proc.stderr or proc.stdout).strip().splitlines()[-1:] or ["exit %d" % proc.returncode]}
    if spec["kind"] == "cli":
        hist = json.loads((run_dir / "history.json").read_text())
        out = {"t_fit": None, **_from_summary(hist.get("summary", {}), hist.get("records", []),
                                              spec["size"]["batch"]["gpt-mini"])}
    else:
        out = json.loads(proc.stdout.strip().splitlines()[-1])
    out["from_command_s"] = out["first_end"] - t_spawn if out.get("first_end") else None
    out["from_fit_s"] = out["first_end"] - out["t_fit"] if out.get("first_end") and out.get("t_fit") else None
    out["process_s"] = t_exit - t_spawn
    return out


def plan(models: list[str], work: Path, device: str, size: dict) -> list[dict]:
    """The cases in order. Each goal's two cases run back to back (fit regional and fit whole, then
    the hand loop's two), so that a run cut short by its budget (the GPU day's part (e)) still ends
    with whole pairs; fit's pair first, as fit's figures are gputrain's. The GPT's regional fit stops
    at STOP_AT (a checkpoint) and is then resumed; second starts and the resume name the first
    start's compile cache folder."""
    specs = []
    for m in models:
        # resnet18 has no regional case: it falls back to the whole model (no run of identical blocks
        # holding most weights)
        compiled = ("regional", "whole") if m == "gpt-mini" else ("whole",)
        order = [("fit", "eager"), ("loop", "eager"), *[("fit", c) for c in compiled], *[("loop", c) for c in compiled]]
        for kind, c in order:
            if kind == "loop":
                specs.append({"name": f"{m} loop {c}", "kind": "loop", "model": m, "compile": c})
                continue
            spec = {"name": f"{m} fit {c}", "kind": "fit", "model": m, "compile": c,
                    "compile_cache": str(work / f"cache-{m}-{c}") if c != "eager" else False}
            if m == "gpt-mini" and c == "regional":
                spec.update(run_dir=str(work / "resume-run"), stop_at=STOP_AT)
            specs.append(spec)
        if m == "gpt-mini":
            specs.append({"name": f"{m} fit regional resumed at {STOP_AT}", "kind": "fit", "model": m,
                          "compile": "regional", "run_dir": str(work / "resume-run"),
                          "compile_cache": str(work / f"cache-{m}-regional"), "resume": True})
            for c in ("eager", "regional"):
                specs.append({"name": f"{m} command {c}", "kind": "cli", "model": m, "compile": c,
                              "run_dir": str(work / f"cli-{c}")})
        for c in compiled:
            specs.append({"name": f"{m} fit {c} second start", "kind": "fit", "model": m, "compile": c,
                          "compile_cache": str(work / f"cache-{m}-{c}")})
    for spec in specs:
        spec.update(device=device, size=size)
    return specs


def ratios(results: dict[str, dict]) -> dict[str, float]:
    def r(a: str, b: str, key: str) -> tuple[str, float] | None:
        x, y = results.get(a, {}).get(key), results.get(b, {}).get(key)
        return (f"{key}: {a} / {b}", x / y) if x and y else None

    pairs = [r("gpt-mini fit whole", "gpt-mini fit regional", "from_fit_s"),
             r("gpt-mini loop whole", "gpt-mini loop regional", "from_fit_s"),
             r("gpt-mini fit regional", "gpt-mini fit whole", "steady_ms"),
             r("gpt-mini loop regional", "gpt-mini loop whole", "steady_ms"),
             r("gpt-mini fit whole", "gpt-mini fit whole second start", "from_fit_s"),
             r("gpt-mini fit regional", "gpt-mini fit regional second start", "from_fit_s"),
             r("gpt-mini fit regional", f"gpt-mini fit regional resumed at {STOP_AT}", "from_fit_s"),
             r("gpt-mini fit regional", "gpt-mini loop regional", "from_fit_s"),
             r("gpt-mini fit whole", "gpt-mini loop whole", "from_fit_s"),
             r("resnet18 fit whole", "resnet18 fit whole second start", "from_fit_s")]
    return dict(p for p in pairs if p is not None)


NUMBERS = ("from_command_s", "from_fit_s", "steady_ms", "process_s")


def medians(rounds: list[dict]) -> dict:
    """One case over its rounds: the median of each figure, the rounds' values beside it, the first
    round's other fields (decisions, startup); an error in any round is the case's error."""
    errors = [r for r in rounds if "error" in r and not r.get("timed_out")]
    if errors or all(r.get("timed_out") for r in rounds):
        return {**(errors or rounds)[0], "rounds": len(rounds)}
    rounds = [r for r in rounds if not r.get("timed_out")]
    out = dict(rounds[0])
    for key in NUMBERS:
        values = [r[key] for r in rounds if r.get(key) is not None]
        out[key] = statistics.median(values) if values else None
        if len(rounds) > 1:
            out[f"{key}_rounds"] = values
    out["rounds"] = len(rounds)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--child", help=argparse.SUPPRESS)
    p.add_argument("--device", default="cpu", help="cpu (default; tiny sizes) or cuda")
    p.add_argument("--models", default="gpt-mini,resnet18")
    p.add_argument("--n-embd", type=int, default=None, help="the GPT-mini's width (default 32 on the CPU, 384 on CUDA)")
    p.add_argument("--n-head", type=int, default=None, help="its heads (default 2 on the CPU, 6 on CUDA)")
    p.add_argument("--repeats", type=int, default=1, help="rounds of the whole plan; each case's median is reported")
    p.add_argument("--only", default=None, metavar="REGEX", help="only the cases whose names match")
    p.add_argument("--budget", type=float, default=None, metavar="S", help="start no case after S seconds")
    p.add_argument("--end", type=float, default=None, metavar="S",
                   help="kill a case still running S seconds after the start (reported as timed out, not an error)")
    p.add_argument("--json", default=None, help="where the JSON goes (default: a temp folder)")
    p.add_argument("--steady", type=int, default=None, metavar="ROUNDS",
                   help="only the GPT-mini's steady step, eager / whole / regional interleaved in one process")
    args = p.parse_args(argv)
    if args.child:
        spec = json.loads(args.child)
        print(json.dumps(child_fit(spec) if spec["kind"] == "fit" else child_loop(spec), default=str))
        return 0
    import torch

    if args.device.startswith("cuda") and not torch.cuda.is_available():
        print(f"first_step: --device {args.device}, but torch {torch.__version__} sees no CUDA device", file=sys.stderr)
        return 2
    size = sizes(args.device, args.n_embd, args.n_head)
    if args.steady:
        figures = steady_side_by_side(args.steady, args.device, size)
        gpt = size["gpt"]
        print(f"GPT-mini {gpt['n_layer']} x {gpt['n_embd']}, {gpt['n_head']} heads, context {gpt['block_size']}, "
              f"batch {size['batch']['gpt-mini']}, {args.device}, torch {torch.__version__}")
        for how, f in figures.items():
            print(f"{how:<9} median {f['median_ms']:7.2f} ms  min {f['min_ms']:7.2f} ms  ({args.steady} rounds)")
        print(f"regional / whole: median {figures['regional']['median_ms'] / figures['whole']['median_ms']:.2f}x, "
              f"min {figures['regional']['min_ms'] / figures['whole']['min_ms']:.2f}x")
        if args.json:
            from benchmarks.result_files import write_json

            write_json(args.json, {"command": " ".join(sys.argv), "torch": torch.__version__, "device": args.device,
                                   "size": size, "rounds": args.steady, "steady": figures})
        return 0

    t0 = time.monotonic()
    work = Path(tempfile.mkdtemp(prefix="first-step-"))
    path = Path(args.json) if args.json else work / "first_step.json"
    only = re.compile(args.only) if args.only else None
    rounds: dict[str, list[dict]] = {}
    skipped: list[str] = []
    threads = "1 CPU thread (OMP_NUM_THREADS=1)" if args.device == "cpu" else args.device
    print(f"torch {torch.__version__}, {threads}; each case a fresh process; {args.repeats} round(s)", flush=True)
    print(f"{'case':<44} {'from command s':>14} {'from fit s':>10} {'steady ms':>9}  compile decision", flush=True)
    for i in range(args.repeats):
        rwork = work / f"round-{i}"
        rwork.mkdir()
        for spec in plan(args.models.split(","), rwork, args.device, size):
            if only is not None and not only.search(spec["name"]):
                continue
            if args.budget is not None and time.monotonic() - t0 > args.budget:
                skipped.append(f"{spec['name']} (round {i + 1})")
                continue
            left = None if args.end is None else max(1.0, args.end - (time.monotonic() - t0))
            out = run_child(spec, rwork, timeout=left)
            rounds.setdefault(spec["name"], []).append(out)
            write_result(path, args, size, rounds, skipped)  # after each case: a run cut short keeps what it measured
            if "error" in out:
                print(f"{spec['name']:<44} error: {out['error']}", flush=True)
                continue

            def f(v, fmt):
                return format(v, fmt) if v is not None else "-"

            print(f"{spec['name']:<44} {f(out['from_command_s'], '14.2f')} {f(out['from_fit_s'], '10.2f')} "
                  f"{f(out['steady_ms'], '9.2f')}  {(out.get('compile_decision') or '')[:90]}", flush=True)
    results = write_result(path, args, size, rounds, skipped)
    rs = ratios(results)
    print(f"\nratios (medians of {args.repeats} round(s), side by side):" if args.repeats > 1 else
          "\nratios (one run, side by side):")
    for k, v in rs.items():
        print(f"  {k}: {v:.2f}x")
    if skipped:
        print(f"skipped (--budget {args.budget:.0f} s spent): {', '.join(skipped)}")
    print(f"JSON: {path}")
    return 1 if any("error" in r and not r.get("timed_out") for r in results.values()) else 0


def write_result(path: Path, args: argparse.Namespace, size: dict, rounds: dict[str, list[dict]],
                 skipped: list[str]) -> dict[str, dict]:
    """The figures so far (each case's median over its rounds), written atomically; returns them."""
    import torch

    from benchmarks.result_files import write_json

    results = {name: medians(outs) for name, outs in rounds.items()}
    errors = sorted(name for name, r in results.items() if "error" in r and not r.get("timed_out"))
    timed_out = sorted(name for name, r in results.items() if r.get("timed_out"))
    status = ("failures" if errors else "skipped: the budget was spent before the first case"
              if skipped and not results else "ok")
    write_json(path, {"part": "first_step", "status": status, "errors": errors, "timed_out": timed_out,
                      "command": " ".join(sys.argv), "torch": torch.__version__, "device": args.device,
                      "steps": STEPS, "log_every": LOG_EVERY, "size": size, "repeats": args.repeats,
                      "skipped": skipped, "results": results, "ratios": ratios(results)})
    return results


if __name__ == "__main__":
    sys.exit(main())
