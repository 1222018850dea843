"""History files, metrics logs, curves, the summary table and the progress bar."""

import csv
import io
import json

import numpy as np
import pytest
from helpers import png_size
from rich.console import Console

from gputrain.errors import GputrainError
from gputrain.io.history import History
from gputrain.report.format import format_bytes, format_duration
from gputrain.report.metrics_log import CSV_COLUMNS, MetricsLog
from gputrain.report.plots import plot_history
from gputrain.report.progress import TrainProgress
from gputrain.report.summary import render_summary, summary_table

RECORDS = [{"step": 10, "epoch": 0.5, "loss": 1.2, "lr": 1e-3, "samples_per_s": 900.0, "peak_memory_bytes": None,
            "wall_time_s": 1.0},
           {"step": 20, "epoch": 1.0, "loss": 0.8, "lr": 1e-3, "samples_per_s": 1000.0, "peak_memory_bytes": None,
            "wall_time_s": 2.0, "eval_loss": 0.9, "eval_accuracy": 0.7},
           {"step": 30, "epoch": 1.5, "loss": 0.6, "lr": 5e-4, "samples_per_s": 1100.0, "peak_memory_bytes": None,
            "wall_time_s": 3.0, "eval_loss": float("nan"), "eval_accuracy": 0.65, "eval_top5": 0.99}]


def _csv(path):
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


# ---------------------------------------------------------------- History

def test_history_round_trip_and_queries(tmp_path):
    h = History(config={"lr": 1e-3}, summary={"device": "cpu"})
    for r in RECORDS:
        h.add(r)
    h.add({"step": 40, "loss": np.float32(0.5)})  # a numpy number is written as a number
    path = h.save(tmp_path / "h.json")
    back = History.load(path)
    assert back.records[:2] == RECORDS[:2] and np.isnan(back.records[2]["eval_loss"])
    assert back.records[3]["loss"] == 0.5 and back.summary == {"device": "cpu"} and back.config == {"lr": 1e-3}
    assert back.final("loss") == 0.5 and back.final("eval_accuracy") == 0.65 and back.final("nothing") is None
    assert back.best("eval_accuracy") == 0.7 and back.best("loss", mode="min") == 0.5
    assert back.best("eval_loss", mode="min") == 0.9  # NaN is skipped, not "best"
    # mode "auto" (the default): the rule's direction for the name, or what the run's summary used
    assert back.best("loss") == 0.5 and back.best("eval_loss") == 0.9 and back.best("eval_accuracy") == 0.7
    back.summary["metric_directions"] = {"eval_accuracy": {"mode": "min", "by": "stated"}}
    assert back.best("eval_accuracy") == min(r["eval_accuracy"] for r in RECORDS if "eval_accuracy" in r)
    assert back.column("step") == [10, 20, 30, 40] and back.column("eval_top5") == [None, None, 0.99, None]
    assert History.from_dict(back.to_dict()).records[1] == back.records[1]
    with pytest.raises(ValueError, match="'auto', 'max' or 'min'"):
        back.best("loss", mode="lowest")
    assert [p.name for p in tmp_path.iterdir()] == ["h.json"]


def test_history_refuses_non_dict_records_and_writes_odd_values_as_json(tmp_path):
    """add() takes dicts only; best() of a key never recorded is None; values json cannot write
    (0-d tensors, sets, paths, a tensor with several values) are saved as numbers or text."""
    import pathlib

    import torch

    h = History()
    with pytest.raises(TypeError, match="a history record is a dict, got list"):
        h.add([("step", 1)])  # type: ignore[arg-type]
    assert h.best("eval_accuracy") is None and h.best("loss", mode="min") is None
    h.add({"step": 1, "loss": torch.tensor(0.25), "tags": {"b", "a"}, "dir": pathlib.Path("runs/x"),
           "vec": torch.tensor([1.0, 2.0])})
    back = History.load(h.save(tmp_path / "h.json")).records[0]
    assert back["loss"] == 0.25 and back["tags"] == ["a", "b"] and back["dir"] == "runs/x"
    assert back["vec"] == str(torch.tensor([1.0, 2.0]))  # .item() of 2 values fails: written as text


def test_loading_something_else_is_explained(tmp_path):
    (tmp_path / "x.json").write_text(json.dumps({"a": 1}))
    with pytest.raises(GputrainError, match="x.json: not a gputrain history"):
        History.load(tmp_path / "x.json")
    (tmp_path / "y.json").write_text("{not json")
    with pytest.raises(GputrainError, match="y.json: cannot read a history"):
        History.load(tmp_path / "y.json")
    with pytest.raises(GputrainError, match="z.json: no such file"):
        History.load(tmp_path / "z.json")
    with pytest.raises(GputrainError, match="list of objects"):
        History.from_dict({"kind": "gputrain-history", "records": [1, 2]})


# ---------------------------------------------------------------- MetricsLog

def test_metrics_log_writes_jsonl_and_csv(tmp_path):
    with MetricsLog(tmp_path) as log:
        for r in RECORDS[:2]:
            log.append(r)
        rows = _csv(tmp_path / "metrics.csv")  # flushed at each log point, readable while running
        assert [r["step"] for r in rows] == ["10", "20"]
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line) for line in lines] == RECORDS[:2]
    with open(tmp_path / "metrics.csv", newline="") as f:
        assert next(csv.reader(f)) == CSV_COLUMNS
    rows = _csv(tmp_path / "metrics.csv")
    assert rows[0]["eval_accuracy"] == "" and rows[1]["eval_accuracy"] == "0.7" and rows[1]["loss"] == "0.8"
    assert rows[0]["peak_memory_bytes"] == ""


def test_a_new_key_widens_the_csv_and_a_resume_appends(tmp_path):
    with MetricsLog(tmp_path) as log:
        for r in RECORDS:
            log.append(r)
    with open(tmp_path / "metrics.csv", newline="") as f:
        table = list(csv.reader(f))
    assert table[0] == CSV_COLUMNS + ["eval_top5"]
    assert all(len(row) == len(table[0]) for row in table)  # rectangular
    rows = _csv(tmp_path / "metrics.csv")
    assert [r["eval_top5"] for r in rows] == ["", "", "0.99"] and rows[1]["eval_loss"] == "0.9"
    with MetricsLog(tmp_path) as log:  # a resumed run keeps the widened header and appends
        log.append({"step": 40, "loss": 0.5, "eval_top5": 1.0})
    rows = _csv(tmp_path / "metrics.csv")
    assert [r["step"] for r in rows] == ["10", "20", "30", "40"] and rows[3]["eval_top5"] == "1.0"
    assert len((tmp_path / "metrics.jsonl").read_text().splitlines()) == 4
    assert sorted(p.name for p in tmp_path.iterdir()) == ["metrics.csv", "metrics.jsonl"]


def test_truncate_after_step_drops_what_a_crashed_run_logged_after_its_checkpoint(tmp_path):
    with MetricsLog(tmp_path) as log:
        for r in RECORDS:
            log.append(r)
    with open(tmp_path / "metrics.jsonl", "a") as f:
        f.write('{"step": 40, "lo')  # the crash cut a line short
    with MetricsLog(tmp_path, truncate_after_step=20) as log:  # resumed from the step-20 checkpoint
        log.append({"step": 30, "loss": 0.61})
    assert [json.loads(line)["step"] for line in (tmp_path / "metrics.jsonl").read_text().splitlines()] == [10, 20, 30]
    rows = _csv(tmp_path / "metrics.csv")
    assert [(r["step"], r["loss"]) for r in rows] == [("10", "1.2"), ("20", "0.8"), ("30", "0.61")]
    with MetricsLog(tmp_path, truncate_after_step=0) as log:  # a fresh run in the same folder
        log.append(RECORDS[0])
    assert len(_csv(tmp_path / "metrics.csv")) == 1
    assert len((tmp_path / "metrics.jsonl").read_text().splitlines()) == 1


# ---------------------------------------------------------------- plot

def test_plot_is_a_png_with_an_accuracy_panel_when_there_is_accuracy(tmp_path):
    path = plot_history(History(records=RECORDS, summary={"device": "cpu", "precision": "fp32"}), tmp_path / "c.png")
    assert path.stat().st_size > 5000
    width, height = png_size(path.read_bytes())
    assert (width, height) == (1000, 400)  # loss and accuracy side by side
    loss_only = [{k: v for k, v in r.items() if not (k.startswith("eval_") and k != "eval_loss")} for r in RECORDS]
    assert png_size(plot_history(History(records=loss_only), tmp_path / "l.png").read_bytes()) == (600, 400)
    assert plot_history(History(), tmp_path / "none.png") is None
    assert not (tmp_path / "none.png").exists()


# ---------------------------------------------------------------- summary table

SUMMARY = {"device": "cpu (test)", "precision": "fp32", "precision_reason": "auto: the CPU has no fast bf16",
           "time_s": 3.5, "samples_per_s": 12345.0, "final_loss": 0.25, "final_eval_accuracy": 0.9412,
           "best_eval_accuracy": 0.95, "final_eval_loss": 0.2, "best_eval_loss": 0.19,
           "peak_memory_bytes": 3 * 2**30, "effective_batch": 256, "batch_size": 64, "accumulate": 2,
           "world_size": 2, "steps": 100, "total_steps": 100}


def test_summary_table_shows_the_figures():
    console = Console(record=True, width=160)
    render_summary(SUMMARY, console)
    text = console.export_text()
    for needle in ("cpu (test)", "fp32 (auto: the CPU has no fast bf16)", "3.50 s", "12,345", "0.2500",
                   "0.9412 / 0.9500", "0.2000 / 0.1900", "3.0 GiB", "256 = 64 per step x 2 accumulated x 2 processes",
                   "100 of 100"):
        assert needle in text, needle


def test_summary_table_leaves_out_what_it_does_not_have():
    console = Console(record=True, width=160)
    console.print(summary_table({"device": "cpu", "precision": "fp32", "effective_batch": 64, "batch_size": 64,
                                 "time_s": 125.0, "final_eval_top5": 0.99}))
    text = console.export_text()
    assert "fp32" in text and "()" not in text and "eval loss" not in text and "None" not in text
    assert "2 min 05 s" in text and "eval top5" in text and "0.9900" in text
    assert "not measured" in text


# ---------------------------------------------------------------- progress bar

def test_progress_disabled_is_a_no_op(monkeypatch, capsys):
    import rich.progress

    built = []
    monkeypatch.setattr(rich.progress, "Progress", lambda *a, **k: built.append(a) or None)
    with TrainProgress(False, 10) as p:
        p.update(5, epoch=0.5, loss=1.0, samples_per_s=10.0, memory_bytes=2**20)
    assert built == [] and p._progress is None  # no rich object was made
    out = capsys.readouterr()
    assert out.out == "" and out.err == ""  # and nothing was drawn


def test_progress_enabled_renders_to_a_terminal():
    out = io.StringIO()
    with TrainProgress(True, 10, "cpu fp32", console=Console(file=out, force_terminal=True, width=160)) as p:
        p.update(4, epoch=0.4, loss=0.5, samples_per_s=900.0)
        p.update(10, epoch=1.0, loss=0.25, samples_per_s=1234.0, memory_bytes=2**20)
    text = out.getvalue()
    for needle in ("cpu fp32", "10/10", "epoch 1.00", "loss 0.2500", "1,234 samples/s", "mem 1.0 MiB"):
        assert needle in text, needle


def test_progress_auto(monkeypatch):
    class Terminal(io.StringIO):
        def isatty(self):
            return True

    monkeypatch.setattr("sys.stderr", io.StringIO())
    assert TrainProgress.auto(None) is False and TrainProgress.auto(True) is True
    monkeypatch.setattr("sys.stderr", Terminal())
    assert TrainProgress.auto(None) is True and TrainProgress.auto(False) is False


def test_formatting_helpers():
    assert format_bytes(512) == "512 B" and format_bytes(1536) == "1.5 KiB" and format_bytes(None) == "-"
    assert format_bytes(3 * 2**30) == "3.0 GiB"
    assert format_duration(3.5) == "3.50 s" and format_duration(125) == "2 min 05 s"
    assert format_duration(3725) == "1 h 02 min"


def test_curves_show_the_users_eval_metrics_too(tmp_path):
    recs = [{"step": s, "loss": 1.0 / s, "eval_loss": 1.2 / s, "eval_f1": 0.5 + s / 100} for s in (1, 2, 3)]
    two_panels = plot_history(History(records=recs), tmp_path / "f1.png")
    assert png_size(two_panels.read_bytes()) == (1000, 400)  # a second panel
