"""The type gate: basedpyright, in the standard mode of pyproject's [tool.basedpyright], reports no
error over src/gputrain; the gate can fail; inline ignores stay few and each names its rule; the wheel
carries py.typed, so that users' type checkers read those annotations."""

import importlib.util
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SRC = REPO / "src" / "gputrain"
MAX_INLINE_IGNORES = 20  # the project's limit on `# pyright: ignore[rule]` comments in src/gputrain


def _basedpyright() -> list[str]:
    """The command that runs the basedpyright of this Python's environment; fails when there is none."""
    script = Path(sys.executable).parent / "basedpyright"
    if script.exists():
        return [str(script)]
    if importlib.util.find_spec("basedpyright") is not None:
        return [sys.executable, "-m", "basedpyright"]
    pytest.fail(f"basedpyright is not installed in this environment ({sys.executable}): run "
                "`bash scripts/setup.sh`, which installs the test extras", pytrace=False)


def _check(*args: str, cwd: Path) -> list[dict]:
    """basedpyright's diagnostics (its --outputjson list) for a run with these arguments."""
    cmd = [*_basedpyright(), "--outputjson", "--pythonpath", sys.executable, *args]
    proc = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=600)
    try:
        report = json.loads(proc.stdout)
    except json.JSONDecodeError:
        pytest.fail(f"{' '.join(cmd)} exited {proc.returncode} without a JSON report:\n"
                    f"{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}", pytrace=False)
    return report["generalDiagnostics"]


def _describe(d: dict) -> str:
    """`path:line: [rule] message`, the path relative to the repository."""
    path = Path(d.get("file", "?"))
    where = path.relative_to(REPO) if path.is_relative_to(REPO) else path
    line = d["range"]["start"]["line"] + 1 if "range" in d else "?"
    return f"{where}:{line}: [{d.get('rule', '?')}] {d['message']}"


@pytest.mark.processes
def test_the_package_has_no_type_errors():
    errors = [d for d in _check(cwd=REPO) if d["severity"] == "error"]
    assert not errors, f"basedpyright reports {len(errors)} error(s) in src/gputrain:\n" + "\n".join(
        _describe(d) for d in errors)


def _project_settings() -> dict:
    """pyproject's [tool.basedpyright] (the mode, the Python version), without its include."""
    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10: the settings the project has
        return {"typeCheckingMode": "standard"}
    with open(REPO / "pyproject.toml", "rb") as f:
        settings = dict(tomllib.load(f)["tool"]["basedpyright"])
    settings.pop("include", None)
    return settings


@pytest.mark.processes
def test_the_gate_fails_on_a_misspelled_torch_call(tmp_path):
    """The bug class the gate exists for: torch.cuda.getdevice_name (for get_device_name) crashed
    every CUDA run, and only on CUDA, so no CPU test saw it."""
    (tmp_path / "probe.py").write_text("import torch\ntorch.cuda.getdevice_name(0)\n")
    settings = _project_settings()
    assert settings.get("typeCheckingMode") == "standard"
    config = tmp_path / "pyrightconfig.json"
    config.write_text(json.dumps({**settings, "include": ["probe.py"]}))
    found = [d for d in _check("-p", str(config), cwd=tmp_path) if d["severity"] == "error"]
    assert any(d.get("rule") == "reportAttributeAccessIssue" and "getdevice_name" in d["message"]
               for d in found), [_describe(d) for d in found]


_IGNORE = re.compile(r"#\s*(pyright|type):\s*ignore(\[)?")


def test_inline_ignores_are_few_and_name_their_rule():
    ignores, without_rule = [], []
    for path in sorted(SRC.rglob("*.py")):
        for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            for match in _IGNORE.finditer(line):
                where = f"{path.relative_to(REPO)}:{number}: {line.strip()}"
                ignores.append(where)
                if match.group(1) != "pyright" or match.group(2) is None:
                    without_rule.append(where)
    assert not without_rule, ("each inline ignore must be `# pyright: ignore[ruleName]  # why` "
                              "(a bare or `type: ignore` hides every error on its line):\n" + "\n".join(without_rule))
    assert len(ignores) <= MAX_INLINE_IGNORES, (f"{len(ignores)} inline ignores (at most {MAX_INLINE_IGNORES}):\n"
                                                + "\n".join(ignores))


@pytest.mark.processes
def test_the_wheel_carries_py_typed(tmp_path):
    """PEP 561: the built wheel holds gputrain/py.typed, so users' type checkers read its annotations
    (the package data of pyproject.toml); without it they would treat gputrain as untyped."""
    import zipfile

    import shutil

    tree = tmp_path / "tree"  # a copy: a build/ folder left in the repository would hand the wheel old files
    shutil.copytree(REPO / "src", tree / "src", ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(REPO / name, tree / name)
    proc = subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "--no-index",
                           "-w", str(tmp_path), str(tree)], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (wheel,) = tmp_path.glob("gputrain-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    assert "gputrain/py.typed" in names and "gputrain/__init__.py" in names, sorted(names)[:20]
