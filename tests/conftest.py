"""Shared test setup: the `gpu` marker skips without CUDA; no test leaks a process group or env var."""

import os

import pytest
import torch

# One thread: on a busy 2-core machine OpenMP threads that spin-wait for a core make small steps
# 100x slower; tests need correctness, not speed.
torch.set_num_threads(1)


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU: none visible to this PyTorch "
                                   f"({torch.__version__}); run `make test-gpu` on a GPU machine")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


_WATCHED = ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE")


@pytest.fixture(autouse=True)
def _no_leaks():
    import logging

    before = dict(os.environ)
    # The CLI gives the "gputrain" logger its own handler (and stops propagation) for the run log,
    # also when a module-scoped fixture runs it: every test starts and ends with the logger plain, so
    # caplog sees its records.
    logger = logging.getLogger("gputrain")

    def plain():
        logger.handlers.clear()
        logger.propagate = True
        logger.setLevel(logging.NOTSET)

    plain()
    yield
    plain()
    import torch.distributed as dist

    leaked_pg = dist.is_available() and dist.is_initialized()
    if leaked_pg:
        dist.destroy_process_group()
    added = {k for k in os.environ if k not in before}
    for k in added:
        os.environ.pop(k, None)
    bad = sorted(k for k in added if k in _WATCHED or k.startswith("GPUTRAIN_"))
    assert not leaked_pg, "test left a torch.distributed process group initialized"
    assert not bad, f"test leaked environment variables: {bad}"


@pytest.fixture
def cache_dir(tmp_path, monkeypatch):
    """A private gputrain cache dir (mnist1d etc.) so tests never touch the user's."""
    d = tmp_path / "cache"
    monkeypatch.setenv("GPUTRAIN_CACHE", str(d))
    return d
