"""Where a run is in its data: an endless, resumable stream of batches across epochs (passes).

`BatchStream` is the one object a checkpoint saves as the data position, whatever the source:

- tensors and map-style data (a Dataset, a user's DataLoader rebuilt by gputrain): shuffles depend
  only on (seed, epoch), so (epoch, batch in epoch) is the whole position (the sampler's
  permutation is rebuilt from the seed, and it starts at the batch);
- an iterable with state (torchdata's `StatefulDataLoader`, which also carries a Hugging Face
  `IterableDataset`'s `state_dict()`): that state, taken where the stream stands (so the device feed,
  data/device_feed.py, reads no batch of it ahead);
- a list or tuple of batches: the count, at which its index starts a resumed run (nothing read again);
- an iterable without state (a generator, a plain DataLoader over an IterableDataset): the count;
  a resumed run reads the batches before it again (a warning names how many).

A source (what `make_loader` builds) has `iter_epoch(epoch, start_batch)`, `batch_size` (None: the
batches are the iterable's), `num_samples` (per epoch on this process; None: unknown) and a
`len()` in batches (TypeError: unknown). Optional: `reiterable` (False: a one-shot iterator),
`uniform_batches` (True: every batch has one structure, so it is not checked), `state_dict()` /
`load_state_dict()` (the position beyond the count), `iter_from(epoch, start_batch)` (one endless
iterator across epochs, for a source of known length: the stream counts the epochs itself) and
`describe` (a name for messages).
"""

from __future__ import annotations

from typing import Any, Iterator

from gputrain.errors import ConfigError, DataError


def epoch_seed(seed: int, epoch: int, salt: int = 0) -> int:
    """A distinct, reproducible seed per (run seed, epoch[, purpose])."""
    return (seed * 1_000_003 + epoch * 7_919 + salt * 104_729) % (2**63 - 1)


class DataExhausted(DataError):
    """A one-shot iterable (a generator) ran out before the run's last step; the trainer ends the run
    there (checkpointed, summarized) with this message rather than failing."""


def known_length(source: Any) -> int | None:
    """Batches per epoch, or None when the source cannot say (an iterable without a length)."""
    try:
        return len(source)
    except TypeError:
        return None


def describe_source(source: Any) -> str:
    return getattr(source, "describe", None) or type(source).__name__


def plan_steps(source: Any, *, steps: int | None, epochs: int | None, accumulate: int) -> int:
    """The run's optimizer steps: `steps`, else `epochs` (default 1) x batches per epoch / accumulate.

    Raises ConfigError when the length is needed and unknown, DataError for data with no batch."""
    n = known_length(source)
    if n == 0:
        raise DataError(f"the training data give no batch: {describe_source(source)} is empty. Check the data "
                        "you pass (a filter that removed everything, a wrong path or split)")
    if steps is not None:
        return steps
    if n is None:
        raise ConfigError(f"{describe_source(source)} has no length, so an epoch is unknown: give the run's length "
                          "in steps, TrainConfig(steps=N) (or --steps N); an iterable that runs out starts a new "
                          "pass where it can")
    return max(1, (epochs if epochs is not None else 1) * n // accumulate)


class BatchStream:
    """An endless stream of (epoch, batch_in_epoch, batch) across epochs, resumable at any point.

    An exhausted pass starts the next one; a one-shot iterable raises DataExhausted instead. An
    error while loading a batch gets a note naming the batch. Batches from sources that are not
    uniform are checked for a change of structure or dtype (data/checks.py).
    """

    def __init__(self, loader, epoch: int = 0, batch_in_epoch: int = 0):
        from gputrain.data.checks import BatchCheck

        self.loader = loader
        self.epoch = epoch
        self.batch_in_epoch = batch_in_epoch  # the next batch to yield
        self._it: Iterator[Any] | None = None
        # The source's saved state, to restart at (epoch, batch_in_epoch) instead of reading up to it.
        self._pending_state: Any = None
        self.check = None if getattr(loader, "uniform_batches", False) else BatchCheck(describe_source(loader))
        self._length = known_length(loader)  # batches per epoch (None: unknown); read once, not per pass
        self._reiterable = getattr(loader, "reiterable", True)
        # A source that goes on across epochs by itself (`iter_from`, resident tensors): one iterator
        # for the run, the epoch counted here. Needs a known length.
        self._endless = self._length is not None and callable(getattr(loader, "iter_from", None))
        self.last_batch: Any = None  # the batch yielded last (for the note on a failed first step)
        self.load_error: BaseException | None = None  # set when loading a batch raised

    def rewind(self, epoch: int, batch_in_epoch: int) -> None:
        """Go back to a position (a step that was interrupted gives its batches back)."""
        self.epoch, self.batch_in_epoch, self._it, self._pending_state = epoch, batch_in_epoch, None, None

    # ------------------------------------------------------------ the position, for checkpoints

    def state_dict(self) -> dict[str, Any]:
        """The position: (epoch, batch in epoch), plus the source's state when it has one and its
        live iterator stands exactly there (not after a rewind, not at an epoch's start)."""
        source = None
        if self.batch_in_epoch > 0:
            if self._it is not None:
                get = getattr(self.loader, "state_dict", None)
                source = get() if callable(get) else None
            else:
                source = self._pending_state  # loaded and not started yet: keep it
        return {"epoch": self.epoch, "batch_in_epoch": self.batch_in_epoch, "source": source}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.epoch, self.batch_in_epoch = int(state.get("epoch", 0)), int(state.get("batch_in_epoch", 0))
        self._it = None
        self._pending_state = state.get("source") if self.batch_in_epoch > 0 else None

    def epochs_done(self, samples_seen: int, world_size: int = 1) -> float:
        """Epochs done, fractional (samples seen / samples per epoch); for data of unknown length,
        the passes finished."""
        n = getattr(self.loader, "num_samples", None)
        if not n:
            return float(self.epoch)
        return round(samples_seen / (n * world_size), 4)

    # ------------------------------------------------------------ batches

    def _start(self) -> Iterator[Any]:
        n = self._length
        if n is not None and self.batch_in_epoch >= n:
            self.epoch, self.batch_in_epoch = self.epoch + 1, 0
        if self._pending_state is not None:
            self.loader.load_state_dict(self._pending_state)
            self._pending_state = None
            return self.loader.iter_epoch(self.epoch, self.batch_in_epoch, restored=True)
        if self._endless:
            return self.loader.iter_from(self.epoch, self.batch_in_epoch)
        return self.loader.iter_epoch(self.epoch, self.batch_in_epoch)

    def next(self) -> tuple[int, int, Any]:
        while True:
            it = self._it
            if it is None:
                it = self._it = self._start()
            elif self._endless and self.batch_in_epoch == self._length:  # the source went on into the next epoch
                self.epoch, self.batch_in_epoch = self.epoch + 1, 0
            try:
                batch = next(it)
            except StopIteration:
                self._it = None
                self._end_of_pass()
                continue
            except Exception as exc:
                self._it = None  # a failed iterator is not resumed: the position stays before this batch
                self.load_error = exc
                exc.add_note(f"gputrain: loading batch {self.batch_in_epoch} of epoch {self.epoch} from "
                             f"{describe_source(self.loader)} failed (batches counted from 0). The error is in "
                             "the data: a sample's __getitem__, the collate_fn, the iterable, or a DataLoader "
                             "worker; fix it there (num_workers=0 shows the sample's own traceback)")
                raise
            if self.check is not None:
                self.check(batch, self.epoch, self.batch_in_epoch)
            self.last_batch = batch
            epoch, i = self.epoch, self.batch_in_epoch
            self.batch_in_epoch = i + 1
            return epoch, i, batch

    def name_a_lost_worker(self, exc: BaseException) -> None:
        """A DataLoader worker that dies is reported by torch's SIGCHLD handler wherever the main
        process is, most often inside the step rather than in `next`: name the batches it was
        loading ahead (the position is the interrupted step's, as the step gave its batches back)."""
        if exc is self.load_error or "DataLoader worker" not in str(exc):
            return
        exc.add_note(f"gputrain: loading batch {self.batch_in_epoch} of epoch {self.epoch} or one after it "
                     f"(read ahead by a DataLoader worker) from {describe_source(self.loader)} failed: the worker "
                     "died while the step ran. The error is in the data: a sample's __getitem__, the collate_fn or "
                     "the worker's memory; fix it there (num_workers=0 shows the sample's own traceback)")

    def _end_of_pass(self) -> None:
        if self.batch_in_epoch == 0:
            raise DataError(f"the training data gave no batch in epoch {self.epoch}: {describe_source(self.loader)} "
                            "is empty" + (" (an exhausted generator?)" if self.epoch == 0 else "")
                            + ". Check the data you pass")
        if not self._reiterable:
            raise DataExhausted(f"{describe_source(self.loader)} ran out after {self.batch_in_epoch} batches and can "
                                "be read only once (a generator or an iterator): the run ends here. Pass something that can be "
                                "read again for more (a list, a Dataset, a DataLoader, or an object whose "
                                "__iter__ starts over), or set steps= to what it holds")
        self.epoch, self.batch_in_epoch = self.epoch + 1, 0
