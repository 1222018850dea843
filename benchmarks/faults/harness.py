"""The fault-injection harness: start `gputrain fit` runs, kill, stop, damage and starve them, resume
them, and compare their final checkpoints bit by bit with an uninterrupted run's.

Every faulted run is a real `gputrain fit` process on the CPU (the tiny deterministic workload
benchmarks/faults/tiny.py:workload, a few seconds a run). `Harness` starts runs and finds and
compares checkpoints; each `trial_*` function injects one fault and returns a `Trial` (ok, detail,
steps lost):

  trial_sigkill     SIGKILL at a random moment of training, or aimed at a checkpoint write
  trial_sigterm     SIGTERM at a random moment: exit 143, a checkpoint of the stop step, resume exact
  trial_corrupt     the newest checkpoint truncated, its bytes flipped, or emptied: resume falls back
  trial_nonfinite   --lr 1e30, an inf in a training sample or an inf-gradient: stop or skip as configured
  trial_enospc, trial_tmpfs, trial_preflight_full   a full disk (injected, or a small tmpfs)
  trial_torchrun, trial_torchrun_restart            2 processes (gloo), SIGTERM to one rank

tests/test_faults.py runs a short version of the trials in the default suite;
benchmarks/fault_injection.py runs them in full counts and prints the table in benchmarks/LOG.md.
"""

from __future__ import annotations

import contextlib
import errno
import io
import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[2]  # the runs' working folder: the repository
WORKLOAD = f"{Path(__file__).resolve().with_name('tiny.py')}:workload"
# atomic_file's temp of a checkpoint (or of its .sha256), or the staging folder of a sharded one
_TEMP = re.compile(r"^\.step-\d+\.(pt|dcp)\..+\.tmp$")
_STEP_FILE = re.compile(r"^step-(\d+)\.(pt|dcp)$")  # a one-file checkpoint or a sharded one's folder


# ---------------------------------------------------------------- running gputrain fit


@dataclass
class Run:
    rc: int
    stdout: str
    stderr: str
    seconds: float

    @property
    def last_line(self) -> str:
        lines = [ln for ln in self.stderr.splitlines() if ln.strip()]
        return lines[-1] if lines else ""

    def describe(self) -> str:
        return f"exit {self.rc}; stderr ends:\n" + "\n".join(self.stderr.splitlines()[-15:])


class Harness:
    """Starts `gputrain fit` on the tiny workload with fixed flags; finds and compares checkpoints.

    steps, every: --steps and --checkpoint-every. sleep_ms: a pause in each training forward (a
    run lasts long enough to be hit at random moments). pad_kb: a constant buffer that makes each
    checkpoint that much bigger (writes long enough to be hit). in_process: runs that are not
    faulted (references, resumes) call gputrain.cli.main in this process (no interpreter start,
    no torch import: what keeps the default suite short); faulted runs are always processes.
    """

    def __init__(self, base: str | Path, steps: int = 200, every: int = 5, sleep_ms: float = 5.0,
                 pad_kb: int = 1024, timeout: float = 300.0, in_process: bool = False):
        self.base = Path(base)
        self.steps, self.every, self.sleep_ms, self.pad_kb = steps, every, sleep_ms, pad_kb
        self.timeout = timeout
        self.in_process = in_process
        self._references: dict[tuple, dict[str, Any]] = {}
        self._n = 0
        self.history_inexact = 0  # exact runs whose logged losses differ in their last bits

    # ------------------------------------------------------------ commands

    def new_dir(self, tag: str) -> Path:
        self._n += 1
        return self.base / f"{tag}-{self._n:03d}"

    def args(self, run_dir: Path, *extra: str, options: dict[str, Any] | None = None) -> list[str]:
        opts = {"sleep_ms": self.sleep_ms, "pad_kb": self.pad_kb, **(options or {})}
        out = ["fit", WORKLOAD, "--run-dir", str(run_dir), "--steps", str(self.steps), "--checkpoint-every",
               str(self.every), "--log-every", "10", "--device", "cpu", "--json", "--no-tensorboard"]
        for k, v in opts.items():
            out += ["--option", f"{k}={v}"]
        return out + list(extra)

    @staticmethod
    def env(extra: dict[str, str] | None = None) -> dict[str, str]:
        env = dict(os.environ)
        env.update({"OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "COLUMNS": "250"})
        env.pop("GPUTRAIN_FAULT_ENOSPC_AT", None)
        env.update(extra or {})
        return env

    def start(self, argv: list[str], env: dict[str, str] | None = None) -> "Proc":
        return Proc(argv, self.env(env), self.base)

    def run(self, argv: list[str], env: dict[str, str] | None = None, in_process: bool | None = None) -> Run:
        """A run to its end: in this process when allowed (no env, in_process), else a process."""
        # --nproc is always a process: `gputrain fit --nproc N` hands torchrun sys.argv, not main()'s argv.
        if (self.in_process if in_process is None else in_process) and not env and "--nproc" not in argv:
            return _run_in_process(argv)
        return self.start(argv, env).wait(self.timeout)

    # ------------------------------------------------------------ checkpoints

    @staticmethod
    def folder(run_dir: Path) -> Path:
        return Path(run_dir) / "checkpoints"

    @staticmethod
    def snapshot(run_dir: Path) -> tuple[int | None, bool]:
        """(highest step of a complete checkpoint file, whether a checkpoint temp file exists)."""
        steps, temp = [], False
        try:
            names = os.listdir(Harness.folder(run_dir))
        except FileNotFoundError:
            return None, False
        for name in names:
            m = _STEP_FILE.match(name)
            if m:
                steps.append(int(m.group(1)))
            elif _TEMP.match(name):
                temp = True
        return (max(steps) if steps else None), temp

    @staticmethod
    def resumable(run_dir: Path) -> tuple[int | None, list[str]]:
        """The step --resume will start from (the store's own choice) and the warnings it gives."""
        from gputrain.checkpoint.store import CheckpointStore

        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            found = CheckpointStore(run_dir).load_latest()
        return (None if found is None else int(found[0]["step"])), [str(w.message) for w in caught]

    @staticmethod
    def final(run_dir: Path) -> dict[str, Any]:
        from gputrain.checkpoint.read import read_checkpoint
        from gputrain.checkpoint.store import CheckpointStore

        path = CheckpointStore(run_dir).latest_path()
        if path is None:
            raise AssertionError(f"{run_dir}: no checkpoint")
        with warnings.catch_warnings():  # several processes write the sharded format: read whole here
            warnings.simplefilter("ignore")
            return read_checkpoint(path)

    def reference(self, nproc: int = 1, options: dict[str, Any] | None = None, extra: tuple[str, ...] = ()) -> dict:
        """The final checkpoint of an uninterrupted run with these settings (run once, cached)."""
        key = (nproc, tuple(sorted((options or {}).items())), extra)
        if key not in self._references:
            run_dir = self.new_dir("reference")
            argv = self.args(run_dir, *extra, options=options)
            if nproc > 1:
                argv += ["--nproc", str(nproc)]
            run = self.run(argv)
            if run.rc != 0:
                raise RuntimeError(f"the uninterrupted reference run failed: {run.describe()}")
            self._references[key] = self.final(run_dir)
        return self._references[key]

    def exact(self, run_dir: Path, reference: dict) -> tuple[bool, str]:
        """Does the run's final checkpoint hold the reference's step, model and optimizer, bit for bit?"""
        got = self.final(run_dir)
        if got["step"] != reference["step"]:
            return False, f"final step {got['step']}, the uninterrupted run's {reference['step']}"
        why = _differs(got["model"], reference["model"], "model") or \
            _differs(got["optimizer"], reference["optimizer"], "optimizer")
        if why:
            return False, why
        steps = [r.get("step") for r in got.get("history", [])]
        ref_steps = [r.get("step") for r in reference.get("history", [])]
        if steps != ref_steps:
            return False, f"history records at steps {steps}, the uninterrupted run's at {ref_steps}"
        losses = [r.get("loss") for r in got.get("history", [])]
        ref_losses = [r.get("loss") for r in reference.get("history", [])]
        if losses == ref_losses:
            return True, "bit-equal (model, optimizer, history losses)"
        # The logged loss is a mean over a log interval; a stop inside the interval adds its partial
        # sums in another order, which can change the mean's last bits (the parameters are unaffected).
        rel = max(abs(a - b) / max(abs(b), 1e-30) for a, b in zip(losses, ref_losses))
        if rel > 1e-6:
            return False, f"history losses differ (max relative difference {rel:.3g})"
        self.history_inexact += 1
        return True, (f"bit-equal model and optimizer; history losses equal within {rel:.2g} relative "
                      "(not bit-equal)")

    @staticmethod
    def all_checkpoints_finite_and_verified(run_dir: Path) -> tuple[bool, str]:
        from gputrain.checkpoint.store import CheckpointStore

        store = CheckpointStore(run_dir)
        for path in store.list():
            ok = store.verify(path)
            if ok is not True:
                return False, f"{path.name} does not verify: {ok}"
            model = torch.load(path, map_location="cpu", weights_only=True)["model"]
            for k, v in model.items():
                if torch.is_tensor(v) and v.is_floating_point() and not torch.isfinite(v).all():
                    return False, f"{path.name} holds a non-finite {k}"
        return True, f"{len(store.list())} checkpoints, all verify and are finite"


class Proc:
    """A `python -m gputrain ...` process, output to files (no pipe can fill up and block it)."""

    def __init__(self, argv: list[str], env: dict[str, str], base: Path):
        fd_out, self._out = tempfile.mkstemp(prefix="out.", dir=base)
        fd_err, self._err = tempfile.mkstemp(prefix="err.", dir=base)
        self.t0 = time.perf_counter()
        with os.fdopen(fd_out, "wb") as out, os.fdopen(fd_err, "wb") as err:
            self.p = subprocess.Popen([sys.executable, "-m", "gputrain", *argv], stdout=out, stderr=err, env=env,
                                      cwd=ROOT)

    @property
    def pid(self) -> int:
        return self.p.pid

    def alive(self) -> bool:
        return self.p.poll() is None

    def wait(self, timeout: float) -> Run:
        try:
            rc = self.p.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.p.kill()
            rc = self.p.wait()
            with open(self._err, "a") as f:
                f.write(f"\n[fault_injection: killed after a {timeout:.0f} s timeout]\n")
        seconds = time.perf_counter() - self.t0
        out, err = Path(self._out).read_text(errors="replace"), Path(self._err).read_text(errors="replace")
        for name in (self._out, self._err):
            with contextlib.suppress(OSError):
                os.unlink(name)
        return Run(rc, out, err, seconds)

    def descendants(self) -> list[int]:
        """Every process below this one (torchrun and its workers), by /proc's children lists."""
        out, todo = [], [self.pid]
        while todo:
            pid = todo.pop()
            try:
                kids = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
            except OSError:
                continue
            for k in map(int, kids):
                out.append(k)
                todo.append(k)
        return out


def _run_in_process(argv: list[str]) -> Run:
    from gputrain.cli import main

    err, out = io.StringIO(), io.StringIO()
    t0 = time.perf_counter()
    with warnings.catch_warnings(record=True) as caught, contextlib.redirect_stderr(err), \
            contextlib.redirect_stdout(out):
        warnings.simplefilter("always")
        try:
            rc = main(argv)
        except SystemExit as exc:
            rc = exc.code if isinstance(exc.code, int) else 1
        except Exception as exc:  # noqa: BLE001 - an uncaught error is what a process would print
            import traceback

            traceback.print_exc(file=err)
            rc = 1
    text = "".join(f"{w.category.__name__}: {w.message}\n" for w in caught) + err.getvalue()
    return Run(rc, out.getvalue(), text, time.perf_counter() - t0)


def _differs(a: Any, b: Any, where: str) -> str | None:
    if torch.is_tensor(a) or torch.is_tensor(b):
        if not (torch.is_tensor(a) and torch.is_tensor(b)):
            return f"{where}: a tensor against a {type(b if torch.is_tensor(a) else a).__name__}"
        if a.dtype != b.dtype or a.shape != b.shape:
            return f"{where}: {a.dtype}{tuple(a.shape)} vs {b.dtype}{tuple(b.shape)}"
        ab = a.detach().cpu().contiguous().reshape(-1).view(torch.uint8)
        bb = b.detach().cpu().contiguous().reshape(-1).view(torch.uint8)
        if not torch.equal(ab, bb):
            n = int((a != b).sum()) if a.is_floating_point() else -1
            return f"{where}: the bits differ ({n} values)"
        return None
    if isinstance(a, dict) and isinstance(b, dict):
        if set(a) != set(b):
            return f"{where}: keys {sorted(map(str, set(a) ^ set(b)))} in one only"
        for k in a:
            why = _differs(a[k], b[k], f"{where}.{k}")
            if why:
                return why
        return None
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        if len(a) != len(b):
            return f"{where}: length {len(a)} vs {len(b)}"
        for i, (x, y) in enumerate(zip(a, b)):
            why = _differs(x, y, f"{where}[{i}]")
            if why:
                return why
        return None
    return None if a == b else f"{where}: {a!r} vs {b!r}"


def wait_for(cond, proc: Proc | None, timeout: float, poll: float = 0.002) -> bool:
    """Poll `cond()` until true (True), the process ended or the timeout passed (False)."""
    end = time.perf_counter() + timeout
    while time.perf_counter() < end:
        if cond():
            return True
        if proc is not None and not proc.alive():
            return bool(cond())
        time.sleep(poll)
    return False


def training_started(h: Harness, run_dir: Path):
    return lambda: (h.folder(run_dir) / "latest").exists()


def train_span(h: Harness) -> float:
    """Seconds of training after the first checkpoint at the least (the forwards' sleeps alone)."""
    return (h.steps - h.every) * h.sleep_ms / 1000.0


# ---------------------------------------------------------------- trials


@dataclass
class Trial:
    fault: str
    ok: bool
    lost_steps: int | None  # steps of training the fault cost (see each trial for what is counted)
    detail: str
    facts: dict[str, Any] = field(default_factory=dict)


def trial_sigkill(h: Harness, rng: random.Random, aim: str | None = None) -> Trial:
    """(a) SIGKILL at a random moment of training, or aimed at the k-th checkpoint temp file seen."""
    run_dir = h.new_dir("sigkill")
    aim = aim or rng.choice(["training", "write"])
    reference = h.reference()
    proc = h.start(h.args(run_dir))
    if not wait_for(training_started(h, run_dir), proc, h.timeout):
        return Trial("a", False, None, f"the run never wrote a checkpoint: {proc.wait(5).describe()}")
    before, in_write = None, False
    if aim == "training":
        time.sleep(rng.uniform(0.0, 0.9 * train_span(h)))
        before, in_write = h.snapshot(run_dir)
    else:
        k = rng.randint(2, max(2, int(0.7 * h.steps / h.every)))
        seen: set[str] = set()

        def kth_temp() -> bool:
            nonlocal before, in_write
            try:
                names = os.listdir(h.folder(run_dir))
            except FileNotFoundError:
                return False
            temps = [n for n in names if _TEMP.match(n)]
            seen.update(temps)
            if len(seen) >= k and temps:
                return True
            return False

        wait_for(kth_temp, proc, h.timeout, poll=0.0002)
        delay = rng.choice([0.0, 0.0, rng.uniform(0.0, 0.003)])
        if delay:
            time.sleep(delay)
        before, in_write = h.snapshot(run_dir)
    if not proc.alive():
        first = proc.wait(5)
        return Trial("a", False, None, f"the run ended before the kill (aim {aim}): {first.describe()}")
    os.kill(proc.pid, signal.SIGKILL)
    killed = proc.wait(30)
    resume_step, warns = h.resumable(run_dir)
    run = h.run(h.args(run_dir, "--resume", str(run_dir)))
    if run.rc != 0:
        return Trial("a", False, None, f"resume failed after a kill at {aim}: {run.describe()}")
    ok, why = h.exact(run_dir, reference)
    lost = max(0, (before or 0) - (resume_step or 0))  # complete checkpoints the resume did not use
    return Trial("a", ok, lost, f"kill aimed at {aim} (temp file present: {in_write}), newest complete "
                 f"checkpoint then step {before}, resumed from {resume_step}: {why}",
                 {"aim": aim, "in_write": in_write, "killed_rc": killed.rc, "before": before,
                  "resumed_from": resume_step, "warnings": warns})


_RESUME_HINT = re.compile(r"stopped by (\S+|a stop signal \(on another rank\)) after step (\d+) of \d+; resume with: "
                          r"gputrain fit \.\.\. --resume (\S+)")


def trial_sigterm(h: Harness, rng: random.Random) -> Trial:
    """(b) SIGTERM at a random moment: exit 143, a checkpoint of the stop step, last line says how to resume."""
    run_dir = h.new_dir("sigterm")
    reference = h.reference()
    proc = h.start(h.args(run_dir))
    if not wait_for(training_started(h, run_dir), proc, h.timeout):
        return Trial("b", False, None, f"the run never wrote a checkpoint: {proc.wait(5).describe()}")
    time.sleep(rng.uniform(0.0, 0.9 * train_span(h)))
    if not proc.alive():
        return Trial("b", False, None, f"the run ended before the signal: {proc.wait(5).describe()}")
    os.kill(proc.pid, signal.SIGTERM)
    stopped = proc.wait(60)
    m = _RESUME_HINT.search(stopped.last_line)
    if stopped.rc != 143 or not m:
        return Trial("b", False, None, f"SIGTERM: expected exit 143 and a last line saying how to resume; got "
                     f"{stopped.describe()}")
    step = int(m.group(2))
    resume_step, _ = h.resumable(run_dir)
    if resume_step != step:
        return Trial("b", False, None, f"stopped after step {step} but the newest checkpoint that verifies is "
                     f"step {resume_step}")
    run = h.run(h.args(run_dir, "--resume", m.group(3)))
    if run.rc != 0:
        return Trial("b", False, None, f"resume failed: {run.describe()}")
    ok, why = h.exact(run_dir, reference)
    return Trial("b", ok, step - resume_step, f"stopped after step {step} (exit 143), resumed there: {why}",
                 {"stop_step": step})


def damage(path: Path, how: str, rng: random.Random) -> str:
    data = bytearray(path.read_bytes())
    if how == "truncate":
        cut = rng.randint(0, len(data) - 1)
        path.write_bytes(bytes(data[:cut]))
        return f"truncated to {cut} of {len(data)} bytes"
    if how == "flip":
        n = rng.randint(1, 8)
        where = sorted(rng.randrange(len(data)) for _ in range(n))
        for i in where:
            data[i] ^= 1 << rng.randrange(8)
        path.write_bytes(bytes(data))
        return f"{n} bit(s) flipped at bytes {where}"
    path.write_bytes(b"")
    return "emptied"


def trial_corrupt(h: Harness, rng: random.Random, how: str | None = None) -> Trial:
    """(c) stop a run (SIGTERM), damage its newest checkpoint, resume: falls back to the previous one."""
    run_dir = h.new_dir("corrupt")
    reference = h.reference()
    proc = h.start(h.args(run_dir))
    if not wait_for(lambda: (h.snapshot(run_dir)[0] or 0) >= 2 * h.every, proc, h.timeout):
        return Trial("c", False, None, f"the run never wrote two checkpoints: {proc.wait(5).describe()}")
    time.sleep(rng.uniform(0.0, 0.8 * train_span(h)))
    os.kill(proc.pid, signal.SIGTERM)
    stopped = proc.wait(60)
    if stopped.rc != 143:
        return Trial("c", False, None, f"the stop before the damage failed: {stopped.describe()}")
    from gputrain.checkpoint.store import CheckpointStore

    newest = CheckpointStore(run_dir).latest_path()
    how = how or rng.choice(["truncate", "flip", "empty"])
    what = damage(newest, how, rng)
    newest_step = int(_STEP_FILE.match(newest.name).group(1))
    resume_step, _ = h.resumable(run_dir)
    run = h.run(h.args(run_dir, "--resume", str(run_dir)))
    if run.rc != 0:
        return Trial("c", False, None, f"resume after {what} failed: {run.describe()}")
    warned = newest.name in run.stderr and "skipped" in run.stderr
    ok, why = h.exact(run_dir, reference)
    ok = ok and warned and resume_step is not None and resume_step < newest_step
    return Trial("c", ok, newest_step - (resume_step or 0),
                 f"{newest.name} {what}; resume fell back to step {resume_step} "
                 f"({'with' if warned else 'WITHOUT'} a warning naming it): {why}", {"how": how})


def _last_good_from(stderr: str) -> str | None:
    m = re.search(r"(step-\d+\.pt)", stderr)
    return m.group(1) if m else None


def trial_nonfinite(h: Harness, rng: random.Random, kind: str, on_nan: str, resume_check: bool = True) -> Trial:
    """(d) a non-finite step, with --on-nan stop or skip. kind: "lr" (--lr 1e30), "inf" (an inf in a
    training sample: NaN loss and gradient), "inf-grad" (the same inf into a tanh model: the loss
    stays finite, the gradient is NaN; checkpoints every step, so that the step is a checkpoint's)."""
    run_dir = h.new_dir(f"nan-{kind}-{on_nan}")
    extra = ["--on-nan", on_nan]
    options: dict[str, Any] = {}
    if kind == "lr":
        extra += ["--lr", "1e30"]
        name = "lr 1e30"
    else:
        options["inf_at"] = rng.randrange(256)
        name = f"inf at sample {options['inf_at']}"
        if kind == "inf-grad":
            options["act"] = "tanh"
            extra += ["--checkpoint-every", "1"]
            name += " into a tanh (finite loss, NaN gradient)"
    name += f", --on-nan {on_nan}"
    argv = h.args(run_dir, *extra, options=options)
    run = h.start(argv).wait(h.timeout)
    intact, why_intact = h.all_checkpoints_finite_and_verified(run_dir)
    newest, _ = h.snapshot(run_dir)
    facts = {"kind": kind, "on_nan": on_nan, "rc": run.rc, "last_line": run.last_line, "newest": newest,
             "intact": why_intact}
    if on_nan == "stop":
        m = re.search(r"between steps (\d+) and (\d+)", run.last_line)
        ok = run.rc == 2 and "error" in run.last_line and bool(m) and intact
        # the error names the last good checkpoint, the newest one on disk (or there is none)
        named = _last_good_from(run.last_line)
        if newest is not None:
            ok = ok and named == f"step-{newest:06d}.pt"
        lost = (int(m.group(1)) - 1 - (newest or 0)) if m else None
        return Trial("d", ok, lost, f"{name}: exit {run.rc}, last line: {run.last_line.strip()[:300]!r}; "
                     f"{why_intact}", facts)
    # skip: the run ends, finite, with the skipped steps counted
    summary = {}
    with contextlib.suppress(ValueError, KeyError):
        summary = json.loads(run.stdout)["summary"]
    skipped = summary.get("nonfinite_steps")
    facts["skipped"] = skipped
    ok = run.rc == 0 and intact and bool(skipped)
    detail = f"{name}: exit {run.rc}, {skipped} step(s) skipped; {why_intact}"
    if run.rc != 0:
        detail += f"; {run.describe()}"
    lost = None
    if ok and kind == "inf" and resume_check:
        # The skipping run also survives a SIGTERM + resume exactly (against an uninterrupted one: this run).
        reference = h.final(run_dir)
        run_dir2 = h.new_dir(f"nan-{kind}-skip-resumed")
        proc = h.start(h.args(run_dir2, *extra, options=options))
        wait_for(training_started(h, run_dir2), proc, h.timeout)
        time.sleep(rng.uniform(0.0, 0.8 * train_span(h)))
        os.kill(proc.pid, signal.SIGTERM)
        stopped = proc.wait(60)
        resumed = h.run(h.args(run_dir2, *extra, "--resume", str(run_dir2), options=options))
        same, why = h.exact(run_dir2, reference) if resumed.rc == 0 else (False, resumed.describe())
        ok = ok and stopped.rc == 143 and same
        detail += f"; stopped by SIGTERM (exit {stopped.rc}) and resumed: {why}"
    return Trial("d", ok, lost, detail, facts)


def trial_enospc(h: Harness, rng: random.Random) -> Trial:
    """(e) the k-th checkpoint write (and every later one) fails with ENOSPC in its fsync."""
    run_dir = h.new_dir("enospc")
    reference = h.reference()
    k = rng.randint(2, int(0.8 * h.steps / h.every))
    run = h.start(h.args(run_dir), env={"GPUTRAIN_FAULT_ENOSPC_AT": str(k)}).wait(h.timeout)
    return _after_full_disk(h, run_dir, run, reference, f"ENOSPC injected from checkpoint write {k} on")


def _after_full_disk(h: Harness, run_dir: Path, run: Run, reference: dict, what: str,
                     make_room=lambda: None) -> Trial:
    newest, temp = h.snapshot(run_dir)
    intact, why_intact = h.all_checkpoints_finite_and_verified(run_dir)
    clear = run.rc != 0 and ("No space left on device" in run.stderr or "ENOSPC" in run.stderr
                             or "disk" in run.last_line)
    resume_step, _ = h.resumable(run_dir)
    failed_at = re.findall(r"failed in step (\d+)", run.stderr)  # the step being trained, or after which a save failed
    make_room()
    resumed = h.run(h.args(run_dir, "--resume", str(run_dir)))
    exact, why = h.exact(run_dir, reference) if resumed.rc == 0 else (False, resumed.describe())
    ok = clear and intact and exact and resume_step == newest
    fail_step = int(failed_at[-1]) - 1 if failed_at else None  # steps done when it failed
    return Trial("e", ok, (fail_step - resume_step) if fail_step is not None and resume_step is not None else None,
                 f"{what}: exit {run.rc}, last line: {run.last_line.strip()[:300]!r}; leftover temp file: {temp}; "
                 f"{why_intact}; resumed from step {resume_step}: {why}",
                 {"rc": run.rc, "last_line": run.last_line, "resume_step": resume_step})


def tmpfs_available(base: Path) -> bool:
    if os.geteuid() != 0 or not shutil.which("mount"):
        return False
    mnt = Path(tempfile.mkdtemp(prefix="tmpfs-probe.", dir=base))
    try:
        ok = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mnt)],
                            capture_output=True).returncode == 0
        if ok:
            subprocess.run(["umount", str(mnt)], capture_output=True)
        return ok
    finally:
        with contextlib.suppress(OSError):
            mnt.rmdir()


@contextlib.contextmanager
def small_tmpfs(base: Path, size: str):
    mnt = Path(tempfile.mkdtemp(prefix="tmpfs.", dir=base))
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(mnt)], check=True,
                   capture_output=True)
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], capture_output=True)
        with contextlib.suppress(OSError):
            mnt.rmdir()


def fill(path: Path) -> int:
    """Write `path` until the disk is full; returns the bytes written."""
    n = 0
    chunk = b"\0" * 65536
    with open(path, "wb", buffering=0) as f:
        while True:
            try:
                n += f.write(chunk)
            except OSError as exc:
                if exc.errno != errno.ENOSPC:
                    raise
                break
    # the last, partial chunk: fill the remaining bytes one page at a time
    with open(path, "ab", buffering=0) as f:
        for _ in range(64):
            try:
                n += f.write(b"\0" * 4096)
            except OSError:
                break
    return n


def trial_tmpfs(h: Harness, rng: random.Random) -> Trial:
    """(e) a 16 MiB tmpfs, filled up by another file at a random moment after the first checkpoint."""
    reference = h.reference()
    with small_tmpfs(h.base, "16m") as mnt:
        run_dir = mnt / "run"
        proc = h.start(h.args(run_dir))
        if not wait_for(training_started(h, run_dir), proc, h.timeout):
            return Trial("e", False, None, f"the run never wrote a checkpoint: {proc.wait(5).describe()}")
        time.sleep(rng.uniform(0.0, 0.6 * train_span(h)))
        filler = mnt / "filler"
        size = fill(filler)
        run = proc.wait(h.timeout)
        trial = _after_full_disk(h, run_dir, run, reference, f"tmpfs filled ({size} bytes) mid-run",
                                 make_room=lambda: filler.unlink())
        if run.rc == 0:
            trial.ok = False
            trial.detail = "the run finished although the disk was full (the fill came too late?): " + trial.detail
        return trial


def trial_preflight_full(h: Harness, rng: random.Random) -> Trial:
    """(e) a tmpfs too small for the run's checkpoints: one line, exit 2, before any training."""
    with small_tmpfs(h.base, "2m") as mnt:
        run = h.start(h.args(mnt / "run")).wait(h.timeout)
    lines = [ln for ln in run.stderr.splitlines() if ln.strip()]
    ok = run.rc == 2 and len(lines) == 1 and "disk" in lines[0]
    return Trial("e", ok, 0, f"preflight on a 2 MiB tmpfs: exit {run.rc}, {len(lines)} stderr line(s): "
                 f"{run.last_line.strip()[:300]!r}", {"preflight": True})


def _sigterm_a_rank(h: Harness, rng: random.Random, proc: Proc, run_dir: Path) -> int | Trial:
    """Once training runs, SIGTERM one of the two ranks at a random moment: that rank, or the failed
    Trial when training never started or the ranks' processes were not found."""
    if not wait_for(training_started(h, run_dir), proc, h.timeout):
        return Trial("f", False, None, f"the run never wrote a checkpoint: {proc.wait(5).describe()}")
    time.sleep(rng.uniform(0.0, 0.7 * train_span(h)))
    workers = _ranks(proc)
    if sorted(workers) != [0, 1]:
        return Trial("f", False, None, f"could not find the two ranks' processes (found {workers}): "
                     f"{proc.wait(60).describe()}")
    target = rng.choice([0, 1])
    os.kill(workers[target], signal.SIGTERM)
    return target


def trial_torchrun(h: Harness, rng: random.Random) -> Trial:
    """(f) 2 processes (gloo): SIGTERM to one rank; both stop at the same step; one checkpoint; resume."""
    run_dir = h.new_dir("torchrun")
    reference = h.reference(nproc=2)
    proc = h.start(h.args(run_dir, "--nproc", "2"))
    target = _sigterm_a_rank(h, rng, proc, run_dir)
    if isinstance(target, Trial):
        return target
    stopped = proc.wait(120)
    steps = [int(m.group(2)) for m in _RESUME_HINT.finditer(stopped.stderr)]
    newest, temp = h.snapshot(run_dir)
    files = sorted(p.name for p in h.folder(run_dir).iterdir() if _STEP_FILE.match(p.name))
    from gputrain.checkpoint.store import CheckpointStore
    from gputrain.checkpoint.digests import listed_digests

    store = CheckpointStore(run_dir)
    same_step = len(steps) == 2 and steps[0] == steps[1]
    sidecar = store.folder / f"step-{newest:06d}.pt.sha256"  # one-file format: one digest (a folder: its manifest)
    one_ckpt = same_step and newest == steps[0] and store.verify(store.latest_path()) is True \
        and (not sidecar.exists() or len(listed_digests(sidecar)) == 1) and not temp
    resume_step, _ = h.resumable(run_dir)
    resumed = h.run(h.args(run_dir, "--nproc", "2", "--resume", str(run_dir)))
    exact, why = h.exact(run_dir, reference) if resumed.rc == 0 else (False, resumed.describe())
    ok = same_step and one_ckpt and exact and resume_step == (steps[0] if steps else None)
    return Trial("f", ok, (steps[0] - resume_step) if same_step and resume_step is not None else None,
                 f"SIGTERM to rank {target}: the ranks stopped after steps {steps} (launcher exit {stopped.rc}), "
                 f"checkpoints {files}, resumed from {resume_step}: {why}",
                 {"target_rank": target, "launcher_rc": stopped.rc, "stop_steps": steps})


def trial_torchrun_restart(h: Harness, rng: random.Random) -> Trial:
    """(f) 2 processes with --max-restarts 1 and --resume from the start: SIGTERM to one rank;
    torchrun restarts both, they resume from the stop's checkpoint and finish."""
    run_dir = h.new_dir("torchrun-restart")
    run_dir.mkdir(parents=True)
    reference = h.reference(nproc=2)
    proc = h.start(h.args(run_dir, "--nproc", "2", "--max-restarts", "1", "--resume", str(run_dir)))
    target = _sigterm_a_rank(h, rng, proc, run_dir)
    if isinstance(target, Trial):
        return target
    run = proc.wait(h.timeout)
    steps = [int(m.group(2)) for m in _RESUME_HINT.finditer(run.stderr)]
    exact, why = h.exact(run_dir, reference) if run.rc == 0 else (False, run.describe())
    same_step = len(steps) == 2 and steps[0] == steps[1]
    return Trial("f", exact and same_step, 0 if same_step else None,
                 f"--max-restarts 1, SIGTERM to rank {target}: the ranks stopped after steps {steps}, torchrun "
                 f"restarted them (exit {run.rc}): {why}", {"target_rank": target, "restart": True,
                                                            "launcher_rc": run.rc, "stop_steps": steps})


def _ranks(proc: Proc) -> dict[int, int]:
    workers = {}
    for pid in proc.descendants():
        try:
            env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        except OSError:
            continue
        rank = next((e.split(b"=", 1)[1].decode() for e in env if e.startswith(b"RANK=")), None)
        if rank is not None:
            workers[int(rank)] = pid
    return workers
