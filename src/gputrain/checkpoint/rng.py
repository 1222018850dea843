"""The random-number state of a run: every global generator it draws from, captured as tensors and
plain data (so a checkpoint holding it loads with weights_only=True) and restored exactly on resume.

A checkpoint keeps it under "rng" (parts.RngPart): rank 0's in a one-file checkpoint, each rank's own in
its run-state file of a sharded one.
"""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import torch

from gputrain.errors import CheckpointError


def capture_rng_state(device: torch.device | str | None = None) -> dict[str, Any]:
    """Every global random-number state a run draws from, in weights_only-loadable form.

    Returns {"torch": uint8 tensor, "numpy": {...}, "python": {...}} plus "cuda" (that device's
    generator) or "mps". torch.Generator objects a loader shuffles with are not global: save their
    get_state() separately.
    """
    device = torch.device(device) if device is not None else None
    np_state = np.random.get_state(legacy=True)  # a tuple while the global generator is numpy's MT19937
    if not isinstance(np_state, tuple):
        raise CheckpointError(f"numpy's global random state is a {np_state.get('bit_generator')}, not the MT19937 "
                              "that a checkpoint stores")
    name, keys, pos, has_gauss, cached_gauss = np_state
    version, internal, gauss = random.getstate()
    state: dict[str, Any] = {
        "torch": torch.get_rng_state(),
        # The Mersenne Twister keys are 624 uint32; stored widened to int64 (uint32 tensors have
        # few kernels in older PyTorch), narrowed back on restore.
        "numpy": {"name": str(name), "keys": torch.from_numpy(keys.astype(np.int64)), "pos": int(pos),
                  "has_gauss": int(has_gauss), "cached_gauss": float(cached_gauss)},
        "python": {"version": int(version), "state": [int(x) for x in internal], "gauss": gauss},
    }
    if device is not None and device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    elif device is not None and device.type == "mps":
        state["mps"] = torch.mps.get_rng_state()
    return state


def restore_rng_state(state: dict[str, Any], device: torch.device | str | None = None) -> None:
    """Set the generators `capture_rng_state` read. A device state of another kind is skipped
    (a CUDA run resumed on the CPU draws its CPU numbers exactly, its CUDA ones cannot apply)."""
    device = torch.device(device) if device is not None else None
    try:
        torch.set_rng_state(state["torch"].cpu())
        n = state["numpy"]
        np.random.set_state((n["name"], n["keys"].cpu().numpy().astype(np.uint32), int(n["pos"]),
                             int(n["has_gauss"]), float(n["cached_gauss"])))
        p = state["python"]
        random.setstate((int(p["version"]), tuple(int(x) for x in p["state"]), p["gauss"]))
    except (KeyError, TypeError, ValueError, AttributeError, RuntimeError) as exc:
        raise CheckpointError(
            f"the checkpoint's random-number state is malformed ({type(exc).__name__}: {exc})") from None
    if device is not None and device.type == "cuda" and "cuda" in state:
        torch.cuda.set_rng_state(state["cuda"].cpu(), device)
    elif device is not None and device.type == "mps" and "mps" in state:
        torch.mps.set_rng_state(state["mps"].cpu())
