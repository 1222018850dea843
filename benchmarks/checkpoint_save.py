#!/usr/bin/env python
"""How long training stands still per checkpoint: one file (rank 0 gathers and writes), DCP blocking
(every rank writes its part), DCP async (training goes on while the files are written).

Runs `gputrain fit WORKLOAD --nproc N` once per mode (interleaved, --repeats times) and reads the run
summary's per-save timings: `blocked_s` (the training loop stood still) and `written_s` (from the
start of the save until it was committed). The final save of a run is left out (the run's end
waits for it anyway); the periodic saves are the ones training overlaps.

    python benchmarks/checkpoint_save.py                        # gpt-mini, 2 processes on the CPU
    python benchmarks/checkpoint_save.py --json results/checkpoint_save_cpu.json

Prints a table (median over the periodic saves of all repeats, and the spread of the per-run
medians) and writes JSON with the machine, versions, date and the exact commands.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

MODES = {"file": ["--checkpoint-format", "file"], "dcp": ["--checkpoint-format", "dcp"],
         "dcp-async": ["--checkpoint-format", "dcp", "--async-checkpoint"]}


def checkpoint_bytes(path: Path) -> int:
    """A checkpoint's size: the file, or every file of the folder."""
    return path.stat().st_size if path.is_file() else sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def run_once(workload: str, mode: str, nproc: int, steps: int, every: int, batch: int, base: Path,
             extra: list[str]) -> dict:
    run_dir = base / f"{mode}-{time.time_ns()}"
    cmd = [sys.executable, "-m", "gputrain", "fit", workload, "--device", "cpu", "--nproc", str(nproc),
           "--batch-size", str(batch), "--steps", str(steps), "--checkpoint-every", str(every), "--log-every",
           str(every), "--run-dir", str(run_dir), "--json", "--no-tensorboard", *MODES[mode], *extra]
    env = dict(os.environ, OMP_NUM_THREADS=str(max(1, (os.cpu_count() or 1) // nproc)), GLOO_SOCKET_IFNAME="lo")
    done = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{done.stderr[-3000:]}")
    summary = json.loads(done.stdout[done.stdout.index("{"):])["summary"]
    saves = [t for t in summary["checkpoint_timings"] if t["step"] < steps]  # the periodic ones
    size = checkpoint_bytes(run_dir / "checkpoints" / ("step-%06d.%s" % (steps, "pt" if mode == "file" else "dcp")))
    return {"mode": mode, "command": cmd, "blocked_s": [t["blocked_s"] for t in saves],
            "written_s": [t["written_s"] for t in saves], "time_s": summary["time_s"],
            "checkpoint_bytes": size, "steps": summary["steps"]}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workload", default="gpt-mini")
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--every", type=int, default=3)
    ap.add_argument("--batch", type=int, default=4, help="per process")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--modes", default="file,dcp,dcp-async")
    ap.add_argument("--json", default=None)
    ap.add_argument("extra", nargs="*", help="more `gputrain fit` flags (after --)")
    args = ap.parse_args(argv)
    modes = args.modes.split(",")
    base = Path(tempfile.mkdtemp(prefix="gputrain-ckpt-bench."))  # kept: the runs' folders, for a look
    runs = []
    for repeat in range(args.repeats):
        for mode in modes:  # interleaved: the machine's load changes over minutes
            r = run_once(args.workload, mode, args.nproc, args.steps, args.every, args.batch, base, args.extra)
            r["repeat"] = repeat
            runs.append(r)
            print(f"{mode:10s} repeat {repeat}: blocked {['%.3f' % b for b in r['blocked_s']]} s, written "
                  f"{['%.3f' % w for w in r['written_s']]} s", flush=True)
    rows = ["| format | checkpoint size | training blocked per save (median) | save written in (median) | "
            "blocked, per-run medians |", "|---|---|---|---|---|"]
    table = {}
    for mode in modes:
        mine = [r for r in runs if r["mode"] == mode]
        blocked = [b for r in mine for b in r["blocked_s"]]
        written = [w for r in mine for w in r["written_s"]]
        per_run = [statistics.median(r["blocked_s"]) for r in mine]
        table[mode] = {"blocked_median_s": statistics.median(blocked), "written_median_s": statistics.median(written),
                       "blocked_per_run_s": per_run, "checkpoint_bytes": mine[0]["checkpoint_bytes"]}
        rows.append(f"| {mode} | {mine[0]['checkpoint_bytes'] / 2**20:.0f} MiB | {statistics.median(blocked):.3f} s | "
                    f"{statistics.median(written):.3f} s | {', '.join('%.3f' % x for x in per_run)} |")
    print("\n".join(rows))
    if args.json:
        Path(args.json).write_text(json.dumps({
            "date": time.strftime("%Y-%m-%d %H:%M"), "machine": platform.processor() or platform.machine(),
            "cpus": os.cpu_count(), "torch": torch.__version__, "python": platform.python_version(),
            "config": vars(args), "table": table, "runs": runs}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
