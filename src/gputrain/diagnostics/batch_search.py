"""The largest batch that fits: a search driven by out-of-memory errors.

- `find_max_batch(try_batch, ...)`: doubling, then binary search, catching only OOM errors.
- `batch_trial(probe, make_batch, ...)`: a `try_batch` that runs the step fit runs (a
  `probe.StepProbe`) at batch b, or compares that step's memory with a limit to dry-run the search
  on any device.
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from gputrain.diagnostics.probe import StepProbe
from gputrain.errors import ConfigError, GputrainError
from gputrain.runtime.oom import free_after_oom, is_oom

_NO_LIMIT_CAP = 2**31  # doubling stops here when neither `limit` nor an OOM stops it


def find_max_batch(try_batch: Callable[[int], None], start: int = 1, limit: int | None = None,
                   device: torch.device | str | None = None) -> int:
    """The largest batch size for which `try_batch(batch_size)` runs without running out of memory.

    Doubles from `start` until a batch fails or reaches `limit`, then binary-searches between the
    last batch that ran and the first that did not. If `start` itself fails, halves down first.
    Out-of-memory errors (see `is_oom`) are caught and the memory freed; any other exception
    propagates. Assumes that a batch that fits means every smaller one fits.

    Returns the largest batch that ran. Raises GputrainError when even a batch of 1 does not fit,
    and ConfigError for start < 1 or limit < 1.
    """
    if start < 1:
        raise ConfigError(f"find_max_batch: start must be >= 1, got {start}")
    if limit is not None and limit < 1:
        raise ConfigError(f"find_max_batch: limit must be >= 1, got {limit}")
    cap = limit if limit is not None else _NO_LIMIT_CAP
    tried: dict[int, bool] = {}

    def runs(batch: int) -> bool:
        if batch not in tried:
            ok = True
            try:
                try_batch(batch)
            except Exception as exc:  # noqa: BLE001 - only OOM is handled, the rest is re-raised
                if not is_oom(exc):
                    raise
                ok = False
            if not ok:
                free_after_oom(device)  # outside the except block: the traceback is gone by now
            tried[batch] = ok
        return tried[batch]

    batch = min(start, cap)
    good, bad = 0, None
    if runs(batch):
        good = batch
        while good < cap:
            batch = min(good * 2, cap)
            if runs(batch):
                good = batch
            else:
                bad = batch
                break
        if bad is None:
            return good
    else:
        bad = batch
        while bad > 1:
            batch = bad // 2
            if runs(batch):
                good = batch
                break
            bad = batch
        if good == 0:
            where = f" on {device}" if device is not None else ""
            raise GputrainError(
                f"out of memory{where} even with a batch of 1: the model, its gradients and optimizer state "
                "do not fit; use bf16, --recompute, a smaller model or a device with more "
                "memory")
    while bad - good > 1:
        mid = (good + bad) // 2
        if runs(mid):
            good = mid
        else:
            bad = mid
    return good


def batch_trial(probe: StepProbe, make_batch: Callable[[int], Any],
                limit_bytes: int | None = None) -> Callable[[int], None]:
    """A `try_batch` for `find_max_batch`: the step fit runs (`probe`'s) at batch size b.

    make_batch(b) -> a batch of b samples on the probe's device (`probe_batches`). Without
    limit_bytes the step just runs to its steady state (on a GPU a batch too large raises a real
    out-of-memory error). With limit_bytes the step's memory (`StepProbe.measure`: the real peak on
    CUDA, the estimate elsewhere) is compared with limit_bytes and torch.OutOfMemoryError raised
    above it: a dry run of the search on any device, or a smaller GPU simulated on a bigger one.
    """

    def trial(b: int) -> None:
        batch = make_batch(b)
        if limit_bytes is None:
            probe.step(batch)
            return
        need = probe.measure(batch)["peak_bytes"]
        if need > limit_bytes:
            raise torch.OutOfMemoryError(f"out of memory (limit): a batch of {b} needs {need:,} bytes, "
                                         f"the limit is {limit_bytes:,}")

    return trial
