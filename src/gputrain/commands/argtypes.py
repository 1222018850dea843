"""Argument types shared by the subcommands: each rejects a bad value with a one-line reason."""

from __future__ import annotations

import argparse


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
