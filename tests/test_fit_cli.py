"""`gputrain fit` on the command line: runs, writes its run directory, and fails in one line."""

import json
import subprocess
import sys
import textwrap

import pytest
from helpers import cli

from gputrain.cli import main


@pytest.mark.parametrize("args,needle", [
    (["fit", "no-such-workload"], "unknown workload"),
    (["fit", "iris-mlp", "--batch-size", "0"], "expected a positive integer, got '0'"),
    (["fit", "iris-mlp", "--epochs", "2", "--steps", "3"], "not allowed with argument"),
    (["fit", "iris-mlp", "--precision", "fp16", "--device", "cpu", "--no-save"], "fp16 is not supported on the CPU"),
    (["fit", "iris-mlp", "--device", "cuda:3", "--no-save"], "cuda:3 requested"),
    (["fit", "iris-mlp", "--lr", "-1"], "expected a positive number"),
    (["fit", "nomodule_xyz:make"], "nomodule_xyz"),
])
def test_fit_errors_are_one_line_with_exit_code_2(args, needle, capsys):
    with pytest.raises(SystemExit) as exc_info:
        code = main(args)
        raise SystemExit(code)
    err = capsys.readouterr().err.strip()
    assert exc_info.value.code == 2
    assert needle in err, err
    assert len(err.splitlines()) == 1, err


def test_fit_list(capsys):
    code, out, _ = cli(capsys, "fit", "--list", "--json")
    rows = json.loads(out)
    names = {r["name"] for r in rows}
    assert code == 0
    assert {"iris-mlp", "digits-cnn", "mnist1d-cnn", "mnist1d-mlp", "mnist1d-gru", "linear-regression",
            "mlp-binary", "cifar10-cnn", "mnist-cnn", "synthetic-cifar"} <= names


@pytest.mark.parametrize("flag", ["--recompute", "--checkpointing"])
def test_recompute_and_its_old_name_set_the_config(flag, capsys):
    from gputrain.cli import build_parser
    from gputrain.commands.fit import build_config
    from gputrain.workloads import get_workload

    w = get_workload("iris-mlp")
    for argv, expected in (([flag], True), ([flag, "net.0,net.2"], ["net.0", "net.2"]), ([], False)):
        args = build_parser().parse_args(["fit", "iris-mlp", "--no-save", *argv])
        assert build_config(args, w).recompute == expected
    with pytest.raises(SystemExit):
        build_parser().parse_args(["fit", "--help"])
    assert "--checkpointing is its old name" in " ".join(capsys.readouterr().out.split())


def test_fit_iris_writes_its_run_dir_and_resumes(tmp_path, capsys):
    run_dir = tmp_path / "iris"
    code, out, _ = cli(capsys, "fit", "iris-mlp", "--device", "cpu", "--epochs", "300", "--log-every", "100",
                               "--run-dir", str(run_dir), "--json", "--stop-at-step", "200")
    assert code == 0
    summary = json.loads(out)["summary"]
    assert summary["steps"] == 200 and summary["stopped_early"]
    for name in ("checkpoints", "metrics.jsonl", "metrics.csv", "history.json", "curves.png"):
        assert (run_dir / name).stat().st_size > 0, name
    stopped = json.loads((run_dir / "history.json").read_text())["records"]
    code, out, _ = cli(capsys, "fit", "iris-mlp", "--device", "cpu", "--epochs", "300", "--log-every", "100",
                               "--resume", str(run_dir), "--json")
    summary = json.loads(out)["summary"]
    assert code == 0 and summary["steps"] == 300 and not summary["stopped_early"]
    assert summary["final_eval_accuracy"] > 0.8
    # The resumed run continued the stopped one: it ends exactly where an uninterrupted run ends
    # (a run that ignored --resume would start from fresh weights and log other losses).
    whole = tmp_path / "whole"
    code, _, _ = cli(capsys, "fit", "iris-mlp", "--device", "cpu", "--epochs", "300", "--log-every", "100",
                             "--run-dir", str(whole), "--json")
    resumed = json.loads((run_dir / "history.json").read_text())["records"]
    reference = json.loads((whole / "history.json").read_text())["records"]
    assert code == 0 and [r["step"] for r in resumed] == [100, 200, 300]
    # The first two records are the stopped run's own, timings included: that run was continued,
    # not repeated (a fresh run from the same seed would log the same losses but other timings).
    assert resumed[:2] == stopped
    assert [r["loss"] for r in resumed] == pytest.approx([r["loss"] for r in reference], rel=1e-6)


def test_fit_option_parsing_reaches_the_workload(capsys):
    code, out, _ = cli(capsys, "fit", "linear-regression", "--device", "cpu", "--option", "n=300", "--epochs", "1",
                               "--no-save", "--json")
    assert code == 0 and json.loads(out)["summary"]["samples"] == 300
    with pytest.raises(SystemExit) as exc_info:
        raise SystemExit(main(["fit", "linear-regression", "--option", "n300", "--no-save"]))
    assert exc_info.value.code == 2 and "expected KEY=VALUE" in capsys.readouterr().err


def test_fit_batch_size_auto_on_the_cpu_keeps_the_default_and_says_why(capsys):
    code, out, err = cli(capsys, "fit", "mlp-binary", "--device", "cpu", "--batch-size", "auto", "--steps", "3",
                               "--no-save", "--json")
    from gputrain.workloads import get_workload

    assert code == 0
    assert json.loads(out)["summary"]["batch_size"] == get_workload("mlp-binary").defaults.get("batch_size", 64)
    assert "--batch-size auto needs a CUDA device" in err


def test_user_workload_module_function(tmp_path, monkeypatch, capsys):
    (tmp_path / "my_wl.py").write_text(textwrap.dedent("""
        import torch
        from torch import nn
        import gputrain
        from gputrain.workloads import DataSplits

        def make():
            g = torch.Generator().manual_seed(0)
            x = torch.randn(200, 5, generator=g)
            y = (x[:, 0] > 0).long()
            return gputrain.Workload(
                name="mine", description="user workload",
                make_data=lambda: DataSplits(train=(x[:150], y[:150]), test=(x[150:], y[150:])),
                make_model=lambda: nn.Sequential(nn.Linear(5, 16), nn.ReLU(), nn.Linear(16, 2)),
                loss_fn=nn.CrossEntropyLoss(), task="classification",
                defaults={"batch_size": 25, "epochs": 30, "lr": 0.01})
    """))
    monkeypatch.syspath_prepend(str(tmp_path))
    code, out, _ = cli(capsys, "fit", "my_wl:make", "--device", "cpu", "--no-save", "--json")
    summary = json.loads(out)["summary"]
    assert code == 0 and summary["workload"] == "mine"
    assert summary["final_eval_accuracy"] > 0.9


@pytest.mark.processes
def test_console_script_runs_fit_quickly(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "gputrain", "fit", "linear-regression", "--device", "cpu",
                           "--epochs", "2", "--no-save", "--json"], capture_output=True, text=True, timeout=120,
                          cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    summary = json.loads(proc.stdout)["summary"]
    assert summary["task"] == "regression" and summary["final_loss"] > 0


def test_resume_alone_continues_the_newest_run_of_the_workload_with_a_checkpoint(tmp_path, monkeypatch, capsys):
    """`fit W --resume` without a path: the newest run under runs/W/ that holds checkpoints; a newer
    folder without any is passed over; no run at all is a one-line error naming the workload."""
    monkeypatch.chdir(tmp_path)
    common = ["fit", "iris-mlp", "--device", "cpu", "--epochs", "300", "--log-every", "100", "--json"]
    code, _, err = cli(capsys, *common, "--resume")
    assert code == 2 and "no earlier run of iris-mlp with a checkpoint under runs/" in err
    stopped = tmp_path / "runs" / "iris-mlp" / "20260101-000000"
    code, out, _ = cli(capsys, *common, "--run-dir", str(stopped), "--stop-at-step", "200")
    assert code == 0 and json.loads(out)["summary"]["steps"] == 200
    (tmp_path / "runs" / "iris-mlp" / "20991231-235959").mkdir()  # newer, but nothing to resume from
    code, out, _ = cli(capsys, *common, "--resume")
    summary = json.loads(out)["summary"]
    assert code == 0 and summary["steps"] == 300 and not summary["stopped_early"]
    records = json.loads((stopped / "history.json").read_text())["records"]
    assert [r["step"] for r in records] == [100, 200, 300]  # the stopped run went on, in its own folder
    assert sorted(p.name for p in (tmp_path / "runs" / "iris-mlp").iterdir()) == ["20260101-000000", "20991231-235959"]


def test_argument_types_accept_good_values_and_reject_others_with_the_value():
    import argparse

    from gputrain.commands.argtypes import positive_float, positive_int, tri

    assert positive_int("3") == 3 and positive_float("0.5") == 0.5 and positive_float("1e-3") == 1e-3
    assert [tri(v) for v in ("auto", "ON", " yes", "1", "off", "False", "no", "0")] == [
        "auto", True, True, True, False, False, False, False]
    for fn, bad, says in ((positive_int, "x", "positive integer"), (positive_int, "2.5", "positive integer"),
                          (positive_int, "-1", "positive integer"), (positive_float, "nan", "positive number"),
                          (positive_float, "abc", "positive number"), (positive_float, "0", "positive number"),
                          (tri, "maybe", "auto, on or off")):
        with pytest.raises(argparse.ArgumentTypeError, match=f"expected .*{says}.*got '{bad}'"):
            fn(bad)
