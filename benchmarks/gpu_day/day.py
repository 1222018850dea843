#!/usr/bin/env python
"""The GPU day: one device command that proves fit on the GPU and measures the speed table.

    bash benchmarks/gpu_session.sh day                 # on the GPU machine, into $OUT: < 9 min on an H100
    bash benchmarks/gpu_session.sh day --device cpu    # the same code on the CPU, tiny sizes (CI runs it)
    python -m benchmarks.gpu_day.day --parts a,c --out DIR
    bash benchmarks/gpu_session.sh day --parts a --smoke-only '^(profile|report)$' --budget 180   # a rerun

Parts, in this order (the most important first), each a subprocess with its own time budget (plus
what the parts before it left unused), so that a run cut short still returns what came before; after
each part the summary files are written again:

  a  smoke     every `gpu` test and a smoke of every CLI command (smoke.py)
  b  zoo       the conformance zoo: GPUTRAIN_ZOO_DEVICE=<device> pytest tests/test_zoo.py, per-case
               results from its JUnit XML ("not present" where the file is missing)
  c  syncs     steady-state host syncs over 50 steps of 8 kinds of run (syncs.py): 0 each, or named
  d  speed     the speed table, side by side in one process, medians of 3 (speed.py)
  e  first-step  the time to the first step of the 12-block GPT-mini, whole-model against regional
               compile, cold and with the compile cache (first_step.py), as long as the day's time lasts
  f  float8    bf16 vs float8 GPT-mini through torchao (float8.py): "not installed" without it

Parts (e) and (f) are optional: skipped for want of time, the day is still whole.

The first line of the output, and of the summary, names the device the day runs on and the versions
(torch, CUDA, cuDNN, driver, Python).

Written to --out (default $OUT, else gpu-out), at most 8 files come back from the GPU machine:
gpu_day.json (every figure, the environment, the command, each part's status), gpu_day.md (the
summary) and gpu_day_logs.tar.gz (every part's full log); the work files stay in --work, outside
--out. Exit status 0 when every part ran without a failure (or was "not present" / "not installed" /
"not applicable"), 1 otherwise. A GPU day's JSON is committed as
benchmarks/results/gpu_day_<device>_<date>.json.
"""

from __future__ import annotations

import argparse
import os
import re
import shlex
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
import xml.etree.ElementTree as ET
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from benchmarks.gpu_day.report import FINE, goals, headline, next_call, not_fine, write_markdown

ROOT = Path(__file__).resolve().parents[2]
PARTS_PACKAGE = "benchmarks.gpu_day"  # each part runs as `python -m benchmarks.gpu_day.<module>` from ROOT


@dataclass
class Part:
    key: str
    name: str
    title: str
    budget_gpu: float  # seconds on an H100 (the day's 9 minutes: 500 s planned, the rest slack)
    budget_cpu: float  # seconds on 2 CPU cores (tiny sizes)


PARTS = [
    Part("a", "smoke", "the gpu tests and a smoke of every CLI command", 180, 360),
    Part("b", "zoo", "the conformance zoo, each model against its own loop", 70, 120),
    Part("c", "syncs", "steady-state host syncs per kind of run", 40, 200),
    Part("d", "speed", "the speed table, side by side, medians of 3", 180, 360),
    Part("e", "first-step", "time to the first step: whole vs regional compile, cold and cached", 60, 150),
    Part("f", "float8", "bf16 vs float8 GPT-mini (torchao)", 30, 30),
]

# The first-step cases the day runs, in this order (first_step.py's names): on a GPU the pairs that
# the goals compare; on the CPU (a check of the code under torch 2.11) the regional ones only.
FIRST_STEP_GPU = r"^gpt-mini (fit|loop) (whole|regional)( second start)?$"
FIRST_STEP_CPU = r"^gpt-mini (fit regional( second start)?|loop regional)$"
# The longest first-step case on an H100 (a whole-model compile of the GPT-mini, process start
# included) is not timed yet: no case starts later than this before the part's end.
FIRST_STEP_LAST_START_S = 45
# The CPU budgets are caps for a slow, shared 2-core machine (the CPU run takes 3-8 minutes there).

# The smoke lines the CPU run keeps (each a `python -m gputrain` process; all of them take ~10 min on
# 2 cores): the gpu tests (all skip), the commands that read a run, and two fits.
CPU_SMOKE = r"^(gpu-tests|info|fit-iris-mlp|fit-linear-regression|eval|predict|export|slurm|sweep)$"


# ---------------------------------------------------------------- each part's command and result


def smoke_part(args, work: Path, budget: float) -> tuple[list[str], dict, Path]:
    cmd = [args.python, "-m", f"{PARTS_PACKAGE}.smoke", "--out", str(work), "--device", args.device,
           "--budget", str(max(30.0, budget - 15))]
    if args.cpu:
        cmd += ["--steps", "3"]
    if args.smoke_only or args.cpu:
        cmd += ["--only", args.smoke_only or CPU_SMOKE]
    return cmd, {}, work / "gpu_smoke.json"


def smoke_status(result: dict | None, rc: int) -> str:
    if result is None:
        return "crashed"
    return "ok" if rc == 0 and result.get("failed", 1) == 0 else "failures"


def zoo_part(args, work: Path, budget: float) -> tuple[list[str], dict, Path] | dict:
    tests = Path(args.zoo_tests)
    if not (ROOT / tests).is_file() and not tests.is_file():
        return {"status": "not present", "reason": f"{args.zoo_tests} is not in this tree"}
    cmd = [args.python, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-o", "addopts=", "-rfEs",
           "--junitxml", str(work / "zoo.xml")]
    cases = zoo_cases(args, tests) if args.zoo_cases else []
    cmd += cases or [str(tests)]
    return cmd, {"GPUTRAIN_ZOO_DEVICE": args.device}, work / "zoo.xml"


def zoo_cases(args, tests: Path) -> list[str]:
    """The first --zoo-cases test ids of the file (the CPU run's sample of the zoo)."""
    out = subprocess.run([args.python, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider",
                          "-o", "addopts=", str(tests)], cwd=ROOT, capture_output=True, text=True,
                         env=part_env({"GPUTRAIN_ZOO_DEVICE": args.device}), timeout=120)
    # ids are relative to pytest's rootdir: keep what follows the file, put the file as given before it
    ids = [f"{tests}::{ln.strip().split('::', 1)[1]}" for ln in out.stdout.splitlines() if "::" in ln]
    return ids[:args.zoo_cases]


def read_junit(path: Path) -> dict[str, Any] | None:
    """Per-case outcomes of a pytest --junitxml file: name, outcome, seconds, message."""
    if not path.is_file():
        return None
    cases = []
    for case in ET.parse(path).getroot().iter("testcase"):
        outcome, message = "passed", ""
        for tag in ("failure", "error", "skipped"):
            el = case.find(tag)
            if el is not None:
                outcome = {"failure": "failed", "error": "error", "skipped": "skipped"}[tag]
                message = (el.get("message") or el.text or "")[:500]
                break
        cases.append({"name": f"{case.get('classname', '')}::{case.get('name', '')}", "outcome": outcome,
                      "seconds": float(case.get("time") or 0.0), "message": message})
    counts = {k: sum(c["outcome"] == k for c in cases) for k in ("passed", "failed", "error", "skipped")}
    return {"part": "zoo", "cases": cases, **counts}


def zoo_status(result: dict | None, rc: int) -> str:
    if result is None or (not result["cases"] and rc not in (0, 5)):  # 5: pytest collected nothing
        return "crashed"
    return "failures" if result["failed"] or result["error"] or rc not in (0, 5) else "ok"


def syncs_part(args, work: Path, budget: float) -> tuple[list[str], dict, Path]:
    steps = "10" if args.cpu else "50"
    return [args.python, "-m", f"{PARTS_PACKAGE}.syncs", "--device", args.device, "--steps", steps,
            "--json", str(work / "syncs.json")], {}, work / "syncs.json"


def speed_part(args, work: Path, budget: float) -> tuple[list[str], dict, Path]:
    return [args.python, "-m", f"{PARTS_PACKAGE}.speed", "--device", args.device, "--repeats", "2" if args.cpu else "3",
            "--budget", str(max(10.0, budget - 15)), "--json", str(work / "speed.json"),
            *(["--require-peers"] if args.require_peers else [])], {}, work / "speed.json"


def first_step_part(args, work: Path, budget: float) -> tuple[list[str], dict, Path] | dict:
    if budget < FIRST_STEP_LAST_START_S + 15:
        return {"status": "skipped: the day's budget is spent",
                "reason": f"{budget:.0f} s left, under the {FIRST_STEP_LAST_START_S + 15} s that one case may take"}
    # no case starts in the part's last FIRST_STEP_LAST_START_S seconds; one still running 5 s before
    # the part's end is killed ("timed out"), so the part writes its JSON before the day's kill
    return [args.python, "-m", f"{PARTS_PACKAGE}.first_step", "--device", args.device, "--models", "gpt-mini",
            "--only", FIRST_STEP_CPU if args.cpu else FIRST_STEP_GPU,
            "--budget", str(budget - FIRST_STEP_LAST_START_S), "--end", str(budget - 5),
            "--json", str(work / "first_step.json")], {}, work / "first_step.json"


def float8_part(args, work: Path, budget: float) -> tuple[list[str], dict, Path]:
    return [args.python, "-m", f"{PARTS_PACKAGE}.float8", "--device", args.device,
            "--budget", str(max(10.0, budget - 10)), "--json", str(work / "float8.json")], {}, work / "float8.json"


def json_status(result: dict | None, rc: int) -> str:
    if result is None:
        return "crashed"
    status = result.get("status", "ok")
    return "failures" if status == "ok" and rc != 0 else status


BUILDERS: dict[str, Callable] = {"a": smoke_part, "b": zoo_part, "c": syncs_part, "d": speed_part,
                                 "e": first_step_part, "f": float8_part}
STATUS: dict[str, Callable[[dict | None, int], str]] = {"a": smoke_status, "b": zoo_status, "c": json_status,
                                                        "d": json_status, "e": json_status, "f": json_status}


# ---------------------------------------------------------------- running a part


def part_env(extra: dict) -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT / "src"), env.get("PYTHONPATH")]))
    env["PYTHONUNBUFFERED"] = "1"
    return {**env, **extra}


def run_part(part: Part, args, work: Path, budget: float) -> dict[str, Any]:
    """Run one part in its own process group, killed whole at budget + a grace for its last write."""
    pwork = work / part.name
    pwork.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    built = BUILDERS[part.key](args, pwork, budget)
    if isinstance(built, dict):  # decided without running anything ("not present")
        return {**built, "seconds": 0.0, "budget_s": budget}
    cmd, extra_env, result_path = built
    log = work / "logs" / f"{part.key}-{part.name}.log"
    timed_out = False
    with open(log, "w") as f:
        f.write(f"$ {' '.join(cmd)}\n")
        f.flush()
        proc = subprocess.Popen(cmd, cwd=ROOT, env=part_env(extra_env), stdout=f, stderr=subprocess.STDOUT,
                                start_new_session=True)
        try:
            rc = proc.wait(timeout=budget + args.grace)
        except subprocess.TimeoutExpired:
            timed_out = True
            _kill(proc)
            rc = proc.returncode
    result = read_result(part.key, result_path)
    status = "timeout" if timed_out else STATUS[part.key](result, rc)
    tail = log.read_text(errors="replace")[-3000:]
    return {"status": status, "rc": rc, "seconds": round(time.monotonic() - t0, 1), "budget_s": budget,
            "command": " ".join(cmd), "log": log.name, "result": result,
            "tail": tail if status not in FINE else ""}


def read_result(key: str, path: Path) -> dict | None:
    import json

    if key == "b":
        return read_junit(path)
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def _kill(proc: subprocess.Popen) -> None:
    import signal

    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(proc.pid, sig)
            proc.wait(10)
            return
        except ProcessLookupError:
            return
        except subprocess.TimeoutExpired:
            continue


# ---------------------------------------------------------------- the day


def read_environment(args) -> tuple[dict[str, Any], str]:
    """Versions, device names and driver (gputrain.bench.common.environment), and the day's device as
    the results' file name gives it (gputrain.bench.common.device_slug; "cpu" without a GPU): read in a
    subprocess of the day's interpreter (this one may not be it), so that a broken torch shows here as
    an error, not as a crash of the day."""
    import json

    code = ("import json, torch; from gputrain.bench.common import device_slug, environment; "
            "d = [torch.device('cpu')] + ([torch.device('cuda')] if torch.cuda.is_available() else []); "
            f"day = torch.device({args.device!r}); "
            "print(json.dumps({'environment': environment(d), "
            "'slug': device_slug(day if day.type != 'cuda' or torch.cuda.is_available() else None)}))")
    out = subprocess.run([args.python, "-c", code], cwd=ROOT, env=part_env({}), capture_output=True, text=True,
                         timeout=120)
    try:
        read = json.loads(out.stdout.strip().splitlines()[-1])
        return read["environment"], read["slug"]
    except (IndexError, ValueError, KeyError, TypeError):
        return {"error": (out.stderr or out.stdout)[-2000:]}, "cpu"


def write_outputs(day: dict[str, Any], out: Path, work: Path) -> None:
    import json

    day["goals"] = goals(day)
    day["next_call"] = next_call(day)
    (out / "gpu_day.json").write_text(json.dumps(day, indent=2, default=str) + "\n")
    write_markdown(day, out / "gpu_day.md")
    with tarfile.open(out / "gpu_day_logs.tar.gz", "w:gz") as tar:
        for sub in sorted(work.iterdir()):
            tar.add(sub, arcname=f"gpu_day/{sub.name}", filter=_logs_only)


def _logs_only(info: tarfile.TarInfo):
    """Logs and result files, not the run directories' checkpoints and data."""
    if info.isdir() or info.name.endswith((".log", ".json", ".xml", ".md", ".txt", ".toml")):
        return info
    return None


def part_budget(own: float, left: float, later: float) -> float:
    """A part's seconds: its own budget plus what the parts before it left unused, never what the
    parts after it are owed; if the parts before ran over (into their grace), this one, being the
    more important, still gets its own budget as far as the day's time allows."""
    free = left - later
    return free if free >= own else min(own, left)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda", help="cuda (default) or cpu (tiny sizes: a check of the code)")
    ap.add_argument("--parts", default="a,b,c,d,e,f", help="which parts, comma-separated (default all: a,b,c,d,e,f)")
    ap.add_argument("--budget", type=float, default=None,
                    help="seconds for the whole day (default 510 on cuda: under 9 minutes; 1200 on cpu)")
    ap.add_argument("--grace", type=float, default=20, help="seconds a part may run past its budget to write")
    ap.add_argument("--zoo-tests", default="tests/test_zoo.py")
    ap.add_argument("--smoke-only", default=None, metavar="REGEX",
                    help="part (a): only the smoke lines whose names match (a rerun of the lines that failed)")
    ap.add_argument("--zoo-cases", type=int, default=None, help="run only the first N zoo cases (default: all on "
                    "cuda, 2 on cpu)")
    ap.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "gpu-out")))
    ap.add_argument("--work", type=Path, default=None, help="work files (default: a gpu_day folder beside --out)")
    ap.add_argument("--python", default=sys.executable, help="the interpreter of the parts")
    ap.add_argument("--require-peers", action="store_true", help="fail the speed part when Lightning or Accelerate "
                    "is not installed (`make gpu-day-cpu`, whose venv has the peers extra)")
    args = ap.parse_args(argv)
    args.cpu = args.device == "cpu"
    if args.budget is None:
        args.budget = 1200.0 if args.cpu else 510.0
    if args.zoo_cases is None:
        args.zoo_cases = 2 if args.cpu else 0
    wanted = [p.strip() for p in args.parts.split(",") if p.strip()]
    unknown = sorted(set(wanted) - {p.key for p in PARTS})
    if unknown:
        ap.error(f"unknown parts {unknown}: choose from {','.join(p.key for p in PARTS)}")
    if args.smoke_only is not None:
        try:  # refused here, not after the machine's minutes went to the parts before the smoke's start
            re.compile(args.smoke_only)
        except re.error as exc:
            ap.error(f"--smoke-only {args.smoke_only!r} is not a regular expression ({exc}): give one that "
                     "matches smoke line names, e.g. '^(profile|report)$'")
    args.wanted = wanted
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    t0 = time.monotonic()
    env, slug = read_environment(args)
    print(f"gpu day: {headline(env, args.device)}", flush=True)
    if not args.cpu and not any(d.get("device", "").startswith("cuda") for d in env.get("devices", [])):
        print(f"gpu_day: torch sees no CUDA device here ({env.get('torch') or env.get('error', '?')}): run it on "
              "the GPU machine, or with --device cpu to check the code at tiny sizes", file=sys.stderr)
        return 2
    out = args.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    work = (args.work or out.parent / f"{out.name}-work").resolve()
    shutil.rmtree(work, ignore_errors=True)
    try:
        (work / "logs").mkdir(parents=True)
    except OSError:  # the folder above --out is not ours to write: a temporary folder instead
        work = Path(tempfile.mkdtemp(prefix="gpu_day-"))
        (work / "logs").mkdir()
    day: dict[str, Any] = {
        "benchmark": "gpu_day",
        "command": shlex.join(["python", "-m", "benchmarks.gpu_day.day", *(argv if argv is not None else sys.argv[1:])]),
        "config": {"device": args.device, "parts": args.wanted, "budget_s": args.budget, "grace_s": args.grace,
                   "smoke_only": args.smoke_only, "zoo_tests": args.zoo_tests, "zoo_cases": args.zoo_cases or "all",
                   "require_peers": args.require_peers,
                   "own_budgets_s": {p.key: p.budget_cpu if args.cpu else p.budget_gpu for p in PARTS},
                   "budget_rule": "a part's own budget plus what earlier parts left unused"},
        "environment": env, "device_slug": slug,
        "results_path": f"benchmarks/results/gpu_day_{slug}_{env.get('date', time.strftime('%Y-%m-%d'))}.json",
        "parts": {}}
    own = {p.key: p.budget_cpu if args.cpu else p.budget_gpu for p in PARTS if p.key in args.wanted}
    for i, part in enumerate(p for p in PARTS if p.key in args.wanted):
        left = args.budget - (time.monotonic() - t0)
        budget = part_budget(own[part.key], left, sum(list(own.values())[i + 1:]))
        if budget < 10:
            day["parts"][part.key] = {"status": "skipped: the day's budget is spent", "seconds": 0.0, "budget_s": budget}
        else:
            print(f"[{time.monotonic() - t0:5.0f} s] part {part.key} ({part.name}): {part.title}, "
                  f"budget {budget:.0f} s", flush=True)
            day["parts"][part.key] = run_part(part, args, work, budget)
        day["parts"][part.key].update(name=part.name, title=part.title)
        day["wall_s"] = round(time.monotonic() - t0, 1)
        write_outputs(day, out, work)
        print(f"[{time.monotonic() - t0:5.0f} s] part {part.key} ({part.name}): {day['parts'][part.key]['status']}",
              flush=True)
    # (e) and (f) are optional: with no time left for them the day is still whole
    bad = not_fine(day)
    print(f"gpu day: {len(day['parts'])} parts in {day['wall_s']:.0f} s; "
          + (f"not fine: {bad}" if bad else "every part fine") + f" -> {out / 'gpu_day.json'}, {out / 'gpu_day.md'}")
    after = day["next_call"]
    print(f"next device call: {after['command']}  ({after['why']})" if after else
          "next device call: none (every part ended fine and whole): give the machine back")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
