"""Where a run is in its data: an endless, resumable stream of batches across epochs.

Shuffles depend only on (seed, epoch), so the position (epoch, batch in epoch) is all a checkpoint
needs to replay exactly the batches an uninterrupted run would have seen.
"""

from __future__ import annotations

from typing import Any, Iterator


def epoch_seed(seed: int, epoch: int, salt: int = 0) -> int:
    """A distinct, reproducible seed per (run seed, epoch[, purpose])."""
    return (seed * 1_000_003 + epoch * 7_919 + salt * 104_729) % (2**63 - 1)


class BatchStream:
    """An endless stream of (epoch, batch_in_epoch, batch) across epochs, resumable at any point."""

    def __init__(self, loader, epoch: int = 0, batch_in_epoch: int = 0):
        self.loader = loader
        self.epoch = epoch
        self.batch_in_epoch = batch_in_epoch  # the next batch to yield
        self._it: Iterator[Any] | None = None

    def rewind(self, epoch: int, batch_in_epoch: int) -> None:
        """Go back to a position (a step that was interrupted gives its batches back)."""
        self.epoch, self.batch_in_epoch, self._it = epoch, batch_in_epoch, None

    def next(self) -> tuple[int, int, Any]:
        while True:
            it = self._it
            if it is None:
                if self.batch_in_epoch >= len(self.loader):
                    self.epoch, self.batch_in_epoch = self.epoch + 1, 0
                it = self._it = self.loader.iter_epoch(self.epoch, self.batch_in_epoch)
            try:
                batch = next(it)
            except StopIteration:
                self._it = None
                self.epoch, self.batch_in_epoch = self.epoch + 1, 0
                continue
            pos = (self.epoch, self.batch_in_epoch)
            self.batch_in_epoch += 1
            return pos[0], pos[1], batch
