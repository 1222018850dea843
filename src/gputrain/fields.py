"""A setting declared once: a dataclass field with its default, its command-line flag, help and check.

    lr: float = setting(1e-3, flag="--lr", help="the peak learning rate", check=finite(above=0))

`setting(...)` is `dataclasses.field(...)` with the rest in the field's metadata, where the command
line (gputrain/runs/flags.py builds argparse from it), a config file and a sweep's space
(gputrain/runs/stated.py) and the dataclass's own `__post_init__` (`check_fields`) all read it: a
value is refused the same way, with the same line, wherever it came from, before anything runs.

A check is a callable `(name, value) -> None` raising ConfigError with one line naming the value
and what to write instead; the constructors below make the common ones.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
from dataclasses import dataclass
from typing import Any, Callable, Iterable

from gputrain.errors import ConfigError

Check = Callable[[str, Any], None]


@dataclass(frozen=True)
class Flag:
    """How a field appears on the command line (argparse's add_argument, generated from it).

    names: "--lr" and its aliases; parse: argparse's `type` (raises ArgumentTypeError with the
    value); action "store_true" for a switch; nargs "?" with const for an optional value; group:
    fields in one mutually exclusive group (--epochs | --steps); shown_default: what --help says
    for a default that is not the field's own (None: the field's default). choices_first: a value
    outside `choices` is refused with argparse's own line ("invalid choice: ... (choose from ...)")
    rather than the field's check (the line sweep, memory and bench have always said).

    A field may have more than one flag (`setting(also=...)`): each sets the same field, e.g.
    --compile (the whole model) and --compile-scope {whole,regional}.
    """

    names: tuple[str, ...]
    help: str = ""
    parse: Callable[[str], Any] | None = None
    action: str | None = None
    nargs: str | None = None
    const: Any = None
    metavar: str | None = None
    choices: tuple[str, ...] | None = None
    group: str | None = None
    choices_first: bool = False


def setting(default: Any = dataclasses.MISSING, *, flag: str | tuple[str, ...] | None = None, help: str = "",
            check: Check | None = None, parse: Callable[[str], Any] | None = None, action: str | None = None,
            nargs: str | None = None, const: Any = None, metavar: str | None = None,
            choices: Iterable[str] | None = None, group: str | None = None, also: Iterable[Flag] = (),
            choices_first: bool = False, default_factory: Callable[[], Any] | Any = dataclasses.MISSING) -> Any:
    """A dataclass field whose flag, help and check are declared beside its default. also: more
    flags that set the same field (a switch and a flag with a value, e.g. --compile and
    --compile-scope)."""
    names = (flag,) if isinstance(flag, str) else tuple(flag or ())
    meta = {"check": check, "help": help, "also": tuple(also),
            "flag": Flag(names, help, parse, action, nargs, const, metavar,
                         tuple(choices) if choices is not None else None, group, choices_first) if names else None}
    if default_factory is not dataclasses.MISSING:
        return dataclasses.field(default_factory=default_factory, metadata=meta)
    return dataclasses.field(default=default, metadata=meta)


def flag_of(f: dataclasses.Field) -> Flag | None:
    return f.metadata.get("flag")


def flags_of(f: dataclasses.Field) -> tuple[Flag, ...]:
    """Every flag that sets field `f`: its own, then those of `setting(also=...)`."""
    own = flag_of(f)
    return ((own,) if own is not None else ()) + tuple(f.metadata.get("also", ()))


def check_field(cls: Any, name: str, value: Any) -> None:
    """Run field `name`'s own check on `value` (ConfigError naming it)."""
    for f in dataclasses.fields(cls):
        if f.name == name:
            check = f.metadata.get("check")
            if check is not None:
                check(name, value)
            return


def check_fields(obj: Any) -> None:
    """Run every field's own check on its value (what a dataclass's __post_init__ calls)."""
    for f in dataclasses.fields(obj):
        check = f.metadata.get("check")
        if check is not None:
            check(f.name, getattr(obj, f.name))


# ---------------------------------------------------------------- checks


def integer(low: int | None = None, high: int | None = None, *, optional: bool = False, why: str = "") -> Check:
    """An int (not a bool) in [low, high]; None too when optional. why: what the bound is for."""

    def check(name: str, value: Any) -> None:
        if value is None and optional:
            return
        if not isinstance(value, int) or isinstance(value, bool) or (low is not None and value < low) or \
                (high is not None and value > high):
            raise ConfigError(f"{name} must be {_int_range(low, high)}{why}, got {value!r}")

    return check


def positive_int(optional: bool = False) -> Check:
    """A positive int (the message every count has had: "must be a positive integer")."""

    def check(name: str, value: Any) -> None:
        if value is None and optional:
            return
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ConfigError(f"{name} must be a positive integer, got {value!r}")

    return check


def number(above: float | None = None, at_least: float | None = None, below: float | None = None,
           at_most: float | None = None, *, optional: bool = False, message: str | None = None) -> Check:
    """A finite real number within the given bounds (open: above/below; closed: at_least/at_most).
    message: the whole line before ", got VALUE" (default: "NAME must be a finite number ...")."""

    def check(name: str, value: Any) -> None:
        if value is None and optional:
            return
        ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
        x = float(value) if ok and isinstance(value, (int, float)) else 0.0
        for bound, inside in ((above, x > (above or 0)), (at_least, x >= (at_least or 0)),
                              (below, x < (below or 0)), (at_most, x <= (at_most or 0))):
            ok = ok and (bound is None or inside)
        if not ok:
            bounds = [f"> {above:g}" if above is not None else "", f">= {at_least:g}" if at_least is not None else "",
                      f"< {below:g}" if below is not None else "", f"<= {at_most:g}" if at_most is not None else ""]
            said = message or f"{name} must be a finite number{' ' if any(bounds) else ''}" + \
                " and ".join(b for b in bounds if b)
            raise ConfigError(f"{said}, got {value!r}")

    return check


def one_of(choices: Iterable[Any], *, optional: bool = False, message: str | None = None) -> Check:
    """One of `choices`. message: the line before ", got VALUE" (default "NAME must be one of ...")."""
    options = tuple(choices)

    def check(name: str, value: Any) -> None:
        if value is None and optional:
            return
        if isinstance(value, bool) or value not in options:
            shown = ", ".join(repr(c) for c in options)
            raise ConfigError(f"{message or f'{name} must be one of {shown}'}, got {value!r}")

    return check


def _int_range(low: int | None, high: int | None) -> str:
    if low is not None and high is not None:
        return f"an integer from {low} to {high}"
    if low is not None:
        return {0: "0 or a positive integer", 1: "a positive integer"}.get(low, f"an integer of at least {low}")
    if high is not None:
        return f"an integer of at most {high}"
    return "an integer"


def boolean(name: str, value: Any) -> None:
    if not isinstance(value, bool):
        raise ConfigError(f"{name} must be True or False, got {value!r}")


# ---------------------------------------------------------------- command-line values (argparse types)
#
# Each refuses a bad value with argparse's one line ("argument --lr: expected a positive number,
# got 'inf'"); the field's own check runs after it (gputrain/runs/flags.py).


def positive_int_arg(value: str) -> int:
    try:
        n = int(value)
    except ValueError:
        n = 0
    if n < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value!r}")
    return n


def positive_float_arg(value: str) -> float:
    try:
        x = float(value)
    except ValueError:
        x = 0.0
    if not (x > 0 and math.isfinite(x)):
        raise argparse.ArgumentTypeError(f"expected a positive number, got {value!r}")
    return x


def tri_arg(value: str) -> str | bool:
    """'auto', or on/off as True/False."""
    v = value.strip().lower()
    if v == "auto":
        return "auto"
    if v in ("on", "true", "yes", "1"):
        return True
    if v in ("off", "false", "no", "0"):
        return False
    raise argparse.ArgumentTypeError(f"expected auto, on or off, got {value!r}")
