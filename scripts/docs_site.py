"""The documentation site's generated pages, as a MkDocs hook (mkdocs.yml: `hooks:`), so that none can drift
from the code or the measurements:

- reference/cli.md: every subcommand and flag, walked from `gputrain.cli.build_parser()`'s argparse tree;
- reference/config.md: every key of a config file, from the field declarations (gputrain/fields.py's
  `setting(...)`: default, flag, help, check) of TrainConfig ([train]), RunSettings ([fit]) and
  SweepSettings ([sweep]), with the comments written beside each field in its source;
- results/: one page per benchmarks/results/*.json (device, date, torch, the table), an index of them,
  the notebook of how each figure was reached (benchmarks/LOG.md) and the plots beside the JSON;
- `<!-- fields: module.Class -->` in any page: that dataclass's fields as a table (the API reference
  shows TrainConfig's this way).

The tests call the same functions (tests/test_docs.py). Nothing here is imported by gputrain.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import importlib
import inspect
import io
import json
import re
import textwrap
import tokenize
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
LOG = ROOT / "benchmarks" / "LOG.md"
FIELDS_MARK = re.compile(r"<!-- fields: ([\w.]+) -->")
# the config file's tables and the dataclass each one is read into (gputrain/runs/stated.py)
CONFIG_TABLES = (("train", "gputrain.config.TrainConfig"), ("fit", "gputrain.runs.spec.RunSettings"),
                 ("sweep", "gputrain.sweeps.settings.SweepSettings"))


# ---------------------------------------------------------------- shared


def _cell(text: Any) -> str:
    """One Markdown table cell: pipes escaped, one line."""
    return str(text).replace("|", "\\|").replace("\n", " ").strip()


def _code(text: Any) -> str:
    s = str(text)
    return f"``{s}``" if "`" in s else f"`{s}`"


def _load(dotted: str) -> Any:
    module, _, name = dotted.rpartition(".")
    return getattr(importlib.import_module(module), name)


# ---------------------------------------------------------------- the CLI, from the argparse tree


def _subcommands(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    return {}


def cli_commands(parser: argparse.ArgumentParser | None = None, prefix: str = "gputrain"
                 ) -> list[tuple[str, argparse.ArgumentParser]]:
    """Every command of the tree, depth first: ("gputrain fit", its parser), ("gputrain bench matmul", ...)."""
    if parser is None:
        from gputrain.cli import build_parser

        parser = build_parser()
    out = []
    for name, sub in _subcommands(parser).items():
        out.append((f"{prefix} {name}", sub))
        out.extend(cli_commands(sub, f"{prefix} {name}"))
    return out


def _flag_row(parser: argparse.ArgumentParser, action: argparse.Action) -> str:
    formatter = parser._get_formatter()
    names = ", ".join(_code(s) for s in action.option_strings) if action.option_strings else _code(action.dest)
    if action.nargs != 0 and action.option_strings:
        names += " " + _code(formatter._format_args(action, formatter._get_default_metavar_for_optional(action)))
    help_text = formatter._expand_help(action) if action.help else ""
    if action.choices and not isinstance(action, argparse._SubParsersAction):
        help_text += f" (choices: {', '.join(map(str, action.choices))})"
    default = action.default
    shown = "" if default in (None, False, argparse.SUPPRESS) or action.nargs == 0 else _code(default)
    return f"| {names} | {_cell(help_text)} | {_cell(shown)} |"


def cli_reference() -> str:
    """reference/cli.md: each command's usage, description and every flag with its help and default."""
    lines = ["# Command line", "",
             "Generated from `gputrain.cli.build_parser()`: every subcommand and every flag, as `gputrain COMMAND "
             "--help` prints them (`-h`, `--help` on every command prints its own). Flags that set a training setting are the config file's keys too "
             "([Config file](config.md)).", ""]
    for title, parser in cli_commands():
        lines += [f"## `{title}`", "", _cell(parser.description or ""), "", "```text",
                  parser.format_usage().strip(), "```", ""]
        actions = [a for a in parser._actions if not isinstance(a, (argparse._HelpAction, argparse._SubParsersAction))]
        subs = _subcommands(parser)
        if subs:
            lines += ["| subcommand | what |", "|---|---|"]
            lines += [f"| [`{title} {n}`](#{_anchor(f'{title} {n}')}) | {_cell(s.description or '')} |"
                      for n, s in subs.items()]
            lines.append("")
        if actions:
            lines += ["| argument | what | default |", "|---|---|---|"]
            lines += [_flag_row(parser, a) for a in actions]
            for group in parser._mutually_exclusive_groups:
                lines += ["", "One of: " + ", ".join(_code(a.option_strings[0]) for a in group._group_actions) + "."]
            lines.append("")
    return "\n".join(lines)


def _anchor(title: str) -> str:
    """The id MkDocs' toc gives a heading `title` (written in backticks)."""
    return re.sub(r"[^\w\- ]", "", title).strip().lower().replace(" ", "-")


# ---------------------------------------------------------------- config keys, from the field declarations


def _comments(cls: type) -> tuple[dict[str, list[str]], dict[str, str]]:
    """The comments written beside each field in `cls`'s source: the lines above it and after it on its own
    lines, by field name; and the section headings (a short comment opening a block above a field)."""
    source = textwrap.dedent(inspect.getsource(cls))
    fields = {f.name for f in dataclasses.fields(cls)}
    statements: list[tuple[str, int, int]] = []  # field, first line, last line
    for node in ast.parse(source).body[0].body:  # type: ignore[attr-defined]
        target = getattr(node, "target", None)
        if target is not None and getattr(target, "id", None) in fields:
            statements.append((target.id, node.lineno, node.end_lineno))
    comments: dict[int, str] = {}
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.COMMENT and "pyright:" not in tok.string:
            comments[tok.start[0]] = tok.string.lstrip("#").strip()
    notes: dict[str, list[str]] = {}
    headings: dict[str, str] = {}
    previous_end = 0
    for name, first, last in statements:
        above = [comments[n] for n in range(previous_end + 1, first) if n in comments]
        beside = [comments[n] for n in range(first, last + 1) if n in comments]
        if above and (len(above[0].split()) <= 4 and not re.search(r"[:(\"=|]", above[0])):
            headings[name] = above.pop(0)
        notes[name] = above + beside
        previous_end = last
    return notes, headings


def _default(f: dataclasses.Field) -> str:
    if f.default is not dataclasses.MISSING:
        return _code(repr(f.default) if isinstance(f.default, str) else f.default)
    if f.default_factory is not dataclasses.MISSING:  # type: ignore[misc]
        return _code(f.default_factory())  # type: ignore[misc]
    return "required"


def _type(f: dataclasses.Field) -> str:
    return _code(f.type if isinstance(f.type, str) else getattr(f.type, "__name__", f.type))


def fields_table(dotted: str, *, key_prefix: str = "") -> str:
    """Every field of the dataclass `dotted` (module.Class): its key, type, default, flag and what it is (the
    help declared with it, and the comments beside it in the source), grouped by the source's headings."""
    from gputrain.fields import flags_of

    cls = _load(dotted)
    notes, headings = _comments(cls)
    header = ["| key | type | default | flag | what |", "|---|---|---|---|---|"]
    lines: list[str] = []
    for f in dataclasses.fields(cls):
        if f.name in headings:
            lines += ["", f"**{headings[f.name][0].upper() + headings[f.name][1:]}**", "", *header]
        elif not lines:
            lines += header
        flags = ", ".join(_code(n) for fl in flags_of(f) for n in fl.names)
        what = "; ".join(t for t in [f.metadata.get("help", "")] + [" ".join(notes.get(f.name, []))] if t)
        lines.append(f"| {_code(key_prefix + f.name)} | {_cell(_type(f))} | {_cell(_default(f))} | {flags} | "
                     f"{_cell(what)} |")
    return "\n".join(lines).strip("\n")


def config_reference() -> str:
    """reference/config.md: the tables of a config file and every key of each."""
    from gputrain.runs.stated import SECTIONS

    lines = ["# Config file", "",
             "A run is one TOML file (`gputrain fit --config run.toml`; every run directory holds its own as "
             "`config.toml`). This page is generated from the field declarations (`gputrain/fields.py`'s "
             "`setting(...)`: each key's default, flag, help and check are declared once, beside the field), so "
             "every key a file may hold is here. How to write one: [Configs and sweeps](../how-to/configs.md).", "",
             f"Tables of a file: {', '.join(f'`[{s}]`' for s in SECTIONS)}, beside the top-level `workload` "
             "(a built-in workload's name, or `module:function`, or `path/to/file.py:function`).", "",
             "## `[options]`", "",
             "The workload's own options, as `--option KEY=VALUE` gives them (`gputrain fit --list` shows each "
             "built-in workload's).", "",
             "## `[optimizers.NAME]`", "",
             "A workload with a step of its own: the settings of its optimizer NAME (`lr`, `betas`, `weight_decay`, "
             "`momentum`, `eps`, where the optimizer has them), set after the workload builds it; "
             "`--optimizer NAME.KEY=VALUE` on the command line.", ""]
    what = {"train": "TrainConfig's fields: what the trainer reads (`gputrain.TrainConfig` in Python).",
            "fit": "The run's own settings (RunSettings): what is done around the trainer, `gputrain fit`'s own "
                   "flags.",
            "sweep": "The search (`gputrain sweep`; `gputrain fit` leaves it alone). `[sweep.space]` holds the "
                     "searched keys: `{loguniform = [low, high]}`, `{uniform = [low, high]}` (`step = ...`), "
                     "`{int = [low, high]}` (`step`, `log = true`), `{choices = [...]}` for any `[train]` key, "
                     "`[fit]` key or workload option (`options.n`)."}
    for table, dotted in CONFIG_TABLES:
        cls = _load(dotted)
        count = len([f for f in dataclasses.fields(cls) if f.name != "space"])
        lines += [f"## `[{table}]`", "", f"{what[table]} {count} keys, from `{dotted}`.", "",
                  fields_table(dotted), ""]
    return "\n".join(lines)


# ---------------------------------------------------------------- results, from benchmarks/results/*.json


def _scalar(v: Any) -> bool:
    return isinstance(v, (str, int, float, bool)) or v is None


def _number(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:.4g}"
    return str(v)


def _flatten(row: dict, prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in row.items():
        if isinstance(v, dict) and all(_scalar(x) for x in v.values()):
            out.update(_flatten(v, f"{prefix}{k}."))
        elif _scalar(v):
            out[f"{prefix}{k}"] = v
    return out


def _rows(data: Any) -> tuple[str, list[dict[str, Any]]]:
    """The file's main table: its largest list of objects (a row that holds an object of objects, as
    train_speed's results by contender, becomes one row per inner object)."""
    best: tuple[str, list] = ("", [])
    candidates = data.items() if isinstance(data, dict) else [("rows", data)]
    for key, value in candidates:
        if isinstance(value, list) and value and all(isinstance(r, dict) for r in value) and len(value) > len(best[1]):
            best = (key, value)
    rows = []
    for row in best[1]:
        nested = [k for k, v in row.items() if isinstance(v, dict) and v and all(isinstance(x, dict) for x in v.values())]
        if nested:
            base = {k: v for k, v in row.items() if k not in nested}
            for inner_key, inner in row[nested[0]].items():
                rows.append(_flatten({**base, nested[0]: inner_key, **inner}))
        else:
            rows.append(_flatten(row))
    return best[0], rows


def _meta(data: Any) -> dict[str, Any]:
    """Device, date, torch and the command of a results file, wherever its writer put them."""
    if not isinstance(data, dict):
        return {}
    env = data.get("environment") if isinstance(data.get("environment"), dict) else {}
    meta = data.get("meta") if isinstance(data.get("meta"), dict) else {}
    out = {}
    for key in ("benchmark", "device_name", "device", "gpu", "cpu", "machine", "date", "timestamp", "torch", "cuda",
                "python", "command"):
        for src in (data, env, meta):
            v = src.get(key)
            if v is not None and _scalar(v) and key not in out:
                out[key] = v
    return out


def _title(stem: str) -> tuple[str, str, str]:
    """(benchmark, device, date) of a results file's name: <benchmark>_<device>_<date>[-what]."""
    m = re.match(r"(.+?)_((?:cpu|nvidia|amd)[\w-]*?)_(\d{4}-\d\d-\d\d.*)$", stem)
    if m:
        return m.group(1), m.group(2), m.group(3)
    m = re.match(r"(.+?)_(\d{4}-\d\d-\d\d.*)$", stem)
    return (m.group(1), "", m.group(2)) if m else (stem, "", "")


def result_page(path: Path, columns: int = 12) -> str:
    data = json.loads(path.read_text())
    bench, device, date = _title(path.stem)
    lines = [f"# {bench}: {device or 'computed'} {date}", "",
             f"Generated from `benchmarks/results/{path.name}` ([the file]({path.name}); the figures as the benchmark wrote them; how they "
             "were reached and what they mean: [the log](log.md)).", ""]
    meta = _meta(data)
    if meta:
        lines += ["| | |", "|---|---|"] + [f"| {k} | {_cell(_code(v) if k == 'command' else v)} |"
                                           for k, v in meta.items()] + [""]
    summary = data.get("summary") if isinstance(data, dict) else None
    if isinstance(summary, dict) and summary and all(_scalar(v) for v in _flatten(summary).values()):
        flat = _flatten(summary)
        lines += ["## Summary", "", "| | |", "|---|---|"] + [f"| {_cell(k)} | {_cell(_number(v))} |"
                                                             for k, v in flat.items()] + [""]
    key, rows = _rows(data)
    if rows:
        keys = list(dict.fromkeys(k for r in rows for k in r))
        shown = keys[:columns]
        lines += [f"## {key}", ""]
        if len(keys) > columns:
            lines += [f"The first {columns} of {len(keys)} columns; the JSON holds them all.", ""]
        lines += ["| " + " | ".join(_cell(k) for k in shown) + " |", "|" + "---|" * len(shown)]
        lines += ["| " + " | ".join(_cell(_number(r.get(k, ""))) for k in shown) + " |" for r in rows]
        lines.append("")
    for png in sorted(RESULTS.glob(f"{path.stem}_*.png")):
        lines += [f"![{png.stem}]({png.name})", ""]
    return "\n".join(lines)


def results_index() -> str:
    files = sorted(RESULTS.glob("*.json"))
    lines = ["# Results", "",
             "Every measured figure gputrain states comes from a file in `benchmarks/results/`, named "
             "`<benchmark>_<device>_<date>` (a time of day where one day has several). Each page below is "
             "generated from its file: the device, the date, the torch and the table. How each figure was "
             "reached, pass by pass, is [the benchmark log](log.md); the headline figures, with what they mean, "
             "are on [How fast, measured](speed.md).", "",
             "| benchmark | device | date | torch | file |", "|---|---|---|---|---|"]
    for path in sorted(files, key=lambda p: (_title(p.stem)[2], p.stem), reverse=True):
        bench, device, date = _title(path.stem)
        meta = _meta(json.loads(path.read_text()))
        lines.append(f"| [{bench}]({path.stem}.md) | {device or 'computed'} | {date} | {_cell(meta.get('torch', ''))} "
                     f"| `{path.name}` |")
    md = sorted(RESULTS.glob("*.md"))
    if md:
        lines += ["", "Index pages that `gputrain bench all` wrote: " + ", ".join(f"[{p.stem}]({p.name})" for p in md) + "."]
    return "\n".join(lines) + "\n"


def log_page() -> str:
    """benchmarks/LOG.md as a page of the site: its `results/FILE.json` names link to their pages."""
    text = LOG.read_text().replace("](../docs/", "](../")  # its links into docs/, as seen from results/
    return re.sub(r"`results/([\w.-]+)\.json`", r"[`results/\1.json`](\1.md)", text)


def generated_pages() -> dict[str, str | bytes]:
    """Every generated file of the site, by its path under docs/."""
    pages: dict[str, str | bytes] = {"reference/cli.md": cli_reference(), "reference/config.md": config_reference(),
                                     "results/index.md": results_index(), "results/log.md": log_page()}
    for path in sorted(RESULTS.glob("*.json")):
        pages[f"results/{path.stem}.md"] = result_page(path)
        pages[f"results/{path.name}"] = path.read_bytes()  # the file itself, beside its page
    for path in sorted(RESULTS.glob("*.png")):
        pages[f"results/{path.name}"] = path.read_bytes()
    for path in sorted(RESULTS.glob("*.md")):
        pages[f"results/{path.name}"] = path.read_text()
    return pages


def expand_fields(markdown: str) -> str:
    return FIELDS_MARK.sub(lambda m: fields_table(m.group(1)), markdown)


# ---------------------------------------------------------------- the MkDocs hook


def on_files(files, config):  # noqa: ANN001 (MkDocs' hook signature)
    from mkdocs.structure.files import File

    for src_uri, content in generated_pages().items():
        files.append(File.generated(config, src_uri, content=content))
    return files


def on_page_markdown(markdown, page, config, files):  # noqa: ANN001
    return expand_fields(markdown)
