"""The training progress bar (rich), redrawn only at log points."""

from __future__ import annotations

import sys

from gputrain.report.format import format_bytes


class TrainProgress:
    """A rich progress bar (step/total, epoch, loss, samples/s, memory, ETA), redrawn only when the
    trainer calls update() at a log point: no refresh thread competes with the training loop.

    With enabled=False no rich object is created and every method returns at once.
    """

    def __init__(self, enabled: bool, total_steps: int, description: str = "training", console=None):
        self.enabled = enabled
        self.total = total_steps
        self.description = description
        self.console = console
        self._progress = None
        self._task = None

    @staticmethod
    def auto(force: bool | None = None) -> bool:
        """Whether to show a bar: `force` when given, else whether stderr is a terminal."""
        if force is not None:
            return bool(force)
        try:
            return sys.stderr.isatty()
        except (AttributeError, ValueError):  # replaced or closed stderr
            return False

    def __enter__(self) -> "TrainProgress":
        if not self.enabled:
            return self
        from rich.console import Console
        from rich.markup import escape
        from rich.progress import (BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn,
                                   TimeRemainingColumn)

        self._progress = Progress(
            TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(),
            TextColumn("epoch {task.fields[epoch]}"), TextColumn("loss {task.fields[loss]}"),
            TextColumn("{task.fields[rate]} samples/s"), TextColumn("mem {task.fields[mem]}"),
            TimeElapsedColumn(), TextColumn("ETA"), TimeRemainingColumn(),
            console=self.console or Console(stderr=True), auto_refresh=False, transient=False)
        self._progress.start()
        self._task = self._progress.add_task(escape(self.description), total=self.total,
                                             epoch="-", loss="-", rate="-", mem="-")
        self._progress.refresh()
        return self

    def update(self, step: int, epoch: float | None = None, loss: float | None = None,
               samples_per_s: float | None = None, memory_bytes: int | None = None) -> None:
        """Show the state at optimizer step `step` (memory_bytes: the device's peak, None on the CPU)."""
        if self._progress is None or self._task is None:
            return
        self._progress.update(
            self._task, completed=step,
            epoch=f"{epoch:.2f}" if epoch is not None else "-",
            loss=f"{loss:.4f}" if loss is not None else "-",
            rate=f"{samples_per_s:,.0f}" if samples_per_s is not None else "-",
            mem=format_bytes(memory_bytes) if memory_bytes else "-")
        self._progress.refresh()

    def __exit__(self, *exc) -> None:
        if self._progress is not None:
            self._progress.stop()
            self._progress = None
