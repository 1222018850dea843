#!/usr/bin/env python
"""One command for the day a GPU is lent: every `gpu` test and a smoke run of each CLI command on CUDA.

    python -m benchmarks.gpu_day.smoke                  # on cuda, into $OUT (or gpu-out)
    bash benchmarks/gpu_session.sh smoke                # the same, as one device command (480 s budget: < 9 min)
    python -m benchmarks.gpu_day.smoke --device cpu --steps 3 --only 'fit-(iris|linear)' --demo-failure
    python -m benchmarks.gpu_day.smoke --dry-run        # print the lines, run nothing

Each line is one subprocess (`python -m gputrain ...` or `python -m pytest -m gpu`) with its own
timeout, killed whole (its process group) when it runs over; the whole session has a budget, and
the lines that no longer fit in it are reported as skipped, not silently dropped. Lines that share
the GPU harmlessly run --jobs at a time; those that time things or fill the memory (`memory
--find-max`, `bench`, `profile`, `doctor`, the pytest run) run alone. (The autotuner's trials share the
GPU with other fits: its choice may differ from a quiet machine's; the smoke checks that it works.)

The lines (names are what docs/gpu_checklist.md cites, as `smoke:NAME`):
  gpu-tests            python -m pytest -m gpu (the `tests` part of gpu_session.sh)
  info, doctor         gputrain info / doctor (NVML telemetry, bandwidth and matmul measurement)
  fit-WORKLOAD         gputrain fit WORKLOAD --steps N: every built-in workload with its defaults
                       (cifar10-cnn and mnist-cnn read tiny files in the real formats, written here)
  fit-...-compile, -regional-compile, -autotune, -fp16, -bf16, -on-nan-skip, -loader, -recompute,
  -batch-auto, -resume:
                       the switches' CUDA paths (compile inside the whole-step graph, whole and
                       regional (gpt-mini: each block compiled once), the autotuner's
                       trials, GradScaler, bf16 autocast, the device-side skip of non-finite steps, the
                       pinned DataLoader with its side-stream prefetcher, recompute, the
                       largest batch that fits, resume of a CUDA run's checkpoint)
  profile              gputrain profile (torch.profiler with CUDA activity, NVML sampling, the verdict)
  memory-find-max      gputrain memory --find-max (the real batch search on the device)
  bench-quick          gputrain bench all --quick (matmul, transfer, crossover, precision, memory)
  report               gputrain report RUN_DIR of a CUDA run (with the profile in it)
  eval, predict, export  a CUDA run's checkpoint evaluated, applied to data, exported (safetensors)
  slurm                the sbatch script (printed)
  sweep                an Optuna sweep of 2 trials on the device ("skipped" without optuna)

Output, in --out (default $OUT, else gpu-out): gpu_smoke.json and gpu_smoke.md (pass/fail, seconds,
the command and the tail of the output of each line), and smoke/ with the run directories and the
full log of every line. Exit status: 0 when every line that ran passed, 1 otherwise.

On the GPU machine (no network) the mnist1d wheel comes in .whl/ (see session.sh); this script
needs nothing beyond gputrain's own dependencies, and gputrain importable (session.sh puts src/ on
PYTHONPATH).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import pickle
import platform
import re
import shlex
import signal
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
TAIL_CHARS = 2000


@dataclass
class Line:
    name: str
    argv: list[str]  # after `python -m`
    timeout: float
    covers: str
    expect: str | None = None  # a regex the output must contain (besides exit status 0)
    exclusive: bool = False  # runs alone (it times something or fills the device's memory)
    after: str | None = None  # the name of a line that must have finished first
    # filled in by the run
    status: str = "not run"
    rc: int | None = None
    seconds: float = 0.0
    tail: str = ""
    log: str = ""
    command: str = field(default="")


def write_tiny_cifar(folder: Path, n: int = 256, n_test: int = 256) -> Path:
    """A cifar-10-batches-py folder in CIFAR-10's real format (pickled dicts of uint8 rows)."""
    import numpy as np

    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    for name, m in [*((f"data_batch_{i}", n) for i in range(1, 6)), ("test_batch", n_test)]:
        batch = {b"data": rng.integers(0, 256, (m, 3072), dtype=np.uint8),
                 b"labels": [int(v) for v in rng.integers(0, 10, m)]}
        with open(folder / name, "wb") as f:
            pickle.dump(batch, f)
    return folder


def write_tiny_mnist(folder: Path, n: int = 1024, n_test: int = 256) -> Path:
    """MNIST's four IDX files (raw), random images."""
    import numpy as np

    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)

    def idx(path: Path, array) -> None:
        header = bytes([0, 0, 0x08, array.ndim]) + b"".join(int(d).to_bytes(4, "big") for d in array.shape)
        path.write_bytes(header + array.astype(np.uint8).tobytes())

    for images, labels, m in [("train-images-idx3-ubyte", "train-labels-idx1-ubyte", n),
                              ("t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte", n_test)]:
        idx(folder / images, rng.integers(0, 256, (m, 28, 28)))
        idx(folder / labels, rng.integers(0, 10, m))
    return folder


def write_sweep_config(path: Path, device: str, steps: int) -> Path:
    """The `sweep` line's config: 2 trials of iris-mlp on the device, one worker."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(f'workload = "iris-mlp"\n\n[train]\ndevice = "{device}"\nsteps = {max(steps, 4)}\n'
                    f'log_every = {max(steps // 2, 2)}\n\n[sweep]\ntrials = 2\nworkers = 1\nmetric = "eval_loss"\n\n'
                    '[sweep.space]\nlr = {loguniform = [1e-4, 1e-1]}\n')
    return path


def builtin_workloads() -> list[str]:
    from gputrain.workloads.registry import WORKLOADS

    return list(WORKLOADS)


def plan(args, work: Path) -> list[Line]:
    dev, steps = args.device, str(args.steps)
    runs = work / "runs"
    g = ["gputrain"]
    fit_common = ["--device", dev, "--steps", steps, "--progress", "off"]
    data_dir = {"cifar10-cnn": work / "data" / "cifar-10-batches-py", "mnist-cnn": work / "data" / "mnist"}
    lines = [Line("gpu-tests", ["pytest", "-q", "-m", "gpu", "-p", "no:cacheprovider", "-o", "addopts=", "-rfEs"],
                  300, "every @pytest.mark.gpu test (tests/); all skip without CUDA", exclusive=True,
                  expect=r"\d+ (passed|skipped)"),
             Line("info", [*g, "info"], 60, "devices, NVML telemetry, build", expect=r"gputrain"),
             Line("doctor", [*g, "doctor"], 120, "the checks and the bandwidth/matmul measurement", exclusive=True)]
    fits = []
    for w in builtin_workloads():
        extra = ["--data-dir", str(data_dir[w])] if w in data_dir else []
        fits.append(Line(f"fit-{w}", [*g, "fit", w, *fit_common, *extra, "--run-dir", str(runs / w)],
                          180, f"fit {w} with its defaults: precision, placement, graphs, channels_last, summary",
                          expect=r"run directory"))
    variants = [
        Line("fit-synthetic-cifar-compile",
             [*g, "fit", "synthetic-cifar", *fit_common, "--option", "n=4096", "--compile",
              "--run-dir", str(runs / "compile")],
             300, "torch.compile inside the whole-step CUDA graph, recompile/graph-break report", expect=r"run directory"),
        Line("fit-gpt-mini-compile",
             [*g, "fit", "gpt-mini", *fit_common, "--compile", "--run-dir", str(runs / "gpt-compile")],
             300, "torch.compile of a transformer (SDPA) inside the graph", expect=r"run directory"),
        Line("fit-gpt-mini-regional-compile",
             [*g, "fit", "gpt-mini", *fit_common, "--compile", "--compile-scope", "regional",
              "--run-dir", str(runs / "gpt-regional")],
             300, "regional compile (each block compiled once, shared) inside the whole-step graph",
             expect=r"regional:\s+\d+\s+x\s+Block\s+in\s+blocks\s+compiled\s+once"),
        Line("fit-digits-cnn-fp16", [*g, "fit", "digits-cnn", *fit_common, "--precision", "fp16",
                                     "--run-dir", str(runs / "fp16")],
             180, "fp16 autocast + GradScaler (graphs off for fp16)", expect=r"run directory"),
        Line("fit-gpt-mini-fp16", [*g, "fit", "gpt-mini", *fit_common, "--precision", "fp16",
                                   "--run-dir", str(runs / "gpt-fp16")],
             180, "GradScaler with a transformer", expect=r"run directory"),
        Line("fit-digits-cnn-bf16", [*g, "fit", "digits-cnn", *fit_common, "--precision", "bf16",
                                     "--run-dir", str(runs / "bf16")],
             180, "bf16 autocast, TF32 settings", expect=r"run directory"),
        Line("fit-mnist1d-cnn-on-nan-skip",
             [*g, "fit", "mnist1d-cnn", *fit_common, "--lr", "1e30", "--log-every", "5", "--on-nan", "skip",
              "--run-dir", str(runs / "nan-skip")],
             180, "on_nan=skip decided on the device (inside the graph), the skipped-steps warning",
             expect=r"were skipped"),
        Line("fit-resnet18-cifar-loader",
             [*g, "fit", "resnet18-cifar", *fit_common, "--option", "n=4096", "--data-on-device", "off",
              "--run-dir", str(runs / "loader")],
             180, "pinned DataLoader + side-stream prefetcher, uint8 normalization on the device",
             expect=r"run directory"),
        Line("fit-gpt-mini-recompute",
             [*g, "fit", "gpt-mini", *fit_common, "--recompute", "--run-dir", str(runs / "recompute")],
             180, "recompute of the repeated blocks on CUDA", expect=r"run directory"),
        Line("fit-digits-cnn-batch-auto", [*g, "fit", "digits-cnn", *fit_common, "--batch-size", "auto",
                                           "--run-dir", str(runs / "batch-auto")],
             180, "--batch-size auto: the out-of-memory-driven search over the step fit trains with",
             expect=r"run directory"),
        Line("fit-mnist1d-cnn-stop", [*g, "fit", "mnist1d-cnn", "--device", dev, "--steps", str(2 * args.steps),
                                      "--progress", "off", "--stop-at-step", steps,
                                      "--run-dir", str(runs / "resume")],
             180, "a CUDA run stopped and checkpointed (CUDA RNG state, graphs)", expect=r"run directory"),
        Line("fit-mnist1d-cnn-resume", [*g, "fit", "mnist1d-cnn", "--device", dev, "--steps", str(2 * args.steps),
                                        "--progress", "off", "--resume", str(runs / "resume")],
             180, "resume of that checkpoint on CUDA", expect=r"run directory", after="fit-mnist1d-cnn-stop"),
        Line("fit-mnist1d-cnn-autotune",
             [*g, "fit", "mnist1d-cnn", *fit_common, "--autotune", "--autotune-force", "--run-dir", str(runs / "autotune")],
             360, "the autotuner's trials (graphs, precision, channels_last, compile, reduce-overhead)",
             expect=r"run directory"),
        Line("profile", [*g, "profile", "digits-cnn", "--device", dev, "--steps", "10", "--out", str(runs / "digits-cnn")],
             180, "torch.profiler with CUDA activity, sync detection, NVML sampler, verdict", exclusive=True),
        Line("memory-find-max", [*g, "memory", "mnist1d-cnn", "--device", dev, "--find-max"], 240,
             "estimate vs measured peak, the real batch search on the device", exclusive=True),
        Line("bench-quick", [*g, "bench", "all", "--quick", "--device", dev, "--out", str(work / "bench")], 300,
             "matmul, transfer, crossover, precision, memory benchmarks and their index", exclusive=True),
        Line("report", [*g, "report", str(runs / "digits-cnn")], 60,
             "report.html of a CUDA run with its profile", exclusive=True, expect=r"report"),
        # The commands that read a finished run (iris-mlp's, checkpointed at its last step) and the two
        # that start no training of their own device's kind.
        Line("eval", [*g, "eval", str(runs / "iris-mlp"), "--device", dev, "--json"], 90,
             "eval of a CUDA run's last checkpoint on its test split", expect=r"accuracy", after="fit-iris-mlp"),
        Line("predict", [*g, "predict", str(runs / "iris-mlp"), "--device", dev, "--data", "test",
                         "--out", str(work / "predict.pt")], 90,
             "predict: the trained model's outputs on the test split, to a file", after="fit-iris-mlp"),
        Line("export", [*g, "export", str(runs / "iris-mlp"), "--format", "safetensors",
                        "--out", str(work / "iris.safetensors")], 90,
             "export of a CUDA run's weights as safetensors", after="fit-iris-mlp"),
        Line("slurm", [*g, "slurm", "iris-mlp", "--nodes", "2", "--gpus-per-node", "4",
                       "--run-dir", str(runs / "slurm")], 60,
             "the sbatch script for 2 nodes x 4 GPUs (printed, not submitted)", expect=r"#SBATCH"),
        Line("sweep", [*g, "sweep", "--config", str(work / "sweep.toml"), "--sweep-dir", str(work / "sweep"),
                       "--quiet"], 240,
             "an Optuna sweep of 2 iris-mlp trials on the device (one worker per GPU)", exclusive=True),
    ]
    # The slow lines (compile) and the run that a later line resumes start first; the lines that run
    # alone come last, the report after the profile it shows.
    first = [ln for ln in variants if ln.name.endswith(("-compile", "-autotune")) or ln.name == "fit-mnist1d-cnn-stop"]
    alone = [ln for ln in variants if ln.exclusive]
    lines += first + fits + [ln for ln in variants if ln not in first and ln not in alone] + alone
    if args.only:
        pattern = re.compile(args.only)
        lines = [ln for ln in lines if pattern.search(ln.name)]
    if args.skip:
        pattern = re.compile(args.skip)
        lines = [ln for ln in lines if not pattern.search(ln.name)]
    if args.demo_failure:
        # A command that must fail: a non-finite loss with on_nan=stop (the default). Its line shows
        # how a failure reads in the summary (the error's tail).
        lines.insert(0, Line("demo-failure-nan-stop",
                             [*g, "fit", "iris-mlp", "--device", dev, "--steps", "5", "--lr", "1e30", "--no-save",
                              "--progress", "off"],
                             120, "a deliberate failure, to show how one reads (not a smoke line)"))
    if importlib.util.find_spec("optuna") is None:
        for ln in lines:
            if ln.name == "sweep":
                ln.status = "skipped: optuna not installed (pip install 'gputrain[sweep]')"
    if dev == "cpu":
        # CUDA-only switches are refused on a CPU; the --device cpu mode checks the driver, not CUDA.
        for ln in lines:
            if ln.name.endswith(("-fp16", "-compile", "-autotune")) and ln.name.startswith("fit-"):
                ln.status = "skipped: needs cuda"
    for ln in lines:
        ln.command = shlex.join(["python", "-m", *ln.argv])
        if args.timeout:
            ln.timeout = min(ln.timeout, args.timeout)
    return lines


def _kill(proc: subprocess.Popen) -> None:
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(10)
            return
        except subprocess.TimeoutExpired:
            continue


class Running:
    def __init__(self, line: Line, python: str, env: dict, logdir: Path, timeout: float):
        self.line, self.t0 = line, time.monotonic()
        self.deadline = self.t0 + timeout
        self.cut_by_budget = timeout < line.timeout
        line.log = str(logdir / f"{line.name}.log")
        self.f = open(line.log, "w")
        self.proc = subprocess.Popen([python, "-m", *line.argv], cwd=ROOT, env=env, stdout=self.f,
                                     stderr=subprocess.STDOUT, start_new_session=True)
        line.status = "running"

    def poll(self) -> bool:
        """True when finished (or killed for its timeout)."""
        rc = self.proc.poll()
        timed_out = rc is None and time.monotonic() > self.deadline
        if rc is None and not timed_out:
            return False
        if timed_out:
            _kill(self.proc)
        ln = self.line
        ln.seconds = round(time.monotonic() - self.t0, 1)
        ln.rc = self.proc.returncode
        self.f.close()
        text = Path(ln.log).read_text(errors="replace")
        ln.tail = text[-TAIL_CHARS:]
        if timed_out and self.cut_by_budget:
            ln.status = f"fail: stopped at the overall budget after {ln.seconds:.0f} s"
        elif timed_out:
            ln.status = f"fail: timeout after {ln.seconds:.0f} s"
        elif ln.rc != 0:
            ln.status = f"fail: exit {ln.rc}"
        elif ln.expect and not re.search(ln.expect, text):
            ln.status = f"fail: output lacks /{ln.expect}/"
        else:
            ln.status = "pass"
        return True


def run(lines: list[Line], args, work: Path) -> float:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT / "src"), env.get("PYTHONPATH")]))
    env.setdefault("GPUTRAIN_CACHE", str(work / "cache"))  # mnist1d once, no user autotune cache
    env["PYTHONUNBUFFERED"] = "1"
    env["COLUMNS"] = "120"
    logdir = work / "logs"
    logdir.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()

    def say(msg: str) -> None:
        print(f"[{time.monotonic() - t0:5.0f} s] {msg}", flush=True)

    todo = [ln for ln in lines if ln.status == "not run"]
    running: list[Running] = []
    while todo or running:
        for r in [r for r in running if r.poll()]:
            running.remove(r)
            say(f"{r.line.status:<12} {r.line.name} ({r.line.seconds:.0f} s)")
        if todo:
            nxt = todo[0]
            waiting = nxt.after is not None and any(ln.name == nxt.after for ln in [*todo, *(r.line for r in running)])
            if waiting:
                can_start = False
            elif nxt.exclusive:
                can_start = not running
            else:
                can_start = len(running) < args.jobs and not any(r.line.exclusive for r in running)
            if can_start:
                todo.pop(0)
                left = args.budget - (time.monotonic() - t0)
                if left < min(30.0, nxt.timeout):
                    nxt.status = f"skipped: overall budget ({args.budget:.0f} s) spent"
                    say(f"{nxt.status:<12} {nxt.name}")
                else:
                    say(f"start {nxt.name}")
                    running.append(Running(nxt, args.python, env, logdir, min(nxt.timeout, left)))
                continue
        time.sleep(0.2)
    return time.monotonic() - t0


def summarize(lines: list[Line], args, wall: float) -> dict:
    try:
        import torch

        torch_version = torch.__version__
        gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    except Exception as exc:  # the summary must be written whatever the environment
        torch_version, gpu = f"(import failed: {exc})", None
    real = lines
    return {
        "device": args.device, "gpu": gpu, "torch": torch_version, "python": platform.python_version(),
        "host": platform.node(), "started": time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(time.time() - wall)),
        "wall_s": round(wall, 1), "budget_s": args.budget, "steps": args.steps, "jobs": args.jobs,
        "passed": sum(ln.status == "pass" for ln in real),
        "failed": sum(ln.status.startswith("fail") for ln in real),
        "skipped": sum(ln.status.startswith("skipped") for ln in real),
        "lines": [{k: v for k, v in asdict(ln).items() if k not in ("argv", "exclusive")} for ln in lines],
    }


def write_markdown(summary: dict, path: Path) -> None:
    s = summary
    out = [f"# gpu smoke: {s['passed']} passed, {s['failed']} failed, {s['skipped']} skipped",
           "", f"{s['started']} on {s['host']}: device {s['device']} ({s['gpu'] or 'no CUDA'}), torch {s['torch']}, "
               f"Python {s['python']}; {s['wall_s']:.0f} s of a {s['budget_s']:.0f} s budget, --steps {s['steps']}.", "",
           "| line | status | s | covers |", "|---|---|---|---|"]
    for ln in s["lines"]:
        out.append(f"| `{ln['name']}` | {ln['status']} | {ln['seconds']:.0f} | {ln['covers']} |")
    bad = [ln for ln in s["lines"] if ln["status"].startswith("fail")]
    for ln in bad:
        out += ["", f"## {ln['name']}: {ln['status']}", "", f"`{ln['command']}`", "", "```",
                ln["tail"].rstrip()[-TAIL_CHARS:], "```"]
    path.write_text("\n".join(out) + "\n")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda", help="cuda (default), cuda:N, or cpu to try the driver itself")
    ap.add_argument("--steps", type=int, default=30, help="optimizer steps of each fit (default 30)")
    ap.add_argument("--budget", type=float, default=480, help="seconds for the whole session (default 480)")
    ap.add_argument("--jobs", type=int, default=None, help="lines run at once (default 4 on cuda, 1 on cpu)")
    ap.add_argument("--only", help="run only the lines whose name matches this regex")
    ap.add_argument("--skip", help="leave out the lines whose name matches this regex")
    ap.add_argument("--timeout", type=float, help="cap every line's own timeout at this many seconds")
    ap.add_argument("--demo-failure", action="store_true",
                    help="add a line that fails (a non-finite loss with on_nan=stop), to see how a failure reads")
    ap.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "gpu-out")))
    ap.add_argument("--python", default=sys.executable, help="the interpreter of the lines")
    ap.add_argument("--dry-run", action="store_true", help="print the lines and write nothing")
    args = ap.parse_args(argv)
    if args.jobs is None:
        args.jobs = 1 if args.device == "cpu" else 4
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    work = (args.out / "smoke").resolve()
    lines = plan(args, work)
    if args.dry_run:
        for ln in lines:
            flag = " [alone]" if ln.exclusive else ""
            print(f"{ln.name:<30} {ln.timeout:4.0f} s{flag}  {ln.command}" + (f"   ({ln.status})" if ln.status != "not run" else ""))
        print(f"# {len(lines)} lines, budget {args.budget:.0f} s, {args.jobs} at a time")
        return 0
    args.out.mkdir(parents=True, exist_ok=True)
    if any(ln.name == "sweep" for ln in lines):
        write_sweep_config(work / "sweep.toml", args.device, args.steps)
    if any(ln.name in ("fit-cifar10-cnn", "fit-mnist-cnn") for ln in lines):
        write_tiny_cifar(work / "data" / "cifar-10-batches-py")
        write_tiny_mnist(work / "data" / "mnist")
    wall = run(lines, args, work)
    summary = summarize(lines, args, wall)
    (args.out / "gpu_smoke.json").write_text(json.dumps(summary, indent=2) + "\n")
    write_markdown(summary, args.out / "gpu_smoke.md")
    print(f"gpu smoke: {summary['passed']} passed, {summary['failed']} failed, {summary['skipped']} skipped "
          f"in {wall:.0f} s -> {args.out / 'gpu_smoke.json'}, {args.out / 'gpu_smoke.md'}")
    return 0 if summary["failed"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
