"""The maps stay true to the tree: tests/README.md lists every test file and names only paths that exist;
every package's docstring names each of its modules; the package map of docs/design.md names every
package and module of src/gputrain; helpers.py's docstring names each helper, and no test file copies one."""

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TESTS, SRC = ROOT / "tests", ROOT / "src"
PACKAGE = SRC / "gputrain"


def _index() -> str:
    return (TESTS / "README.md").read_text()


def _module_names(package: Path) -> list[str]:
    """The names of a package's modules and subpackages (no __init__)."""
    return sorted([p.stem for p in package.glob("*.py") if p.name != "__init__.py"]
                  + [p.name for p in package.iterdir() if (p / "__init__.py").is_file()])


def _packages() -> list[Path]:
    return sorted(init.parent for init in PACKAGE.rglob("__init__.py"))


def _names(name: str, text: str, *, prose: bool = False) -> bool:
    """Whether `text` names the module `name` as a word (`name`, name.py, name/; in prose also with
    spaces for underscores and in any case)."""
    spellings = {name, name.replace("_", " ")} if prose else {name}
    flags = re.IGNORECASE if prose else 0
    return any(re.search(rf"(?<!\w){re.escape(s)}(?!\w)", text, flags) for s in spellings)


def _layout() -> str:
    """The package map of docs/design.md, from its "- Layout" item to the next top-level item."""
    notes = (ROOT / "docs" / "design.md").read_text()
    start = notes.index("- Layout (")
    end = notes.index("\n- ", start)
    return notes[start:end]


def _item(layout: str, package: str) -> str:
    """The layout item that opens with `package/` (with its nested items); '' when there is none."""
    lines = layout.splitlines()
    for i, line in enumerate(lines):
        m = re.match(rf"(\s*)- `{re.escape(package)}/`", line)
        if m:
            indent, out = len(m.group(1)), [line]
            for rest in lines[i + 1:]:
                item = re.match(r"(\s*)- ", rest)
                if item and len(item.group(1)) <= indent:
                    break
                out.append(rest)
            return "\n".join(out)
    return ""


def test_the_index_lists_every_test_file():
    listed = set(re.findall(r"`(test_\w+\.py)`", _index()))
    missing = sorted(p.name for p in TESTS.glob("test_*.py") if p.name not in listed)
    assert not missing, f"tests/README.md does not list {missing}: add a line naming what each covers"


def test_every_path_the_index_names_exists():
    # A path: a backticked name with a slash or a .py ending, under tests/, src/ or the repository.
    paths = {t for t in re.findall(r"`([^`\s]+)`", _index()) if "/" in t or t.endswith(".py")}
    assert len(paths) > 50, sorted(paths)  # the index names files, not only folders
    gone = sorted(t for t in paths if not any((base / t).exists() for base in (TESTS, SRC, ROOT)))
    assert not gone, f"tests/README.md names paths that do not exist: {gone}"


def test_every_package_docstring_names_each_of_its_modules():
    gaps = {}
    for package in _packages():
        doc = ast.get_docstring(ast.parse((package / "__init__.py").read_text())) or ""
        missing = [m for m in _module_names(package) if not _names(m, doc)]
        if missing:
            gaps[str(package.relative_to(SRC))] = missing
    assert not gaps, f"package docstrings that do not name these modules (one line each): {gaps}"


def test_the_design_notes_package_map_names_every_package_and_module():
    layout = _layout()
    gaps = {}
    top = [p.name for p in PACKAGE.glob("*.py") if p.name != "__init__.py" and f"`{p.name}`" not in layout]
    if top:
        gaps["gputrain"] = top
    for package in _packages():
        if package == PACKAGE:
            continue
        item = _item(layout, package.name)
        if not item:
            gaps[str(package.relative_to(SRC))] = "no item opening with its `name/`"
            continue
        missing = [m for m in _module_names(package) if not _names(m, item, prose=True)]
        if missing:
            gaps[str(package.relative_to(SRC))] = missing
    assert not gaps, f"docs/design.md's package map does not name: {gaps}"


def _shape(node: ast.FunctionDef | ast.ClassDef) -> str:
    """A top-level function or class without its name and docstring: two copies give the same string."""
    body = node.body[1:] if ast.get_docstring(node) is not None else node.body
    return ast.dump(ast.Module(body=body, type_ignores=[]))


def _definitions(path: Path) -> dict[str, ast.FunctionDef | ast.ClassDef]:
    tree = ast.parse(path.read_text())
    return {n.name: n for n in tree.body if isinstance(n, (ast.FunctionDef, ast.ClassDef))}


def test_helpers_docstring_names_each_helper():
    tree = ast.parse((TESTS / "helpers.py").read_text())
    doc = ast.get_docstring(tree) or ""
    public = [n.name for n in tree.body
              if isinstance(n, (ast.FunctionDef, ast.ClassDef)) and not n.name.startswith("_")]
    public += [t.id for n in tree.body if isinstance(n, ast.Assign) for t in n.targets
               if isinstance(t, ast.Name) and not t.id.startswith("_")]
    missing = [name for name in public if f"`{name}`" not in doc]
    assert not missing, f"helpers.py's docstring does not name {missing}"


def test_no_test_file_copies_a_helper():
    helpers = {_shape(node): name for name, node in _definitions(TESTS / "helpers.py").items()}
    copies = [f"{path.name}: {name} (helpers.{helpers[_shape(node)]})"
              for path in sorted(TESTS.glob("test_*.py")) for name, node in _definitions(path).items()
              if _shape(node) in helpers]
    assert not copies, f"import these from helpers instead of copying them: {copies}"


def test_the_design_notes_show_the_step_as_it_is_in_the_source():
    """docs/design.md's listing of the step is the source of TrainStep.run and TrainStep.gradients."""
    import inspect

    from gputrain.train.step.train_step import TrainStep

    notes = (ROOT / "docs" / "design.md").read_text()
    block = notes.split("<!-- the step: TrainStep.run and TrainStep.gradients -->\n```python\n", 1)[1].split("```", 1)[0]
    source = inspect.getsource(TrainStep.run) + "\n" + inspect.getsource(TrainStep.gradients)
    assert block == source, "docs/design.md's step differs from train/step/train_step.py: copy it again"
