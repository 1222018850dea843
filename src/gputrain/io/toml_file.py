"""TOML files read with the standard library (tomllib) and written back, with the line of each key.

`read_toml(path)` returns a `TomlFile`: the parsed tree and where each key was written, so that an
error about a value can name the file's line ("run.toml line 7: [train] lr: ..."). `dumps(sections)`
writes a tree of plain values (str, int, float, bool, lists, dicts) as TOML that `tomllib` reads
back to the same values; None values are left out (TOML has no null).
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable

from gputrain.errors import ConfigError

_BARE = re.compile(r"^[A-Za-z0-9_-]+$")
_KEY_PART = r'(?:[A-Za-z0-9_-]+|"(?:[^"\\]|\\.)*"|\'[^\']*\')'
_KEY = re.compile(rf"^\s*({_KEY_PART}(?:\s*\.\s*{_KEY_PART})*)\s*=")
_HEADER = re.compile(rf"^\s*\[\s*({_KEY_PART}(?:\s*\.\s*{_KEY_PART})*)\s*\]\s*(?:#.*)?$")


@dataclass
class TomlFile:
    """A parsed TOML file: `data` (the tree), `path` (as given) and the line of each key path."""

    path: str
    data: dict[str, Any]
    lines: dict[tuple[str, ...], int] = field(default_factory=dict)

    def line_of(self, keys: Iterable[str]) -> int | None:
        """The line where `keys` (a path such as ("train", "lr")) or its nearest parent was written."""
        keys = tuple(keys)
        for n in range(len(keys), 0, -1):
            if keys[:n] in self.lines:
                return self.lines[keys[:n]]
        return None

    def where(self, keys: Iterable[str]) -> str:
        """"run.toml line 7" (or just "run.toml" when the key's line is unknown)."""
        line = self.line_of(keys)
        return f"{self.path} line {line}" if line else self.path

    def error(self, keys: Iterable[str], message: str) -> ConfigError:
        """A ConfigError that starts with the file and the key's line."""
        return ConfigError(f"{self.where(keys)}: {message}")


def read_toml(path: str | Path, what: str = "--config") -> TomlFile:
    """Parse the TOML file at `path` (UTF-8, with or without a byte-order mark); raises ConfigError (one
    line, naming `what` and the file) when it is missing, not a file, not UTF-8 or not valid TOML
    (tomllib's message gives line and column)."""
    p = Path(path)
    if not p.exists():
        raise ConfigError(f"{what} {path}: no such file")
    if p.is_dir():
        raise ConfigError(f"{what} {path} is a folder: give a TOML file (a run's config is RUN_DIR/config.toml)")
    try:  # utf-8-sig: a byte-order mark (Windows editors write one) is read past, as the file means
        text = p.read_text(encoding="utf-8-sig")
    except UnicodeDecodeError:
        raise ConfigError(f"{what} {path}: not a UTF-8 text file; a config is a TOML file") from None
    except OSError as exc:
        raise ConfigError(f"{what} {path}: cannot read it ({exc.strerror})") from None
    # Imported here: tomllib compiles its regular expressions on import (~80 ms, 3% of `import torch`),
    # which `gputrain --help` and every command without a config file would pay.
    import tomllib

    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{what} {path}: not valid TOML: {exc}") from None
    return TomlFile(str(path), data, key_lines(text))


def key_lines(text: str) -> dict[tuple[str, ...], int]:
    """{key path: line number (1-based)} of the table headers and `key = value` lines of TOML text.
    Keys inside inline tables take their table's line (TomlFile.line_of looks up the parents)."""
    lines: dict[tuple[str, ...], int] = {}
    table: tuple[str, ...] = ()
    in_multiline: str | None = None
    for n, line in enumerate(text.splitlines(), start=1):
        if in_multiline:  # inside a multi-line string: nothing here is a key
            if line.count(in_multiline) % 2 == 1:
                in_multiline = None
            continue
        header = _HEADER.match(line)
        if header:
            table = _split_key(header.group(1))
            lines.setdefault(table, n)
            continue
        key = _KEY.match(line)
        if key:
            lines.setdefault(table + _split_key(key.group(1)), n)
            rest = line[key.end():]
            for quote in ('"""', "'''"):
                if rest.count(quote) % 2 == 1:
                    in_multiline = quote
    return lines


def _split_key(key: str) -> tuple[str, ...]:
    parts = re.findall(_KEY_PART, key)
    return tuple(json.loads(p) if p.startswith('"') else p.strip("'") for p in parts)


def dumps(top: dict[str, Any], tables: dict[str, dict[str, Any]], header: Iterable[str] = (),
          notes: dict[str, Iterable[str]] | None = None) -> str:
    """TOML text: `header` lines as comments, the `top` keys, then each of `tables` as [name]
    (a dict value inside a table as an inline table; a table whose values are all dicts as
    [name.key] tables). notes: {table name: comment lines written at the end of that table}."""
    out = [f"# {line}" if line else "#" for line in header]
    if out:
        out.append("")
    out += [f"{key_text(k)} = {value_text(v)}" for k, v in top.items() if v is not None]
    for name, table in tables.items():
        nested = {k: v for k, v in table.items() if isinstance(v, dict) and v and all(isinstance(x, dict) for x in v.values())}
        if out and out[-1] != "":
            out.append("")
        out.append(f"[{name}]")
        out += [f"{key_text(k)} = {value_text(v)}" for k, v in table.items() if v is not None and k not in nested]
        out += [f"# {line}" for line in (notes or {}).get(name, ())]
        for key, sub in nested.items():
            out += ["", f"[{name}.{key_text(key)}]"]
            out += [f"{key_text(k)} = {value_text(v)}" for k, v in sub.items() if v is not None]
    return "\n".join(out) + "\n"


def key_text(key: str) -> str:
    return key if _BARE.match(key) else json.dumps(key, ensure_ascii=False)


def value_text(v: Any) -> str:
    """One value as TOML (inline tables for dicts, arrays for lists and tuples)."""
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, int):
        return str(v)
    if isinstance(v, float):
        if math.isnan(v):
            return "nan"
        if math.isinf(v):
            return "inf" if v > 0 else "-inf"
        return repr(v)
    if isinstance(v, str):
        return json.dumps(v, ensure_ascii=False)  # JSON's escapes are TOML's (\", \\, \n, \uXXXX)
    if isinstance(v, (list, tuple)):
        return "[" + ", ".join(value_text(x) for x in v) + "]"
    if isinstance(v, dict):
        items = [f"{key_text(str(k))} = {value_text(x)}" for k, x in v.items() if x is not None]
        return "{" + ", ".join(items) + "}" if items else "{}"
    raise TypeError(f"cannot write {type(v).__name__} {v!r} as TOML")
