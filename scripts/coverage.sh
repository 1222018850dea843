#!/usr/bin/env bash
# `make coverage`: line coverage of src/gputrain under the CPU test suite (the same tests as
# `make test`), subprocesses included, and the map of what the suite never runs.
#
# The settings are in pyproject.toml ([tool.coverage.*]): patch = ["subprocess"] makes every Python
# started below the measured pytest (`python -m gputrain ...`, the `gputrain` script, torchrun and its
# workers, `python -c ...`) measure itself, each into its own data file (parallel = true) under
# coverage-out/; `coverage combine` merges them. Output (git-ignored), in coverage-out/:
#   coverage.json        per file and per function (scripts/uncovered_functions.py reads it)
#   html/index.html      the annotated source
#   uncovered_functions.txt  every function of src/gputrain with no line run
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
# -p no:cacheprovider: leave .pytest_cache alone; -p coverage_guard (scripts/coverage_guard.py): puts
# coverage's tracer back after any test that removed it with sys.settrace; the rest as `make test` runs it.
PYTHONPATH="$PWD/scripts${PYTHONPATH:+:$PYTHONPATH}" \
    "$VPY" -m coverage run -m pytest -q -p no:cacheprovider -p coverage_guard "$@"
rc=$?
echo "coverage: pytest exited $rc after $(( $(date +%s) - start )) s"

files=$(find "$OUT" -maxdepth 1 -name '.coverage.*' | wc -l)
echo "coverage: combining $files data files (pytest and the Python processes it started)"
"$VPY" -m coverage combine -q
"$VPY" -m coverage json -q -o "$OUT/coverage.json"
"$VPY" -m coverage html -q -d "$OUT/html"
"$VPY" -m coverage report --sort=cover > "$OUT/report.txt"
"$VPY" scripts/uncovered_functions.py "$OUT/coverage.json" > "$OUT/uncovered_functions.txt"
grep "^TOTAL" "$OUT/report.txt"
"$VPY" - "$OUT/coverage.json" "$OUT/uncovered_functions.txt" <<'PY'
import json, sys
totals = json.load(open(sys.argv[1]))["totals"]
n = sum(1 for line in open(sys.argv[2]) if line.startswith("src/"))
print(f"coverage: {totals['percent_covered']:.1f}% of src/gputrain lines run by the CPU suite "
      f"({totals['covered_lines']}/{totals['num_statements']}); {n} functions with no line run "
      f"({sys.argv[2]}); report: {sys.argv[1].replace('coverage.json', 'html/index.html')}")
PY
exit $rc
