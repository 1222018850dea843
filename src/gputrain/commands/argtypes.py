"""Argument types shared by the subcommands, each rejecting a bad value with a one-line reason, and
the workload options of `--option KEY=VALUE` (fit, eval, predict, export)."""

from __future__ import annotations

import argparse

from gputrain.errors import ConfigError


def positive_int(value: str) -> int:
    try:
        n = int(value)
    except ValueError:
        n = 0
    if n < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value!r}")
    return n


def positive_float(value: str) -> float:
    try:
        x = float(value)
    except ValueError:
        x = 0.0
    if not x > 0:
        raise argparse.ArgumentTypeError(f"expected a positive number, got {value!r}")
    return x


def tri(value: str):
    """'auto', or on/off as True/False."""
    v = value.strip().lower()
    if v == "auto":
        return "auto"
    if v in ("on", "true", "yes", "1"):
        return True
    if v in ("off", "false", "no", "0"):
        return False
    raise argparse.ArgumentTypeError(f"expected auto, on or off, got {value!r}")


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
