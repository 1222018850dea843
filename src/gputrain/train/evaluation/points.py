"""When a run evaluates: at the steps `TrainConfig.eval_every` names, else at each epoch end, and at
the run's end. Epochs shorter than the log interval (a full-batch run's one-step epochs) are
evaluated at each log point instead, at most once a log interval, as are data without a length
(no epoch ends).

Each evaluation step is a log point too (the loss is read there as well), so an epoch that ends
between two log points still gets its evaluation at its end. The steps are whole numbers worked out
from the step count: the loop asks for the next one when it starts a stretch of steps, never per step.
"""

from __future__ import annotations


class EvalPoints:
    """The steps at which a run evaluates.

    eval_every: steps between evaluations (None: epoch ends). batches_per_epoch: the training data's
    batches per epoch on this process (None: unknown). accumulate: batches per optimizer step.
    total_steps: the run's last step (always evaluated). log_every: the log interval (the cadence
    for data without a length). has_eval: False: no evaluation ever.
    """

    def __init__(self, eval_every: int | None, batches_per_epoch: int | None, accumulate: int, total_steps: int,
                 log_every: int, has_eval: bool = True):
        self.every, self.batches, self.accumulate = eval_every, batches_per_epoch, accumulate
        self.total_steps, self.log_every, self.has_eval = total_steps, log_every, has_eval
        # epoch ends when an epoch is at least a log interval; else (or without a length) log points
        self.at_epoch_ends = batches_per_epoch is not None and batches_per_epoch / accumulate >= log_every
        self.needed_by: str | None = None  # what needs an evaluation at every epoch end (`each_epoch`)

    def each_epoch(self, why: str) -> None:
        """Evaluate at every epoch end however short (`why`: what needs it, e.g. a scheduler stepping on
        an evaluation metric); unless eval_every was given, which stays as asked."""
        if self.every is None and self.batches is not None and not self.at_epoch_ends:
            self.at_epoch_ends, self.needed_by = True, why

    def _epoch_end_after(self, step: int) -> int:
        """The first step after `step` whose batches finish an epoch: ceil(k * batches / accumulate)."""
        n, acc = self.batches or 1, self.accumulate
        k = step * acc // n + 1
        return -(-k * n // acc)

    def next_after(self, step: int) -> int:
        """The next step after `step` at which the run evaluates (past the run's end: none before it)."""
        if not self.has_eval:
            return self.total_steps + 1
        if self.every is not None:
            due = (step // self.every + 1) * self.every
        elif self.at_epoch_ends:
            due = self._epoch_end_after(step)
        else:
            due = (step // self.log_every + 1) * self.log_every
        return min(due, max(self.total_steps, step + 1))

    def due(self, step: int) -> bool:
        """Whether the run evaluates after `step` (host arithmetic only)."""
        if not self.has_eval or step < 1:
            return False
        return step >= self.total_steps or self.next_after(step - 1) == step

    def describe(self) -> tuple[str, str]:
        """(when, why) for the run log and the summary's decisions."""
        if not self.has_eval:
            return "none", "no eval data"
        if self.every is not None:
            return f"every {self.every} steps and at the run's end", f"TrainConfig.eval_every={self.every}"
        if self.at_epoch_ends:
            per = (self.batches or 1) / self.accumulate
            return (f"at each epoch end, every {per:.4g} steps, and at the run's end",
                    self.needed_by or "the default (eval_every unset) for data with a length")
        if self.batches is not None:
            per = self.batches / self.accumulate
            return (f"at every log point (every {self.log_every} steps) and at the run's end",
                    f"the default (eval_every unset): at each epoch end, at most once a log interval; an epoch "
                    f"({per:.4g} steps) is shorter than log_every")
        return (f"at every log point (every {self.log_every} steps) and at the run's end",
                "the default (eval_every unset) for data without a length: no epoch ends to evaluate at; "
                "set eval_every to evaluate less often")
