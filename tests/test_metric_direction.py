"""One rule for a metric's direction (gputrain/metric_direction.py), used by the summary, report.html,
EarlyStopping and the best checkpoint: stated, a torchmetrics metric's own, gputrain's own, the name,
else higher; the summary says where it guessed."""

import json

import pytest
import torch
from helpers import data, mlp
from torch import nn

from gputrain import EMA, EarlyStopping, TrainConfig, fit
from gputrain.errors import ConfigError
from gputrain.checkpoint.store import CheckpointStore
from gputrain.metric_direction import Direction, metric_direction, metric_figures, says_lower_is_better
from gputrain.report.summary import summary_rows


class _Metric:
    """A torchmetrics-like metric: only `higher_is_better` matters to the rule."""

    def __init__(self, higher_is_better):
        self.higher_is_better = higher_is_better


@pytest.mark.parametrize("key, mode, by", [
    ("eval_loss", "min", "built-in"), ("eval_ema_loss", "min", "built-in"), ("loss", "min", "built-in"),
    ("eval_accuracy", "max", "built-in"), ("eval_ema_accuracy", "max", "built-in"),
    ("eval_mse", "min", "name"), ("eval_ema_mae", "min", "name"), ("eval_perplexity", "min", "name"),
    ("eval_ppl", "min", "name"), ("eval_wer", "min", "name"), ("eval_meanSquaredError", "min", "name"),
    ("eval_valloss", "min", "name"), ("eval_top1_err", "min", "name"), ("eval_kl_divergence", "min", "name"),
    ("eval_f1", "max", "default"), ("eval_margin_mean", "max", "default"), ("eval_bleu", "max", "default"),
])
def test_the_name_rule(key, mode, by):
    assert metric_direction(key) == Direction(mode, by)


def test_a_metric_says_its_own_direction_and_a_stated_one_wins():
    metrics = {"quality": _Metric(False), "err_rate": _Metric(True), "plain": object()}
    assert metric_direction("eval_quality", metrics=metrics) == Direction("min", "metric")
    assert metric_direction("eval_ema_quality", metrics=metrics) == Direction("min", "metric")  # its EMA twin
    assert metric_direction("eval_err_rate", metrics=metrics) == Direction("max", "metric")  # over the name
    assert metric_direction("eval_plain", metrics=metrics) == Direction("max", "default")
    stated = {"eval_quality": "max", "eval_margin": "min"}
    assert metric_direction("eval_quality", stated, metrics) == Direction("max", "stated")
    assert metric_direction("eval_ema_margin", stated) == Direction("min", "stated")
    with pytest.raises(ValueError, match="'min' or 'max'"):
        metric_direction("eval_margin", {"eval_margin": "lower"})
    with pytest.raises(ConfigError, match="metric_modes must be a dict"):
        TrainConfig(metric_modes={"eval_margin": "lowest"})
    assert says_lower_is_better("MeanAbsoluteError") and not says_lower_is_better("eval_recall")


def test_the_figures_take_the_best_by_the_rule_and_skip_non_finite_values():
    records = [{"step": 1, "loss": 1.0, "eval_ema_loss": 0.35, "eval_accuracy": 0.5, "eval_mse": 2.0},
               {"step": 2, "loss": 0.5, "eval_ema_loss": float("nan"), "eval_accuracy": 0.9},
               {"step": 3, "loss": 0.2, "eval_ema_loss": 0.03, "eval_accuracy": 0.8, "eval_mse": 1.0}]
    f = metric_figures(records)
    assert (f["final_eval_ema_loss"], f["best_eval_ema_loss"]) == (0.03, 0.03)
    assert (f["final_eval_accuracy"], f["best_eval_accuracy"]) == (0.8, 0.9)
    assert f["best_eval_mse"] == 1.0 and f["evaluations"] == 3 and f["final_loss"] == 0.2
    assert f["metric_directions"]["eval_mse"] == {"mode": "min", "by": "name"}


def _margin(outputs, batch):
    top2 = outputs.topk(2, dim=1).values
    return {"margin": (top2[:, 0] - top2[:, 1]).mean(), "spread": outputs.std()}


def test_a_run_reports_its_lowest_ema_loss_as_best_and_says_where_it_guessed(tmp_path):
    """The issue's digits-cnn --ema run in small: the EMA loss falls over the run, so its best is its
    last and lowest value, not its first (the old rule took the maximum of every metric but eval_loss)."""
    x, y = data(192)
    h = fit(mlp(), (x, y), loss_fn=nn.CrossEntropyLoss(), eval_data=(x[:64], y[:64]), callbacks=[EMA(0.9)],
            metrics={"margin": _margin}, config=TrainConfig(device="cpu", batch_size=32, epochs=4, lr=1e-2,
                                                            log_every=3, run_dir=str(tmp_path / "run")))
    s = h.summary
    ema = [r["eval_ema_loss"] for r in h.records if "eval_ema_loss" in r]
    assert len(ema) == 4 and ema[-1] < ema[0]
    assert s["best_eval_ema_loss"] == min(ema) and s["best_eval_loss"] == min(r["eval_loss"] for r in h.records
                                                                                if "eval_loss" in r)
    rows = dict(summary_rows(s))
    assert rows["eval ema loss (final / lowest)"] == f"{s['final_eval_ema_loss']:.4f} / {min(ema):.4f}"
    assert "eval accuracy (final / highest)" in rows
    assert "eval margin spread (final / highest, guessed: say otherwise with metric_modes)" in rows
    assert s["metric_directions"]["eval_ema_margin"] == {"mode": "max", "by": "default"}
    html = (tmp_path / "run" / "report.html").read_text()
    assert f"{s['final_eval_ema_loss']:.4f} / {min(ema):.4f}" in html and "eval ema loss (final / lowest)" in html


def test_metric_modes_state_a_direction_for_the_summary_early_stopping_and_the_best_checkpoint(tmp_path):
    x, y = data(192)
    stop = EarlyStopping("eval_margin_spread", patience=100)
    cfg = TrainConfig(device="cpu", batch_size=32, epochs=3, lr=1e-2, log_every=6, run_dir=str(tmp_path / "run"),
                      metric_modes={"eval_margin_spread": "min"}, best_metric="eval_margin_spread",
                      checkpoint_every=6, keep_last=1)
    h = fit(mlp(), (x, y), loss_fn=nn.CrossEntropyLoss(), eval_data=(x[:64], y[:64]), callbacks=[stop],
            metrics={"margin": _margin}, config=cfg)
    spreads = {r["step"]: r["eval_margin_spread"] for r in h.records if "eval_margin_spread" in r}
    assert list(spreads) == [6, 12, 18] and min(spreads.values()) != spreads[18]  # the best is not the last
    assert h.summary["best_eval_margin_spread"] == min(spreads.values())
    assert stop.mode == "min" and stop.best == min(spreads.values())
    best = CheckpointStore(tmp_path / "run").best_record()
    assert best is not None and best["mode"] == "min" and best["value"] == min(spreads.values())
    assert "eval margin spread (final / lowest)" in dict(summary_rows(h.summary))


def test_a_torchmetrics_metric_decides_by_its_higher_is_better(tmp_path):
    from torchmetrics.classification import MulticlassCalibrationError

    x, y = data(192)
    stop = EarlyStopping("eval_calib", patience=100)  # nothing in the name says which way: the metric does
    h = fit(mlp(), (x, y), loss_fn=nn.CrossEntropyLoss(), eval_data=(x[:64], y[:64]), callbacks=[stop],
            metrics={"calib": MulticlassCalibrationError(num_classes=3)},
            config=TrainConfig(device="cpu", batch_size=32, epochs=3, lr=1e-2, log_every=6, run_dir=str(tmp_path / "run"),
                               best_metric="eval_calib", checkpoint_every=6))
    values = [r["eval_calib"] for r in h.records if "eval_calib" in r]
    assert len(values) == 3 and len(set(values)) == 3
    assert h.summary["best_eval_calib"] == min(values) and stop.mode == "min"
    assert h.summary["metric_directions"]["eval_calib"] == {"mode": "min", "by": "metric"}
    record = json.loads((tmp_path / "run" / "checkpoints" / "index.json").read_text())["best"]
    assert record["mode"] == "min" and record["value"] == min(values)


def test_the_checkpoint_store_keeps_the_lowest_loss_by_default(tmp_path):
    store = CheckpointStore(tmp_path, keep_last=1, best_metric="eval_loss")  # best_mode "auto"
    for step, loss in enumerate([0.9, 0.2, 0.5, 0.7], start=1):
        store.save({"w": torch.zeros(1)}, step, {"eval_loss": loss})
    assert store.best_record()["value"] == 0.2 and store.best_mode == "min"
    assert CheckpointStore(tmp_path, best_metric="eval_f1").best_mode == "max"


def test_early_stopping_auto_follows_the_rule_where_it_used_a_suffix():
    assert EarlyStopping("eval_mse").mode == "min"  # the old rule: "max" (the name does not end in "loss")
    assert EarlyStopping("eval_perplexity").mode == "min" and EarlyStopping("eval_f1").mode == "max"
    assert EarlyStopping("eval_f1", mode="min").mode == "min"


def test_an_old_summary_shown_again_gets_its_best_values_by_the_rule(tmp_path):
    """report.html of a run written before the rule (best = max of every metric but eval_loss)."""
    from gputrain.report.html import render_report

    records = [{"step": 1, "loss": 1.0, "eval_loss": 0.5, "eval_ema_loss": 0.35},
               {"step": 2, "loss": 0.5, "eval_loss": 0.3, "eval_ema_loss": 0.03}]
    old = {"workload": "w", "final_eval_ema_loss": 0.03, "best_eval_ema_loss": 0.35, "final_eval_loss": 0.3,
           "best_eval_loss": 0.3}
    html = render_report(records, old)
    assert "eval ema loss (final / lowest)" in html and "0.0300 / 0.0300" in html and "0.3500" not in html
