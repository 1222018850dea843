#!/usr/bin/env python
"""Every branch that the measured run never took inside a function it entered, CUDA-only ones first.

Reads coverage.py's JSON report with branch data (7.x, `branch = true`: per file and per function
`executed_branches` / `missing_branches`; `make coverage` writes coverage-out/coverage.json) and the
source files it names, and prints one line per untaken branch:

    cuda   runtime/devices.py::synchronizer: if device.type == 'cuda' -> true   (line 297; device.type == 'cuda')
    other  train/loop/early_stopping.py::EarlyStopping.improved: if self.mode == 'min' -> false   (line 61)

The checklist check (`--checklist docs/gpu_checklist.md`) exits 1 naming each CUDA-only untaken
branch that the page lacks and each branch the page names that is no longer an untaken branch
(stale: taken now, renamed, or gone).

    python scripts/untaken_branches.py [coverage-out/coverage.json] [--checklist docs/gpu_checklist.md] [--table]

What counts
-----------
A branch is one way out of a decision (`if`/`elif`, `while`, `for`, `match`) as coverage.py
records it. Listed are the ways never taken whose decision line ran, in functions (methods, nested
functions) with at least one line run; functions with no line run are scripts/uncovered_functions.py's.
Decisions whose own line never ran (they sit in code that an untaken branch leads to) are counted, not
listed: the untaken branch before them names that code. Module-level and class-body decisions are
left out (they run at import).

The name of a branch
--------------------
`PATH::QUALNAME: KEYWORD CONDITION -> SIDE`, e.g. `train/optim/build.py::make_optimizer: elif device.type == 'cuda' -> true`:
PATH relative to the package, QUALNAME coverage.py's dotted name of the function, the condition as
`ast.unparse` writes it (so reformatting and edits elsewhere in the file leave the name alone), SIDE
`true`/`false` for `if`/`elif`/`while`, `body`/`exit` for `for`, `case PATTERN` for `match`. A
decision whose keyword and condition repeat inside the same function gets ` (#2)`, ` (#3)` after the
condition, by order in the function. In the Markdown table a `|` in a condition is written `\\|`.

Which untaken branches are CUDA-only (the rule)
-----------------------------------------------
1. Tag: a comment `# cuda-only` (optionally `# cuda-only: why`) on the decision's line, on any line
   of its condition, or on the line just above it marks the decision: each of its untaken ways is
   CUDA-only. `# not-cuda-only` there overrides rule 2 for a pattern that misleads.
2. Pattern: the branch's side is taken only when the condition's truth value implies a CUDA device.
   The condition is read with `ast`; `not`, `and`, `or` and `:=` are followed (an `and` that is true
   implies CUDA when one operand does; an `or` that is false when one operand's falsehood does; `not`
   swaps the side). The atoms that imply CUDA:
   - a CUDA word is true: a name, attribute or called function whose identifier has `cuda`, `nccl`,
     `gpu` or `gpus` as an underscore-separated part (`torch.cuda.is_available()`, `x.is_cuda`,
     `_cuda_available()`, `speed.cuda_graphs`, `torch.version.cuda`, `on_gpu`, `gpu is not None`; in
     gputrain a "gpu" is a CUDA device), or is `use_scaler` / `pin_memory` (fp16's GradScaler and
     pinned host memory are CUDA-only in gputrain); no part says no (`no`, `not`, `non`, `without`:
     `why_no_gpu()`), and it is not a setting (a path through `config`, `cfg`, `args`, `options`,
     `opts`, `settings`: `cfg.cuda_graphs` is what the user asked for, which a CPU run may be asked
     too). `X is True`, `X is not None`, `X > 0`, `X >= 1`, `X != 0` of a CUDA word (a count: any
     side on which it is surely above 0) count as true; `X is None`, `X == 0`, `X < 1` as false;
   - a comparison with GPU strings: `X == 'cuda'`, `X in ('cuda', 'mps')`, `X.startswith('cuda')`
     true (every string is `cuda...`, `nccl` or `mps`; `!=` / `not in` false), and a device type that
     is not the CPU: `X.type != 'cpu'` true, `X.type == 'cpu'` false (X ending in `type` or naming a
     device), unless X's CUDA case was dealt with before (an earlier `if X == 'cuda'` at the same
     level whose body returns, raises, continues or breaks, or an `if` above it in its elif chain):
     then "not the CPU" is some third device.
   Loops and `match` are CUDA-only by tag only.
3. Listed by hand: a branch that neither rule marks but the checklist names (a CUDA-only condition that
   no pattern can see, such as a tensor learning rate that only a capturable optimizer on CUDA has).
   It passes the check while it stays an untaken branch; a tag in the source makes it required.
Everything else untaken is printed as `other` (information: CPU code that no test takes).

A file that changed since the run (a measured line that is no statement's first line today) is named
and not read; the check then exits 1 (measure again). A file modified after the run started
(`run_started` beside the JSON, from scripts/coverage.sh) whose lines still fit is named as a warning.
"""

from __future__ import annotations

import argparse
import ast
import io
import json
import re
import sys
import tokenize
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SECTION = "## CUDA-only branches"  # the checklist's table: from this heading to the next `## `
ID_RE = re.compile(r"^\S+\.py::\S+: (?:if|elif|while|for|match) .+ -> .+$")
TAG_RE = re.compile(r"#\s*(not-)?cuda-only\b")
CUDA_WORDS = {"use_scaler", "pin_memory"}
SETTINGS = {"config", "cfg", "args", "options", "opts", "settings"}
NEGATIONS = {"no", "not", "non", "without"}
GPU_STRINGS = re.compile(r"^(cuda(:\d+)?|nccl|mps)$")


@dataclass
class Branch:
    id: str
    path: str  # relative to the package
    line: int
    kind: str  # "cuda" | "other"
    why: str = ""  # the atom or tag that made it CUDA-only
    listed: bool = False
    unreached: int = 0  # decisions after it in its function whose line never ran


@dataclass
class Result:
    branches: list[Branch] = field(default_factory=list)
    unreached: int = 0
    outside: int = 0  # module-level / class-body
    edited: list[str] = field(default_factory=list)  # edited after the run started; the measured lines still fit
    drifted: list[str] = field(default_factory=list)  # the measured lines no longer fit the source: not read
    unknown: list[str] = field(default_factory=list)  # arcs whose line is no decision in today's source


# ---- the pattern ---------------------------------------------------------------------------------

def _ident(node: ast.AST) -> str | None:
    """The identifier that a name, attribute or call stands for (`torch.cuda.is_available()` -> is_available)."""
    if isinstance(node, ast.Call):
        node = node.func
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return node.attr
    return None


def _path(node: ast.AST) -> list[str]:
    """The identifiers of a dotted name, right to left (`torch.cuda.is_available()` -> is_available, cuda, torch)."""
    parts = []
    target = node.func if isinstance(node, ast.Call) else node
    while isinstance(target, (ast.Name, ast.Attribute)):
        parts.append(target.id if isinstance(target, ast.Name) else target.attr)
        if isinstance(target, ast.Name):
            break
        target = target.value
        if isinstance(target, ast.Call):  # torch.cuda.current_stream().query(): keep walking left
            target = target.func
    return parts


def _cuda_word(node: ast.AST) -> bool:
    """A name/attribute/call with a CUDA word in its dotted path, and not a user's setting (`cfg.cuda_graphs`)."""
    parts = _path(node)
    if SETTINGS & set(parts[1:]):
        return False  # what was asked for (the CPU may be asked too, and refuse), not what the device is
    for p in parts:
        words = set(p.lower().split("_"))
        if words & NEGATIONS:
            return False  # why_no_gpu(), no_cuda: true when there is none
        if p in CUDA_WORDS or words & {"cuda", "nccl", "gpu", "gpus"}:
            return True
    return False


def _strings(node: ast.AST) -> list[str] | None:
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return [node.value]
    if isinstance(node, (ast.Tuple, ast.List, ast.Set)) and node.elts and all(
            isinstance(e, ast.Constant) and isinstance(e.value, str) for e in node.elts):
        return [e.value for e in node.elts]  # type: ignore[attr-defined]
    return None


def _device_type(node: ast.AST) -> bool:
    ident = _ident(node) or ""
    return ident == "type" or ident.endswith("_type") or "device" in ident.lower() or ident in ("dev", "kind")


def _compare(left: ast.AST, op: ast.cmpop, right: ast.AST, value: bool, handled: frozenset[str] = frozenset()) -> str | None:
    text = f"{ast.unparse(left)} {_OPS.get(type(op), '?')} {ast.unparse(right)}"
    for subject, other in ((left, right), (right, left)):
        strings = _strings(other)
        if strings is not None and not isinstance(subject, ast.Constant):
            if all(GPU_STRINGS.match(s) for s in strings) and any(s != "mps" for s in strings):
                if isinstance(op, (ast.Eq, ast.In, ast.Is)) and value or isinstance(op, (ast.NotEq, ast.NotIn, ast.IsNot)) and not value:
                    return text
            if strings == ["cpu"] and _device_type(subject) and ast.unparse(subject) not in handled:
                if isinstance(op, (ast.NotEq, ast.NotIn)) and value or isinstance(op, (ast.Eq, ast.In)) and not value:
                    return text
            return None
    if not _cuda_word(left) or not isinstance(right, ast.Constant):
        return None
    c = right.value
    if isinstance(c, bool) or c is None:  # X is True / is not None / == False ...: the CUDA word's truth
        word = {(ast.Is, True): True, (ast.Eq, True): True, (ast.IsNot, None): True, (ast.IsNot, False): True,
                (ast.Is, False): False, (ast.Eq, False): False, (ast.Is, None): False, (ast.IsNot, True): False}
        word_true = word.get((type(op), c))
        return text if word_true is not None and word_true == value else None
    if not isinstance(c, (int, float)):
        return None
    # a count or size of CUDA things: the side on which it is surely > 0
    if value and (isinstance(op, ast.Gt) and c >= 0 or isinstance(op, ast.GtE) and c > 0
                  or isinstance(op, ast.NotEq) and c == 0 or isinstance(op, ast.Eq) and c > 0):
        return text
    if not value and (isinstance(op, ast.Lt) and c > 0 or isinstance(op, ast.LtE) and c >= 0
                      or isinstance(op, ast.Eq) and c == 0):
        return text
    return None


_OPS = {ast.Eq: "==", ast.NotEq: "!=", ast.In: "in", ast.NotIn: "not in", ast.Is: "is", ast.IsNot: "is not",
        ast.Gt: ">", ast.GtE: ">=", ast.Lt: "<", ast.LtE: "<="}


def implies_cuda(node: ast.AST, value: bool, handled: frozenset[str] = frozenset()) -> str | None:
    """The atom (source text) that makes `node` evaluating to `value` (its truth) imply a CUDA device, or None.

    handled: subjects (source text) whose CUDA case was dealt with before this decision (an earlier
    `if X == 'cuda': return`, or an `if` above this `elif`): "not the CPU" no longer means CUDA for them."""
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.Not):
        return implies_cuda(node.operand, not value, handled)
    if isinstance(node, ast.NamedExpr):
        return implies_cuda(node.value, value, handled)
    if isinstance(node, ast.BoolOp):
        parts = [implies_cuda(v, value, handled) for v in node.values]
        # and: true -> every operand true (one implying CUDA is enough); false -> some operand false (all must)
        # or: false -> every operand false (one is enough); true -> some operand true (all must)
        one_is_enough = isinstance(node.op, ast.And) == value
        if one_is_enough:
            return next((p for p in parts if p), None)
        return " and ".join(p for p in parts if p) if all(parts) else None  # type: ignore[misc]
    if isinstance(node, ast.Compare):
        if len(node.ops) == 1:
            return _compare(node.left, node.ops[0], node.comparators[0], value, handled)
        # a chain is the `and` of its pairs
        lefts = [node.left, *node.comparators[:-1]]
        parts = [_compare(a, op, b, value, handled) for a, op, b in zip(lefts, node.ops, node.comparators)]
        if value:
            return next((p for p in parts if p), None)
        return None
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "startswith" \
            and node.args and (s := _strings(node.args[0])) and all(GPU_STRINGS.match(x) for x in s):
        return ast.unparse(node) if value else None
    if isinstance(node, (ast.Name, ast.Attribute, ast.Call)) and _cuda_word(node):
        return ast.unparse(node) if value else None
    return None


# ---- the source ----------------------------------------------------------------------------------

@dataclass
class Decision:
    node: ast.AST
    keyword: str  # if | elif | while | for | match
    text: str  # the condition (for: `x in y`)
    function: ast.AST | None
    occurrence: int = 1
    tag: str | None = None  # "cuda-only" | "not-cuda-only"
    handled: frozenset[str] = frozenset()  # see implies_cuda


class Source:
    """One file: its decisions by line, the functions by their first line, the tag comments."""

    def __init__(self, text: str):
        self.lines = text.splitlines()
        tree = ast.parse(text)
        self.decisions: dict[int, Decision] = {}
        self.functions: dict[int, ast.AST] = {}
        self.tags: dict[int, str] = {}
        self.starts = statement_lines(text)
        try:
            for tok in tokenize.generate_tokens(io.StringIO(text).readline):
                if tok.type == tokenize.COMMENT and (m := TAG_RE.search(tok.string)):
                    self.tags[tok.start[0]] = "not-cuda-only" if m.group(1) else "cuda-only"
        except (tokenize.TokenError, SyntaxError):
            pass
        self._walk(tree, None)
        self._handled(tree)
        seen: dict[tuple[int, str, str], int] = {}
        for line in sorted(self.decisions):
            d = self.decisions[line]
            key = (id(d.function), d.keyword if d.keyword != "elif" else "if", d.text)
            seen[key] = d.occurrence = seen.get(key, 0) + 1
            end = getattr(getattr(d.node, "test", None) or getattr(d.node, "iter", None)
                          or getattr(d.node, "subject", None), "end_lineno", None) or line
            for ln in range(line - 1, end + 1):
                if ln in self.tags:
                    d.tag = self.tags[ln]

    def _walk(self, node: ast.AST, function: ast.AST | None) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                self.functions[child.lineno] = child
                self._walk(child, child)
                continue
            if isinstance(child, ast.ClassDef):
                self._walk(child, None)
                continue
            if isinstance(child, ast.If):
                line = self.lines[child.lineno - 1].lstrip()
                kw = "elif" if line.startswith("elif") else "if"
                self.decisions[child.lineno] = Decision(child, kw, ast.unparse(child.test), function)
            elif isinstance(child, ast.While):
                self.decisions[child.lineno] = Decision(child, "while", ast.unparse(child.test), function)
            elif isinstance(child, (ast.For, ast.AsyncFor)):
                text = f"{ast.unparse(child.target)} in {ast.unparse(child.iter)}"
                self.decisions[child.lineno] = Decision(child, "for", text, function)
            elif isinstance(child, ast.Match):
                self.decisions[child.lineno] = Decision(child, "match", ast.unparse(child.subject), function)
            self._walk(child, function)

    def _handled(self, tree: ast.AST) -> None:
        """Each if/elif's subjects whose CUDA case an earlier sibling `if` (ending in return/raise/
        continue/break) or an `if` above it in its elif chain has taken."""
        for node in ast.walk(tree):
            for name in ("body", "orelse", "finalbody"):
                stmts = getattr(node, name, None)
                if not isinstance(stmts, list):
                    continue
                before: set[str] = set()
                for s in stmts:
                    if not isinstance(s, ast.If) or (name == "orelse" and self._is_elif(s)):
                        continue
                    above = set(before)
                    link: ast.If | None = s
                    while link is not None:
                        if (d := self.decisions.get(link.lineno)) is not None:
                            d.handled = frozenset(above)
                        subjects = _gpu_subjects(link.test)
                        above |= subjects
                        if link.body and isinstance(link.body[-1], (ast.Return, ast.Raise, ast.Continue, ast.Break)):
                            before |= subjects
                        nxt = link.orelse[0] if len(link.orelse) == 1 else None
                        link = nxt if isinstance(nxt, ast.If) and self._is_elif(nxt) else None

    def _is_elif(self, node: ast.If) -> bool:
        return self.lines[node.lineno - 1].lstrip().startswith("elif")


def _gpu_subjects(test: ast.AST) -> set[str]:
    """The subjects (source text) that `test` compares with GPU strings (`device.type == 'cuda'` -> device.type)."""
    out = set()
    for n in ast.walk(test):
        if isinstance(n, ast.Compare) and len(n.ops) == 1:
            for subject, other in ((n.left, n.comparators[0]), (n.comparators[0], n.left)):
                strings = _strings(other)
                if strings and any(GPU_STRINGS.match(s) for s in strings):
                    out.add(ast.unparse(subject))
    return out


def _first_line(stmts: list[ast.stmt]) -> int | None:
    if not stmts:
        return None
    s = stmts[0]
    decorators = getattr(s, "decorator_list", None)
    return min([s.lineno, *(d.lineno for d in decorators)]) if decorators else s.lineno


def side(d: Decision, target: int) -> tuple[str, bool | None]:
    """The side's label and, for if/while, the condition's truth on that side."""
    node = d.node
    if isinstance(node, (ast.If, ast.While)):
        return ("true", True) if target == _first_line(node.body) else ("false", False)
    if isinstance(node, (ast.For, ast.AsyncFor)):
        return ("body", None) if target == _first_line(node.body) else ("exit", None)
    if isinstance(node, ast.Match):
        for case in node.cases:
            if target == _first_line(case.body):
                return f"case {ast.unparse(case.pattern)}", None
        return "no case", None
    return f"line {target}", None


def branch_id(path: str, qualname: str, d: Decision, label: str) -> str:
    n = f" (#{d.occurrence})" if d.occurrence > 1 else ""
    return f"{path}::{qualname}: {d.keyword} {d.text}{n} -> {label}"


# ---- the report ----------------------------------------------------------------------------------

def _resolve(path: str, root: Path) -> Path:
    p = Path(path)
    return p if p.is_absolute() else root / p


def statement_lines(text: str) -> set[int]:
    """The lines coverage.py can report for a source text: first lines of statements (and decorators,
    except clauses, match cases). A measured line outside them means the file changed since the run."""
    starts: set[int] = set()
    for n in ast.walk(ast.parse(text)):
        if isinstance(n, (ast.stmt, ast.ExceptHandler)):
            starts.add(n.lineno)
            starts.update(d.lineno for d in getattr(n, "decorator_list", ()))
        elif isinstance(n, ast.match_case):
            starts.add(n.pattern.lineno)
    return starts


def drifted_files(report: dict, prefix: str = "src/gputrain/", root: Path = ROOT) -> list[str]:
    """The files (relative to the package) whose measured lines no longer fit today's source; files
    that cannot be read are left out."""
    out = []
    for raw, data in sorted(report["files"].items()):
        norm = raw.replace("\\", "/")
        if prefix not in norm or "executed_lines" not in data:
            continue
        try:
            starts = statement_lines(_resolve(raw, root).read_text())
        except (OSError, SyntaxError):
            continue
        if not set(data["executed_lines"]) | set(data.get("missing_lines", ())) <= starts:
            out.append(norm[norm.index(prefix) + len(prefix):])
    return out


def untaken(report: dict, prefix: str = "src/gputrain/", root: Path = ROOT, since: float | None = None) -> Result:
    """Every untaken branch in an entered function of the files under `prefix`, classified.

    since: when the measured run started (epoch seconds; default the report's own time stamp): a file
    modified later is named as edited. A file whose measured lines are not all first lines of statements
    in today's source has changed since: it is named as drifted and its branches are not read."""
    res = Result()
    if not report.get("meta", {}).get("branch_coverage"):
        raise SystemExit("this coverage JSON has no branch data: measure with branch = true (pyproject's [tool.coverage.run])")
    stamp = report["meta"].get("timestamp")
    when = since if since is not None else datetime.fromisoformat(stamp).timestamp() if stamp else None
    for raw, data in sorted(report["files"].items()):
        norm = raw.replace("\\", "/")
        if prefix not in norm:
            continue
        rel = norm[norm.index(prefix) + len(prefix):]
        file = _resolve(raw, root)
        try:
            src = Source(file.read_text())
        except (OSError, SyntaxError) as exc:
            res.unknown.append(f"{rel}: cannot read the source ({exc})")
            continue
        executed = set(data["executed_lines"])
        if not executed | set(data.get("missing_lines", ())) <= src.starts:
            res.drifted.append(rel)
            continue
        if when is not None and file.stat().st_mtime > when:
            res.edited.append(rel)
        functions = data.get("functions")
        if functions is None:
            raise SystemExit("this coverage JSON has no per-function data: coverage.py 7.x writes it (`coverage json`)")
        for qualname, f in functions.items():
            missing = f.get("missing_branches") or []
            if not missing:
                continue
            if not qualname:  # module level and class bodies
                res.outside += len(missing)
                continue
            if f["summary"]["covered_lines"] == 0:
                continue  # never entered: uncovered_functions.py's list
            listed: list[Branch] = []
            for a, b in sorted(map(tuple, missing)):
                if a not in executed:
                    res.unreached += 1
                    before = [x for x in listed if x.line < a]
                    if before:
                        before[-1].unreached += 1
                    continue
                d = src.decisions.get(a)
                if d is None:
                    res.unknown.append(f"{rel}:{a} -> {b} in {qualname}: no decision on that line in the source today")
                    continue
                label, truth = side(d, b)
                why = ""
                if d.tag == "cuda-only":
                    why = "tag: # cuda-only"
                elif d.tag is None and truth is not None:
                    why = implies_cuda(d.node.test, truth, d.handled) or ""  # type: ignore[attr-defined]
                br = Branch(branch_id(rel, qualname, d, label), rel, a, "cuda" if why else "other", why)
                listed.append(br)
            res.branches.extend(listed)
    return res


def checklist_ids(text: str) -> list[str]:
    """The branch names in the checklist's CUDA-only table (code spans of the `PATH::QUALNAME: ...` form)."""
    start = text.find(SECTION)
    if start < 0:
        return []
    end = text.find("\n## ", start + len(SECTION))
    section = text[start:end if end >= 0 else len(text)]
    spans = re.findall(r"`([^`\n]+)`", section)
    return [s.replace("\\|", "|") for s in spans if ID_RE.match(s.replace("\\|", "|"))]


def table_row(b: Branch) -> str:
    name = b.id.replace("|", "\\|")
    return f"| [ ] | `{name}` | TODO: the `gpu` test or `smoke:NAME` that takes it |"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("json", nargs="?", default="coverage-out/coverage.json")
    ap.add_argument("--prefix", default="src/gputrain/", help="only files whose path contains this")
    ap.add_argument("--root", type=Path, default=ROOT, help="relative paths of the report are under this folder")
    ap.add_argument("--checklist", type=Path, help="a Markdown file whose CUDA-only table must name every CUDA-only branch")
    ap.add_argument("--table", action="store_true",
                    help="print a Markdown row for each CUDA-only branch the checklist lacks (to paste into it)")
    args = ap.parse_args(argv)
    report = json.loads(Path(args.json).read_text())
    started = Path(args.json).with_name("run_started")  # scripts/coverage.sh writes it: the run's start, epoch seconds
    since = float(started.read_text()) if started.is_file() else None
    res = untaken(report, args.prefix, args.root, since)
    listed = set(checklist_ids(args.checklist.read_text())) if args.checklist else set()
    for b in res.branches:
        if b.kind == "other" and b.id in listed:
            b.kind, b.why, b.listed = "cuda", "listed by hand", True
    cuda = [b for b in res.branches if b.kind == "cuda"]
    other = [b for b in res.branches if b.kind == "other"]

    def show(b: Branch) -> str:
        more = f"; +{b.unreached} branches after it never reached" if b.unreached else ""
        why = f"; {b.why}" if b.why else ""
        return f"{b.kind:<6} {b.id}   (line {b.line}{why}{more})"

    print(f"# CUDA-only branches the CPU suite never takes, in functions it enters ({len(cuda)}):")
    for b in cuda:
        print(show(b))
    print(f"# other branches it never takes there (CPU code no test takes: information) ({len(other)}):")
    for b in other:
        print(show(b))
    for note in res.unknown:
        print(f"# warning: {note}")
    if res.edited:
        print(f"# warning: {len(res.edited)} source files were modified after the run started (their measured "
              f"lines still fit; the data may be from an older text): " + ", ".join(res.edited))
    if res.drifted:
        print(f"# warning: {len(res.drifted)} source files changed since the run (measured lines that are no "
              f"statement today): their branches are not read: " + ", ".join(res.drifted))
    t = report["totals"]
    tagged = sum(b.why.startswith("tag") for b in cuda)
    by_hand = sum(b.listed for b in cuda)
    by = {"pattern": len(cuda) - tagged - by_hand, "tag": tagged, "hand": by_hand}
    print(f"# total: {len(cuda)} CUDA-only untaken branches ({by['pattern']} by pattern, {by['tag']} tagged, "
          f"{by['hand']} listed by hand), {len(other)} other untaken branches in functions the suite enters, "
          f"{res.unreached} more behind them never reached, {res.outside} at module level; "
          f"branches taken {t['covered_branches']}/{t['num_branches']}")
    if args.table:
        for b in cuda:
            if b.id not in listed:
                print(table_row(b))
    if not args.checklist:
        return 0
    missing = [b for b in cuda if b.id not in listed]
    every = {b.id for b in res.branches}
    unread = tuple(f"{path}::" for path in res.drifted)  # entries of files not read: neither stale nor current
    stale = sorted(i for i in listed if i not in every and not i.startswith(unread))
    for b in missing:
        print(f"not in {args.checklist}: {b.id}   (line {b.line}; {b.why})", file=sys.stderr)
    for i in stale:
        print(f"stale in {args.checklist}: {i}   (no longer an untaken branch of an entered function: taken, renamed or gone)",
              file=sys.stderr)
    if res.drifted:
        print(f"cannot check {len(res.drifted)} files that changed since the run ({', '.join(res.drifted)}): "
              f"measure again (make coverage)", file=sys.stderr)
    if missing or stale or res.drifted:
        print(f"# {len(missing)} CUDA-only untaken branches missing from {args.checklist}, {len(stale)} stale entries"
              + (f", {len(res.drifted)} files not checked" if res.drifted else ""), file=sys.stderr)
        return 1
    print(f"# every CUDA-only untaken branch is in {args.checklist} ({len(listed)} entries, none stale)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
