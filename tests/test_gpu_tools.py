"""The tools for the day a GPU is lent, checked on the CPU: benchmarks/gpu_day/smoke.py's lines (every
built-in workload, every flag one gputrain accepts) and its summary; scripts/uncovered_functions.py."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

from benchmarks.gpu_day import smoke

ROOT = Path(__file__).resolve().parents[1]


def _load(path: Path):
    spec = importlib.util.spec_from_file_location(path.stem, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[path.stem] = module
    spec.loader.exec_module(module)
    return module


uncovered = _load(ROOT / "scripts" / "uncovered_functions.py")


def _plan(tmp_path, *argv):
    args = smoke.parse_args(["--out", str(tmp_path), "--dry-run", *argv])
    return smoke.plan(args, tmp_path / "smoke")


def test_smoke_lines_cover_every_workload_and_each_command_and_parse(tmp_path):
    from gputrain.cli import build_parser
    from gputrain.workloads.registry import WORKLOADS

    lines = _plan(tmp_path)
    names = [ln.name for ln in lines]
    assert len(names) == len(set(names))
    assert {f"fit-{w}" for w in WORKLOADS} <= set(names)
    import argparse

    commands = {ln.argv[1] for ln in lines if ln.argv[0] == "gputrain"}
    every = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction)).choices
    assert commands == set(every)  # a smoke line for every CLI command
    fit_flags = {a for ln in lines if ln.argv[:2] == ["gputrain", "fit"] for a in ln.argv if a.startswith("--")}
    assert {"--compile", "--autotune", "--on-nan", "--precision", "--data-on-device", "--resume"} <= fit_flags
    assert {ln.argv[ln.argv.index("--precision") + 1] for ln in lines if "--precision" in ln.argv} == {"fp16", "bf16"}
    parser = build_parser()
    for ln in lines:
        if ln.argv[0] == "gputrain":  # the flags exist and take these values (argparse exits on a bad one)
            args = parser.parse_args(ln.argv[1:])
            assert getattr(args, "device", "cuda") in ("cuda", None), ln.name
    by_name = {ln.name: ln for ln in lines}
    assert all(ln.after in by_name and names.index(ln.after) < names.index(ln.name) for ln in lines if ln.after)
    assert names[0] == "gpu-tests" and names.index("report") > names.index("profile")


def test_smoke_filters_and_cpu_mode(tmp_path):
    lines = _plan(tmp_path, "--device", "cpu", "--only", "fit-digits", "--skip", "bf16|batch", "--demo-failure")
    assert [ln.name for ln in lines] == ["demo-failure-nan-stop", "fit-digits-cnn", "fit-digits-cnn-fp16"]
    assert lines[2].status == "skipped: needs cuda" and lines[1].status == "not run"
    assert all("--device cpu" in ln.command for ln in lines)


@pytest.mark.processes
def test_smoke_runs_lines_and_writes_one_summary_with_the_error_tail(tmp_path):
    """Two real subprocesses through the scheduler: one passes, one fails; the JSON counts them and
    the Markdown shows the failing command and the end of its output."""
    import argparse

    lines = [smoke.Line("ok", ["json.tool", "--help"], 60, "a command that works", expect=r"usage"),
             smoke.Line("bad", ["gputrain", "fit", "no-such-workload"], 60, "a command that fails")]
    for ln in lines:
        ln.command = " ".join(["python", "-m", *ln.argv])
    args = argparse.Namespace(device="cpu", steps=3, budget=120, jobs=2, python=sys.executable)
    wall = smoke.run(lines, args, tmp_path / "smoke")
    summary = smoke.summarize(lines, args, wall)
    assert (summary["passed"], summary["failed"], summary["skipped"]) == (1, 1, 0)
    bad = summary["lines"][1]
    assert bad["status"] == "fail: exit 2" and "unknown workload" in bad["tail"]
    smoke.write_markdown(summary, tmp_path / "gpu_smoke.md")
    md = (tmp_path / "gpu_smoke.md").read_text()
    assert md.startswith("# gpu smoke: 1 passed, 1 failed, 0 skipped")
    assert "## bad: fail: exit 2" in md and "python -m gputrain fit no-such-workload" in md
    assert "unknown workload" in md.split("## bad")[1]
    json.dumps(summary)  # the summary file is plain JSON


def _report(functions: dict[str, tuple[int, int]]) -> dict:
    """A coverage JSON of one file: name -> (statements, covered)."""
    return {"totals": {"percent_covered": 50.0}, "files": {"src/gputrain/m.py": {"functions": {
        name: {"start_line": i + 1, "summary": {"num_statements": n, "covered_lines": c}}
        for i, (name, (n, c)) in enumerate(functions.items())}}}}


def test_uncovered_functions_folds_nested_ones_into_a_parent_that_never_ran(tmp_path, capsys):
    report = _report({"": (5, 5), "ran": (3, 1), "ran.inner": (2, 0), "never": (4, 0), "never.inner": (1, 0),
                      "C.method": (2, 0), "C.method.deep.deeper": (1, 0), "empty": (0, 0)})
    rows = uncovered.uncovered(report)
    assert [(r["qualname"], r["nested"]) for r in rows] == [("ran.inner", 0), ("never", 1), ("C.method", 1)]
    path = tmp_path / "coverage.json"
    path.write_text(json.dumps(report))
    checklist = tmp_path / "checklist.md"
    checklist.write_text("- `m.py::ran.inner`: ...\n- `m.py::never`: ...\n")
    assert uncovered.main([str(path), "--checklist", str(checklist)]) == 1
    err = capsys.readouterr().err
    assert "not in" in err and "m.py::C.method" in err and "m.py::never" not in err
    checklist.write_text(checklist.read_text() + "- `m.py::C.method`\n")
    assert uncovered.main([str(path), "--checklist", str(checklist)]) == 0
    out = capsys.readouterr().out
    assert "src/gputrain/m.py:4  never  (4 lines, +1 nested)" in out and "# 3 functions with no line run" in out


def test_uncovered_functions_needs_per_function_data():
    with pytest.raises(SystemExit, match="per-function data"):
        uncovered.uncovered({"totals": {}, "files": {"src/gputrain/m.py": {"summary": {}}}})
