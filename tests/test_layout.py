"""The house rules of the layout: the training core does not import workloads, bench or diagnostics."""

import ast
from pathlib import Path

import gputrain

CORE = ("train", "data", "runtime", "io")
FORBIDDEN = ("gputrain.workloads", "gputrain.bench", "gputrain.diagnostics", "gputrain.commands")


def _imports(path: Path) -> list[str]:
    names = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.append(node.module)
    return names


def test_the_training_core_imports_no_workloads_bench_or_diagnostics():
    root = Path(gputrain.__file__).parent
    offenders = [f"{path.relative_to(root)} imports {name}"
                 for pkg in CORE for path in sorted((root / pkg).rglob("*.py"))
                 for name in _imports(path) if name.startswith(FORBIDDEN)]
    assert offenders == []


def test_modules_stay_small():
    root = Path(gputrain.__file__).parent
    big = {str(p.relative_to(root)): n for p in root.rglob("*.py")
           if (n := len(p.read_text().splitlines())) > 700}
    assert big == {}, "split these by concern"
