"""History files, metrics logs, curves, the summary table and the progress bar."""

import csv
import io
import json

import pytest
from rich.console import Console

from gputrain.errors import GputrainError
from gputrain.history import History
from gputrain.reporting import MetricsLog, TrainProgress, format_bytes, plot_history, render_summary

RECORDS = [{"step": 10, "epoch": 0.5, "loss": 1.2, "lr": 1e-3, "samples_per_s": 900.0, "peak_memory_bytes": None,
            "wall_time_s": 1.0},
           {"step": 20, "epoch": 1.0, "loss": 0.8, "lr": 1e-3, "samples_per_s": 1000.0, "peak_memory_bytes": None,
            "wall_time_s": 2.0, "eval_loss": 0.9, "eval_accuracy": 0.7, "extra": 3}]


def test_history_round_trip_and_queries(tmp_path):
    h = History(records=[dict(r) for r in RECORDS], config={"lr": 1e-3}, summary={"device": "cpu"})
    path = h.save(tmp_path / "h.json")
    back = History.load(path)
    assert back.records == h.records and back.summary == {"device": "cpu"}
    assert back.final("loss") == 0.8 and back.best("loss", "min") == 0.8 and back.best("eval_accuracy") == 0.7
    assert back.column("step") == [10, 20] and back.final("nothing") is None
    (tmp_path / "x.json").write_text(json.dumps({"a": 1}))
    with pytest.raises(GputrainError, match="not a gputrain history"):
        History.load(tmp_path / "x.json")


def test_metrics_log_writes_jsonl_and_rectangular_csv(tmp_path):
    with MetricsLog(tmp_path) as log:
        for r in RECORDS:
            log.append(r)
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line)["step"] for line in lines] == [10, 20]
    assert json.loads(lines[1])["extra"] == 3
    rows = list(csv.DictReader(open(tmp_path / "metrics.csv")))
    assert [r["step"] for r in rows] == ["10", "20"]
    assert rows[0]["eval_accuracy"] == "" and rows[1]["eval_accuracy"] == "0.7"
    with MetricsLog(tmp_path) as log:  # a resumed run appends without a second header
        log.append(RECORDS[0])
    assert len(list(csv.DictReader(open(tmp_path / "metrics.csv")))) == 3


def test_plot_is_a_png(tmp_path):
    path = plot_history(History(records=RECORDS), tmp_path / "c.png")
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 5000
    assert plot_history(History(), tmp_path / "none.png") is None


def test_summary_table_shows_the_figures():
    console = Console(record=True, width=120)
    render_summary({"device": "cpu (test)", "precision": "fp32", "precision_reason": "auto", "time_s": 3.5,
                    "samples_per_s": 12345.0, "final_eval_accuracy": 0.9412, "best_eval_accuracy": 0.95,
                    "final_eval_loss": 0.2, "best_eval_loss": 0.19, "peak_memory_bytes": 3 * 2**30,
                    "effective_batch": 256, "batch_size": 64, "accumulate": 2, "world_size": 2}, console)
    text = console.export_text()
    for needle in ("cpu (test)", "3.50 s", "12,345", "0.9412", "3.0 GiB", "256 = 64 per step x 2 accumulated x 2"):
        assert needle in text, needle


def test_progress_disabled_is_a_no_op_and_enabled_renders():
    with TrainProgress(False, 10) as p:
        p.update(5, loss=1.0)
        assert p._progress is None
    out = io.StringIO()
    with TrainProgress(True, 10, "run", console=Console(file=out, force_terminal=True, width=120)) as p:
        p.update(10, epoch=1.0, loss=0.25, samples_per_s=1000.0, memory_bytes=2**20)
    assert "0.2500" in out.getvalue() and "10/10" in out.getvalue()


def test_format_bytes():
    assert format_bytes(512) == "512 B" and format_bytes(1536) == "1.5 KiB" and format_bytes(None) == "-"
