"""How long `import gputrain` took in this process, in seconds: started by the package's first
statement and stopped by its last (gputrain/__init__.py), read by a run's startup costs
(train/loop/startup_costs.py). A module of its own on the ground floor, so that the trainer reads
it without importing the package's face."""

import time

_STARTED = time.perf_counter()  # imported first by gputrain/__init__.py: torch's import is inside when gputrain came first
_seconds: float | None = None


def stop() -> None:
    """The package's import ends here (called once, by gputrain/__init__.py's last statement)."""
    global _seconds
    _seconds = time.perf_counter() - _STARTED


def import_seconds() -> float:
    """Seconds `import gputrain` took in this process (until now, if it has not ended)."""
    return _seconds if _seconds is not None else time.perf_counter() - _STARTED
