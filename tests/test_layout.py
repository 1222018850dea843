"""The house rules of the layout, checked on the code's own imports and calls:

- the training core (train, checkpoint, data, runtime, io) imports no workloads, bench, diagnostics or commands;
- diagnostics imports no bench or commands (the benchmarks build on the diagnostics, not back);
- io, data and runtime import no train, report or checkpoint (the floors under the trainer);
- checkpoint imports no train or report: it sits on those floors, under the trainer, which hands it
  what it reads as Protocols;
- inside train/, imports run one way: loop -> evaluation -> step -> optim (loop also uses step and
  optim directly; modes.py sits beside them for loop and evaluation);
- only cli.py and commands/ import gputrain.commands: a run is trained below the command line
  (gputrain/runs/), which the commands, the sweeps and the Python API call;
- nothing outside io/ opens a file for writing: files are written whole or not at all through
  io/atomic.py (allow-listed: logs that only append);
- no module is over 500 lines.
"""

import ast
from pathlib import Path

import gputrain

ROOT = Path(gputrain.__file__).parent
CORE = ("train", "checkpoint", "data", "runtime", "io")
FORBIDDEN = ("gputrain.workloads", "gputrain.bench", "gputrain.diagnostics", "gputrain.commands")

# Files that open a file for writing themselves, and why that is safe.
WRITES_ALLOWED = {
    "report/metrics_log.py": "metrics.jsonl and metrics.csv only grow, one line per log point (append mode); a crash "
                             "leaves at most a cut last line, which readers skip; rewrites go through io/atomic.py",
}
MAX_LINES = 500


def _modules(*folders: str) -> list[Path]:
    return sorted(p for f in folders for p in (ROOT / f).rglob("*.py")) if folders else sorted(ROOT.rglob("*.py"))


def _imports(path: Path) -> list[str]:
    names = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.append(node.module)
    return names


def _offenders(folders: tuple[str, ...], forbidden: tuple[str, ...]) -> list[str]:
    return [f"{path.relative_to(ROOT)} imports {name}"
            for path in _modules(*folders) for name in _imports(path) if name.startswith(forbidden)]


def test_the_training_core_imports_no_workloads_bench_or_diagnostics():
    assert _offenders(CORE, FORBIDDEN) == []


def test_diagnostics_import_no_bench_or_commands():
    assert _offenders(("diagnostics",), ("gputrain.bench", "gputrain.commands")) == []


def test_the_floors_under_the_trainer_import_nothing_above_them():
    """io, data and runtime serve the trainer and the reports, never the other way round (export reads
    a model's logits through gputrain/outputs.py, not train/step/loss.py)."""
    assert _offenders(("io", "data", "runtime"), ("gputrain.train", "gputrain.report", "gputrain.checkpoint")) == []


def test_the_checkpoint_package_sits_under_the_trainer():
    """The checkpoint package reads the trainer through Protocols (checkpoint/parts.py, save_resume.py), so it
    imports nothing of train/ (nor the reports above it)."""
    assert _offenders(("checkpoint",), ("gputrain.train", "gputrain.report")) == []


# train/'s sub-packages, each with those it must not import (the way runs loop -> evaluation -> step -> optim).
TRAIN_ABOVE = {
    "optim": ("gputrain.train.step.train_step", "gputrain.train.evaluation", "gputrain.train.loop"),
    "step": ("gputrain.train.evaluation", "gputrain.train.loop"),
    "evaluation": ("gputrain.train.loop",),
}


def test_train_is_by_concern_and_its_imports_run_one_way():
    """The step knows nothing of the loop or evaluation, the optimizers nothing of the step: a part
    that needs something from above is in the wrong place. Every module of train/ is in one of the
    four concerns, except modes.py (the user's train/eval modes, used by the loop and evaluation)."""
    train = ROOT / "train"
    assert sorted(p.name for p in train.iterdir() if p.suffix == ".py") == ["__init__.py", "modes.py"]
    assert sorted(p.name for p in train.iterdir() if p.is_dir() and p.name != "__pycache__") == [
        "evaluation", "loop", "optim", "step"]
    offenders = [o for sub, above in TRAIN_ABOVE.items() for o in _offenders((f"train/{sub}",), above)]
    assert offenders == []


def test_only_the_command_line_imports_the_commands():
    """The command line parses and renders; what it runs lives below it, so nothing else imports
    gputrain.commands (a sweep's trial trains through gputrain/runs/, as `gputrain fit` does)."""
    offenders = [f"{path.relative_to(ROOT)} imports {name}" for path in _modules()
                 if str(path.relative_to(ROOT)) != "cli.py" and path.relative_to(ROOT).parts[0] != "commands"
                 for name in _imports(path) if name.startswith("gputrain.commands")]
    assert offenders == []


def _mode(call: ast.Call, position: int) -> str | None:
    """The mode string of an open-like call (positional `position` or mode=), when it is a literal."""
    args = [a for a in call.args if not isinstance(a, ast.Starred)]
    node = args[position] if len(args) > position else next((k.value for k in call.keywords if k.arg == "mode"), None)
    return node.value if isinstance(node, ast.Constant) and isinstance(node.value, str) else None


def file_writes(source: str) -> list[tuple[int, str]]:
    """(line, call) of every call in `source` that writes a file without io/atomic.py: open() or
    os.fdopen() in a write/append/create mode, Path.open() likewise, Path.write_text/write_bytes."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.Call):
            continue
        f = node.func
        name = f.id if isinstance(f, ast.Name) else f.attr if isinstance(f, ast.Attribute) else ""
        if name in ("write_text", "write_bytes") and isinstance(f, ast.Attribute):
            found.append((node.lineno, name))
        elif name in ("open", "fdopen"):
            # open(path, mode) and os.fdopen(fd, mode); a method open (Path.open(mode)) takes the mode first
            function = isinstance(f, ast.Name) or name == "fdopen" or ast.unparse(f) in ("io.open", "os.open")
            position = 1 if function else 0
            mode = _mode(node, position)
            if mode is not None and any(c in mode for c in "wax+"):
                found.append((node.lineno, f"{ast.unparse(f)}(..., {mode!r})"))
    return found


def test_the_check_for_file_writes_finds_each_kind():
    src = ("open(p, 'w')\nopen(p, mode='ab')\nos.fdopen(fd, 'wb')\nPath(p).open('w')\np.write_text('x')\n"
           "q.write_bytes(b'')\nopen(p)\nopen(p, 'rb')\nPath(p).open()\nf.write('x')\n")
    assert [line for line, _ in file_writes(src)] == [1, 2, 3, 4, 5, 6]


def test_nothing_outside_io_writes_a_file_without_the_atomic_helper():
    outside = [(rel, path) for path in _modules()
               if (rel := str(path.relative_to(ROOT))).split("/")[0] != "io" and rel not in WRITES_ALLOWED]
    offenders = [f"{rel}:{line} {call}" for rel, path in outside for line, call in file_writes(path.read_text())]
    assert offenders == [], "write through gputrain.io.atomic (atomic_file / write_text), or allow-list with a reason"


def test_modules_stay_small():
    lines = {str(p.relative_to(ROOT)): len(p.read_text().splitlines()) for p in _modules()}
    big = {name: n for name, n in lines.items() if n > MAX_LINES}
    assert big == {}, "split these by concern"


def test_every_public_name_resolves_and_an_unknown_one_is_an_attribute_error():
    """The names `gputrain` loads on first use (its module __getattr__) each import and are the objects
    of the module they name; __all__ lists only names that exist; a misspelling says what is missing."""
    import importlib

    import pytest

    for name, module in gputrain._LAZY.items():
        assert getattr(gputrain, name) is getattr(importlib.import_module(module), name), name
    assert all(hasattr(gputrain, name) for name in gputrain.__all__)
    with pytest.raises(AttributeError, match="module 'gputrain' has no attribute 'fitt'"):
        gputrain.fitt  # noqa: B018
