"""Every figure a run writes agrees with its history: the summary, the terminal table, report.html,
metrics.csv, metrics.jsonl and the TensorBoard scalars, recomputed here from history.json's records
for a run with several metrics (the built-in loss and accuracy, EMA twins, two torchmetrics metrics
whose directions differ, a callable with two keys)."""

import csv
import html
import json
import math
import statistics

import pytest
import torch
from helpers import data, mlp
from torch import nn

from gputrain import EMA, TrainConfig, fit
from gputrain.report.summary import summary_rows

# Which way each key improves, written out here (not asked of gputrain): its own loss and accuracy,
# the torchmetrics metrics' own higher_is_better, the callable's keys by name (no cue: higher).
LOWER = {"eval_loss", "eval_ema_loss", "eval_calib", "eval_ema_calib", "eval_margin_err", "eval_ema_margin_err"}
HIGHER = {"eval_accuracy", "eval_ema_accuracy", "eval_acc", "eval_ema_acc", "eval_margin_gap", "eval_ema_margin_gap"}


def _margin(outputs, batch):
    top2 = outputs.topk(2, dim=1).values
    wrong = (outputs.argmax(1) != batch[1]).float().mean()
    return {"gap": (top2[:, 0] - top2[:, 1]).mean(), "err": wrong}


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    pytest.importorskip("torchmetrics", reason="torchmetrics is not installed")
    from torchmetrics.classification import MulticlassAccuracy, MulticlassCalibrationError

    run_dir = tmp_path_factory.mktemp("agree") / "run"
    x, y = data(288)
    torch.manual_seed(0)  # 224 training samples: 7 steps of 32 an epoch, log points every 5 steps
    h = fit(mlp(), (x[:224], y[:224]), loss_fn=nn.CrossEntropyLoss(), eval_data=(x[224:], y[224:]),
            callbacks=[EMA(0.9)], metrics={"acc": MulticlassAccuracy(num_classes=3, average="micro"),
                                           "calib": MulticlassCalibrationError(num_classes=3), "margin": _margin},
            config=TrainConfig(device="cpu", batch_size=32, epochs=3, lr=1e-2, log_every=5, run_dir=str(run_dir),
                               loggers=("csv", "tensorboard")))
    saved = json.loads((run_dir / "history.json").read_text())
    return run_dir, saved["records"], saved["summary"], h


def _numbers(record):
    return {k: float(v) for k, v in record.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}


def test_the_summary_recomputed_from_the_records(run):
    _, records, s, h = run
    assert s == h.summary and records == h.records
    eval_keys = sorted({k for r in records for k in r if k.startswith("eval_")})
    assert set(eval_keys) == LOWER | HIGHER
    for key in eval_keys:
        values = [r[key] for r in records if key in r]
        assert s[f"final_{key}"] == values[-1], key
        assert s[f"best_{key}"] == (min(values) if key in LOWER else max(values)), key
    assert s["steps"] == records[-1]["step"] == s["total_steps"] == 21  # 3 epochs of 7 steps
    assert [r["step"] for r in records] == [5, 7, 10, 14, 15, 20, 21]  # log points and epoch ends
    evaluated = [r["step"] for r in records if "eval_loss" in r]
    assert evaluated == [7, 14, 21] and s["evaluations"] == 3  # at each epoch end
    assert s["final_loss"] == records[-1]["loss"]
    rates = [r["samples_per_s"] for r in records]
    assert s["samples_per_s_how"] == "median of the log points' samples/s after the first"
    assert len(rates) == 7 and s["samples_per_s"] == statistics.median(rates[1:])  # the mean of the middle two
    assert s["samples"] == 21 * 32


def test_the_terminal_table_and_report_html_show_the_summarys_figures(run):
    run_dir, records, s, _ = run
    rows = dict(summary_rows(s))
    page = (run_dir / "report.html").read_text()
    for key in LOWER | HIGHER:
        label = key.replace("_", " ") + (" (final / lowest" if key in LOWER else " (final / highest")
        (row,) = [k for k in rows if k.startswith(label)]
        assert rows[row] == f"{s[f'final_{key}']:.4f} / {s[f'best_{key}']:.4f}", key
        assert f"<td class='k'>{html.escape(row)}</td><td>{rows[row]}</td>" in page, key
        # the headline card: the final value
        assert f"<div class='l'>final {key.replace('_', ' ')}</div><div class='v'>{s[f'final_{key}']:.4g}</div>" in page
    assert rows["steps"] == "21 of 21" and rows["evaluations"].startswith("3 (at each epoch end")
    assert rows["samples/s"] == f"{s['samples_per_s']:,.0f} (median of the log points' samples/s after the first)"
    for label, value in summary_rows(s):  # every row of the terminal table is in the page
        assert f"<td class='k'>{html.escape(label)}</td><td>{html.escape(value)}</td>" in page, label


def test_metrics_csv_and_jsonl_hold_the_records(run):
    run_dir, records, _, _ = run
    with open(run_dir / "metrics.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == len(records)
    for row, record in zip(rows, records):
        assert {k: float(v) for k, v in row.items() if v != ""} == _numbers(record)
    jsonl = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [_numbers(r) for r in jsonl] == [_numbers(r) for r in records]


def test_tensorboard_scalars_are_the_records(run):
    pytest.importorskip("tensorboard", reason="tensorboard is not installed")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from gputrain.report.tensorboard import tag_for

    run_dir, records, _, _ = run
    ea = EventAccumulator(str(run_dir), size_guidance={"scalars": 0})
    ea.Reload()
    keys = sorted({k for r in records for k in _numbers(r)} - {"step"})
    assert sorted(ea.Tags()["scalars"]) == sorted(tag_for(k) for k in keys)
    for key in keys:
        expected = [(r["step"], float(r[key])) for r in records if key in _numbers(r)]
        got = [(e.step, e.value) for e in ea.Scalars(tag_for(key))]
        assert [s for s, _ in got] == [s for s, _ in expected], key
        assert all(math.isclose(g, e, rel_tol=1e-6, abs_tol=1e-6) for (_, g), (_, e) in zip(got, expected)), key
