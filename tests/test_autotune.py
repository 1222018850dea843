"""gputrain fit --autotune (issue 14): trial rows, choice of the fastest, cache, error rows, batch kept."""

from __future__ import annotations

import json

import torch
from helpers import tiny_workload
from torch import nn

from gputrain.config import TrainConfig
from gputrain.diagnostics import autotune as at


def config(**kw) -> TrainConfig:
    return TrainConfig(**{"device": "cpu", "precision": "fp32", "batch_size": 32, "accumulate": 2, **kw})


def fake_trial(speeds: dict, calls: list):
    """A run_trial whose samples/s is speeds[(precision, channels_last)]; None there = an exception row."""

    def trial(workload, cfg, overrides, steps):
        calls.append(dict(overrides))
        speed = speeds[(overrides["precision"], overrides["channels_last"])]
        if speed is None:
            return {"overrides": dict(overrides), "samples_per_s": None, "step_ms": None, "peak_memory": None,
                    "compile_s": None, "graphs": None, "status": "error: RuntimeError: boom"}
        return {"overrides": dict(overrides), "samples_per_s": speed, "step_ms": 1.0, "peak_memory": None,
                "compile_s": 0.1, "graphs": None, "status": "ok"}

    return trial


def test_candidates_cpu_conv_net_and_dense_net():
    dev = torch.device("cpu")
    conv = at.candidates(config(), dev, tiny_workload().make_model())
    assert {(c["precision"], c["channels_last"]) for c in conv} == {
        ("fp32", False), ("fp32", True), ("bf16", False), ("bf16", True)}
    assert not any(c["compile"] or c["cuda_graphs"] for c in conv)
    dense = at.candidates(config(), dev, nn.Sequential(nn.Linear(4, 4)))
    assert {(c["precision"], c["channels_last"]) for c in dense} == {("fp32", False), ("bf16", False)}


def test_real_trial_runs_and_reports_a_row():
    row = at.run_trial(tiny_workload(), config(), {"precision": "fp32", "channels_last": False,
                                                   "cuda_graphs": False, "compile": False}, steps=2)
    assert row["status"] == "ok", row
    assert row["samples_per_s"] > 0 and row["compile_s"] >= 0 and row["peak_memory"] is None


def test_failing_candidate_becomes_an_error_row():
    row = at.run_trial(tiny_workload(), config(), {"precision": "no-such-precision"}, steps=2)
    assert row["status"].startswith("error:") and row["samples_per_s"] is None


def test_picks_the_fastest_and_keeps_the_batch(tmp_path, monkeypatch):
    calls = []
    speeds = {("fp32", False): 100.0, ("fp32", True): 50.0, ("bf16", False): None, ("bf16", True): 300.0}
    monkeypatch.setattr(at, "run_trial", fake_trial(speeds, calls))
    cache = tmp_path / "autotune.json"
    cfg, report = at.autotune(tiny_workload(), config(), steps=2, cache_path=cache)

    assert report["choice"] == {"cuda_graphs": False, "channels_last": True, "precision": "bf16", "compile": False}
    assert cfg.precision == "bf16" and cfg.channels_last is True
    assert cfg.batch_size == 32 and cfg.accumulate == 2  # never changed
    assert "kept at 32" in report["batch"] and "does not change the effective batch" in report["batch"]
    assert len(calls) == 4 and not report["cached"]
    errors = [r for r in report["rows"] if r["status"].startswith("error")]
    assert len(errors) == 1 and errors[0]["overrides"]["precision"] == "bf16"
    assert [r["chosen"] for r in report["rows"]].count(True) == 1
    assert report["key"] in json.loads(cache.read_text())

    # Second call: the cached choice, no trial.
    calls.clear()
    cfg2, report2 = at.autotune(tiny_workload(), config(), steps=2, cache_path=cache)
    assert calls == [] and report2["cached"] and report2["choice"] == report["choice"]
    assert cfg2.precision == "bf16" and cfg2.batch_size == 32

    # force measures again; a different batch size is a different key.
    at.autotune(tiny_workload(), config(), steps=2, cache_path=cache, force=True)
    assert len(calls) == 4
    calls.clear()
    _, report3 = at.autotune(tiny_workload(), config(batch_size=16), steps=2, cache_path=cache)
    assert len(calls) == 4 and report3["key"] != report["key"]


def test_compile_is_tried_only_with_the_best_set(tmp_path, monkeypatch):
    calls = []
    speeds = {("fp32", False): 100.0, ("fp32", True): 500.0, ("bf16", False): 10.0, ("bf16", True): 20.0}
    monkeypatch.setattr(at, "run_trial", fake_trial(speeds, calls))
    _, report = at.autotune(tiny_workload(), config(), steps=2, cache_path=tmp_path / "c.json", include_compile=True)
    compiled = [c for c in calls if c["compile"]]
    assert len(compiled) == 1 and compiled[0]["precision"] == "fp32" and compiled[0]["channels_last"] is True


def test_a_graphed_winner_is_also_tried_with_compiles_own_cuda_graphs(tmp_path, monkeypatch):
    """Which replays a compiled step faster, gputrain's whole-step graph or compile's cudagraph
    trees, is measured: the trees variant (gputrain's graph off) runs, and wins when it is faster."""
    calls = []
    sets = [{"cuda_graphs": g, "channels_last": False, "precision": "fp32", "compile": False} for g in (True, False)]
    monkeypatch.setattr(at, "candidates", lambda *a, **k: [dict(s) for s in sets])

    def trial(workload, cfg, overrides, steps):
        calls.append(dict(overrides))
        speed = {(True, False, None): 200.0, (False, False, None): 100.0, (True, True, None): 300.0,
                 (False, True, at.TREES_MODE): 400.0}[
            (overrides["cuda_graphs"], overrides["compile"], overrides.get("compile_mode"))]
        return {"overrides": dict(overrides), "samples_per_s": speed, "step_ms": 1.0, "peak_memory": None,
                "compile_s": 2.0, "graphs": None, "status": "ok"}

    cfg, report = at.autotune(tiny_workload(), config(), steps=2, cache_path=tmp_path / "c.json",
                              include_compile=True, trial=trial)
    assert calls[2:] == [dict(sets[0], compile=True),
                         dict(sets[0], compile=True, compile_mode="reduce-overhead", cuda_graphs=False)]
    assert report["choice"]["compile_mode"] == "reduce-overhead"
    assert cfg.compile and cfg.compile_mode == "reduce-overhead" and cfg.cuda_graphs is False
    assert "(mode reduce-overhead)" in at._describe(report["choice"])


def test_all_failing_keeps_the_config(tmp_path, monkeypatch):
    calls = []
    monkeypatch.setattr(at, "run_trial", fake_trial(dict.fromkeys(
        [("fp32", False), ("fp32", True), ("bf16", False), ("bf16", True)]), calls))
    cfg, report = at.autotune(tiny_workload(), config(), steps=2, cache_path=tmp_path / "c.json")
    assert report["choice"] is None and cfg.precision == "fp32" and not (tmp_path / "c.json").exists()


def test_cli_autotune_json(tmp_path, monkeypatch, capsys):
    from gputrain.cli import main

    monkeypatch.setenv("GPUTRAIN_CACHE", str(tmp_path))
    rc = main(["fit", "digits-cnn", "--autotune", "--steps", "3", "--no-save", "--json", "--device", "cpu"])
    assert rc == 0
    out = json.loads(capsys.readouterr().out)
    rep = out["autotune"]
    assert rep["choice"] is not None and not rep["cached"] and len(rep["rows"]) == 4
    assert "does not change the effective batch" in rep["batch"]
    assert out["summary"]["workload"] == "digits-cnn"
    assert (tmp_path / "autotune.json").exists()


def test_render_report_shows_every_trial_and_marks_the_choice():
    """The table `fit --autotune` prints: one row per trial with its numbers, the chosen one marked,
    graphs that were asked for but not used said so, an error row with its status, the cache named."""
    import io

    from rich.console import Console

    report = {"cached": True, "cache_path": "/c/autotune.json", "rows": [
        {"overrides": {"cuda_graphs": True, "channels_last": True, "precision": "bf16", "compile": False},
         "graphs": "on", "samples_per_s": 12345.6, "step_ms": 1.234, "peak_memory": 3 * 2**20,
         "compile_s": None, "status": "ok", "chosen": True},
        {"overrides": {"cuda_graphs": True, "channels_last": False, "precision": "fp32", "compile": True,
                       "compile_mode": "reduce-overhead"},
         "graphs": "off: a forward hook", "samples_per_s": 100.0, "step_ms": 10.0, "peak_memory": None,
         "compile_s": 4.5, "status": "ok"},
        {"overrides": {"cuda_graphs": False, "channels_last": False, "precision": "fp16", "compile": False},
         "samples_per_s": None, "step_ms": None, "peak_memory": None, "compile_s": None,
         "status": "error: RuntimeError: boom"},
    ]}
    buf = io.StringIO()
    at.render_report(report, Console(file=buf, width=200, color_system=None))
    out = buf.getvalue()
    assert "cached: /c/autotune.json" in out
    rows = {name: next(line for line in out.splitlines() if name in line) for name in ("bf16", "fp32", "fp16")}
    cells = {name: [c.strip() for c in line.strip(" │|").split("│")] for name, line in rows.items()}
    assert cells["bf16"] == ["on", "on", "bf16", "off", "12,346", "1.23", "3 MiB", "-", "* chosen"]
    assert cells["fp32"] == ["on (not used)", "off", "fp32", "reduce-overhead", "100", "10.00", "-", "4.50", "ok"]
    assert cells["fp16"] == ["off", "off", "fp16", "off", "-", "-", "-", "-", "error: RuntimeError: boom"]


def test_compile_is_tried_regionally_for_a_model_of_repeated_blocks(tmp_path, monkeypatch):
    from gputrain.workloads.real_models import GPTMini

    calls = []
    speeds = {("fp32", False): 100.0, ("bf16", False): 10.0}
    monkeypatch.setattr(at, "run_trial", fake_trial(speeds, calls))
    workload = tiny_workload()
    workload.make_model = lambda: GPTMini(65, block_size=8, n_layer=3, n_embd=16, n_head=2)
    at.autotune(workload, config(), steps=2, cache_path=tmp_path / "c.json", include_compile=True)
    assert [c["compile"] for c in calls if c["compile"]] == ["regional"]
    assert at.compile_choice(nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))) is True


def test_a_resume_takes_the_choice_its_checkpoint_recorded_and_measures_nothing(tmp_path, monkeypatch):
    """Timing picks once: the run autotuned to channels_last on, a resume with --autotune takes that
    choice from its checkpoint, although a new measurement (and the cache) would now pick it off."""
    from gputrain.train import fit_workload

    calls: list = []
    monkeypatch.setattr(at, "run_trial", fake_trial({("fp32", False): 100.0, ("fp32", True): 200.0,
                                                     ("bf16", False): 50.0, ("bf16", True): 50.0}, calls))
    run = str(tmp_path / "run")
    first, _ = at.autotune(tiny_workload(), config(run_dir=run, steps=6), steps=2, cache_path=tmp_path / "c.json")
    assert first.channels_last is True and len(calls) == 4
    fit_workload(tiny_workload(), first.replace(stop_at_step=3))  # stopped after step 3, checkpointed
    monkeypatch.setattr(at, "run_trial", fake_trial({("fp32", False): 900.0, ("fp32", True): 1.0,
                                                     ("bf16", False): 1.0, ("bf16", True): 1.0}, calls))
    resumed, report = at.autotune(tiny_workload(), config(run_dir=run, steps=6, resume=True), steps=2,
                                  cache_path=tmp_path / "other.json", force=True)
    assert resumed.channels_last is True and len(calls) == 4  # nothing measured again
    assert report["from_checkpoint"].endswith("step-000003.pt") and report["choice"]["channels_last"] is True
