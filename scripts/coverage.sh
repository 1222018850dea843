#!/usr/bin/env bash
# `make coverage`: line and branch coverage of src/gputrain under the CPU test suite (the same tests
# as `make test`), subprocesses included, and the map of what the suite never runs.
#
# The settings are in pyproject.toml ([tool.coverage.*]): patch = ["subprocess"] makes every Python
# started below the measured pytest (`python -m gputrain ...`, the `gputrain` script, torchrun and its
# workers, `python -c ...`) measure itself, each into its own data file (parallel = true) under
# coverage-out/; `coverage combine` merges them. Output (git-ignored), in coverage-out/:
#   coverage.json        per file and per function, lines and branches (the two scripts below read it)
#   html/index.html      the annotated source (partial branches marked)
#   report.txt           per file: statements, branches, partial branches, missed lines
#   uncovered_functions.txt  every function of src/gputrain with no line run (scripts/uncovered_functions.py)
#   untaken_branches.txt     every branch never taken in a function the suite enters, CUDA-only ones
#                            first (scripts/untaken_branches.py)
# A full run (no arguments) also checks both lists against docs/gpu_checklist.md and exits 1 when the
# page lacks one or names one that no longer exists (after pytest's own status).
# Arguments go to pytest, e.g. `scripts/coverage.sh tests/test_report_html.py` for one file.
set -uo pipefail
cd "$(dirname "$0")/.."
VPY=${GPUTRAIN_VENV:-.venv}/bin/python
OUT=${COVERAGE_OUT:-coverage-out}  # another folder for a partial run, e.g. COVERAGE_OUT=/tmp/cov scripts/coverage.sh tests/test_x.py
mkdir -p "$OUT" && OUT=$(cd "$OUT" && pwd)
export COVERAGE_FILE="$OUT/.coverage"

if ! "$VPY" -c "import coverage" 2>/dev/null; then
    echo "coverage: not installed in the venv (it comes with the test extras: make test, or pip install -e .[test])" >&2
    exit 2
fi
# Subprocesses start measuring from coverage's .pth file in the interpreter's site-packages: without it
# only the pytest process would count (the CLI commands would read 0%).
if ! "$VPY" - <<'PY'
import pathlib, site, sys
pths = [p for d in site.getsitepackages() for p in pathlib.Path(d).glob("*coverage*.pth")]
sys.exit(0 if pths else "coverage: no coverage .pth in site-packages: subprocesses would not be measured")
PY
then
    exit 2
fi

rm -rf "$OUT"/.coverage* "$OUT"/html "$OUT"/coverage.json
start=$(date +%s)
echo "$start" > "$OUT/run_started"  # untaken_branches.py names the source files modified after it
# -p no:cacheprovider: leave .pytest_cache alone; -p coverage_guard (scripts/coverage_guard.py): puts
# coverage's tracer back after any test that removed it with sys.settrace; the rest as `make test` runs it,
# on its pytest-xdist workers (-n, WORKERS=N to choose; each worker is a Python below the measured one,
# so it measures itself into its own data file, as the processes the tests start do).
PYTHONPATH="$PWD/scripts${PYTHONPATH:+:$PYTHONPATH}" \
    "$VPY" -m coverage run -m pytest -q -p no:cacheprovider -p coverage_guard -n "${WORKERS:-auto}" "$@"
rc=$?
echo "coverage: pytest exited $rc after $(( $(date +%s) - start )) s"

files=$(find "$OUT" -maxdepth 1 -name '.coverage.*' | wc -l)
echo "coverage: combining $files data files (pytest and the Python processes it started)"
"$VPY" -m coverage combine -q
"$VPY" -m coverage json -q -o "$OUT/coverage.json"
"$VPY" -m coverage html -q -d "$OUT/html"
"$VPY" -m coverage report --sort=cover > "$OUT/report.txt"
"$VPY" scripts/uncovered_functions.py "$OUT/coverage.json" > "$OUT/uncovered_functions.txt"
"$VPY" scripts/untaken_branches.py "$OUT/coverage.json" > "$OUT/untaken_branches.txt"
grep "^TOTAL" "$OUT/report.txt"
"$VPY" - "$OUT/coverage.json" "$OUT/uncovered_functions.txt" "$OUT/untaken_branches.txt" <<'PY'
import json, sys
t = json.load(open(sys.argv[1]))["totals"]
n = sum(1 for line in open(sys.argv[2]) if line.startswith("src/"))
branches = [line for line in open(sys.argv[3]) if line.startswith("# total:")]
print(f"coverage: {100 * t['covered_lines'] / max(t['num_statements'], 1):.1f}% of src/gputrain lines run by the CPU "
      f"suite ({t['covered_lines']}/{t['num_statements']}); branches taken {t['covered_branches']}/{t['num_branches']} "
      f"({100 * t['covered_branches'] / max(t['num_branches'], 1):.1f}%, {t['num_partial_branches']} decisions "
      f"taken one way only); {n} functions with no line run ({sys.argv[2]})")
print("coverage: " + (branches[-1][len("# total: "):].strip() if branches else "no branch summary") + f" ({sys.argv[3]})")
print(f"coverage: report {sys.argv[1].replace('coverage.json', 'html/index.html')}")
PY
crc=0
if [[ $# -eq 0 ]]; then  # the whole suite ran: every CUDA-only function and branch must be on the checklist
    "$VPY" scripts/uncovered_functions.py "$OUT/coverage.json" --checklist docs/gpu_checklist.md > /dev/null || crc=1
    "$VPY" scripts/untaken_branches.py "$OUT/coverage.json" --checklist docs/gpu_checklist.md > /dev/null || crc=1
    [[ $crc == 0 ]] && echo "coverage: docs/gpu_checklist.md names every CUDA-only function and branch, and nothing stale"
fi
exit $(( rc != 0 ? rc : crc ))
