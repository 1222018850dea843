"""The fixed cost of gputrain's import and of `gputrain --help`, against `import torch` alone.

Each command runs in a fresh Python process, the three in turn (interleaved, so a machine whose
load changes during the run affects each alike), `--runs` times; the figure is the median wall time
of each from spawn to exit (this script's perf_counter), and its ratio to `import torch`'s. The
goal (issue 45): both within 10% of `import torch`.

    python -c "import torch"
    python -c "import gputrain"
    python -m gputrain --help

Usage:
  python benchmarks/import_time.py                  # 9 runs of each, JSON to a temp folder
  python benchmarks/import_time.py --runs 15 --json out.json
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
COMMANDS = {
    "import torch": ["-c", "import torch"],
    "import gputrain": ["-c", "import gputrain"],
    "gputrain --help": ["-m", "gputrain", "--help"],
}


def measure(runs: int) -> dict[str, list[float]]:
    """Seconds from spawn to exit of each command, `runs` times each, interleaved."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(HERE.parent / "src"), os.environ.get("PYTHONPATH", "")]))
    times: dict[str, list[float]] = {name: [] for name in COMMANDS}
    for _ in range(runs):
        for name, args in COMMANDS.items():
            t0 = time.perf_counter()
            subprocess.run([sys.executable, *args], env=env, check=True, stdout=subprocess.DEVNULL)
            times[name].append(time.perf_counter() - t0)
    return times


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--runs", type=int, default=9)
    p.add_argument("--json", default=None, help="where the JSON goes (default: a temp folder)")
    args = p.parse_args(argv)
    times = measure(args.runs)
    medians = {name: statistics.median(t) for name, t in times.items()}
    base = medians["import torch"]
    print(f"{'command':<18} {'median s':>9} {'min s':>7} {'max s':>7} {'/ import torch':>15}  ({args.runs} runs each)")
    for name, t in times.items():
        print(f"{name:<18} {medians[name]:9.3f} {min(t):7.3f} {max(t):7.3f} {medians[name] / base:14.3f}x")
    path = Path(args.json) if args.json else Path(tempfile.mkdtemp(prefix="import-time-")) / "import_time.json"
    sys.path.insert(0, str(HERE.parent / "src"))
    from gputrain.io.atomic import atomic_file

    with atomic_file(path, "w") as fh:
        json.dump({"command": " ".join(sys.argv), "runs": args.runs, "seconds": times, "median_s": medians,
                   "ratio_to_import_torch": {n: m / base for n, m in medians.items()}}, fh, indent=1)
    print(f"JSON: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
