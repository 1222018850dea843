"""The command line of a run, generated from the fields of the run spec (gputrain/fields.py): each
field with a flag becomes one argparse argument, its default shown in the help and left out of the
parsed namespace (argparse.SUPPRESS), so that the namespace holds exactly what the command line
stated; `stated(namespace)` turns it into a RunConfig, which merges over a config file's
(`stated_run`).

Every command declares its settings so: `gputrain fit` every field of TrainConfig and RunSettings,
`profile` and `memory` the TrainConfig fields they measure with, and each command its own settings
(a dataclass of `setting(...)` fields: `add_flags` / `given`), such as a sweep's budget.

A flag's value is checked twice, both with one line: by its argparse type (a positive integer) and
by its field's own check (a finite weight decay), so that a value is refused before anything runs.
"""

from __future__ import annotations

import argparse
import dataclasses
from typing import Any, Callable, Iterable

from gputrain.config import TrainConfig
from gputrain.errors import ConfigError
from gputrain.fields import Flag, flags_of
from gputrain.runs.stated import RunConfig
from gputrain.runs.spec import AUTO_FIELDS, RunSettings

# What a run's command line states besides the fields: the workload (positional), --data-dir and
# --option (its options), --optimizer (a step of your own's optimizers), --no-tensorboard.
EXTRAS = ("workload", "data_dir", "option", "optimizer", "no_tensorboard")


def add_spec_arguments(parser: argparse.ArgumentParser, train: Iterable[str] | None = None,
                       fit: Iterable[str] | None = None) -> None:
    """One argument per flag of each field of TrainConfig (`train`: those fields, in that order;
    None: every one) and of RunSettings (`fit`), dest the field's name, absent from the namespace
    when not given."""
    add_flags(parser, TrainConfig, train)
    add_flags(parser, RunSettings, fit)


def add_flags(parser: argparse.ArgumentParser, cls: type, names: Iterable[str] | None = None) -> None:
    """One argparse argument per flag of each field of the dataclass `cls` (declared with
    gputrain.fields.setting): `names`, in that order, or every field with a flag, in the order
    they are declared."""
    groups: dict[str, Any] = {}
    for f in _fields(cls, names):
        flags = flags_of(f)
        for flag in flags:
            _add_flag(parser, groups, cls, f, flag, several=len(flags) > 1)


def given(args: argparse.Namespace, cls: type, names: Iterable[str] | None = None) -> dict[str, Any]:
    """{field: value} of what the command line stated of `cls`'s fields (`names`, or all)."""
    values = vars(args)
    return {f.name: values[f.name] for f in _fields(cls, names) if f.name in values}


def _fields(cls: type, names: Iterable[str] | None) -> list[dataclasses.Field]:
    by_name = {f.name: f for f in dataclasses.fields(cls) if flags_of(f)}
    return list(by_name.values()) if names is None else [by_name[n] for n in names]


def _add_flag(parser: argparse.ArgumentParser, groups: dict[str, Any], cls: type, f: dataclasses.Field, flag: Flag,
              several: bool) -> None:
    """One argparse argument for `flag` of field `f` (several: the field has other flags too)."""
    target = parser
    if flag.group:
        if flag.group not in groups:
            groups[flag.group] = parser.add_mutually_exclusive_group()
        target = groups[flag.group]
    kwargs: dict[str, Any] = {"dest": f.name, "default": argparse.SUPPRESS, "help": _help(flag, f)}
    if flag.action:
        # a switch beside a flag with a value (--compile beside --compile-scope regional): the value
        # wins whatever their order
        kwargs["action"] = _SwitchOn if flag.action == "store_true" and several else flag.action
    if flag.action != "store_true":
        kwargs["type"] = _checked(flag, cls, f.name)
        for key in ("nargs", "metavar", "choices"):
            if getattr(flag, key) is not None:
                kwargs[key] = getattr(flag, key)
        if flag.nargs == "?":
            kwargs["const"] = flag.const
    target.add_argument(*flag.names, **kwargs)


class _SwitchOn(argparse.Action):
    """store_true that keeps the value another flag of the same field has set."""

    def __init__(self, option_strings: list[str], dest: str, **kwargs: Any) -> None:
        super().__init__(option_strings, dest, nargs=0, **kwargs)

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: Any,
                 option_string: str | None = None) -> None:
        if getattr(namespace, self.dest, None) in (None, False):
            setattr(namespace, self.dest, True)


def stated(args: argparse.Namespace, train: Iterable[str] | None = None, fit: Iterable[str] | None = None,
           extras: Iterable[str] = EXTRAS) -> RunConfig:
    """The RunConfig of what the command line stated: the flags of `train` and `fit`'s fields (None:
    every field's) and of `extras` that the parser has (the workload, --option, --data-dir,
    --optimizer, --no-tensorboard)."""
    train_values = given(args, TrainConfig, train)
    if "loggers" in train_values:  # --logger a,b --logger c: one list
        train_values["loggers"] = tuple(n for item in train_values["loggers"] for n in item)
    extra = {k: v for k, v in vars(args).items() if k in set(extras)}
    if extra.get("no_tensorboard"):
        train_values["tensorboard"] = False  # resolved over the loggers of every source (runs/resolve.py)
    options: dict[str, Any] = {"data_dir": extra["data_dir"]} if extra.get("data_dir") else {}
    if extra.get("option"):
        from gputrain.runs.stated import workload_options

        options.update(workload_options(extra["option"], example="--option n=2000"))
    optimizers = optimizer_settings(extra.get("optimizer") or [])
    return RunConfig(workload=extra.get("workload"), options=options, optimizers=optimizers, train=train_values,
                     fit=given(args, RunSettings, fit))


def stated_run(args: argparse.Namespace, train: Iterable[str] | None = None, fit: Iterable[str] | None = None,
               extras: Iterable[str] = EXTRAS) -> RunConfig:
    """What the command line states (as `stated`) over --config's file when one is given."""
    from gputrain.runs.stated import load_run_config, merge

    flags = stated(args, train, fit, extras)
    config = getattr(args, "config", None)
    return merge(load_run_config(config), flags) if config else flags


def optimizer_settings(items: list[str]) -> dict[str, dict[str, Any]]:
    """{name: {key: value}} of the repeated `--optimizer NAME.KEY=VALUE` (betas as two numbers with a
    comma: 0.5,0.999), each checked as [optimizers.NAME] checks it; ConfigError naming the item."""
    from gputrain.train.optim.by_name import check_optimizer_setting

    out: dict[str, dict[str, Any]] = {}
    for item in items:
        target, sep, text = item.partition("=")
        name, dot, key = target.partition(".")
        if not sep or not dot or not name or not key or "." in key:
            raise ConfigError(f"--optimizer {item!r}: expected NAME.KEY=VALUE, e.g. --optimizer generator.lr=1e-3")
        try:
            value: Any = [float(t) for t in text.split(",")] if "," in text else float(text)
        except ValueError:
            raise ConfigError(f"--optimizer {item!r}: {text!r} is not a number (betas: two numbers, 0.5,0.999)") \
                from None
        try:
            out.setdefault(name, {})[key] = check_optimizer_setting(name, key, value)
        except ConfigError as exc:
            raise ConfigError(f"--optimizer {item!r}: {exc}") from None
    return out


def _help(flag: Flag, f: dataclasses.Field) -> str:
    default = f.default if f.default is not dataclasses.MISSING else None
    if flag.action == "store_true" or default in (None, False) or f.name in AUTO_FIELDS or "default" in flag.help:
        return flag.help
    shown = ",".join(default) if isinstance(default, tuple) else default
    return f"{flag.help} (default: {shown})" if flag.help else f"default: {shown}"


def _checked(flag: Flag, cls: type, name: str) -> Callable[[str], Any]:
    """The flag's argparse type: its parser, then its field's check (a ConfigError becomes argparse's
    one line, naming the flag)."""
    from gputrain.fields import check_field

    parse = flag.parse or str

    def convert(text: str) -> Any:
        value = parse(text)
        if value == "auto" and name in AUTO_FIELDS:
            return value
        if flag.choices_first and value not in (flag.choices or ()):
            return value  # argparse refuses it next, naming the choices
        try:
            check_field(cls, name, _field_value(name, value))
        except ConfigError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None
        return value

    convert.__name__ = getattr(parse, "__name__", "value")
    return convert


def _field_value(name: str, value: Any) -> Any:
    """A flag's parsed value as its field holds it (--logger a,b is a list of one flag's names)."""
    return tuple(value) if name == "loggers" else value
