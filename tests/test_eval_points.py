"""Evaluation when the docs say: at each epoch end and at the run's end unless eval_every says
otherwise (each evaluation a log point too), at every log point for data without a length, and the
run log and the summary say which."""

import logging

from helpers import data, mlp
from torch import nn

from gputrain import TrainConfig, fit
from gputrain.train.evaluation.points import EvalPoints


def _evaluated(h):
    return [r["step"] for r in h.records if "eval_loss" in r]


def _fit(x, y, **cfg):
    return fit(mlp(), (x, y), loss_fn=nn.CrossEntropyLoss(), eval_data=(x[:32], y[:32]),
               config=TrainConfig(device="cpu", **cfg))


def test_epoch_ends_are_worked_out_from_the_step_count():
    every_6 = EvalPoints(None, batches_per_epoch=6, accumulate=1, total_steps=14, log_every=4)
    assert [s for s in range(1, 15) if every_6.due(s)] == [6, 12, 14]  # the run's end too, not an epoch end
    assert every_6.next_after(0) == 6 and every_6.next_after(6) == 12 and every_6.next_after(12) == 14
    # 5 batches an epoch, 2 a step: epoch 1 ends in step 3 (batches 4 and 5), epoch 2 in step 5.
    accumulated = EvalPoints(None, batches_per_epoch=5, accumulate=2, total_steps=5, log_every=1)
    assert [s for s in range(1, 6) if accumulated.due(s)] == [3, 5]
    by_steps = EvalPoints(7, batches_per_epoch=6, accumulate=1, total_steps=20, log_every=4)
    assert [s for s in range(1, 21) if by_steps.due(s)] == [7, 14, 20]
    no_length = EvalPoints(None, batches_per_epoch=None, accumulate=1, total_steps=10, log_every=4)
    assert [s for s in range(1, 11) if no_length.due(s)] == [4, 8, 10]
    # Epochs shorter than the log interval (full batch: one step each): at each log point, not every step.
    short = EvalPoints(None, batches_per_epoch=1, accumulate=1, total_steps=250, log_every=100)
    assert [s for s in range(1, 251) if short.due(s)] == [100, 200, 250] and short.next_after(0) == 100
    assert "an epoch (1 steps) is shorter than log_every" in short.describe()[1]
    none = EvalPoints(None, 6, 1, 12, 4, has_eval=False)
    assert not any(none.due(s) for s in range(1, 13)) and none.next_after(0) == 13
    assert every_6.describe()[0] == "at each epoch end, every 6 steps, and at the run's end"
    assert "without a length" in no_length.describe()[1] and by_steps.describe()[1] == "TrainConfig.eval_every=7"


def test_a_two_epoch_run_with_log_points_inside_an_epoch_evaluates_twice(caplog):
    x, y = data(96)  # 6 batches of 16 an epoch
    with caplog.at_level(logging.INFO, logger="gputrain"):
        h = _fit(x, y, batch_size=16, epochs=2, log_every=4)
    assert _evaluated(h) == [6, 12]  # the epoch ends (the second is the run's end)
    assert [r["step"] for r in h.records] == [4, 6, 8, 12]  # an epoch end is a log point too
    assert h.summary["evaluations"] == 2
    assert h.summary["evaluation"] == "at each epoch end, every 6 steps, and at the run's end"
    assert "evaluation: at each epoch end, every 6 steps, and at the run's end" in caplog.text
    assert {"name": "evaluation", "value": "at each epoch end, every 6 steps, and at the run's end",
            "reason": "the default (eval_every unset) for data with a length"} in h.summary["decisions"]


def test_vit_like_log_points_twice_an_epoch_evaluate_once_an_epoch():
    """timm's ViT case: 22 steps an epoch, log_every=11: one evaluation an epoch, not two."""
    x, y = data(88)
    h = _fit(x, y, batch_size=4, epochs=2, log_every=11)
    assert _evaluated(h) == [22, 44] and [r["step"] for r in h.records] == [11, 22, 33, 44]


def test_a_run_that_ends_between_epoch_ends_evaluates_once_more_at_its_end():
    x, y = data(96)
    h = _fit(x, y, batch_size=16, steps=14, log_every=4)
    assert _evaluated(h) == [6, 12, 14] and h.summary["evaluations"] == 3


def test_eval_every_makes_its_steps_log_points():
    x, y = data(96)
    h = _fit(x, y, batch_size=16, steps=12, log_every=4, eval_every=5)
    assert _evaluated(h) == [5, 10, 12] and [r["step"] for r in h.records] == [4, 5, 8, 10, 12]


class _Batches:
    """An iterable of batches without a length: no epoch ends to evaluate at."""

    def __init__(self, x, y):
        self.x, self.y = x, y

    def __iter__(self):
        for i in range(0, len(self.x), 16):
            yield self.x[i:i + 16], self.y[i:i + 16]


def test_a_full_batch_run_evaluates_at_its_log_points_not_every_step():
    x, y = data(96)
    h = _fit(x, y, batch_size=96, epochs=30, log_every=10)  # 30 one-step epochs
    assert _evaluated(h) == [10, 20, 30] and [r["step"] for r in h.records] == [10, 20, 30]


def test_data_without_a_length_evaluate_at_every_log_point_and_say_so():
    x, y = data(96)
    h = fit(mlp(), _Batches(x, y), loss_fn=nn.CrossEntropyLoss(), eval_data=(x[:32], y[:32]),
            config=TrainConfig(device="cpu", steps=10, log_every=4))
    assert _evaluated(h) == [4, 8, 10]
    assert h.summary["evaluation"] == "at every log point (every 4 steps) and at the run's end"
