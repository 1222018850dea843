"""Runs as files: `gputrain fit --config run.toml`, `--print-config`, and RUN_DIR/config.toml.

A run is one tree, one TOML file (read with the standard library's tomllib):

    workload = "iris-mlp"      # a built-in workload, or module:function
    [options]                  # the workload's options (--option KEY=VALUE, --data-dir)
    [optimizers.NAME]          # a step of your own: the settings of its optimizer NAME (lr, betas, ...)
    [train]                    # TrainConfig's fields: every fit flag that sets one (--lr is lr,
                               # --logger is loggers, --no-tensorboard is loggers without "tensorboard")
                               # and the fields no flag sets (warmup_steps, metric_modes, ...)
    [fit]                      # the run's own settings (RunSettings: nproc, early_stop, ema, ...)
    [sweep]                    # the search (gputrain/sweeps); `gputrain fit` leaves it alone

A RunConfig is what one source states, keys it leaves out absent: a file, the command line
(gputrain/runs/flags.py), a sweep's trial. `merge` lays one over another; gputrain/runs/resolve.py
makes the RunSpec (gputrain/runs/spec.py), taking each setting from the first of: the command line,
the file, the workload's defaults, the fields' defaults. Every run with a run directory records its
resolved tree (all of it) as RUN_DIR/config.toml, so `gputrain fit --config RUN_DIR/config.toml
--run-dir NEW` repeats it. An unknown key, a value of the wrong type or one its field refuses (the
checks declared beside each field) is one ConfigError naming the key and its line.
"""

from __future__ import annotations

import dataclasses
import difflib
import types
import typing
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Union

from gputrain.config import DEFAULT_LOGGERS, TrainConfig, tensorboard_loggers
from gputrain.errors import ConfigError
from gputrain.io.toml_file import TomlFile, read_toml, value_text
from gputrain.runs.spec import AUTO_FIELDS, RunSettings

SECTIONS = ("options", "optimizers", "train", "fit", "sweep")
__all__ = ["RunConfig", "check_tree", "check_value", "field_types", "load_run_config",
           "merge", "option_text", "workload_options"]
# [train] tensorboard: TrainConfig's old switch, in every RUN_DIR/config.toml recorded before TensorBoard
# became one of the loggers; read as the loggers it leaves (config.tensorboard_loggers), with a warning.
OLD_TENSORBOARD = "tensorboard"


@dataclass
class RunConfig:
    """What one source states of a run (a file, the command line, a sweep's trial): the workload,
    its options, the TrainConfig fields and run settings it sets.

    `train` and `fit` hold only the keys the file sets (checked and converted: a list for a tuple
    field is a tuple); `sweep` is the raw [sweep] table, checked by gputrain/sweeps; `source` is the
    parsed file (for the line of a key in later errors), None for a tree given as a dict.
    """

    workload: str | None = None
    options: dict[str, Any] = field(default_factory=dict)
    optimizers: dict[str, dict[str, Any]] = field(default_factory=dict)
    train: dict[str, Any] = field(default_factory=dict)
    fit: dict[str, Any] = field(default_factory=dict)
    sweep: dict[str, Any] | None = None
    source: TomlFile | None = None

    def where(self, *keys: str) -> str:
        return self.source.where(keys) if self.source else "the config"


def load_run_config(path: str | Path, what: str = "--config") -> RunConfig:
    """The RunConfig of a TOML file; ConfigError (one line, with the file's line) for bad input."""
    return check_tree(read_toml(path, what))


def check_tree(source: TomlFile) -> RunConfig:
    """Check every key and value of a parsed config file and return it as a RunConfig."""
    data = source.data
    for key, value in data.items():
        if key == "workload":
            if not isinstance(value, str) or not value:
                raise source.error([key], f"workload must be a string (a built-in workload or module:function), "
                                          f"got {_shown(value)}")
        elif key not in SECTIONS:
            raise source.error([key], _unknown_top_key(key))
        elif not isinstance(value, dict):
            raise source.error([key], f"{key} must be a table ([{key}]), got {_shown(value)}")
    options = dict(data.get("options", {}))
    for key, value in options.items():
        if not isinstance(value, (str, int, float, bool)):
            raise source.error(["options", key], f"[options] {key}: a workload option is a string, number or "
                                                 f"true/false, got {_shown(value)}")
    train_table = dict(data.get("train", {}))
    tensorboard = train_table.pop(OLD_TENSORBOARD, None)
    train = {k: check_value("train", k, v, source) for k, v in train_table.items()}
    if tensorboard is not None:
        train["loggers"] = _old_tensorboard(tensorboard, train.get("loggers", DEFAULT_LOGGERS), source)
    if "epochs" in train and "steps" in train:
        raise source.error(["train", "steps"], "[train] sets both epochs and steps: give one of them")
    fit = {k: check_value("fit", k, v, source) for k, v in data.get("fit", {}).items()}
    optimizers = _check_optimizers(data.get("optimizers", {}), source)
    return RunConfig(workload=data.get("workload"), options=options, optimizers=optimizers, train=train, fit=fit,
                     sweep=data.get("sweep"), source=source)


def _check_optimizers(table: dict[str, Any], source: TomlFile) -> dict[str, dict[str, Any]]:
    """[optimizers.NAME] tables: each a table of settings (train/optim/by_name.py checks each value)."""
    from gputrain.train.optim.by_name import check_optimizer_setting

    out: dict[str, dict[str, Any]] = {}
    for name, values in table.items():
        if not isinstance(values, dict):
            raise source.error(["optimizers", name], f"[optimizers] {name} must be a table ([optimizers.{name}] "
                                                     f"with lr = ..., betas = [...]), got {_shown(values)}")
        out[name] = {}
        for key, value in values.items():
            try:
                out[name][key] = check_optimizer_setting(name, key, value)
            except ConfigError as exc:
                raise source.error(["optimizers", name, key], str(exc)) from None
    return out


def check_value(section: str, key: str, value: Any, source: TomlFile | None = None,
                keys: tuple[str, ...] | None = None) -> Any:
    """`value` for [section] `key` ("train" or "fit"), converted (an int where a float is expected
    is a float, a list for a tuple is a tuple, "none" for an optional field is None); ConfigError
    naming the key (and its line, given `source`) when the key is unknown, the type wrong, or the
    value one TrainConfig refuses. `keys`: where in the file it was written (default section.key)."""
    at = keys or (section, key)

    def fail(message: str) -> ConfigError:
        return source.error(at, message) if source else ConfigError(message)

    hints = field_types(section)
    if key not in hints:
        raise fail(_unknown_key(section, key, hints))
    hint = hints[key]
    if key in AUTO_FIELDS and section == "train" and value == "auto":
        return value
    if value == "none" and _optional(hint) and not _fits("none", hint):
        return None
    if not _fits(value, hint):
        raise fail(f"[{section}] {key} must be {_describe(hint)}, got {_shown(value)}")
    value = _convert(value, hint)
    if key not in ("run_dir", "resume"):
        try:  # the field's own checks (a positive lr, a known schedule), one field at a time
            one: dict[str, Any] = {key: value}
            (TrainConfig if section == "train" else RunSettings)(**one)
        except ConfigError as exc:
            raise fail(f"[train] {key}: {exc}" if section == "train" else f"[fit] {exc}") from None
    return value


def field_types(section: str) -> dict[str, Any]:
    """{key: type} of the keys a [train] or [fit] table takes."""
    cls = TrainConfig if section == "train" else RunSettings
    hints = typing.get_type_hints(cls)
    return {f.name: hints[f.name] for f in dataclasses.fields(cls)}


# ---------------------------------------------------------------- one source over another


def merge(base: RunConfig, over: RunConfig) -> RunConfig:
    """`over`'s settings laid over `base`'s (the command line over a file, a trial's parameters over
    its sweep's config). An `over` that sets epochs or steps drops both of `base`'s: they are one
    choice. Options are merged key by key; `source` stays the file's, for the lines of its keys."""
    train = dict(base.train)
    if {"epochs", "steps"} & set(over.train):
        train.pop("epochs", None)
        train.pop("steps", None)
    train.update(over.train)
    optimizers = {name: {**base.optimizers.get(name, {}), **over.optimizers.get(name, {})}
                  for name in {**base.optimizers, **over.optimizers}}
    return RunConfig(workload=over.workload or base.workload, options={**base.options, **over.options},
                     optimizers=optimizers, train=train,
                     fit={**base.fit, **over.fit}, sweep=over.sweep if over.sweep is not None else base.sweep,
                     source=base.source or over.source)


def workload_options(items: list[str], example: str = "") -> dict[str, str]:
    """{key: value} of the repeated `--option KEY=VALUE` (a dash in a key is an underscore, as in
    the workload's parameter names); ConfigError naming the item without KEY=VALUE. example: shown
    after the expected form, e.g. "--option n=2000"."""
    options: dict[str, str] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ConfigError(f"--option {item!r}: expected KEY=VALUE{f', e.g. {example}' if example else ''}")
        options[key.replace("-", "_")] = value
    return options


def option_text(value: Any) -> str:
    """A workload option as `--option KEY=VALUE` gives it (options reach the workload as strings)."""
    return ("true" if value else "false") if isinstance(value, bool) else str(value)


# ---------------------------------------------------------------- types and messages


def _fits(value: Any, hint: Any) -> bool:
    origin = typing.get_origin(hint)
    if origin in (Union, types.UnionType):
        return any(_fits(value, a) for a in typing.get_args(hint))
    if hint is type(None):
        return value is None
    if hint is bool:
        return isinstance(value, bool)
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if hint is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if hint is str:
        return isinstance(value, str)
    if origin in (list, tuple):
        return isinstance(value, list) and all(_fits(v, typing.get_args(hint)[0]) for v in value)
    if origin is dict:
        k, v = typing.get_args(hint)
        return isinstance(value, dict) and all(_fits(a, k) and _fits(b, v) for a, b in value.items())
    return isinstance(value, hint) if isinstance(hint, type) else True


def _convert(value: Any, hint: Any) -> Any:
    args = typing.get_args(hint) if typing.get_origin(hint) in (Union, types.UnionType) else (hint,)
    if isinstance(value, int) and not isinstance(value, bool) and float in args and int not in args:
        return float(value)
    if isinstance(value, list) and any(typing.get_origin(a) is tuple for a in args):
        return tuple(value)
    return value


def _optional(hint: Any) -> bool:
    return typing.get_origin(hint) in (Union, types.UnionType) and type(None) in typing.get_args(hint)


def _describe(hint: Any) -> str:
    origin = typing.get_origin(hint)
    if origin in (Union, types.UnionType):
        parts = [_describe(a) for a in typing.get_args(hint) if a is not type(None)]
        if _optional(hint):
            parts.append('"none"')
        return " or ".join(dict.fromkeys(parts))
    names = {bool: "true or false", int: "an integer", float: "a number", str: "a string"}
    if hint in names:
        return names[hint]
    if origin in (list, tuple):
        return f"a list of {_describe(typing.get_args(hint)[0]).removeprefix('a ').removeprefix('an ')}s"
    if origin is dict:
        return f"a table of {_describe(typing.get_args(hint)[1]).removeprefix('a ').removeprefix('an ')}s"
    return str(hint)


def _shown(value: Any) -> str:
    """A TOML value and its TOML type, for messages: "'fast' (a string)"."""
    kind = ("true or false" if isinstance(value, bool) else "an integer" if isinstance(value, int) else
            "a number" if isinstance(value, float) else "a string" if isinstance(value, str) else
            "a list" if isinstance(value, list) else "a table" if isinstance(value, dict) else type(value).__name__)
    return f"{value!r} ({kind})"


def _old_tensorboard(value: Any, loggers: tuple[str, ...], source: TomlFile) -> tuple[str, ...]:
    """The loggers [train] tensorboard = `value` leaves; a DeprecationWarning saying what to write."""
    if not isinstance(value, bool):
        raise source.error(["train", OLD_TENSORBOARD], f"[train] tensorboard must be true or false, got {_shown(value)}")
    out = tensorboard_loggers(loggers, value)
    warnings.warn(f"{source.where(['train', OLD_TENSORBOARD])}: [train] tensorboard is deprecated: TensorBoard is one "
                  f"of the loggers, on when loggers names \"tensorboard\"; for this file write loggers = "
                  f"{value_text(list(out))} instead", DeprecationWarning, stacklevel=2)
    return out


def _unknown_key(section: str, key: str, known: dict[str, Any]) -> str:
    if section == "train" and key == "checkpointing":
        return "[train] checkpointing is the old name of recompute (not run checkpoints): write recompute"
    other = "fit" if section == "train" else "train"
    if key.replace("-", "_") in field_types(other):
        return f"[{section}] has no key {key!r}: it belongs under [{other}] as {key.replace('-', '_')}"
    close = difflib.get_close_matches(key.replace("-", "_"), list(known), n=1, cutoff=0.6)
    if close:
        return f"unknown key {key!r} in [{section}]: did you mean {close[0]!r}?"
    return f"unknown key {key!r} in [{section}]: the keys are {', '.join(known)}"


def _unknown_top_key(key: str) -> str:
    name = key.replace("-", "_")
    for section in ("train", "fit"):
        if name in field_types(section):
            return f"{key!r} at the top of the file: put it under [{section}] (as {name})"
    if name in ("data_dir", "option"):
        return f"{key!r} at the top of the file: workload options go under [options]"
    return f"unknown key {key!r}: a config file has workload and the tables {', '.join(f'[{s}]' for s in SECTIONS)}"
