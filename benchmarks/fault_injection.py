#!/usr/bin/env python
"""Fault injection (issue 13): kill, stop, damage and starve `gputrain fit` runs, then resume them.

Every faulted run is a real `gputrain fit` process on the CPU (the tiny deterministic workload
benchmarks/faults/tiny.py:workload, a few seconds a run); each is then resumed with --resume and
its final checkpoint compared, tensor by tensor and bit by bit, with an uninterrupted run's (the
harness that does it: benchmarks/faults/harness.py):

  a  SIGKILL at a random moment of training, or aimed at a checkpoint write (the k-th temp file seen)
  b  SIGTERM at a random moment: exit 143, a checkpoint of the stop step, resume exact
  c  the newest checkpoint truncated, its bytes flipped, or emptied: resume falls back, ends exact
  d  --lr 1e30, and an inf planted in a training sample: stops (exit 2, names the steps and the last
     good checkpoint; no checkpoint holds a non-finite value) or, with --on-nan skip, skips and ends
     finite (the inf run also killed and resumed: exact against an uninterrupted skipping run)
  e  a full disk: an ENOSPC injected into the checkpoint write's fsync (any machine), and a small
     tmpfs filled up mid-run (where `mount -t tmpfs` works): the previous checkpoint verifies, the
     error says so, and a resume once there is room ends exact
  f  torchrun with 2 processes (gloo), SIGTERM to one rank: both stop at the same step, one
     checkpoint, a new --nproc 2 --resume ends exact
  g  sharded (DCP) checkpoints, 2 processes: SIGKILL of one rank while a checkpoint is being
     written; every checkpoint left verifies, a --nproc 2 --resume ends exact (benchmarks/faults/dcp.py)
  h  sharded checkpoints: one file of the newest folder damaged (a shard, a run state, the metadata);
     the resume warns naming the file, falls back to the previous checkpoint, ends exact

    python -m benchmarks.fault_injection                 # the full counts (>= 30 SIGKILLs), minutes
    python -m benchmarks.fault_injection --quick         # a few of each
    python -m benchmarks.fault_injection --only a,b --json results.json

Prints a table: fault, trials, runs that ended exact (or as configured, for d), data lost.
tests/test_faults.py runs a short version of the same trials in the default suite.
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch

from benchmarks.faults.dcp import trial_dcp_damaged, trial_dcp_sigkill
from benchmarks.faults.harness import (Harness, Trial, tmpfs_available, trial_corrupt, trial_enospc, trial_nonfinite,
                                       trial_preflight_full, trial_sigkill, trial_sigterm, trial_tmpfs, trial_torchrun,
                                       trial_torchrun_restart)


# ---------------------------------------------------------------- the suite


FAULTS = {
    "a": "SIGKILL mid-training / mid-checkpoint-write, then --resume",
    "b": "SIGTERM at a random step, then --resume",
    "c": "newest checkpoint truncated / bytes flipped / emptied, then --resume",
    "d": "lr 1e30 and an inf in the data, --on-nan stop and skip",
    "e": "full disk: ENOSPC injected, a filled tmpfs, preflight on a tiny tmpfs",
    "f": "torchrun 2 processes (gloo), SIGTERM to one rank, then --resume (or --max-restarts 1)",
    "g": "DCP, 2 processes (gloo): SIGKILL of one rank during a checkpoint write, then --resume",
    "h": "DCP, 2 processes: one file of the newest checkpoint folder damaged, then --resume",
}


def run_suite(h: Harness, counts: dict[str, int], seed: int = 0, only: str = "abcdefgh",
              log=print) -> list[Trial]:
    rng = random.Random(seed)
    trials: list[Trial] = []

    def record(t: Trial) -> None:
        trials.append(t)
        log(f"[{t.fault}] {'ok  ' if t.ok else 'FAIL'} {t.detail}")

    if "a" in only:
        for _ in range(counts["a"]):
            record(trial_sigkill(h, rng))
    if "b" in only:
        for _ in range(counts["b"]):
            record(trial_sigterm(h, rng))
    if "c" in only:
        hows = ["truncate", "flip", "empty"]
        for i in range(counts["c"]):
            record(trial_corrupt(h, rng, hows[i % 3]))
    if "d" in only:
        for i in range(counts["d"]):
            record(trial_nonfinite(h, rng, *NONFINITE_CASES[i % len(NONFINITE_CASES)]))
    if "e" in only:
        tmpfs = tmpfs_available(h.base)
        for i in range(counts["e"]):
            if tmpfs and i % 2 == 1:
                record(trial_tmpfs(h, rng))
            else:
                record(trial_enospc(h, rng))
        if tmpfs:
            record(trial_preflight_full(h, rng))
        else:
            log("[e] no tmpfs here (mount refused): the full disk was only injected")
    if "f" in only:
        for i in range(counts["f"]):
            record(trial_torchrun_restart(h, rng) if i % 2 == 1 else trial_torchrun(h, rng))
    if "g" in only:
        for _ in range(counts["g"]):
            record(trial_dcp_sigkill(h, rng))
    if "h" in only:
        for _ in range(counts["h"]):
            record(trial_dcp_damaged(h, rng))
    return trials


def lost_text(fault: str, ts: list[Trial], every: int) -> str:
    lost = [t.lost_steps for t in ts if t.lost_steps is not None]
    if fault == "a":
        writes = sum(1 for t in ts if t.facts.get("in_write"))
        passed = [x for x in lost if x > 0]
        text = (f"no run lost its result; {writes} of {len(ts)} kills landed while a checkpoint temp file existed; "
                f"resumed from the newest complete checkpoint in {len(lost) - len(passed)}")
        if passed:
            text += (f", from the one before in {len(passed)} ({_span(passed)} steps redone: killed after the "
                     "new file's rename, before `latest` named it, which load_latest passes over by design)")
        return text
    if fault == "b":
        return f"{sum(lost)} steps (resumed at the stop step)" if lost else "-"
    if fault == "c":
        return f"{_span(lost)} steps (the damaged checkpoint's)" if lost else "-"
    if fault == "d":
        return (f"{_span(lost)} finite steps after the last good checkpoint (stop runs)" if lost
                else "none (skip runs)")
    if fault == "e":
        return f"{_span(lost)} steps since the previous checkpoint" if lost else "-"
    if fault == "f":
        return f"{sum(lost)} steps (resumed at the stop step)" if lost else "-"
    if fault == "g":
        in_save = sum(1 for t in ts if t.facts.get("in_save"))
        newest = sum(1 for t in ts if t.lost_steps == 0)
        return (f"{in_save} of {len(ts)} kills landed while the checkpoint's staging folder existed; resumed from the "
                f"newest committed checkpoint (or a newer one committed before the kill) in {newest}; the steps "
                "since it are redone")
    if fault == "h":
        files = sorted({t.facts.get("file", "?") for t in ts})
        return (f"{_span(lost)} steps (the damaged checkpoint's); damaged: {', '.join(files)}; the warning named the "
                f"file in {sum(1 for t in ts if t.facts.get('warned'))} of {len(ts)}" if lost else "-")
    return "-"


def _span(values: list[int]) -> str:
    return f"{min(values)}" if min(values) == max(values) else f"{min(values)}-{max(values)}"


def table(trials: list[Trial], every: int) -> str:
    rows = ["| fault | trials | ended exact | data lost |", "|---|---|---|---|"]
    for fault, what in FAULTS.items():
        ts = [t for t in trials if t.fault == fault]
        if not ts:
            continue
        good = sum(t.ok for t in ts)
        label = "as configured" if fault == "d" else "exact"
        rows.append(f"| ({fault}) {what} | {len(ts)} | {good}/{len(ts)} {label} | {lost_text(fault, ts, every)} |")
    return "\n".join(rows)


FULL_EVERY = 5  # the Harness's default --checkpoint-every
NONFINITE_CASES = [("lr", "stop"), ("inf", "stop"), ("lr", "skip"), ("inf", "skip"), ("inf-grad", "stop"),
                   ("inf-grad", "skip")]
FULL = {"a": 32, "b": 10, "c": 6, "d": 12, "e": 4, "f": 4, "g": 20, "h": 6}
QUICK = {"a": 3, "b": 2, "c": 3, "d": 6, "e": 2, "f": 2, "g": 2, "h": 2}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="a few trials of each fault")
    ap.add_argument("--only", default="abcdefgh", help="which faults, e.g. a,b")
    ap.add_argument("--seed", type=int, default=0)
    for k in FULL:
        ap.add_argument(f"--trials-{k}", type=int, default=None)
    ap.add_argument("--json", default=None, help="write every trial's outcome to this file")
    ap.add_argument("--keep", action="store_true", help="keep the run directories (printed)")
    ap.add_argument("--table-from", default=None, metavar="JSON", help="print the table of an earlier --json file")
    args = ap.parse_args(argv)
    if args.table_from:
        saved = json.loads(Path(args.table_from).read_text())
        trials = [Trial(**t) for t in saved["trials"]]
        print(table(trials, FULL_EVERY))
        return 0
    counts = dict(QUICK if args.quick else FULL)
    for k in FULL:
        if getattr(args, f"trials_{k}") is not None:
            counts[k] = getattr(args, f"trials_{k}")
    only = args.only.replace(",", "")
    base = Path(tempfile.mkdtemp(prefix="gputrain-faults."))
    t0 = time.perf_counter()
    try:
        h = Harness(base)
        trials = run_suite(h, counts, seed=args.seed, only=only, log=lambda s: print(s, flush=True))
    finally:
        if args.keep:
            print(f"run directories kept in {base}")
        else:
            shutil.rmtree(base, ignore_errors=True)
    elapsed = time.perf_counter() - t0
    print()
    print(table(trials, h.every))
    print(f"\n{len(trials)} trials in {elapsed:.0f} s; torch {torch.__version__}, CPU, seed {args.seed}")
    if args.json:
        Path(args.json).write_text(json.dumps({
            "seed": args.seed, "counts": counts, "seconds": elapsed, "torch": torch.__version__,
            "trials": [t.__dict__ for t in trials]}, indent=1, default=str))
    return 0 if all(t.ok for t in trials) else 1


if __name__ == "__main__":
    sys.exit(main())
