"""scripts/untaken_branches.py on a synthetic coverage.json and source files of its own: it finds a
CUDA-only branch that the CPU suite never takes, asks the checklist for it, and flags stale entries."""

from __future__ import annotations

import ast
import json
from pathlib import Path

import pytest
from test_gpu_tools import ROOT, _load

branches = _load(ROOT / "scripts" / "untaken_branches.py")

SOURCE = '''\
import torch


def step(x, device, scale=None):
    if device.type == "cuda":
        x = x.cuda(non_blocking=True)
    if scale is None:
        scale = 1.0
    if device.type == "cuda":
        torch.cuda.synchronize()
    return x * scale


def set_lr(group, value):
    if isinstance(group["lr"], torch.Tensor):  # cuda-only: a capturable optimizer's device lr
        group["lr"].fill_(value)
    else:
        group["lr"] = value


def load(state):
    if not torch.cuda.is_available():
        return state
    for key in state:
        state[key] = state[key].cuda()
    return state
'''

CUDA_IDS = [  # what the checker must ask the checklist for
    "mod.py::step: if device.type == 'cuda' -> true",
    "mod.py::step: if device.type == 'cuda' (#2) -> true",
    "mod.py::set_lr: if isinstance(group['lr'], torch.Tensor) -> true",  # by its tag
    "mod.py::load: if not torch.cuda.is_available() -> false",  # `not` swaps the side
]
OTHER_ID = "mod.py::step: if scale is None -> false"  # CPU code no test takes: information only


def _line(text: str, needle: str, nth: int = 1) -> int:
    hits = [i for i, line in enumerate(text.splitlines(), 1) if needle in line]
    return hits[nth - 1]


def _write(tmp_path: Path, source: str = SOURCE, shift: int = 0) -> Path:
    """src/gputrain/mod.py and the coverage JSON that a CPU run of it would give (every function entered,
    scale always None, no CUDA). `shift` lines are added at the top: the names must not change."""
    source = "# an edit elsewhere in the file\n" * shift + source
    file = tmp_path / "src" / "gputrain" / "mod.py"
    file.parent.mkdir(parents=True, exist_ok=True)
    file.write_text(source)
    L = lambda needle, nth=1: _line(source, needle, nth)  # noqa: E731
    cuda1, cuda2, scale, ret = L('if device.type == "cuda"'), L('if device.type == "cuda"', 2), L("if scale is None"), L("return x * scale")
    tagged, tensor_else = L("if isinstance(group"), L('group["lr"] = value')
    avail, loop = L("if not torch.cuda.is_available()"), L("for key in state")
    functions = {
        "step": {"start_line": L("def step"), "executed": [cuda1, scale, scale + 1, cuda2, ret],
                 "taken": [[cuda1, scale], [scale, scale + 1], [cuda2, ret]],
                 "missing": [[cuda1, cuda1 + 1], [scale, cuda2], [cuda2, cuda2 + 1]]},
        "set_lr": {"start_line": L("def set_lr"), "executed": [tagged, tensor_else],
                   "taken": [[tagged, tensor_else]], "missing": [[tagged, tagged + 1]]},
        "load": {"start_line": L("def load"), "executed": [avail, avail + 1],
                 "taken": [[avail, avail + 1]],
                 # the loop's line never ran: counted behind the untaken branch, not listed
                 "missing": [[avail, loop], [loop, loop + 1], [loop, loop + 2]]},
    }
    executed = sorted({ln for f in functions.values() for ln in f["executed"]} | {L("import torch"), L("def step")})
    report = {
        "meta": {"version": "7.17.3", "timestamp": "2999-01-01T00:00:00", "branch_coverage": True},
        "totals": {"covered_lines": len(executed), "num_statements": 20, "covered_branches": 5, "num_branches": 11,
                   "num_partial_branches": 4, "percent_covered": 50.0},
        "files": {str(file): {
            "executed_lines": executed,
            "functions": {
                name: {"start_line": f["start_line"], "executed_lines": f["executed"],
                       "summary": {"covered_lines": len(f["executed"]), "num_statements": len(f["executed"]) + 2},
                       "executed_branches": f["taken"], "missing_branches": f["missing"]}
                for name, f in functions.items()} | {
                "": {"start_line": 1, "executed_lines": [L("import torch")], "summary": {"covered_lines": 1, "num_statements": 1},
                     "executed_branches": [], "missing_branches": []}}}},
    }
    path = tmp_path / "coverage.json"
    path.write_text(json.dumps(report))
    return path


def _checklist(tmp_path: Path, *ids: str) -> Path:
    rows = "\n".join(f"| [ ] | `{i.replace('|', chr(92) + '|')}` | smoke:fit-x |" for i in ids)
    page = tmp_path / "gpu_checklist.md"
    page.write_text(f"# checklist\n\n{branches.SECTION} of functions the CPU suite enters\n\n"
                    f"| | branch | run by |\n|---|---|---|\n{rows}\n\n## Next section\n\n"
                    f"`mod.py::elsewhere: if x -> true` (not in the table: not read)\n")
    return page


def test_a_cuda_only_untaken_branch_missing_from_the_checklist_fails_the_check(tmp_path, capsys):
    report = _write(tmp_path)
    page = _checklist(tmp_path, *CUDA_IDS[1:])  # the first is left out
    rc = branches.main([str(report), "--root", str(tmp_path), "--checklist", str(page)])
    out, err = capsys.readouterr()
    assert rc == 1
    assert f"not in {page}: {CUDA_IDS[0]}" in err
    assert not any(f"not in {page}: {i} " in err for i in CUDA_IDS[1:])
    assert "stale" not in err.replace("0 stale", "")
    assert OTHER_ID not in err  # an untaken CPU branch is information, never required
    for i in CUDA_IDS:
        assert f"cuda   {i}   " in out
    assert f"other  {OTHER_ID}   " in out
    assert "# total: 4 CUDA-only untaken branches (3 by pattern, 1 tagged, 0 listed by hand), 1 other" in out
    assert "2 more behind them never reached" in out  # the loop in load(), folded into its guard
    assert "+2 branches after it never reached" in out


def test_the_check_passes_when_the_checklist_lists_every_cuda_only_branch(tmp_path, capsys):
    report = _write(tmp_path)
    page = _checklist(tmp_path, *CUDA_IDS)
    assert branches.main([str(report), "--root", str(tmp_path), "--checklist", str(page)]) == 0
    assert f"every CUDA-only untaken branch is in {page} (4 entries, none stale)" in capsys.readouterr().out


def test_an_entry_that_matches_no_untaken_branch_is_stale(tmp_path, capsys):
    report = _write(tmp_path)
    gone = "mod.py::step: if x.is_cuda -> true"  # no such decision
    page = _checklist(tmp_path, *CUDA_IDS, gone)
    assert branches.main([str(report), "--root", str(tmp_path), "--checklist", str(page)]) == 1
    err = capsys.readouterr().err
    assert f"stale in {page}: {gone}" in err and "not in" not in err
    # a branch the suite takes now is stale too: the taken way of the tagged decision
    page = _checklist(tmp_path, *CUDA_IDS, "mod.py::set_lr: if isinstance(group['lr'], torch.Tensor) -> false")
    assert branches.main([str(report), "--root", str(tmp_path), "--checklist", str(page)]) == 1
    assert "stale in" in capsys.readouterr().err


def test_an_untaken_branch_listed_by_hand_passes_and_names_survive_edits_elsewhere(tmp_path, capsys):
    report = _write(tmp_path, shift=7)  # every line number moves; the names must not
    page = _checklist(tmp_path, *CUDA_IDS, OTHER_ID)
    assert branches.main([str(report), "--root", str(tmp_path), "--checklist", str(page)]) == 0
    out = capsys.readouterr().out
    assert f"cuda   {OTHER_ID}   " in out and "listed by hand" in out
    assert "1 listed by hand" in out
    # --table prints a row to paste for each CUDA-only branch the page lacks
    page = _checklist(tmp_path, *CUDA_IDS[:2])
    assert branches.main([str(report), "--root", str(tmp_path), "--checklist", str(page), "--table"]) == 1
    rows = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("| [ ] |")]
    assert [r.split("`")[1] for r in rows] == CUDA_IDS[2:]


@pytest.mark.parametrize("condition, truth, cuda", [
    ("device.type == 'cuda'", True, True), ("device.type == 'cuda'", False, False),
    ("device.type != 'cuda'", False, True), ("device.type != 'cuda'", True, False),
    ("device.type == 'cpu'", False, True), ("name == 'cpu'", False, False),
    ("device.type in ('cuda', 'mps')", True, True), ("device.type in ('cuda', 'cpu')", True, False),
    ("backend == 'nccl'", True, True), ("spec.startswith('cuda')", True, True),
    ("not torch.cuda.is_available() or _cuda_count() == 0", False, True),
    ("not torch.cuda.is_available() or _cuda_count() == 0", True, False),
    ("x is not None and x.is_cuda", True, True), ("x is None or not x.is_cuda", True, False),
    ("self.precision.use_scaler", True, True), ("not loader.pin_memory", False, True),
    ("torch.cuda.device_count() > 1", True, True), ("p.torch_cuda is None", False, True),
    ("self.speed.cuda_graphs", True, True),
    ("cfg.cuda_graphs is True", True, False),  # what the user asked for: a CPU run may be asked too
    ("isinstance(lr, torch.Tensor)", True, False), ("self.graphed", True, False),
    ("gpu is None", False, True), ("on_gpu", True, True), ("not gpus", False, True),
    ("why_no_gpu()", True, False), ("args.no_cuda", False, False),  # a "no" in the name: true when there is none
])
def test_the_pattern_reads_which_way_of_a_condition_implies_cuda(condition, truth, cuda):
    assert bool(branches.implies_cuda(ast.parse(condition, mode="eval").body, truth)) is cuda


def test_a_report_without_branch_data_is_refused(tmp_path):
    with pytest.raises(SystemExit, match="no branch data"):
        branches.untaken({"meta": {"branch_coverage": False}, "files": {}, "totals": {}})


def test_a_file_that_changed_since_the_run_is_not_read_and_the_check_says_measure_again(tmp_path, capsys):
    report = _write(tmp_path)
    page = _checklist(tmp_path, *CUDA_IDS)
    file = tmp_path / "src" / "gputrain" / "mod.py"
    file.write_text(SOURCE.replace("    if scale is None:\n", "    # a comment where a measured line was\n"
                                                              "    if scale is None:\n"))
    assert branches.main([str(report), "--root", str(tmp_path), "--checklist", str(page)]) == 1
    out, err = capsys.readouterr()
    assert "1 source files changed since the run" in out and "cuda   mod.py::" not in out
    assert "cannot check 1 files that changed since the run (mod.py)" in err
    assert "stale" not in err.replace("0 stale", "")  # its entries are neither stale nor current
    # modified after the run started, lines unchanged: read, with a warning
    file.write_text(SOURCE)
    (tmp_path / "run_started").write_text("0")
    assert branches.main([str(report), "--root", str(tmp_path), "--checklist", str(page)]) == 0
    assert "1 source files were modified after the run started" in capsys.readouterr().out


def test_not_the_cpu_means_cuda_only_unless_an_earlier_branch_took_the_cuda_case():
    source = branches.Source('''\
def device_name(device):
    if device.type == "cuda":
        return "gpu"
    if device.type == "cpu":
        return "cpu"
    return str(device)


def to_device(batch, device):
    if device.type == "cpu":
        return batch
    return batch.to(device, non_blocking=True)


def pinned(batch, device):
    if device.type == "cuda":
        batch = batch.pin_memory()
    if device.type == "cpu":
        return batch
    return batch.to(device, non_blocking=True)


def pick(dev):
    if dev == "cuda":
        x = 1
    elif dev == "cpu":
        x = 2
    return x


def precision(name, dev):
    if name == "tf32":
        if dev != "cuda":
            raise ValueError(dev)
    if dev == "cpu":
        raise ValueError("fp16 on the CPU")
    return name
''')
    false_side = {(d.function.name, d.text): bool(branches.implies_cuda(d.node.test, False, d.handled))
                  for d in source.decisions.values()}
    assert false_side == {
        ("device_name", "device.type == 'cuda'"): False,
        ("device_name", "device.type == 'cpu'"): False,  # cuda returned above: a third device
        ("to_device", "device.type == 'cpu'"): True,
        ("pinned", "device.type == 'cuda'"): False,
        ("pinned", "device.type == 'cpu'"): True,  # the cuda case above goes on: this one still sees it
        ("pick", "dev == 'cuda'"): False, ("pick", "dev == 'cpu'"): False,  # the elif below the cuda case
        ("precision", "name == 'tf32'"): False, ("precision", "dev != 'cuda'"): True,
        ("precision", "dev == 'cpu'"): True,  # the cuda test above is nested, not a sibling
    }


def test_the_function_check_refuses_a_file_that_changed_since_the_run(tmp_path, capsys):
    functions = _load(ROOT / "scripts" / "uncovered_functions.py")
    report = _write(tmp_path)  # every function of mod.py ran
    page = _checklist(tmp_path)
    argv = [str(report), "--root", str(tmp_path), "--checklist", str(page)]
    assert functions.main(argv) == 0
    file = tmp_path / "src" / "gputrain" / "mod.py"
    file.write_text("\n\n" + SOURCE[:SOURCE.index("def load")])  # lines moved, a function gone
    assert functions.main(argv) == 1
    out, err = capsys.readouterr()
    assert "1 source files changed since the run" in out and "cannot check 1 files that changed since the run (mod.py)" in err
