# The two quick-start commands: `make fit` and `make test`. Both set everything up first.
VENV ?= .venv
BIN := $(VENV)/bin

.PHONY: setup fit test test-gpu info doctor

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

info: setup
	$(BIN)/gputrain info

doctor: setup
	$(BIN)/gputrain doctor
