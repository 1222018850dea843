"""`collect_info()`: PyTorch's build, every device, live GPU telemetry and other frameworks' view.

Returns plain data with a stable schema; `gputrain info` renders it or prints it as JSON.
"""

from __future__ import annotations

import importlib
import importlib.util
import platform
import sys
from typing import Any

from gputrain.runtime.devices import describe_devices, torch_build
from gputrain.diagnostics.telemetry import host_memory, nvml_snapshot

SCHEMA_KEYS = ("gputrain", "python", "torch", "devices", "nvml", "frameworks")


def collect_info() -> dict[str, Any]:
    from gputrain.version import __version__

    devices = describe_devices()
    devices["host_memory"] = host_memory()
    return {
        "gputrain": __version__,
        "python": {"version": platform.python_version(), "executable": sys.executable, "platform": platform.platform()},
        "torch": torch_build(),
        "devices": devices,
        "nvml": nvml_snapshot(),
        "frameworks": other_frameworks(),
    }


def other_frameworks() -> dict[str, Any]:
    """TensorFlow and JAX, only if installed: their versions and the GPUs they see.

    A framework that is not installed is never imported; one that is broken is reported, not fatal.
    """
    out: dict[str, Any] = {}
    for name, query in (("tensorflow", _tensorflow), ("jax", _jax)):
        try:
            found = importlib.util.find_spec(name) is not None
        except (ImportError, ValueError) as exc:  # e.g. sys.modules[name] is None or has no __spec__
            out[name] = {"installed": True, "error": f"{type(exc).__name__}: {_first_line(exc)}"}
            continue
        if found:
            out[name] = _probe_framework(query)
    return out


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0][:200] if text else ""


def _probe_framework(fn) -> dict[str, Any]:
    try:
        return fn()
    except BaseException as exc:  # a broken install can raise anything, even SystemExit
        if isinstance(exc, KeyboardInterrupt):
            raise
        return {"installed": True, "error": f"{type(exc).__name__}: {_first_line(exc)}"}


def _tensorflow() -> dict[str, Any]:
    tf = importlib.import_module("tensorflow")  # by name: optional, and maybe without type stubs

    gpus = tf.config.list_physical_devices("GPU")
    return {"installed": True, "version": tf.__version__, "gpus": [g.name for g in gpus]}


def _jax() -> dict[str, Any]:
    jax = importlib.import_module("jax")  # by name: optional, and maybe without type stubs

    devs = jax.devices()
    return {"installed": True, "version": jax.__version__, "devices": [str(d) for d in devs],
            "gpus": [str(d) for d in devs if d.platform in ("gpu", "cuda", "rocm")]}
