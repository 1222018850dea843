"""The GPU day's driver (benchmarks/gpu_day/day.py): a missing zoo is "not present", the zoo's cases are
read from pytest's JUnit XML, a part that crashes or overruns its budget fails the day with its log's
tail in the summary, and the goals are read from the measured figures; the first-step part's script
(benchmarks/gpu_day/first_step.py) reports medians over its rounds, stops starting cases when its budget is
spent and writes its JSON after every case. The whole day on the CPU is .ci/run's step under torch
2.11 (`bash benchmarks/gpu_session.sh day --device cpu`)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from benchmarks.gpu_day import day as gpu_day
from benchmarks.gpu_day import first_step
from benchmarks.gpu_day import report as day_report


def _day(tmp_path: Path, *args: str) -> tuple[int, dict, str]:
    out = tmp_path / "out"
    rc = gpu_day.main(["--device", "cpu", "--out", str(out), "--python", sys.executable, *args])
    files = sorted(p.name for p in out.iterdir())
    assert files == ["gpu_day.json", "gpu_day.md", "gpu_day_logs.tar.gz"], files  # the work stays outside
    return rc, json.loads((out / "gpu_day.json").read_text()), (out / "gpu_day.md").read_text()


@pytest.mark.processes
def test_a_missing_zoo_is_reported_not_present_and_the_day_passes(tmp_path):
    rc, day, md = _day(tmp_path, "--parts", "b", "--zoo-tests", "tests/no_such_zoo.py")
    assert rc == 0
    assert day["parts"]["b"]["status"] == "not present"
    assert "tests/no_such_zoo.py is not in this tree" in md
    assert day["environment"]["torch"] and day["command"].startswith("python -m benchmarks.gpu_day.day --device cpu")


@pytest.mark.processes
def test_the_zoo_runs_on_the_named_device_and_its_cases_come_from_the_junit_xml(tmp_path):
    zoo = tmp_path / "test_tiny_zoo.py"
    zoo.write_text("import os\n"
                   "def test_on_the_day_device():\n    assert os.environ['GPUTRAIN_ZOO_DEVICE'] == 'cpu'\n"
                   "def test_off_by_a_lot():\n    assert 1 == 2, 'the loss differs'\n"
                   "def test_third_not_run():\n    pass\n")
    rc, day, md = _day(tmp_path, "--parts", "b", "--zoo-tests", str(zoo), "--zoo-cases", "2")
    zoo_part = day["parts"]["b"]
    assert rc == 1 and zoo_part["status"] == "failures"
    outcomes = {c["name"].split("::")[-1]: c["outcome"] for c in zoo_part["result"]["cases"]}
    assert outcomes == {"test_on_the_day_device": "passed", "test_off_by_a_lot": "failed"}
    assert "the loss differs" in md


@pytest.mark.processes
def test_a_part_that_crashes_or_overruns_fails_the_day_and_the_next_is_skipped(tmp_path, monkeypatch):
    def crashing(args, work, budget):
        return [sys.executable, "-c", "import no_such_module_of_the_day"], {}, work / "syncs.json"

    def hanging(args, work, budget):
        return [sys.executable, "-c", "import time; time.sleep(120)"], {}, work / "speed.json"

    monkeypatch.setitem(gpu_day.BUILDERS, "c", crashing)
    monkeypatch.setitem(gpu_day.BUILDERS, "d", hanging)
    # 40 s: the environment's read (a torch import in a subprocess, 15 s and more on a loaded 2-core
    # machine) counts against the day's budget, and (c) must still get 10 s to start
    rc, day, md = _day(tmp_path, "--parts", "b,c,d,e", "--zoo-tests", "tests/no_such_zoo.py",
                       "--budget", "40", "--grace", "1")
    assert rc == 1
    assert day["parts"]["b"]["status"] == "not present"  # the parts before still report
    assert day["parts"]["c"]["status"] == "crashed" and day["parts"]["c"]["rc"] != 0
    assert "No module named 'no_such_module_of_the_day'" in md
    assert day["parts"]["d"]["status"] == "timeout"
    assert day["parts"]["d"]["seconds"] < 60
    assert day["parts"]["e"]["status"] == "skipped: the day's budget is spent"  # d took what was left


def test_a_part_gets_what_earlier_parts_left_but_not_what_later_parts_are_owed():
    assert gpu_day.part_budget(180, left=510, later=320) == 190  # the day's 10 s of slack
    assert gpu_day.part_budget(40, left=400, later=210) == 190  # (b) took 0 of its 70 s, (a) 80 of 180
    assert gpu_day.part_budget(40, left=230, later=210) == 40  # earlier parts ran into their grace
    assert gpu_day.part_budget(40, left=25, later=210) == 25  # the day's end comes first


def test_the_goals_are_read_from_the_measured_figures():
    speed = {"iris": {"results": {"gputrain-default": {"median_s": 0.8}}},
             "seed-cnn": {"results": {"gputrain-default": {"x_vs": {"seed-gpu": 12.0}}}},
             "resnet18": {"summary": [{"contender": "gputrain", "vs_hand-eager": 0.95, "vs_lightning-bf16": 1.5}]},
             "graphed": {"rows": [{"workload": "iris-mlp", "wall_over_replay": 1.1}]}}
    syncs = {"rows": [{"case": "EMA", "syncs": 0}, {"case": "DataLoader input", "syncs": 2}]}
    day = {"parts": {"c": {"result": syncs}, "d": {"result": {"rows": speed}}}}
    met = {g["goal"]: (g["value"], g["met"]) for g in day_report.goals(day)}
    assert met["iris-mlp 20000 epochs, gputrain whole run (s)"] == (0.8, True)
    assert met["seed CNN at batch 64, gputrain default vs the seed's GPU loop"] == (12.0, True)
    assert met["ResNet-18 bf16, gputrain vs the hand eager loop"] == (0.95, False)
    assert met["ResNet-18 bf16, gputrain vs Lightning bf16-mixed"] == (1.5, True)
    assert met["ResNet-18 bf16, gputrain vs Accelerate bf16"] == (None, None)  # not measured, not met
    assert met["GPT-mini bf16, gputrain vs the hand eager loop"] == (None, None)
    assert met["graphed step wall / replay, iris-mlp"] == (1.1, True)
    assert met["steady host syncs, EMA"] == (0, True)
    assert met["steady host syncs, DataLoader input"] == (2, False)


def test_the_first_step_goals_are_read_from_the_first_step_part():
    cases = {"gpt-mini loop whole": {"from_fit_s": 30.0, "steady_ms": 10.0},
             "gpt-mini loop regional": {"from_fit_s": 8.0, "steady_ms": 10.4},
             "gpt-mini fit whole": {"from_fit_s": 33.0, "steady_ms": 10.0},
             "gpt-mini fit regional": {"from_fit_s": 15.0, "steady_ms": 11.0},
             "gpt-mini fit regional second start": {"from_fit_s": 3.0},
             "gpt-mini fit whole second start": {"error": ["RuntimeError: boom"]}}
    day = {"parts": {"e": {"result": {"results": cases}}}}
    met = {g["goal"]: (g["value"], g["met"]) for g in day_report.goals(day)}
    assert met["GPT-mini 12 blocks, the hand loop: whole compile's first step / regional's"] == (3.75, True)
    assert met["GPT-mini 12 blocks, gputrain fit: whole compile's first step / regional's"] == (2.2, False)
    assert met["GPT-mini 12 blocks, the hand loop: regional's steady step / whole compile's"][1] is True  # 1.04
    assert met["GPT-mini 12 blocks, gputrain fit: regional's steady step / whole compile's"] == (1.1, False)
    assert met["GPT-mini 12 blocks, gputrain fit regional: first start / second start (compile cache)"] == (5.0, True)
    assert met["GPT-mini 12 blocks, gputrain fit whole: first start / second start (compile cache)"] == (None, None)


def test_the_first_step_part_is_rendered_with_its_cases_ratios_and_what_did_not_run():
    result = {"size": first_step.sizes("cuda"), "steps": 16, "repeats": 1,
              "results": {"gpt-mini fit whole": {"from_fit_s": 31.5, "steady_ms": 9.25, "precision": "bf16",
                                                 "compile_decision": "whole model"},
                          "gpt-mini loop regional": {"error": ["RuntimeError: boom"]}},
              "ratios": {"from_fit_s: a / b": 2.5}, "timed_out": ["gpt-mini fit regional"],
              "skipped": ["gpt-mini fit whole second start (round 1)"]}
    md = "\n".join(day_report.RENDER["e"](result))
    assert "GPT-mini 12 x 384, context 256, batch 64" in md
    assert "| gpt-mini fit whole | 31.5 | - | 9.25 | bf16 | whole model |" in md
    assert "| gpt-mini loop regional | error: ['RuntimeError: boom'] |" in md
    assert "- from_fit_s: a / b: 2.5x" in md
    assert "timed out (killed at the part's end, not failed): gpt-mini fit regional" in md
    assert "skipped (the part's time was spent): gpt-mini fit whole second start (round 1)" in md


def test_first_step_reports_medians_of_its_rounds_and_an_error_in_any_round():
    rounds = [{"from_fit_s": 3.0, "steady_ms": 9.0, "compile_decision": "x"},
              {"from_fit_s": 1.0, "steady_ms": None}, {"from_fit_s": 2.0, "steady_ms": 7.0}]
    got = first_step.medians(rounds)
    assert got["from_fit_s"] == 2.0 and got["from_fit_s_rounds"] == [3.0, 1.0, 2.0]
    assert got["steady_ms"] == 8.0 and got["rounds"] == 3 and got["compile_decision"] == "x"
    assert "error" in first_step.medians([*rounds, {"error": ["boom"]}])
    killed = {"timed_out": True, "error": ["killed after 9 s: the end of --end"]}
    assert first_step.medians([killed, *rounds])["from_fit_s"] == 2.0  # the rounds that ended count
    assert first_step.medians([killed])["timed_out"] is True


@pytest.mark.processes
def test_a_first_step_case_past_its_end_is_killed_and_reported_timed_out(tmp_path):
    spec = first_step.plan(["gpt-mini"], tmp_path, "cpu", first_step.sizes("cpu"))[1]  # the eager hand loop
    t0 = __import__("time").monotonic()
    out = first_step.run_child(spec, tmp_path, timeout=0.5)  # still importing torch then
    assert out["timed_out"] is True and "killed after" in out["error"][0]
    assert __import__("time").monotonic() - t0 < 30


def test_first_step_writes_its_json_after_each_case_and_starts_none_past_its_budget(tmp_path, monkeypatch):
    ran = []

    def child(spec, work, timeout=None):  # a case that "runs" by taking a second of the budget
        if ran:  # the cases before this one are on disk already
            assert set(json.loads(out.read_text())["results"]) == set(ran)
        ran.append(spec["name"])
        clock[0] += 1.0
        return {"from_fit_s": 1.0, "from_command_s": 2.0, "steady_ms": 2.0}

    clock = [0.0]
    out = tmp_path / "fs.json"
    monkeypatch.setattr(first_step, "run_child", child)
    monkeypatch.setattr(first_step.time, "monotonic", lambda: clock[0])
    rc = first_step.main(["--models", "gpt-mini", "--only", "^gpt-mini (fit|loop) (whole|regional)$",
                          "--budget", "1.5", "--json", str(out)])
    result = json.loads(out.read_text())
    # the clock passed 1.5 s after two: fit's pair, whose ratio is the goal
    assert rc == 0 and ran == ["gpt-mini fit regional", "gpt-mini fit whole"]
    assert result["status"] == "ok" and set(result["results"]) == set(ran)
    assert list(result["ratios"]) == ["from_fit_s: gpt-mini fit whole / gpt-mini fit regional",
                                      "steady_ms: gpt-mini fit regional / gpt-mini fit whole"]
    assert result["skipped"] == ["gpt-mini loop regional (round 1)", "gpt-mini loop whole (round 1)"]
    assert first_step.main(["--models", "gpt-mini", "--budget", "-1", "--json", str(out)]) == 0
    assert json.loads(out.read_text())["status"].startswith("skipped")


def test_the_day_runs_first_step_on_its_device_with_a_budget_that_leaves_the_last_case_time():
    args = gpu_day.parse_args(["--device", "cpu"])
    cmd, _, result = gpu_day.first_step_part(args, Path("/w"), 150.0)
    assert cmd[cmd.index("--device") + 1] == "cpu" and cmd[cmd.index("--only") + 1] == gpu_day.FIRST_STEP_CPU
    assert float(cmd[cmd.index("--budget") + 1]) == 150.0 - gpu_day.FIRST_STEP_LAST_START_S
    assert float(cmd[cmd.index("--end") + 1]) == 145.0  # a case still running is killed before the day's kill
    assert result == Path("/w/first_step.json")
    short = gpu_day.first_step_part(args, Path("/w"), gpu_day.FIRST_STEP_LAST_START_S + 5)
    assert short["status"] == "skipped: the day's budget is spent"  # no case could finish: none starts
    import re

    names = [s["name"] for s in first_step.plan(["gpt-mini"], Path("/w"), "cuda", first_step.sizes("cuda"))]
    chosen = [n for n in names if re.search(gpu_day.FIRST_STEP_GPU, n)]
    # each goal's pair back to back, fit's first: a part cut short still ends with whole pairs
    assert chosen == ["gpt-mini fit regional", "gpt-mini fit whole", "gpt-mini loop regional", "gpt-mini loop whole",
                      "gpt-mini fit regional second start", "gpt-mini fit whole second start"]
    assert [n for n in names if re.search(gpu_day.FIRST_STEP_CPU, n)] == [
        "gpt-mini fit regional", "gpt-mini loop regional", "gpt-mini fit regional second start"]


def _parts(device: str, wanted: str, **parts: dict) -> dict:
    return {"config": {"device": device, "parts": wanted.split(",")},
            "parts": {k: {"name": k, "title": k, "seconds": 1.0, "budget_s": 10.0, **p} for k, p in parts.items()}}


def test_the_day_names_the_next_device_call_from_what_failed_was_cut_short_or_never_ran(tmp_path):
    ok = {"status": "ok"}
    # a failed part and one the day never reached (the device command killed): rerun both after the fix
    after = day_report.next_call(_parts("cuda", "a,b,c,d,e,f", a=ok, b=ok, c={"status": "crashed"}))
    assert after["command"] == "bash benchmarks/gpu_session.sh day --parts c,d,e,f --budget 180"
    assert after["why"].startswith("fix what failed, then rerun it alone: (c) crashed; (d) not reached")
    # the smoke's lines that failed or that its budget cut or skipped, and none of those that passed
    smoke = {"status": "failures", "result": {"lines": [
        {"name": "gpu-tests", "status": "pass"}, {"name": "fit-gpt-mini-compile", "status": "fail: exit 1"},
        {"name": "sweep", "status": "skipped: optuna not installed (pip install 'gputrain[sweep]')"},
        {"name": "profile", "status": "fail: stopped at the overall budget after 160 s"},
        {"name": "report", "status": "skipped: overall budget (165 s) spent"}]}}
    after = day_report.next_call(_parts("cuda", "a,b", a=smoke, b=ok))
    assert after["command"] == ("bash benchmarks/gpu_session.sh day --parts a --budget 180 "
                                "--smoke-only '^(fit-gpt-mini-compile|profile|report)$'")
    args = gpu_day.parse_args(["--smoke-only", "^(profile|report)$"])
    cmd = gpu_day.smoke_part(args, Path("/w"), 180.0)[0]
    assert cmd[cmd.index("--only") + 1] == "^(profile|report)$"
    # every part fine, but (e) ran out of time for some cases and (f) was skipped: run them again
    short = {"status": "ok", "result": {"skipped": ["gpt-mini fit whole second start (round 1)"]}}
    after = day_report.next_call(_parts("cuda", "a,e,f", a=ok, e=short,
                                        f={"status": "skipped: the day's budget is spent"}))
    assert after["command"] == "bash benchmarks/gpu_session.sh day --parts e,f --budget 180"
    assert "(f) skipped: the day's budget is spent" in after["why"]
    cut = {"status": "ok", "result": {"skipped": [], "timed_out": ["gpt-mini fit whole"]}}
    assert day_report.next_call(_parts("cpu", "e", e=cut))["command"] == \
        "bash benchmarks/gpu_session.sh day --device cpu --parts e"
    # a whole day: nothing to run again
    whole = _parts("cuda", "a,e,f", a=ok, e={"status": "ok", "result": {"skipped": [], "timed_out": []}},
                   f={"status": "not installed"})
    assert day_report.next_call(whole) is None
    whole.update(device_slug="h100", command="gpu_day.py", results_path="r.json", environment={}, goals=[])
    whole["config"]["budget_s"] = 510.0
    day_report.write_markdown(whole, tmp_path / "whole.md")
    assert "**Next device call:** none: every part ended fine and whole" in (tmp_path / "whole.md").read_text()
    whole["parts"]["a"]["status"] = "failures"
    day_report.write_markdown(whole, tmp_path / "failed.md")
    assert "**Next device call:** `bash benchmarks/gpu_session.sh day --parts a --budget 180`: fix what failed" \
        in (tmp_path / "failed.md").read_text()


@pytest.mark.processes
def test_a_cuda_day_without_a_gpu_is_refused_in_one_line_and_writes_nothing(tmp_path, capsys):
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    assert gpu_day.main(["--out", str(tmp_path / "out"), "--python", sys.executable]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "torch sees no CUDA device here" in err[0] and "--device cpu" in err[0]
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("part", ["z", "a,q"])
def test_an_unknown_part_is_one_clear_line(part, capsys):
    with pytest.raises(SystemExit) as exc:
        gpu_day.parse_args(["--parts", part])
    assert exc.value.code == 2
    assert "unknown parts" in capsys.readouterr().err


def test_a_smoke_only_that_is_no_regular_expression_is_one_clear_line(capsys):
    with pytest.raises(SystemExit) as exc:
        gpu_day.parse_args(["--parts", "a", "--smoke-only", "^(profile|report$"])
    assert exc.value.code == 2
    assert "--smoke-only '^(profile|report$' is not a regular expression" in capsys.readouterr().err


@pytest.mark.processes
def test_the_output_and_the_summary_start_with_the_device_name_and_the_torch_version(tmp_path, capsys):
    import torch

    rc, day, md = _day(tmp_path, "--parts", "b", "--zoo-tests", "tests/no_such_zoo.py")
    cpu = day["environment"]["devices"][0]["name"]
    first = capsys.readouterr().out.splitlines()[0]
    assert first.startswith(f"gpu day: cpu ({cpu}); torch {torch.__version__}, CUDA "), first
    assert md.splitlines()[2] == f"**{day_report.headline(day['environment'], 'cpu')}**"
    env = {"torch": "2.11.0+cu130", "cuda": "13.0", "cudnn": 91900, "driver": "580.1", "python": "3.12.3",
           "devices": [{"device": "cpu", "name": "Xeon"}, {"device": "cuda", "name": "NVIDIA H100 80GB HBM3"}]}
    assert day_report.headline(env, "cuda").startswith("cuda (NVIDIA H100 80GB HBM3); torch 2.11.0+cu130, CUDA 13.0")
    assert "could not be read: ImportError: no torch" in day_report.headline({"error": "ImportError: no torch"}, "cuda")


def _real(statuses: dict[str, str]) -> dict:
    """real_rows' answer for both workloads, one row per contender with the given statuses."""
    return {w: {"rows": [{"workload": w, "contender": c, "repeat": 0, "status": s, "reason": f"{c} said so"}
                         for c, s in statuses.items()], "summary": []}
            for w in ("resnet18-cifar", "gpt-mini")}


@pytest.mark.parametrize("statuses, require, failed", [
    ({"hand-eager": "ok", "lightning-bf16": "ok", "accelerate-bf16": "ok"}, True, []),
    ({"gputrain": "error", "lightning-bf16": "ok"}, False, ["gputrain"]),
    ({"lightning-bf16": "error", "accelerate-bf16": "ok"}, False, ["lightning-bf16"]),
    ({"lightning-bf16": "not installed", "accelerate-bf16": "ok"}, False, []),
    ({"lightning-bf16": "not installed", "accelerate-bf16": "not installed"}, True,
     ["lightning-bf16", "accelerate-bf16"]),
])
def test_a_contender_that_errors_or_a_required_peer_that_is_missing_fails_the_speed_part(
        monkeypatch, statuses, require, failed):
    import torch

    from benchmarks.gpu_day import speed as day_speed

    monkeypatch.setattr(day_speed, "real_rows", lambda *a, **k: _real(statuses))
    monkeypatch.setattr(day_speed.rm, "bf16_matmul_peak", lambda device: None)
    written = []
    result = day_speed.run_rows(torch.device("cpu"), 1, day_speed.Budget(60), {"real"}, written.append,
                                require_peers=require)
    assert written and result["rows"]["resnet18"]["status"] == "ok"
    assert result["status"] == ("failures" if failed else "ok")
    lines = result.get("failed_contenders", [])
    assert [ln.split(":")[0] for ln in lines] == [f"{k} {c}" for k in ("resnet18", "gpt-mini") for c in failed]
    assert all(f"{c} said so" in ln for ln, c in zip(lines, failed * 2))


def test_a_peer_row_is_bf16_only_when_its_forward_ran_under_bf16_autocast():
    import torch
    from torch import nn

    from benchmarks.contenders import AutocastSeen

    def run(how: str) -> str:
        model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2))
        seen = AutocastSeen(model, torch.device("cpu"))
        x = torch.randn(3, 4)
        if how == "around the call":  # Lightning: autocast around training_step
            with torch.autocast("cpu", dtype=torch.bfloat16):
                model(x)
        elif how == "inside forward":  # Accelerate: prepare() wraps model.forward, inside __call__
            model.forward = torch.autocast("cpu", dtype=torch.bfloat16)(model.forward)
            model(x)
        elif how == "off":
            model(x)
        return seen.check("the peer")

    assert run("around the call") == run("inside forward") == "forward under bf16 autocast on cpu (checked in the run)"
    with pytest.raises(RuntimeError, match="the peer: the model's forward ran with autocast off on cpu, not bf16"):
        run("off")
    with pytest.raises(RuntimeError, match="autocast never called"):
        run("not at all")


def test_a_peer_row_is_fp32_only_when_its_forward_ran_without_autocast():
    import torch
    from torch import nn

    from benchmarks.contenders import AutocastSeen

    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2))
    seen = AutocastSeen(model, torch.device("cpu"))
    model(torch.randn(3, 4))
    assert seen.check("the peer", "fp32") == "forward without autocast on cpu (checked in the run)"
    seen = AutocastSeen(model, torch.device("cpu"))
    with torch.autocast("cpu", dtype=torch.bfloat16):  # Lightning's 32-true would not do this
        model(torch.randn(3, 4))
    with pytest.raises(RuntimeError, match="the peer: the model's forward ran with autocast bfloat16 on cpu, not fp32"):
        seen.check("the peer", "fp32")


def test_each_contender_trains_the_steps_it_is_given_and_times_them_apart():
    """benchmarks/contenders.py, which train_speed, real_models and the day's speed part share: the
    hand loop and the seed tutorials' loop run `warmup` untimed steps, then `steps` timed ones (one
    forward each); gputrain's timed window runs from its log point after the warm-up to its last;
    the model's build is inside the call's wall time and out of its whole-run time."""
    import torch
    from torch import nn

    from benchmarks.contenders import Length, Recipe, Spec, gputrain_run, hand_loop, seed_loop

    forwards = []

    def make_model() -> nn.Module:
        model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3))
        model.register_forward_pre_hook(lambda module, args: forwards.append(args[0].shape[0]))
        return model

    g = torch.Generator().manual_seed(0)
    spec = Spec("tiny", 16, torch.randn(40, 4, generator=g), torch.randint(0, 3, (40,), generator=g), make_model,
                nn.CrossEntropyLoss(), task="classification")
    assert Length.of_epochs(spec, 2) == Length(steps=6, epochs=2)  # 3 batches an epoch, the last of 8
    cpu, length = torch.device("cpu"), Length(steps=6, warmup=3)
    for contender in (hand_loop, seed_loop):
        forwards.clear()
        run = contender(spec, cpu, length, Recipe())
        assert len(forwards) == 9 and sorted(set(forwards)) == [8, 16], (contender.__name__, forwards)
        assert (run.warmup_steps, run.measured_steps) == (3, 6)
        assert 0 < run.model_s < run.wall_s and 0 < run.measured_s < run.whole_s
    run = gputrain_run(spec, cpu, length, Recipe(weight_decay=0.0), precision="fp32", schedule="constant")
    assert (run.warmup_steps, run.measured_steps) == (3, 6)  # log points at steps 3, 6 and 9
    assert 0 < run.measured_s < run.whole_s < run.wall_s


def test_the_day_names_its_results_file_by_its_device():
    env, slug = gpu_day.read_environment(gpu_day.parse_args(["--device", "cpu", "--python", sys.executable]))
    assert env["torch"] and slug == "cpu"
    import torch

    if not torch.cuda.is_available():  # a CUDA day without a GPU: no GPU's name to take
        env, slug = gpu_day.read_environment(gpu_day.parse_args(["--python", sys.executable]))
        assert slug == "cpu" and [d["device"] for d in env["devices"]] == ["cpu"]


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_the_day_counts_each_sync_of_a_case_at_its_line(device):
    """benchmarks/gpu_day/syncs.py's count_case (part (c)): on CUDA under the sync debug mode, after torch's
    one-time notice that the mode is a prototype has been consumed (it would count as a sync); on the
    CPU as host reads. A read planted in a per-step callback is counted once per step at its line, and
    the same case without it has no site there."""
    import torch

    from benchmarks.gpu_day import syncs as day_syncs
    from gputrain import Callback

    class ReadsTheDevice(Callback):
        every_step = True  # on_step after every optimizer step (the run takes no CUDA graph then)

        def on_step(self, run):
            torch.ones((), device=device).item()  # PLANTED

    day_syncs.consume_sync_debug_notice()
    steps = 5
    planted = day_syncs.count_case(lambda: day_syncs._plain(device, steps, callbacks=[ReadsTheDevice()]), device, steps)
    assert planted["status"] == "ok"
    assert planted["counted"] == {"cpu": "host-reads", "cuda": "cuda-syncs"}[device]
    site = next(s for s in planted["sites"] if s["code"].endswith("# PLANTED"))
    assert site["count"] == steps and site["where"].startswith(f"{__file__}:") and planted["syncs"] >= steps
    plain = day_syncs.count_case(lambda: day_syncs._plain(device, steps), device, steps)
    assert plain["status"] == "ok" and isinstance(plain["syncs"], int)
    assert not [s for s in plain["sites"] if s["code"].endswith("# PLANTED")]
