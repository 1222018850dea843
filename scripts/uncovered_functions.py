#!/usr/bin/env python
"""Every function of src/gputrain that the measured run never entered (no line executed).

Reads coverage.py's JSON report (7.x, with per-file "functions"; `make coverage` writes
coverage-out/coverage.json) and prints one line per function:

    src/gputrain/runtime/devices.py:120  cuda_summary  (14 lines)

A function nested in one that never ran is folded into it ("+2 nested"); a nested function of one
that did run is listed on its own (a closure the run never called). Lambdas are not functions here.

    python scripts/uncovered_functions.py [coverage-out/coverage.json] [--checklist docs/gpu_checklist.md]

--checklist: also check that each listed function is named in that file (as `path::qualname`, the
form the checklist uses) and print those it lacks; exit 1 when any is missing, or when a file changed
since the run (a measured line that is no statement's first line today: measure again; its functions
are not checked).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from untaken_branches import ROOT, drifted_files  # noqa: E402


def uncovered(report: dict, prefix: str = "src/gputrain/") -> list[dict]:
    """[{path, qualname, line, statements, nested}] of functions with no executed line, in file order."""
    found = []
    for path, data in sorted(report["files"].items()):
        path = path.replace("\\", "/")
        if prefix not in path:
            continue
        path = path[path.index(prefix):]
        functions = data.get("functions")
        if functions is None:
            raise SystemExit("this coverage JSON has no per-function data: coverage.py 7.x writes it (`coverage json`)")
        dead = {name: f for name, f in functions.items()
                if name and f["summary"]["num_statements"] > 0 and f["summary"]["covered_lines"] == 0}
        for name in sorted(dead, key=lambda n: dead[n].get("start_line", 0)):
            parent = name.rpartition(".")[0]
            # folded into an enclosing function (or class method) that never ran either
            if any(parent == other or parent.startswith(other + ".") for other in dead if other != name):
                continue
            nested = [n for n in dead if n.startswith(name + ".")]
            f = dead[name]
            found.append({"path": path, "qualname": name, "line": f.get("start_line"),
                          "statements": f["summary"]["num_statements"], "nested": len(nested)})
    return found


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("json", nargs="?", default="coverage-out/coverage.json")
    ap.add_argument("--prefix", default="src/gputrain/", help="only files whose path contains this")
    ap.add_argument("--checklist", type=Path, help="a Markdown file that must name every listed function")
    ap.add_argument("--root", type=Path, default=ROOT, help="relative paths of the report are under this folder")
    args = ap.parse_args(argv)
    report = json.loads(Path(args.json).read_text())
    rows = uncovered(report, args.prefix)
    drifted = drifted_files(report, args.prefix, args.root)
    for r in rows:
        extra = f", +{r['nested']} nested" if r["nested"] else ""
        print(f"{r['path']}:{r['line']}  {r['qualname']}  ({r['statements']} lines{extra})")
    lines = sum(r["statements"] for r in rows)
    totals = report["totals"]  # percent_covered mixes in the branches when they are measured
    percent = (100 * totals["covered_lines"] / max(totals["num_statements"], 1) if "num_statements" in totals
               else totals["percent_covered"])
    print(f"# {len(rows)} functions with no line run ({lines} statements); total line coverage {percent:.1f}%")
    if drifted:
        print(f"# warning: {len(drifted)} source files changed since the run (measured lines that are no statement "
              f"today): their functions may be misnamed: {', '.join(drifted)}")
    if args.checklist:
        text = args.checklist.read_text()
        name = lambda r: f"{r['path'].removeprefix(args.prefix)}::{r['qualname']}"  # noqa: E731
        missing = [r for r in rows if name(r) not in text and r["path"].removeprefix(args.prefix) not in drifted]
        for r in missing:
            print(f"not in {args.checklist}: {name(r)}", file=sys.stderr)
        if drifted:
            print(f"cannot check {len(drifted)} files that changed since the run ({', '.join(drifted)}): "
                  f"measure again (make coverage)", file=sys.stderr)
        if missing or drifted:
            print(f"# {len(missing)} of them missing from {args.checklist}"
                  + (f", {len(drifted)} files not checked" if drifted else ""), file=sys.stderr)
            return 1
        print(f"# every one of them is in {args.checklist}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
