"""pytest plugin for `make coverage` (scripts/coverage.sh loads it with -p): keeps coverage's tracer on.

On Python < 3.12 coverage measures through sys.settrace. A test that sets its own tracer and ends
with sys.settrace(None) switches the measurement off for every later test of the process, and the
report then shows code those tests ran as never run (it happened: 60% instead of the real figure).
After each test this puts coverage's tracer back if it is gone, and the run ends by naming the tests
that removed it.
"""

from __future__ import annotations

import sys

import pytest

_tracer = None
_culprits: list[str] = []


def pytest_configure(config) -> None:
    global _tracer
    _tracer = sys.gettrace()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    yield
    if _tracer is not None and sys.gettrace() is not _tracer:
        sys.settrace(_tracer)
        _culprits.append(item.nodeid)


def pytest_terminal_summary(terminalreporter) -> None:
    if _tracer is None:
        return
    if _culprits:
        terminalreporter.write_line(
            f"coverage_guard: {len(_culprits)} test(s) left another tracer or none; coverage's was put back "
            f"after each (save and restore sys.gettrace() in them): {', '.join(_culprits)}", yellow=True)
