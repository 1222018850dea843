"""Where the data lives for a run (the memory rule), and why; data/feed.py builds what it decides.

- tensors (columns) on a GPU that fit in `memory_fraction` of free memory: kept on the device
  (`TensorBatches`);
- tensors on the CPU: slices of the tensors, without a DataLoader's per-sample collation;
- tensors that do not fit, or a `Dataset` (of pairs, dicts, ...): a pinned DataLoader with workers
  and a side-stream prefetcher (`LoaderBatches`);
- a user's `DataLoader`, an IterableDataset, a Hugging Face dataset or any iterable of batches:
  data/sources.py.
"""

from __future__ import annotations

import collections.abc
import logging
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils.data import TensorDataset

from gputrain import batch as batches

log = logging.getLogger("gputrain")


@dataclass
class Placement:
    """Where the data lives for this run, and why (for the run log)."""

    kind: str  # "device" | "host-slices" | "dataloader" | "user-dataloader" | "iterable"
    reason: str


def fits_on_device(nbytes: int, device: torch.device, fraction: float) -> tuple[bool, str]:
    """Whether `nbytes` fits in `fraction` of the device's free memory, with the figures."""
    if device.type != "cuda":
        return False, f"{device.type} has no separate device memory"
    free, _total = torch.cuda.mem_get_info(device)
    budget = int(free * fraction)
    ok = nbytes <= budget
    return ok, (f"{nbytes / 2**20:.1f} MiB of data {'fits in' if ok else 'exceeds'} "
                f"{fraction:.0%} of {free / 2**30:.1f} GiB free on {device}")


def choose_device_resident(nbytes: int, device: torch.device, on_device: str | bool,
                           fraction: float) -> tuple[bool, str]:
    """The memory rule: keep the data on the device when it fits in `fraction` of free memory."""
    if on_device != "auto":
        return bool(on_device), f"data_on_device={on_device} was requested"
    if device.type == "mps":
        return True, "MPS shares memory with the host"
    return fits_on_device(nbytes, device, fraction)


def as_columns(data: Any) -> Any | None:
    """The tensor columns behind `data`: a tuple/list of tensors, a TensorDataset, or a Mapping of tensors."""
    if isinstance(data, TensorDataset):
        return tuple(data.tensors)
    if isinstance(data, (tuple, list)) and data and all(isinstance(t, torch.Tensor) for t in data):
        return tuple(data) if not hasattr(data, "_fields") else data
    if (isinstance(data, collections.abc.Mapping) and data
            and all(isinstance(t, torch.Tensor) for t in data.values())):
        return data
    return None


def as_tensors(data: Any) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The (inputs, targets) tensors behind `data`, when it is a pair or a 2-tensor TensorDataset."""
    cols = as_columns(data)
    if isinstance(cols, tuple) and len(cols) == 2:
        return cols[0], cols[1]
    return None


def nbytes_of(columns: Any) -> int:
    return sum(t.numel() * t.element_size() for t in batches.tensor_leaves(columns))


def column_placement(columns: Any, device: torch.device, on_device: str | bool = "auto",
                     memory_fraction: float = 0.5) -> Placement:
    """Where tensor columns live for a run on `device` (the memory rule), and why; builds nothing."""
    if device.type == "cpu":
        return Placement("host-slices", "CPU training: batches are slices of the tensors (no DataLoader)")
    put, why = choose_device_resident(nbytes_of(columns), device, on_device, memory_fraction)
    if put:
        return Placement("device", f"data kept on the device: {why}")
    return Placement("dataloader", f"data streamed from the host (pinned, prefetched): {why}")
