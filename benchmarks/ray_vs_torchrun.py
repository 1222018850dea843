"""The same `gputrain fit` on 2 CPU processes, started by torchrun (`--nproc 2`) and by Ray Train
(`--launcher ray --nproc 2`: a local Ray cluster, 2 workers, gloo): the step's speed and the time to
the first step under each, as ratios (Ray / torchrun).

Each run is its own `python -m gputrain fit` command, in turn (torchrun, Ray, torchrun, Ray, ...), on
the same workload, data, batch size, steps and precision (fp32), one thread per process (torchrun's
launcher and Ray both give each process cores / processes = 1 here). Measured per run:

  steady samples/s   rank 0's samples per second over each log interval after the first (median)
  from fit s         fit's own clock: the trainer's construction to the end of the first step
                     (summary "startup" wall_s, train/loop/startup_costs.py)
  from command s     this script's spawn of the command to the end of the first step (the summary's
                     `ended_at`): the launcher's own start (Ray: the cluster and its worker group)
  command s          the spawn to the command's exit

The ratios are of the medians over the runs; the spread (min-max) of each side is printed beside.

Usage:
  python benchmarks/ray_vs_torchrun.py                    # 2 runs each, JSON to a temp folder
  python benchmarks/ray_vs_torchrun.py --reps 3 --steps 400 --json out.json
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

SRC = str(Path(__file__).resolve().parents[1] / "src")


def one_run(launcher: str, folder: Path, args: argparse.Namespace) -> dict:
    run_dir = folder / f"{launcher}-{time.time_ns()}"
    cmd = [sys.executable, "-m", "gputrain", "fit", args.workload, "--nproc", "2", "--steps", str(args.steps),
           "--log-every", str(args.log_every), "--batch-size", str(args.batch_size), "--device", "cpu",
           "--precision", "fp32", "--no-tensorboard", "--json", "--quiet", "--run-dir", str(run_dir)]
    if launcher == "ray":
        cmd += ["--launcher", "ray"]
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "OMP_NUM_THREADS")}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [SRC, env.get("PYTHONPATH")]))
    env["HOME"] = str(folder / "home")  # Ray's storage (~/ray_results) in the temp folder
    spawn = time.time()
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=args.timeout)
    done = time.time()
    if proc.returncode != 0:
        raise SystemExit(f"{launcher} run failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    summary = json.loads(proc.stdout[proc.stdout.index("{"):])["summary"]
    records = json.loads((run_dir / "history.json").read_text())["records"]
    rates = [r["samples_per_s"] for r in records if r.get("samples_per_s")][1:]
    startup = summary.get("startup") or {}
    return {"launcher": launcher, "steady_samples_per_s": statistics.median(rates), "from_fit_s": startup.get("wall_s"),
            "from_command_s": startup["ended_at"] - spawn if startup.get("ended_at") else None,
            "command_s": done - spawn, "world_size": summary.get("world_size"), "steps": summary.get("steps")}


def _stats(values: list[float]) -> dict:
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "n": len(values)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--workload", default="mnist1d-cnn")
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--log-every", type=int, default=25)
    p.add_argument("--batch-size", type=int, default=64, help="per process")
    p.add_argument("--reps", type=int, default=2, help="runs of each launcher, in turn")
    p.add_argument("--timeout", type=float, default=900)
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    folder = Path(tempfile.mkdtemp(prefix="gputrain-ray-bench-"))
    runs = []
    for rep in range(args.reps):
        for launcher in ("torchrun", "ray"):
            run = one_run(launcher, folder, args)
            runs.append(run)
            print(f"rep {rep + 1} {launcher:<8} steady {run['steady_samples_per_s']:9.0f} samples/s  "
                  f"from fit {run['from_fit_s']:6.2f} s  from command {run['from_command_s']:6.2f} s  "
                  f"command {run['command_s']:6.1f} s", flush=True)
    keys = ("steady_samples_per_s", "from_fit_s", "from_command_s", "command_s")
    table = {launcher: {k: _stats([r[k] for r in runs if r["launcher"] == launcher]) for k in keys}
             for launcher in ("torchrun", "ray")}
    ratios = {k: table["ray"][k]["median"] / table["torchrun"][k]["median"] for k in keys}
    print(f"\n{args.workload}, {args.steps} steps of {args.batch_size} x 2 processes, fp32, CPU, gloo; "
          f"medians of {args.reps} runs each (min-max)")
    print(f"{'':22} {'torchrun':>22} {'ray':>22} {'ray / torchrun':>15}")
    for k in keys:
        t, r = table["torchrun"][k], table["ray"][k]
        print(f"{k:22} {t['median']:10.2f} ({t['min']:.2f}-{t['max']:.2f}) {r['median']:10.2f} "
              f"({r['min']:.2f}-{r['max']:.2f}) {ratios[k]:14.2f}x")
    import torch

    doc = {"command": " ".join([sys.executable, *sys.argv]), "config": vars(args), "torch": torch.__version__,
           "device": "cpu (2 processes, 1 thread each)", "runs": runs, "table": table, "ratios": ratios}
    out = Path(args.json) if args.json else folder / "ray_vs_torchrun.json"
    out.write_text(json.dumps(doc, indent=2))
    print(f"\nJSON: {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
