# The two quick-start commands: `make fit` and `make test`. Both set everything up first.
VENV ?= .venv
BIN := $(VENV)/bin

.PHONY: setup fit test test-gpu coverage info doctor

setup:
	@bash scripts/setup.sh

fit: setup
	$(BIN)/gputrain fit

# Also installs Debian's chromium (as root, when missing) for the browser test of report.html.
test:
	@bash scripts/setup.sh --with-browser
	$(BIN)/python -m pytest -q

test-gpu: setup
	$(BIN)/python -m pytest -q -m gpu

# Line and branch coverage of src/gputrain under the CPU suite (subprocesses included), the functions it
# never runs and the branches it never takes: coverage-out/ (report.txt, coverage.json, html/,
# uncovered_functions.txt, untaken_branches.txt), checked against docs/gpu_checklist.md.
coverage:
	@bash scripts/setup.sh --with-browser
	@bash scripts/coverage.sh

info: setup
	$(BIN)/gputrain info

doctor: setup
	$(BIN)/gputrain doctor
