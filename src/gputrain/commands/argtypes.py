"""Argument types shared by the subcommands, each rejecting a bad value with a one-line reason, and
the workload options of `--option KEY=VALUE` (fit, eval, predict, export). The types are
gputrain/fields.py's, where the settings that use them are declared."""

from __future__ import annotations

from gputrain.fields import positive_float_arg as positive_float
from gputrain.fields import positive_int_arg as positive_int
from gputrain.fields import tri_arg as tri
from gputrain.runs.stated import workload_options

__all__ = ["positive_int", "positive_float", "tri", "workload_options"]
