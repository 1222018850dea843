# The two quick-start commands: `make fit` and `make test`. Both set everything up first.
VENV ?= .venv
BIN := $(VENV)/bin

.PHONY: setup fit test test-fast test-torch test-gpu gpu-day-cpu coverage info doctor docs

setup:
	@bash scripts/setup.sh

fit: setup
	$(BIN)/gputrain fit

# Every CPU test, on pytest-xdist workers, one per core (-n auto: tests/conftest.py); each run ends
# with its 25 slowest tests. Also installs Debian's chromium (as root, when missing) for the browser
# test of report.html, and postgresql and mariadb-server for the tests of a sweep's study on a database server.
# WORKERS=N sets the count (WORKERS=0: one process, no workers).
WORKERS ?= auto
test:
	@bash scripts/setup.sh --with-browser --with-postgres --with-mysql
	$(BIN)/python -m pytest -q -n $(WORKERS)

# The inner loop while changing the step, configs, data or checkpoints: the tests that are not slow
# and start no processes of their own (tests/README.md: the rule and what it leaves out).
test-fast: setup
	$(BIN)/python -m pytest -q -n $(WORKERS) -m "not slow and not processes"

# The suite under another torch release, in a venv of its own (.venv-torch$(TORCH), git-ignored; made by
# scripts/setup.sh, which installs exactly torch==$(TORCH), several GB with its CUDA libraries, unless
# the machine's own torch is that release): `make test-torch TORCH=2.11.0` (the GPU machine's torch,
# the default). PYTEST_ARGS picks tests (.ci/run passes the subset it runs under 2.11).
TORCH ?= 2.11.0
PYTEST_ARGS ?=
test-torch:
	@GPUTRAIN_VENV=.venv-torch$(TORCH) GPUTRAIN_TORCH=$(TORCH) bash scripts/setup.sh --with-browser
	.venv-torch$(TORCH)/bin/python -m pytest -q -n $(WORKERS) $(PYTEST_ARGS)

test-gpu: setup
	$(BIN)/python -m pytest -q -m gpu

# The GPU day's command (benchmarks/gpu_day/day.py) on the CPU at tiny sizes, under torch $(TORCH) in its venv,
# with the peers extra (Lightning, Accelerate) installed there: every part's code runs, the speed table's
# peer rows included; it fails when a part crashes or a peer row errors or is missing. .ci/run runs it.
gpu-day-cpu:
	@GPUTRAIN_VENV=.venv-torch$(TORCH) GPUTRAIN_TORCH=$(TORCH) GPUTRAIN_EXTRAS=test,peers bash scripts/setup.sh
	OUT=$${OUT:-gpu-out/day-cpu} PYTHON=.venv-torch$(TORCH)/bin/python bash benchmarks/gpu_session.sh day --device cpu --require-peers

# Line and branch coverage of src/gputrain under the CPU suite (subprocesses included), the functions it
# never runs and the branches it never takes: coverage-out/ (report.txt, coverage.json, html/,
# uncovered_functions.txt, untaken_branches.txt), checked against docs/gpu_checklist.md.
coverage:
	@bash scripts/setup.sh --with-browser
	@WORKERS=$(WORKERS) bash scripts/coverage.sh

info: setup
	$(BIN)/gputrain info

doctor: setup
	$(BIN)/gputrain doctor

# The documentation site (mkdocs.yml, docs/) into site/ (git-ignored), warnings as errors: a broken link or
# anchor, a missing snippet file, a docstring the API reference cannot read. Serve it with
# `.venv/bin/python -m http.server -d site 8000` (or open site/index.html, without search).
docs: setup
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict --clean
