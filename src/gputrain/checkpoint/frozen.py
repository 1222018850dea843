"""A frozen base (parameters with requires_grad=False, such as a LoRA fine-tune's): which weights it
holds, a fingerprint of them, and checkpoints that leave them out.

A run whose base is frozen writes, unless `TrainConfig.full_checkpoints` is set, checkpoints of the
trainable parameters and the buffers (with the optimizer's state, which is theirs only: the optimizer
holds only parameters that train) plus `frozen`: a fingerprint of the frozen weights. A 7B base in
bf16 is 14 GB that a save no longer writes. A resume (and `gputrain eval / predict / export`) takes
the frozen weights from the model it is given, after checking them against the fingerprint: on
another base the checkpoint's adapter would be meaningless, so that is refused with the names of the
tensors that differ.

The fingerprint is exact and cheap, computed once (at the first save or resume, never per step) on
the device where the weights are: each tensor's bytes read as integers (int16 for 2-byte dtypes,
int32 for 4- and 8-byte ones, uint8 for 1-byte ones), summed plain and weighted by position
(1..65536) over chunks of 65536 values. The sums are exact int64 (|sum| < 2**62): nothing is
rounded, so the order in which a device reduces cannot change them. Any changed value changes a
plain sum, any swap of two different values a weighted one. One host read per device brings the
sums back; sha256 makes them a digest per tensor and one for the base. (Measured on 2 CPU cores:
50M float32 values in 0.26 s, after a first call.)

With the sharded format (DCP: several processes, or asked for) and under FSDP (`shard=True`) the
checkpoints stay full: each rank writes its share of every weight, and the frozen tensors are
sharded where a fingerprint would need them whole.
"""

from __future__ import annotations

import hashlib
from typing import Any, Mapping

import torch
from torch import nn

from gputrain.errors import CheckpointError

CHUNK = 1 << 16  # values per partial sum: with weights up to CHUNK, |weighted sum| < 2**31 * CHUNK**2 / 2 < 2**63
SLICE = 1 << 24  # values widened to int64 at a time (a multiple of CHUNK)
_INT_OF_SIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int32}  # 8-byte values as two int32


def frozen_keys(module: nn.Module) -> list[str]:
    """The state_dict keys of `module`'s frozen parameters (tied names each), in state_dict order."""
    return [k for k, v in module.state_dict(keep_vars=True).items()
            if isinstance(v, nn.Parameter) and not v.requires_grad]


def parameter_counts(module: nn.Module) -> tuple[int, int]:
    """(trainable, frozen) parameter counts of `module`, tied parameters counted once."""
    trainable = frozen = 0
    for p in module.parameters():
        if p.requires_grad:
            trainable += p.numel()
        else:
            frozen += p.numel()
    return trainable, frozen


def _as_ints(t: torch.Tensor) -> torch.Tensor:
    """The tensor's bytes as a flat tensor of small integers (a view where it can be, on its device)."""
    t = t.detach()
    if t.is_complex():
        t = torch.view_as_real(t)
    if t.dtype == torch.bool:
        t = t.to(torch.uint8)
    return t.contiguous().reshape(-1).view(_INT_OF_SIZE[t.element_size()])


def _chunk_sums(t: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """(chunks, 2) int64 on the tensor's device: each chunk's plain and position-weighted sum. Widened
    to int64 a slice at a time (SLICE values: 128 MiB of temporaries at most)."""
    ints = _as_ints(t)
    sums = []
    for start in range(0, max(ints.numel(), 1), SLICE):
        v = ints[start:start + SLICE].to(torch.int64)
        whole = v.numel() // CHUNK * CHUNK
        head = v[:whole].view(-1, CHUNK)
        sums.append(torch.stack([head.sum(1), (head * weights).sum(1)], 1))
        tail = v[whole:]
        if tail.numel() or not whole:
            sums.append(torch.stack([tail.sum(), (tail * weights[:tail.numel()]).sum()]).view(1, 2))
    return torch.cat(sums)


def tensor_digests(tensors: Mapping[str, torch.Tensor]) -> dict[str, str]:
    """name -> 16 hex digits of each tensor's dtype, shape and bytes (see the module docstring). The
    sums are computed where the tensors are and read back in one transfer per device."""
    weights: dict[torch.device, torch.Tensor] = {}
    sums: dict[str, torch.Tensor] = {}
    for name, t in tensors.items():
        if t.device not in weights:
            weights[t.device] = torch.arange(1, CHUNK + 1, device=t.device, dtype=torch.int64)
        sums[name] = _chunk_sums(t, weights[t.device])
    host: dict[str, Any] = {}
    for device in weights:
        names = [n for n in sums if sums[n].device == device]
        block, row = torch.cat([sums[n] for n in names]).cpu().numpy(), 0  # the one read of this device
        for n in names:
            host[n], row = block[row:row + len(sums[n])], row + len(sums[n])
    out = {}
    for name, t in tensors.items():
        h = hashlib.sha256(f"{t.dtype}|{tuple(t.shape)}|".encode())
        h.update(host[name].tobytes())
        out[name] = h.hexdigest()[:16]
    return out


def base_digest(digests: Mapping[str, str]) -> str:
    """One digest over the per-tensor ones (sorted by name)."""
    return hashlib.sha256("\n".join(f"{k} {digests[k]}" for k in sorted(digests)).encode()).hexdigest()


class FrozenBase:
    """A module's frozen parameters: their keys, whether this run's checkpoints leave them out (and
    why), and their fingerprint (computed on first use, then kept: the weights do not train)."""

    def __init__(self, module: nn.Module, trainable_only: bool, reason: str):
        self.module = module
        self.keys = frozen_keys(module)
        self.trainable_only = trainable_only and bool(self.keys)
        self.reason = reason
        self.trainable, self.frozen = parameter_counts(module)
        self._digests: dict[str, str] | None = None

    @classmethod
    def decide(cls, module: nn.Module, *, full_checkpoints: bool, sharded: bool, fsdp: bool) -> "FrozenBase":
        """What the run's checkpoints hold, with the reason (a line of the run log and summary)."""
        trainable, frozen = parameter_counts(module)
        if not frozen:
            return cls(module, False, "full: every parameter trains")
        if full_checkpoints:
            return cls(module, False, "full: asked for (full_checkpoints=True)")
        if fsdp:
            return cls(module, False, "full: under FSDP (shard) the frozen weights are sharded, so each rank "
                                      "writes its share of every weight")
        if sharded:
            return cls(module, False, "full: the sharded format (DCP) writes each rank's share of every weight")
        return cls(module, True, f"trainable only: {trainable:,} of {trainable + frozen:,} parameters, the frozen "
                                 "base checked by its fingerprint on resume (full_checkpoints=True for every weight)")

    @property
    def digests(self) -> dict[str, str]:
        if self._digests is None:
            own = self.module.state_dict()
            self._digests = tensor_digests({k: own[k] for k in self.keys})
        return self._digests

    def header(self) -> dict[str, Any]:
        """The checkpoint's `frozen` entry: what a resume checks the base against."""
        own = self.module.state_dict()
        return {"fingerprint": base_digest(self.digests), "tensors": dict(self.digests), "parameters": self.frozen,
                "shapes": {k: list(own[k].shape) for k in self.keys}}

    def trainable_state(self, state: Mapping[str, Any]) -> dict[str, Any]:
        """`state` (the module's state_dict) without the frozen weights."""
        keys = set(self.keys)
        return {k: v for k, v in state.items() if k not in keys}

    def complete(self, state: Mapping[str, Any]) -> dict[str, Any]:
        """A trainable-only `state` with this module's frozen weights filled in (after `check`)."""
        own = self.module.state_dict()
        return {**{k: own[k] for k in self.keys if k not in state}, **state}

    def check(self, saved: Any, path: str = "", model: str = "this run's model",
              advice: str = "load those, or start a new run") -> None:
        """Raise CheckpointError when a trainable-only checkpoint's `frozen` entry does not describe
        this module's frozen weights: another base, or other parameters frozen. `model` names the
        module in the message, `advice` says what to do about another base."""
        where = f"{path}: " if path else ""
        tensors = saved.get("tensors") if isinstance(saved, dict) else None
        if not isinstance(tensors, dict):
            raise CheckpointError(f"{where}the checkpoint's 'frozen' entry is malformed; use a full checkpoint or "
                                  "start a new run")
        not_frozen = [k for k in tensors if k not in self.digests]
        if not_frozen:
            raise CheckpointError(
                f"{where}the checkpoint holds only the trainable parameters, and {len(not_frozen)} tensor(s) it left "
                f"out as frozen are not frozen in {model} ({_names(not_frozen)}): freeze the same parameters "
                "(requires_grad=False) as the run that wrote it")
        also_frozen = [k for k in self.digests if k not in tensors]
        if also_frozen:  # trained (and saved) by the run that wrote it, part of the base here: another base
            raise CheckpointError(
                f"{where}the checkpoint was trained on another frozen base: {len(also_frozen)} tensor(s) frozen in "
                f"{model} were not frozen in the run that wrote it ({_names(also_frozen)}); it holds only the "
                f"trainable parameters, so it fits only the base it was trained on: freeze the same parameters "
                f"(requires_grad=False) as that run, or {advice}")
        differ = [k for k in tensors if tensors[k] != self.digests[k]]
        if differ:
            raise CheckpointError(
                f"{where}the checkpoint was trained on another frozen base: {len(differ)} of {len(tensors)} frozen "
                f"tensors differ from {model} ({_names(differ)}{_shapes(saved, differ, self.module)}); it holds only "
                f"the trainable parameters, so it fits only the base weights it was trained on: {advice}")
        if saved.get("fingerprint") not in (None, base_digest(self.digests)):
            raise CheckpointError(f"{where}the checkpoint's frozen-base fingerprint does not match its own tensor "
                                  "digests (the checkpoint was changed after it was written): use a full checkpoint "
                                  "or start a new run")


def _shapes(saved: dict, keys: list[str], module: nn.Module) -> str:
    """"; shape ... in the checkpoint, ... here" for the first key whose recorded shape differs."""
    shapes = saved.get("shapes")
    if not isinstance(shapes, dict):
        return ""
    own = module.state_dict()
    for k in keys:
        if k in shapes and list(shapes[k]) != list(own[k].shape):
            return f"; {k}: shape {tuple(shapes[k])} in the checkpoint, {tuple(own[k].shape)} here"
    return ""


def _names(keys: list[str]) -> str:
    return ", ".join(keys[:3]) + (f" and {len(keys) - 3} more" if len(keys) > 3 else "")
