"""TensorBoard event files: read back with TensorBoard's own reader (EventAccumulator) and compared
with metrics.jsonl; the off switch, a missing tensorboard package, non-zero ranks and resumed runs;
TensorBoard as one of the loggers, and the old `tensorboard` switch (deprecated) mapped onto them."""

import json
import logging
import math
import sys
import warnings

import pytest
import torch
from torch import nn

pytest.importorskip("tensorboard", reason="tensorboard is not installed (pip install tensorboard)")

from tensorboard.backend.event_processing.event_accumulator import EventAccumulator  # noqa: E402
from tensorboard.plugins.hparams import plugin_data_pb2  # noqa: E402

from gputrain import cli, fit  # noqa: E402
from gputrain.config import TrainConfig  # noqa: E402
from gputrain.errors import ConfigError  # noqa: E402
from gputrain.report.tensorboard import TensorBoardLog, tag_for  # noqa: E402


def _read(d) -> EventAccumulator:
    ea = EventAccumulator(str(d), size_guidance={"scalars": 0, "tensors": 0})
    ea.Reload()
    return ea


def _records(path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def _assert_matches(ea: EventAccumulator, records: list[dict]) -> None:
    """Every numeric value of every record is the scalar at its step, and nothing else is there."""
    expected: dict[str, dict[int, float]] = {}
    for r in records:
        for key, value in r.items():
            if key != "step" and isinstance(value, (int, float)) and not isinstance(value, bool):
                expected.setdefault(tag_for(key), {})[r["step"]] = float(value)
    assert sorted(ea.Tags()["scalars"]) == sorted(expected)
    for tag, by_step in expected.items():
        got = {e.step: e.value for e in ea.Scalars(tag)}
        assert got.keys() == by_step.keys(), tag
        for step, value in by_step.items():  # TensorBoard stores float32
            assert got[step] == pytest.approx(value, rel=1e-6, abs=1e-30) or (math.isnan(value) and math.isnan(got[step]))


@pytest.fixture(scope="module")
def fit_run(tmp_path_factory):
    d = tmp_path_factory.mktemp("fit") / "run"
    rc = cli.main(["fit", "digits-cnn", "--run-dir", str(d), "--steps", "30", "--log-every", "10",
                   "--quiet", "--progress", "off", "--json"])
    assert rc == 0
    return d


def test_event_files_match_metrics_jsonl(fit_run, tmp_path):
    history = json.loads((fit_run / "history.json").read_text())
    records = _records(fit_run / "metrics.jsonl")
    # log points every 10 steps, and the epoch end (23 steps an epoch), where the run evaluates
    assert [r["step"] for r in records] == [10, 20, 23, 30] and "eval_accuracy" in records[-1]
    tb = TensorBoardLog(tmp_path, history["config"])
    for r in records:
        tb.append(r)
    assert tb.path.parent == tmp_path and tb.path.name.startswith("events.out.tfevents.")
    tb.close(history["summary"])

    ea = _read(tmp_path)
    _assert_matches(ea, records)
    assert {"train/loss", "train/lr", "speed/samples_per_s", "eval/loss", "eval/accuracy"} <= set(ea.Tags()["scalars"])
    # the config as text (markdown) and as hparams
    text = ea.Tensors("config/text_summary")[0].tensor_proto.string_val[0].decode()
    assert "| batch_size | `64` |" in text and "| steps | `30` |" in text
    assert history["summary"]["device"] in ea.Tensors("summary/text_summary")[0].tensor_proto.string_val[0].decode()
    start = plugin_data_pb2.HParamsPluginData.FromString(
        ea.SummaryMetadata("_hparams_/session_start_info").plugin_data.content).session_start_info
    assert start.hparams["batch_size"].number_value == 64 and start.hparams["schedule"].string_value == "cosine"
    assert start.hparams["eval_every"].string_value == "null"  # None is written as JSON
    exp = plugin_data_pb2.HParamsPluginData.FromString(
        ea.SummaryMetadata("_hparams_/experiment").plugin_data.content).experiment
    assert {m.name.tag for m in exp.metric_infos} >= {"train/loss", "eval/accuracy"}


def test_peak_memory_and_new_metrics_get_their_groups(tmp_path):
    records = [{"step": 5, "loss": 2.0, "peak_memory_bytes": 3 * 2**30, "eval_top5": 0.5, "grad_norm": 1.5,
                "note": "text is skipped", "peak_memory_bytes_none": None, "flag": True},
               {"step": 10, "loss": float("nan"), "peak_memory_bytes": 3 * 2**30 + 4096}]
    with TensorBoardLog(tmp_path, {}) as tb:
        for r in records:
            tb.append(r)
    ea = _read(tmp_path)
    assert sorted(ea.Tags()["scalars"]) == ["eval/top5", "memory/peak_memory_bytes", "train/grad_norm", "train/loss"]
    assert math.isnan(ea.Scalars("train/loss")[1].value)
    assert [e.value for e in ea.Scalars("memory/peak_memory_bytes")] == [3 * 2**30, 3 * 2**30 + 4096]
    with pytest.raises(ValueError, match="numeric 'step'"):
        TensorBoardLog(tmp_path / "x", {}).append({"loss": 1.0})


def test_switched_off_writes_nothing(tmp_path):
    tb = TensorBoardLog(tmp_path / "run", {"lr": 0.1}, enabled=False)
    tb.append({"step": 1, "loss": 1.0})
    tb.close()
    assert tb.path is None and not (tmp_path / "run").exists()


class _Collect(logging.Handler):
    def __init__(self):
        super().__init__(logging.WARNING)
        self.messages = []

    def emit(self, record):
        self.messages.append(record.getMessage())


def test_without_tensorboard_it_says_how_to_install_and_does_nothing(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)  # import fails as if not installed
    # A handler on the module's own logger: `gputrain fit` stops propagation above it (caplog sees nothing).
    logger, seen = logging.getLogger("gputrain.report.tensorboard"), _Collect()
    logger.addHandler(seen)
    try:
        tb = TensorBoardLog(tmp_path / "run", {"lr": 0.1})
    finally:
        logger.removeHandler(seen)
    assert not tb.enabled and len(seen.messages) == 1
    assert "pip install tensorboard" in seen.messages[0] and "--no-tensorboard" in seen.messages[0]
    tb.append({"step": 1, "loss": 1.0})
    tb.close()
    assert not (tmp_path / "run").exists()


def test_only_rank_zero_writes(tmp_path, monkeypatch):
    import torch.distributed as dist

    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_rank", lambda: 1)
    tb = TensorBoardLog(tmp_path / "rank1", {"lr": 0.1})
    tb.append({"step": 1, "loss": 1.0})
    tb.close()
    assert not tb.enabled and not (tmp_path / "rank1").exists()
    monkeypatch.setattr(dist, "get_rank", lambda: 0)
    with TensorBoardLog(tmp_path / "rank0", {"lr": 0.1}) as tb:
        tb.append({"step": 1, "loss": 1.0})
    assert [e.value for e in _read(tmp_path / "rank0").Scalars("train/loss")] == [1.0]


def test_resumed_run_hides_what_came_after_its_checkpoint(tmp_path):
    with TensorBoardLog(tmp_path, {}, truncate_after_step=0) as tb:
        for step in (10, 20, 30):  # crashed after logging step 30; its last checkpoint was at step 20
            tb.append({"step": step, "loss": float(step)})
    with TensorBoardLog(tmp_path, {}, truncate_after_step=20) as tb:
        for step in (30, 40):
            tb.append({"step": step, "loss": step + 0.5})
    assert [(e.step, e.value) for e in _read(tmp_path).Scalars("train/loss")] == [(10, 10), (20, 20), (30, 30.5),
                                                                                  (40, 40.5)]


def test_fit_writes_event_files_and_report(tmp_path, capsys):
    on, off = tmp_path / "on", tmp_path / "off"
    assert cli.main(["fit", "digits-cnn", "--run-dir", str(on), "--steps", "20", "--log-every", "10",
                     "--quiet", "--progress", "off", "--json"]) == 0
    assert list(on.glob("events.out.tfevents.*")), "fit wrote no event file"
    _assert_matches(_read(on), _records(on / "metrics.jsonl"))
    assert (on / "report.html").read_text().startswith("<!DOCTYPE html>")
    assert cli.main(["fit", "digits-cnn", "--run-dir", str(off), "--steps", "10", "--log-every", "10",
                     "--quiet", "--progress", "off", "--json", "--no-tensorboard"]) == 0
    assert not list(off.glob("events.out.tfevents.*")) and (off / "metrics.jsonl").is_file()


# ---------------------------------------------------------------- one switch: the loggers


def _fit_tiny(run_dir, config: TrainConfig) -> None:
    torch.manual_seed(0)
    x, y = torch.randn(64, 4), torch.randint(0, 2, (64,))
    fit(nn.Linear(4, 2), (x, y), loss_fn=nn.CrossEntropyLoss(), config=config)


def _tiny(run_dir, **kw) -> dict:
    return dict(device="cpu", batch_size=16, steps=4, log_every=2, run_dir=str(run_dir), **kw)


def test_tensorboard_is_one_of_the_loggers(tmp_path):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        on = TrainConfig(**_tiny(tmp_path / "on", loggers=("csv", "tensorboard")))
        off = TrainConfig(**_tiny(tmp_path / "off", loggers=("csv",)))
        _fit_tiny(tmp_path / "on", on)
        _fit_tiny(tmp_path / "off", off)
    assert not [w for w in caught if issubclass(w.category, DeprecationWarning) and "tensorboard" in str(w.message)]
    assert list((tmp_path / "on").glob("events.out.tfevents.*"))
    assert not list((tmp_path / "off").glob("events.out.tfevents.*")) and (tmp_path / "off" / "metrics.jsonl").is_file()


def test_the_old_tensorboard_switch_warns_and_maps_onto_the_loggers(tmp_path):
    with pytest.warns(DeprecationWarning, match=r"TrainConfig\(tensorboard=\.\.\.\) is deprecated: TensorBoard is one "
                                                r"of the loggers.*use TrainConfig\(loggers=\('csv', 'tensorboard'\)\)"):
        on = TrainConfig(**_tiny(tmp_path / "on"), tensorboard=True)
    _fit_tiny(tmp_path / "on", on)
    assert list((tmp_path / "on").glob("events.out.tfevents.*")), "the old switch gave no event files"
    with pytest.warns(DeprecationWarning, match=r"use TrainConfig\(loggers=\('csv', 'mlflow'\)\)"):
        off = TrainConfig(**_tiny(tmp_path / "off"), loggers=("csv", "tensorboard", "mlflow"), tensorboard=False)
    assert off.loggers == ("csv", "mlflow") and "tensorboard" not in off.to_dict()
    assert off.replace(lr=0.1).loggers == ("csv", "mlflow")
    # True never turned TensorBoard on where the loggers leave it out: a recorded config means the same run
    with pytest.warns(DeprecationWarning):
        assert TrainConfig(loggers=("csv",), tensorboard=True).loggers == ("csv",)
    with pytest.raises(ConfigError, match="tensorboard must be True or False, got 'no'"):
        TrainConfig(tensorboard="no")  # type: ignore[arg-type]
