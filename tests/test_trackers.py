"""Experiment trackers behind one interface (report/trackers.py): MLflow and W&B read back through
their own libraries, several at once from the CLI, and a failing tracker that never stops training."""

import json
import struct
from pathlib import Path

import pytest
import torch
from torch import nn
from helpers import mlp

from gputrain import TrainConfig, fit
from gputrain.errors import ConfigError


def _data(n=64):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, 6, generator=g)
    return x, (x[:, 0] > 0).long()


def _fit(run_dir: Path, loggers, **changes):
    x, y = _data()
    cfg = TrainConfig(device="cpu", batch_size=16, steps=8, log_every=4, run_dir=str(run_dir), name="toy",
                      loggers=loggers, **changes)
    return fit(mlp(classes=2, hidden=8), (x, y), loss_fn=nn.CrossEntropyLoss(), eval_data=(x, y), config=cfg)


@pytest.fixture
def tracker_env(monkeypatch, tmp_path):
    """No tracker setting from the machine leaks in; W&B offline under tmp_path."""
    for var in ("MLFLOW_TRACKING_URI", "MLFLOW_EXPERIMENT_NAME", "WANDB_API_KEY", "WANDB_PROJECT", "WANDB_BASE_URL"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path / "wandb-home"))
    monkeypatch.setenv("WANDB_CONFIG_DIR", str(tmp_path / "wandb-config"))
    monkeypatch.setenv("WANDB_CACHE_DIR", str(tmp_path / "wandb-cache"))
    monkeypatch.setenv("WANDB_DATA_DIR", str(tmp_path / "wandb-data"))
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("NETRC", str(tmp_path / "no-netrc"))
    return tmp_path


def test_logger_names_are_checked():
    with pytest.raises(ConfigError, match="unknown logger 'mlfow'"):
        TrainConfig(loggers=("csv", "mlfow"))
    assert TrainConfig(loggers=["MLflow", "csv", "csv"]).loggers == ("mlflow", "csv")
    assert TrainConfig().loggers == ("csv", "tensorboard")


def test_no_tensorboard_is_the_loggers_without_it():
    """`fit --no-tensorboard`: a shorthand over the one switch (loggers), whichever gave them."""
    import warnings

    from gputrain.cli import build_parser
    from gputrain.commands.fit import build_config
    from gputrain.workloads import get_workload

    w = get_workload("iris-mlp")

    def loggers(*argv: str) -> tuple[str, ...]:
        return build_config(build_parser().parse_args(["fit", "iris-mlp", "--no-save", *argv]), w).loggers

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert loggers() == ("csv", "tensorboard")
        assert loggers("--no-tensorboard") == ("csv",)
        assert loggers("--logger", "tensorboard,mlflow", "--no-tensorboard") == ("mlflow",)
    assert not [w for w in caught if "tensorboard" in str(w.message)]


def test_mlflow_run_read_back_with_mlflows_client(tracker_env):
    pytest.importorskip("mlflow", reason="mlflow is not installed (pip install 'gputrain[track]')")
    pytest.importorskip("sqlalchemy", reason="sqlalchemy is not installed (MLflow's local store needs it)")
    from mlflow.tracking import MlflowClient

    run_dir = tracker_env / "run"
    history = _fit(run_dir, ("csv", "mlflow"), lr=0.003)
    client = MlflowClient(tracking_uri=f"sqlite:///{run_dir / 'mlflow.db'}")
    experiment = client.get_experiment_by_name("toy")
    assert experiment is not None
    (run,) = client.search_runs([experiment.experiment_id])
    assert run.info.status == "FINISHED" and run.info.run_name == "toy/run"
    assert run.data.params["lr"] == "0.003" and run.data.params["batch_size"] == "16"  # the TrainConfig
    losses = client.get_metric_history(run.info.run_id, "loss")
    assert [(m.step, m.value) for m in losses] == [(r["step"], pytest.approx(r["loss"])) for r in history.records]
    assert [m.step for m in client.get_metric_history(run.info.run_id, "eval_accuracy")] == [4, 8]
    assert run.data.metrics["summary/steps"] == 8
    artifacts = {a.path for a in client.list_artifacts(run.info.run_id)}
    assert {"report.html", "curves.png", "history.json", "summary.json"} <= artifacts
    assert json.loads((run_dir / "trackers.json").read_text())["mlflow"] == run.info.run_id
    assert (run_dir / "metrics.csv").exists() and not list(run_dir.glob("events.out.tfevents*"))  # csv yes, TB no


def _wandb_records(path: Path) -> list:
    """The records of an offline run's .wandb file, parsed with wandb's own protobuf definitions.

    wandb >= 0.20 has no Python reader for the file (its Go core reads it), so the framing is read
    here: a 7-byte header (":W&B", magic, version), then LevelDB-log blocks of 32 KiB whose records
    carry a 7-byte header (crc32, length, type: 1 full, 2 first, 3 middle, 4 last).
    """
    from wandb.proto import wandb_internal_pb2 as pb

    data = path.read_bytes()
    assert data[:4] == b":W&B"
    block, pos, out, pending = 32768, 7, [], b""
    while pos + 7 <= len(data):
        if block - pos % block < 7:
            pos += block - pos % block  # the block's zero padding
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        chunk, pos = data[pos + 7:pos + 7 + length], pos + 7 + length
        if kind == 0:
            break
        pending = chunk if kind in (1, 2) else pending + chunk
        if kind in (1, 4):
            record = pb.Record()
            record.ParseFromString(pending)
            out.append(record)
    return out


def _key(item) -> str:
    """An item's key: `key`, or its `nested_key` path joined with "/" (wandb writes either)."""
    return item.key or "/".join(item.nested_key)


def _finished_records(path: Path, timeout_s: float = 60.0) -> list:
    """The file's records once its last one (exit) is written: wandb's service process writes the file
    behind the run's finish(); teardown() ends that process, which closes the file."""
    import time

    import wandb

    wandb.teardown()
    deadline = time.monotonic() + timeout_s
    while True:
        records = _wandb_records(path)
        if (records and records[-1].WhichOneof("record_type") == "exit") or time.monotonic() > deadline:
            return records
        time.sleep(0.2)


@pytest.mark.processes
def test_wandb_offline_run_read_back(tracker_env):
    pytest.importorskip("wandb", reason="wandb is not installed (pip install 'gputrain[track]')")
    run_dir = tracker_env / "run"
    history = _fit(run_dir, ("wandb",), lr=0.003)
    (wandb_file,) = list((run_dir / "wandb").glob("offline-run-*/run-*.wandb"))
    records = _finished_records(wandb_file)
    kinds = [r.WhichOneof("record_type") for r in records]
    (run,) = [r.run for r in records if r.WhichOneof("record_type") == "run"]
    config = {_key(item): json.loads(item.value_json) for item in run.config.update}
    assert run.project == "gputrain" and run.display_name == "toy/run"
    assert config["lr"] == 0.003 and config["name"] == "toy"
    rows = [{_key(i): json.loads(i.value_json) for i in r.history.item} for r in records
            if r.WhichOneof("record_type") == "history"]
    assert [(row["_step"], row["loss"]) for row in rows] == \
        [(rec["step"], pytest.approx(rec["loss"])) for rec in history.records]
    assert "eval_accuracy" in rows[-1]
    summary = {}
    for r in records:
        if r.WhichOneof("record_type") == "summary":
            summary.update({_key(i): json.loads(i.value_json) for i in r.summary.update})
    assert summary["steps"] == 8 and summary["workload"] == "toy"
    saved = {f.path for r in records if r.WhichOneof("record_type") == "files" for f in r.files.files}
    assert {"report.html", "curves.png", "history.json"} <= saved
    assert kinds[-1] == "exit" and [r.exit.exit_code for r in records if r.WhichOneof("record_type") == "exit"] == [0]
    assert not (run_dir / "metrics.csv").exists()  # only the loggers named


def test_a_tracker_that_fails_is_one_warning_and_training_goes_on(tracker_env, monkeypatch, caplog):
    pytest.importorskip("mlflow", reason="mlflow is not installed (pip install 'gputrain[track]')")
    import socket

    with socket.socket() as s:  # a loopback port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"http://127.0.0.1:{port}")
    with caplog.at_level("WARNING", logger="gputrain"):
        history = _fit(tracker_env / "run", ("csv", "mlflow"))
    assert history.summary["steps"] == 8
    warnings = [r.getMessage() for r in caplog.records if "mlflow" in r.getMessage()]
    assert len(warnings) == 1 and "does not answer" in warnings[0] and "training goes on" in warnings[0]
    assert "\n" not in warnings[0]
    assert len((tracker_env / "run" / "metrics.jsonl").read_text().splitlines()) == 2  # the other tracker ran


def test_a_tracker_failing_mid_run_is_dropped_with_a_warning(tmp_path, monkeypatch, caplog):
    from gputrain.report import trackers

    calls = []

    class Flaky(trackers.Tracker):
        name = "flaky"

        def log(self, record):
            calls.append(record["step"])
            raise ConnectionError("server went away\nwith a long trace")

    monkeypatch.setattr(trackers, "_factory", lambda name: (lambda run_dir, config, start: Flaky()))
    with caplog.at_level("WARNING", logger="gputrain"):
        history = _fit(tmp_path / "run", ("csv",))
    assert history.summary["steps"] == 8 and calls == [4]  # dropped after its first failure
    (warning,) = [r.getMessage() for r in caplog.records if "flaky" in r.getMessage()]
    assert warning == "flaky tracking is off for this run: ConnectionError: server went away (training goes on)"


@pytest.mark.processes
def test_the_cli_takes_several_loggers(tracker_env, capsys):
    pytest.importorskip("wandb", reason="wandb is not installed (pip install 'gputrain[track]')")
    from gputrain import cli

    d = tracker_env / "cli-run"
    rc = cli.main(["fit", "iris-mlp", "--run-dir", str(d), "--steps", "10", "--log-every", "5", "--device", "cpu",
                   "--logger", "csv,tensorboard", "--logger", "wandb", "--json", "--progress", "off"])
    assert rc == 0
    config = json.loads((d / "history.json").read_text())["config"]
    assert config["loggers"] == ["csv", "tensorboard", "wandb"]
    assert (d / "metrics.csv").exists() and list(d.glob("events.out.tfevents*"))
    assert list((d / "wandb").glob("offline-run-*/run-*.wandb"))


class _Breaks(nn.Module):
    """The toy model, raising in its forward from step `at` on (an error in user code mid-run)."""

    def __init__(self, at: int):
        super().__init__()
        self.inner, self.at, self.calls = mlp(classes=2, hidden=8), at, 0

    def forward(self, x):
        self.calls += 1
        if self.training and self.calls >= self.at:
            raise ValueError("the model broke")
        return self.inner(x)


def _fit_failing(run_dir: Path, loggers, at: int = 6):
    x, y = _data()
    cfg = TrainConfig(device="cpu", batch_size=16, steps=8, log_every=4, run_dir=str(run_dir), name="toy",
                      loggers=loggers)
    with pytest.raises(ValueError, match="the model broke"):
        fit(_Breaks(at), (x, y), loss_fn=nn.CrossEntropyLoss(), config=cfg)


def test_a_failed_run_is_marked_failed_in_mlflow(tracker_env):
    pytest.importorskip("mlflow", reason="mlflow is not installed (pip install 'gputrain[track]')")
    pytest.importorskip("sqlalchemy", reason="sqlalchemy is not installed (MLflow's local store needs it)")
    from mlflow.tracking import MlflowClient

    run_dir = tracker_env / "run"
    _fit_failing(run_dir, ("mlflow",))
    client = MlflowClient(tracking_uri=f"sqlite:///{run_dir / 'mlflow.db'}")
    (run,) = client.search_runs([client.get_experiment_by_name("toy").experiment_id])
    assert run.info.status == "FAILED"
    assert [m.step for m in client.get_metric_history(run.info.run_id, "loss")] == [4]  # the log point before


@pytest.mark.processes
def test_a_failed_run_exits_1_in_wandb(tracker_env):
    pytest.importorskip("wandb", reason="wandb is not installed (pip install 'gputrain[track]')")
    run_dir = tracker_env / "run"
    _fit_failing(run_dir, ("wandb",))
    (wandb_file,) = list((run_dir / "wandb").glob("offline-run-*/run-*.wandb"))
    records = _finished_records(wandb_file)
    assert [r.exit.exit_code for r in records if r.WhichOneof("record_type") == "exit"] == [1]


def test_wandb_is_online_only_with_an_api_key_or_a_netrc_entry(tracker_env, monkeypatch):
    from gputrain.report.wandb_tracker import logged_in

    assert not logged_in()  # the fixture: no key, a netrc path that does not exist
    netrc = tracker_env / "netrc"
    netrc.write_text("machine api.wandb.ai login user password secret\n")
    netrc.chmod(0o600)
    monkeypatch.setenv("NETRC", str(netrc))
    assert logged_in()
    monkeypatch.setenv("WANDB_BASE_URL", "https://wandb.example.org")
    assert not logged_in()  # the entry is for another host
    monkeypatch.setenv("WANDB_API_KEY", "k" * 40)
    assert logged_in()


def test_the_tracker_interface_defaults_do_nothing_and_the_shared_helpers(tmp_path):
    from gputrain.report.tracker_base import (Tracker, TrackerUnavailable, numbers_at_step, read_ids, require,
                                              resumed_id, write_id)

    tracker = Tracker()
    assert tracker.log({"step": 1, "loss": 0.5}) is None and tracker.close() is None
    step, values = numbers_at_step({"step": 3, "loss": 0.25, "lr": 1e-3, "ok": True, "note": "x", "peak": None})
    assert step == 3 and values == {"loss": 0.25, "lr": 1e-3}  # bools, strings and None are not numbers
    with pytest.raises(TrackerUnavailable, match=r"no_such_tracker_pkg is not installed .*: pip install it"):
        require("no_such_tracker_pkg", "pip install it")
    write_id(tmp_path, "mlflow", "abc")
    write_id(tmp_path, "wandb", "xyz")
    assert read_ids(tmp_path) == {"mlflow": "abc", "wandb": "xyz"}
    assert resumed_id(tmp_path, "mlflow", start_step=5) == "abc"
    assert resumed_id(tmp_path, "mlflow", start_step=0) is None  # a new run starts a new tracker run
