"""The fixed cost of gputrain's import and of `gputrain --help`, against `import torch` alone.

Each command runs in a fresh Python process, the three in turn (interleaved, so a machine whose
load changes during the run affects each alike), `--runs` times; the figure is the median wall time
of each from spawn to exit (this script's perf_counter), and its ratio to `import torch`'s. The
goal (issue 45): both within 10% of `import torch`.

On a loaded machine the wall times of separate processes spread widely, so each gputrain command
also runs once per round under `python -X importtime`: the sum of its top-level imports over the
`torch` import inside the same process (median over the rounds) is the import's share that is not
torch's, a ratio that one process's load affects alike on both sides. (It leaves out what is not an
import: argparse building --help, the interpreter's start.)

    python -c "import torch"
    python -c "import gputrain"
    python -m gputrain --help

Usage:
  python -m benchmarks.import_time                  # 9 runs of each, JSON to a temp folder
  python -m benchmarks.import_time --runs 15 --json out.json
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
COMMANDS = {
    "import torch": ["-c", "import torch"],
    "import gputrain": ["-c", "import gputrain"],
    "gputrain --help": ["-m", "gputrain", "--help"],
}


def measure(runs: int) -> tuple[dict[str, list[float]], dict[str, list[float]]]:
    """Seconds from spawn to exit of each command, `runs` times each, interleaved; and for each
    gputrain command the ratio of its imports to torch's inside one `-X importtime` process."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(HERE.parent / "src"), os.environ.get("PYTHONPATH", "")]))
    times: dict[str, list[float]] = {name: [] for name in COMMANDS}
    in_process: dict[str, list[float]] = {name: [] for name in COMMANDS if name != "import torch"}
    for _ in range(runs):
        for name, args in COMMANDS.items():
            t0 = time.perf_counter()
            subprocess.run([sys.executable, *args], env=env, check=True, stdout=subprocess.DEVNULL)
            times[name].append(time.perf_counter() - t0)
        for name in in_process:
            proc = subprocess.run([sys.executable, "-X", "importtime", *COMMANDS[name]], env=env, check=True,
                                  stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
            in_process[name].append(imports_over_torch(proc.stderr))
    return times, in_process


def imports_over_torch(report: str) -> float:
    """From `-X importtime`'s lines ("import time: self | cumulative | name", nesting by indent):
    the cumulative microseconds of the top-level imports from the first of gputrain's on (the
    interpreter's own start, `site` and `encodings`, left out: `import torch` pays them too) over
    those of the `torch` import within them."""
    top, torch_us, started = 0, 0, False
    for line in report.splitlines():
        if not line.startswith("import time:") or "|" not in line or "cumulative" in line:
            continue
        _self, cumulative, name = line[len("import time:"):].split("|")
        started = started or name.strip().startswith("gputrain")
        if started and not name.startswith("  "):  # nesting: two spaces per level after the separator's one
            top += int(cumulative)
        if name.strip() == "torch":
            torch_us = int(cumulative)
    return top / torch_us if torch_us else float("nan")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--runs", type=int, default=9)
    p.add_argument("--json", default=None, help="where the JSON goes (default: a temp folder)")
    args = p.parse_args(argv)
    times, in_process = measure(args.runs)
    medians = {name: statistics.median(t) for name, t in times.items()}
    shares = {name: statistics.median(r) for name, r in in_process.items()}
    base = medians["import torch"]
    print(f"{'command':<18} {'median s':>9} {'min s':>7} {'max s':>7} {'/ import torch':>15} {'imports / torch':>16}"
          f"  ({args.runs} runs each)")
    for name, t in times.items():
        share = f"{shares[name]:15.3f}x" if name in shares else f"{'':>16}"
        print(f"{name:<18} {medians[name]:9.3f} {min(t):7.3f} {max(t):7.3f} {medians[name] / base:14.3f}x {share}")
    path = Path(args.json) if args.json else Path(tempfile.mkdtemp(prefix="import-time-")) / "import_time.json"
    from benchmarks.result_files import write_json  # gputrain's (and torch's) import, after the measurement

    write_json(path, {"command": " ".join(sys.argv), "runs": args.runs, "seconds": times, "median_s": medians,
                      "ratio_to_import_torch": {n: m / base for n, m in medians.items()},
                      "imports_over_torch_in_process": in_process, "imports_over_torch_median": shares})
    print(f"JSON: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
