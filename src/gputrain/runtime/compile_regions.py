"""torch.compile of a run's model: the whole model, or its repeated block once for all its siblings.

Regional compilation (PyTorch's recipe "Reducing torch.compile cold start compilation time with
regional compilation"; Accelerate's `compile_regions`): a model whose layers repeat (a GPT's or a
BERT's or a ViT's ModuleList of identical blocks) has each block compiled in place with
`nn.Module.compile`. Every block runs the same forward code object and dynamo treats the
parameters as inputs, so the first block's graph passes the guards of its siblings: one block is
traced and compiled, not the whole stack unrolled. The code between the blocks (embeddings, head,
loss) runs eagerly.

A model without such a run of blocks (a ResNet's stages hold two identical blocks each, a small
share of the weights) is compiled whole, and the decision says why.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

# The repeated blocks must hold at least this share of the model's parameters: compiling a small
# part regionally leaves most of the model eager (a ResNet's one pair of identical BasicBlocks).
MIN_SHARE = 0.5


@dataclass(frozen=True)
class RepeatedBlocks:
    """The largest run of identical blocks: the container's name, the block class, how many, their
    share of the model's parameters (0..1)."""

    container: str
    block_class: str
    count: int
    share: float
    blocks: tuple[nn.Module, ...]


def _structure(module: nn.Module) -> tuple:
    """What makes two blocks the same compiled code: the class and every parameter's and buffer's
    name, shape and dtype (two blocks that differ here would recompile instead of sharing)."""
    return (type(module),
            tuple((n, tuple(p.shape), p.dtype) for n, p in module.named_parameters()),
            tuple((n, tuple(b.shape), b.dtype) for n, b in module.named_buffers()))


def find_repeated_blocks(model: nn.Module) -> RepeatedBlocks | None:
    """The ModuleList / Sequential child run with the most parameters made of >= 2 identical blocks
    (same class, same parameter shapes); None when the model has none."""
    total = sum(p.numel() for p in model.parameters()) or 1
    best: RepeatedBlocks | None = None
    best_params = -1
    for name, container in model.named_modules():
        if not isinstance(container, (nn.ModuleList, nn.Sequential)):
            continue
        groups: dict[tuple, list[nn.Module]] = {}
        for child in container.children():
            groups.setdefault(_structure(child), []).append(child)
        for key, blocks in groups.items():
            if len(blocks) < 2:
                continue
            params = sum(p.numel() for b in blocks for p in b.parameters())
            if params > best_params or (params == best_params and best is not None and len(blocks) > best.count):
                best_params = params
                best = RepeatedBlocks(name or "(the model)", key[0].__name__, len(blocks), params / total,
                                      tuple(blocks))
    return best


@dataclass
class CompiledModel:
    """What `compile_model` did: the model to call, "whole" or "regional", and why."""

    model: nn.Module
    how: str
    reason: str
    blocks: RepeatedBlocks | None = None


def compile_model(model: nn.Module, *, regional: bool, mode: str | None = None) -> CompiledModel:
    """Compile `model` (after it was moved and wrapped): regionally when asked and its repeated
    blocks hold at least MIN_SHARE of its parameters (each block compiled in place, the model itself
    returned), else whole (`torch.compile(model)`, an OptimizedModule)."""
    if regional:
        found = find_repeated_blocks(model)
        if found is not None and found.share >= MIN_SHARE:
            for block in found.blocks:
                block.compile(mode=mode or None)
            return CompiledModel(model, "regional",
                                 f"regional: {found.count} x {found.block_class} in {found.container} compiled once "
                                 f"and shared ({found.share:.0%} of the parameters)", found)
        why = ("no ModuleList or Sequential of >= 2 identical blocks" if found is None else
               f"the largest run of identical blocks ({found.count} x {found.block_class} in {found.container}) "
               f"holds {found.share:.0%} of the parameters, under {MIN_SHARE:.0%}")
        reason = f"whole model: regional compilation asked, but {why}"
    else:
        reason = "whole model"
    compiled: Any = torch.compile(model, mode=mode or None)
    return CompiledModel(compiled, "whole", reason)
