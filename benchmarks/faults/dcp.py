"""Fault injection for sharded (DCP) checkpoints: `gputrain fit --nproc 2` (gloo), every rank writing
its part; the trials of harness.py's Harness (same workload, flags and exactness check):

  g  SIGKILL of one rank while a DCP checkpoint is being written (a staging folder exists): torchrun
     stops the job; every checkpoint left under a step name verifies, and a --nproc 2 --resume ends
     bit-equal to an uninterrupted 2-process run
  h  one file of the newest checkpoint folder damaged (a rank's shard, a rank's run state or DCP's
     metadata; bytes flipped or truncated): the resume warns naming that file, falls back to the
     checkpoint before, and ends bit-equal

benchmarks/fault_injection.py runs them with the others (--only g,h); tests/test_faults.py a short one.
"""

from __future__ import annotations

import os
import random
import re
import signal
from pathlib import Path

from benchmarks.faults.harness import Harness, Trial, _ranks, damage, training_started, wait_for

# a save's staging folder (.step-N.dcp.TOKEN.tmp, TOKEN = hex time - pid), not a pruned or replaced
# folder on its way out (.step-N.dcp.pruned-PID.tmp)
_STAGING = re.compile(r"^\.step-(\d+)\.dcp\.[0-9a-f]+-\d+\.tmp$")
_DIR = re.compile(r"^step-(\d+)\.dcp$")
DCP_PAD_KB = 16384  # a 16 MiB buffer in the model: each save writes (and hashes) long enough to be hit


def _committed(h: Harness, run_dir: Path) -> list[int]:
    try:
        return sorted(int(m.group(1)) for n in os.listdir(h.folder(run_dir)) if (m := _DIR.match(n)))
    except FileNotFoundError:
        return []


def _staging(h: Harness, run_dir: Path) -> list[str]:
    try:
        return [n for n in os.listdir(h.folder(run_dir)) if _STAGING.match(n)]
    except FileNotFoundError:
        return []


def trial_dcp_sigkill(h: Harness, rng: random.Random) -> Trial:
    """(g) SIGKILL one rank of `--nproc 2` while the k-th DCP checkpoint is being written."""
    run_dir = h.new_dir("dcp-sigkill")
    options = {"pad_kb": DCP_PAD_KB}
    reference = h.reference(nproc=2, options=options)
    proc = h.start(h.args(run_dir, "--nproc", "2", options=options))
    if not wait_for(training_started(h, run_dir), proc, h.timeout):
        return Trial("g", False, None, f"the run never wrote a checkpoint: {proc.wait(5).describe()}")
    k = rng.randint(1, max(1, int(0.6 * h.steps / h.every)))
    seen: set[str] = set()

    def kth_save() -> bool:
        names = _staging(h, run_dir)
        seen.update(names)
        return len(seen) >= k and bool(names)

    wait_for(kth_save, proc, h.timeout, poll=0.0005)
    workers = _ranks(proc)
    if sorted(workers) != [0, 1] or not proc.alive():
        return Trial("g", False, None, f"the ranks were not found running (found {workers}): "
                     f"{proc.wait(60).describe()}")
    target = rng.choice([0, 1])
    committed_before = _committed(h, run_dir)
    os.kill(workers[target], signal.SIGKILL)
    in_save = bool(_staging(h, run_dir))  # the staging folder was still there when the rank died
    killed = proc.wait(120)
    from gputrain.checkpoint.store import CheckpointStore

    store = CheckpointStore(run_dir)
    bad = [f"{p.name}: {why}" for p in store.list() if (why := store.verify(p)) is not True]
    resume_step, warns = h.resumable(run_dir)
    run = h.run(h.args(run_dir, "--nproc", "2", "--resume", str(run_dir), options=options))
    if run.rc != 0:
        return Trial("g", False, None, f"resume after killing rank {target} failed: {run.describe()}")
    exact, why = h.exact(run_dir, reference)
    newest = max(committed_before) if committed_before else None
    ok = exact and not bad and not warns and killed.rc != 0 and resume_step is not None \
        and newest is not None and resume_step >= newest
    lost = None if resume_step is None or newest is None else max(0, newest - resume_step)
    return Trial("g", ok, lost,
                 f"SIGKILL to rank {target} during save {k} (staging folder present: {in_save}; committed then "
                 f"{committed_before[-2:]}), launcher exit {killed.rc}, checkpoints not verifying: {bad or 'none'}, "
                 f"resumed from {resume_step}: {why}",
                 {"target_rank": target, "in_save": in_save, "launcher_rc": killed.rc, "resumed_from": resume_step,
                  "newest_before": newest, "warnings": warns})


_WHICH = ["__0_0.distcp", "__1_0.distcp", "run-00000.pt", "run-00001.pt", ".metadata"]


def trial_dcp_damaged(h: Harness, rng: random.Random) -> Trial:
    """(h) damage one file of the newest checkpoint folder of a 2-process run; resume falls back."""
    run_dir = h.new_dir("dcp-damaged")
    reference = h.reference(nproc=2)
    stop = h.every * rng.randint(3, max(3, h.steps // h.every - 2))
    stopped = h.run(h.args(run_dir, "--nproc", "2", "--stop-at-step", str(stop)))
    if stopped.rc != 0:
        return Trial("h", False, None, f"the run to step {stop} failed: {stopped.describe()}")
    from gputrain.checkpoint.store import CheckpointStore

    newest = CheckpointStore(run_dir).latest_path()
    if newest is None or newest.name != f"step-{stop:06d}.dcp":
        return Trial("h", False, None, f"expected step-{stop:06d}.dcp as the newest checkpoint, found {newest}")
    name = rng.choice(_WHICH)
    how = rng.choice(["flip", "truncate"])
    what = damage(newest / name, how, rng)
    resume_step, warns = h.resumable(run_dir)
    run = h.run(h.args(run_dir, "--nproc", "2", "--resume", str(run_dir)))
    if run.rc != 0:
        return Trial("h", False, None, f"resume after {name} {what} failed: {run.describe()}")
    # The resuming job's warning names the folder and the file in it.
    warned = bool(re.search(rf"{re.escape(newest.name)} skipped: {re.escape(name)}", run.stderr))
    exact, why = h.exact(run_dir, reference)
    ok = exact and warned and resume_step is not None and resume_step < stop
    return Trial("h", ok, None if resume_step is None else stop - resume_step,
                 f"{newest.name}/{name} {what}; warning naming it: {warned}; resumed from {resume_step}: {why}",
                 {"file": name, "how": how, "warned": warned, "resumed_from": resume_step, "stop": stop,
                  "store_warnings": warns})
