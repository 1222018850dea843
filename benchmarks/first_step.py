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

Models (tiny, for 2 CPU cores; random data of the real shapes, fp32):
  gpt-mini   GPTMini: 12 blocks of width 32, 2 heads, context 32, vocabulary 65, batch 8 of 256
  resnet18   ResNet18Cifar width 8 (the stages 8, 16, 32, 64 channels), 3x32x32 float images,
             10 classes, batch 8 of 256

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

Usage:
  python benchmarks/first_step.py                      # all cases, JSON to a temp folder
  python benchmarks/first_step.py --json out.json --models gpt-mini
  python benchmarks/first_step.py --steady 60          # the steady step only, interleaved
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
STEPS, LOG_EVERY, STOP_AT = 16, 4, 8
BATCH = 8
GPT = {"vocab_size": 65, "block_size": 32, "n_layer": 12, "n_embd": 32, "n_head": 2, "dropout": 0.0}
RESNET_WIDTH = 8


# ---------------------------------------------------------------- models and data (child side)

def make_model(name: str):
    import torch

    from gputrain.workloads.real_models import GPTMini, ResNet18Cifar

    torch.manual_seed(0)
    return GPTMini(**GPT) if name == "gpt-mini" else ResNet18Cifar(num_classes=10, width=RESNET_WIDTH)


def make_data(name: str):
    import torch

    g = torch.Generator().manual_seed(1)
    if name == "gpt-mini":
        seq = torch.randint(0, GPT["vocab_size"], (256, GPT["block_size"] + 1), generator=g)
        return seq[:, :-1].contiguous(), seq[:, 1:].contiguous()
    return torch.randn(256, 3, 32, 32, generator=g), torch.randint(0, 10, (256,), generator=g)


def loss_fn(name: str):
    from torch import nn

    from gputrain.workloads.real_models import next_token_loss

    return next_token_loss if name == "gpt-mini" else nn.functional.cross_entropy


def gpt_workload():
    """The GPT-mini as a gputrain Workload, for `gputrain fit first_step:gpt_workload`."""
    from gputrain.workloads.base import DataSplits, Workload

    return Workload("gpt-mini-12", "GPTMini 12x32 on random tokens", lambda: DataSplits(make_data("gpt-mini")),
                    lambda: make_model("gpt-mini"), loss_fn("gpt-mini"), task=None,
                    defaults={"batch_size": BATCH, "steps": STEPS, "log_every": LOG_EVERY})


def child_fit(spec: dict) -> dict:
    from gputrain import TrainConfig, fit

    model, data = make_model(spec["model"]), make_data(spec["model"])
    compile_ = {"eager": False, "whole": True, "regional": "regional"}[spec["compile"]]
    cfg = TrainConfig(device="cpu", precision="fp32", batch_size=BATCH, steps=STEPS, log_every=LOG_EVERY,
                      loggers=(), compile=compile_, run_dir=spec.get("run_dir"),
                      compile_cache=spec.get("compile_cache", False), stop_at_step=spec.get("stop_at"),
                      resume=bool(spec.get("resume")))
    t_fit = time.time()
    history = fit(model, data, loss_fn=loss_fn(spec["model"]), config=cfg)
    return {"t_fit": t_fit, **_from_summary(history.summary, history.records)}


def _from_summary(summary: dict, records: list) -> dict:
    rates = [r["samples_per_s"] for r in records if r.get("samples_per_s")][1:]
    startup = summary.get("startup") or {}
    compile_row = next((d for d in summary.get("decisions", []) if d["name"] == "compile"), {})
    return {"first_end": startup.get("ended_at"), "steady_ms": 1000 * BATCH / statistics.median(rates)
            if rates else None, "startup": startup, "compile_decision": compile_row.get("reason")}


def child_loop(spec: dict) -> dict:
    import torch

    model, (x, y), lf = make_model(spec["model"]), make_data(spec["model"]), loss_fn(spec["model"])
    t_fit = time.time()  # as for fit: the model and the data are built
    if spec["compile"] == "whole":
        model = torch.compile(model)
    elif spec["compile"] == "regional":
        for block in model.blocks:
            block.compile()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    g = torch.Generator().manual_seed(0)
    times, first_end = [], None
    for step in range(STEPS):
        t0 = time.perf_counter()
        idx = torch.randint(0, len(x), (BATCH,), generator=g)
        loss = lf(model(x.index_select(0, idx)), y.index_select(0, idx))
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        times.append(time.perf_counter() - t0)
        if step == 0:
            first_end = time.time()
    return {"t_fit": t_fit, "first_end": first_end, "steady_ms": 1000 * statistics.median(times[4:])}


def steady_side_by_side(rounds: int) -> dict[str, dict[str, float]]:
    """The GPT-mini's hand-loop step eager / whole / regional, interleaved in this process: median
    and min ms per step over `rounds` rounds (after 4 warm-up steps each, which compile)."""
    import torch

    torch.set_num_threads(1)
    model_name = "gpt-mini"
    (x, y), lf = make_data(model_name), loss_fn(model_name)
    steps = {}
    for how in ("eager", "whole", "regional"):
        model = make_model(model_name)
        run = model
        if how == "whole":
            run = torch.compile(model)
        elif how == "regional":
            for block in model.blocks:
                block.compile()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
        g = torch.Generator().manual_seed(0)

        def step(run=run, opt=opt, g=g) -> None:
            idx = torch.randint(0, len(x), (BATCH,), generator=g)
            lf(run(x.index_select(0, idx)), y.index_select(0, idx)).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)

        for _ in range(4):
            step()
        steps[how] = step
    times: dict[str, list[float]] = {how: [] for how in steps}
    for _ in range(rounds):
        for how, step in steps.items():
            t0 = time.perf_counter()
            step()
            times[how].append(time.perf_counter() - t0)
    return {how: {"median_ms": 1000 * statistics.median(t), "min_ms": 1000 * min(t)} for how, t in times.items()}


# ---------------------------------------------------------------- the parent: cases in turn

def run_child(spec: dict, work: Path) -> dict:
    """One case in a fresh process with an empty inductor cache; its figures, or its error."""
    # One thread: on the shared 2 cores, OpenMP threads spin-waiting for a core made small steps many
    # times slower (tests/conftest.py); both sides run with the same.
    env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=tempfile.mkdtemp(dir=work, prefix="inductor-"), OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join([str(HERE.parent / "src"), str(HERE), os.environ.get("PYTHONPATH", "")]))
    env.pop("GPUTRAIN_COMPILE_CACHE", None)
    if spec.get("compile_cache"):  # a named folder: gputrain keeps inductor's cache in it (empty on a first start)
        env.pop("TORCHINDUCTOR_CACHE_DIR")
    if spec["kind"] == "cli":
        run_dir = Path(spec["run_dir"])
        cmd = [sys.executable, "-m", "gputrain", "fit", "first_step:gpt_workload", "--device", "cpu",
               "--precision", "fp32", "--run-dir", str(run_dir), "--no-tensorboard", "--quiet"]
        if spec["compile"] == "whole":
            cmd.append("--compile")
        elif spec["compile"] == "regional":
            cmd += ["--compile-scope", "regional"]
    else:
        cmd = [sys.executable, str(Path(__file__).resolve()), "--child", json.dumps(spec)]
    t_spawn = time.time()
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    t_exit = time.time()
    if proc.returncode != 0:
        return {"error": (proc.stderr or proc.stdout).strip().splitlines()[-1:] or ["exit %d" % proc.returncode]}
    if spec["kind"] == "cli":
        hist = json.loads((run_dir / "history.json").read_text())
        out = {"t_fit": None, **_from_summary(hist.get("summary", {}), hist.get("records", []))}
    else:
        out = json.loads(proc.stdout.strip().splitlines()[-1])
    out["from_command_s"] = out["first_end"] - t_spawn if out.get("first_end") else None
    out["from_fit_s"] = out["first_end"] - out["t_fit"] if out.get("first_end") and out.get("t_fit") else None
    out["process_s"] = t_exit - t_spawn
    return out


def plan(models: list[str], work: Path) -> list[dict]:
    """The cases in order. The GPT's regional fit stops at STOP_AT (a checkpoint) and is then resumed;
    second starts and the resume name the first start's compile cache folder."""
    specs = []
    for m in models:
        for c in ("eager", "whole", "regional"):
            if m == "resnet18" and c == "regional":
                continue  # falls back to the whole model (no run of identical blocks holding most weights)
            spec = {"name": f"{m} fit {c}", "kind": "fit", "model": m, "compile": c,
                    "compile_cache": str(work / f"cache-{m}-{c}") if c != "eager" else False}
            if m == "gpt-mini" and c == "regional":
                spec.update(run_dir=str(work / "resume-run"), stop_at=STOP_AT)
            specs.append(spec)
            specs.append({"name": f"{m} loop {c}", "kind": "loop", "model": m, "compile": c})
        if m == "gpt-mini":
            specs.append({"name": f"{m} fit regional resumed at {STOP_AT}", "kind": "fit", "model": m,
                          "compile": "regional", "run_dir": str(work / "resume-run"),
                          "compile_cache": str(work / f"cache-{m}-regional"), "resume": True})
            for c in ("eager", "regional"):
                specs.append({"name": f"{m} command {c}", "kind": "cli", "model": m, "compile": c,
                              "run_dir": str(work / f"cli-{c}")})
        for c in ("whole", "regional") if m == "gpt-mini" else ("whole",):
            specs.append({"name": f"{m} fit {c} second start", "kind": "fit", "model": m, "compile": c,
                          "compile_cache": str(work / f"cache-{m}-{c}")})
    return specs


def ratios(results: dict[str, dict]) -> dict[str, float]:
    def r(a: str, b: str, key: str) -> tuple[str, float] | None:
        x, y = results.get(a, {}).get(key), results.get(b, {}).get(key)
        return (f"{key}: {a} / {b}", x / y) if x and y else None

    pairs = [r("gpt-mini fit whole", "gpt-mini fit regional", "from_fit_s"),
             r("gpt-mini fit regional", "gpt-mini fit whole", "steady_ms"),
             r("gpt-mini fit whole", "gpt-mini fit whole second start", "from_fit_s"),
             r("gpt-mini fit regional", "gpt-mini fit regional second start", "from_fit_s"),
             r("gpt-mini fit regional", f"gpt-mini fit regional resumed at {STOP_AT}", "from_fit_s"),
             r("gpt-mini fit regional", "gpt-mini loop regional", "from_fit_s"),
             r("gpt-mini fit whole", "gpt-mini loop whole", "from_fit_s"),
             r("resnet18 fit whole", "resnet18 fit whole second start", "from_fit_s")]
    return dict(p for p in pairs if p is not None)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--child", help=argparse.SUPPRESS)
    p.add_argument("--models", default="gpt-mini,resnet18")
    p.add_argument("--json", default=None, help="where the JSON goes (default: a temp folder)")
    p.add_argument("--steady", type=int, default=None, metavar="ROUNDS",
                   help="only the GPT-mini's steady step, eager / whole / regional interleaved in one process")
    args = p.parse_args(argv)
    if args.steady:
        figures = steady_side_by_side(args.steady)
        for how, f in figures.items():
            print(f"{how:<9} median {f['median_ms']:7.2f} ms  min {f['min_ms']:7.2f} ms  ({args.steady} rounds)")
        print(f"regional / whole: median {figures['regional']['median_ms'] / figures['whole']['median_ms']:.2f}x, "
              f"min {figures['regional']['min_ms'] / figures['whole']['min_ms']:.2f}x")
        return 0
    if args.child:
        spec = json.loads(args.child)
        print(json.dumps(child_fit(spec) if spec["kind"] == "fit" else child_loop(spec), default=str))
        return 0
    import torch

    work = Path(tempfile.mkdtemp(prefix="first-step-"))
    results: dict[str, dict] = {}
    print(f"torch {torch.__version__}, 1 CPU thread (OMP_NUM_THREADS=1); each case a fresh process", flush=True)
    print(f"{'case':<44} {'from command s':>14} {'from fit s':>10} {'steady ms':>9}  compile decision", flush=True)
    for spec in plan(args.models.split(","), work):
        out = results[spec["name"]] = run_child(spec, work)
        if "error" in out:
            print(f"{spec['name']:<44} error: {out['error']}", flush=True)
            continue

        def f(v, fmt):
            return format(v, fmt) if v is not None else "-"

        print(f"{spec['name']:<44} {f(out['from_command_s'], '14.2f')} {f(out['from_fit_s'], '10.2f')} "
              f"{f(out['steady_ms'], '9.2f')}  {(out.get('compile_decision') or '')[:90]}", flush=True)
    rs = ratios(results)
    print("\nratios (one run, side by side):")
    for k, v in rs.items():
        print(f"  {k}: {v:.2f}x")
    path = Path(args.json) if args.json else work / "first_step.json"
    from gputrain.io.atomic import atomic_file

    with atomic_file(path, "w") as fh:
        json.dump({"command": " ".join(sys.argv), "torch": torch.__version__, "steps": STEPS, "log_every": LOG_EVERY,
                   "batch": BATCH, "gpt": GPT, "resnet_width": RESNET_WIDTH, "results": results, "ratios": rs},
                  fh, indent=1, default=str)
    print(f"JSON: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
