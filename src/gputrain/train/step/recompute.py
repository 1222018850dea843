"""Recompute: blocks run their forward again in backward instead of storing their activations.

- `apply_recompute(model, targets)`: wrap the named blocks (or the repeated ones) so that their
  forward runs under torch.utils.checkpoint.checkpoint (torch's name for recompute); gradients do
  not change.
- `recompute_units(model)`: the blocks chosen when no names are given, each a `RecomputeUnit`
  (the memory estimate also measures the activations per block with them).

Part of training (the trainer applies it for TrainConfig(recompute=...), `fit --recompute`); the
memory diagnostics use `recompute_units` to say what recomputing would save.
"""

from __future__ import annotations

import difflib
import math
import re
import types
from collections import Counter
from typing import Callable, Sequence

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint  # torch's name for recompute: nothing is saved to disk

from gputrain.errors import ConfigError
from gputrain.torch_compat import BATCHNORM_TYPES

class RecomputeUnit:
    """One block that is recomputed: a module, or a run of children of an nn.Sequential (`container`,
    its layers `span` = (start, end)); `name` as `apply_recompute` takes it."""

    def __init__(self, name: str, modules: list[nn.Module], container: nn.Sequential | None = None,
                 span: tuple[int, int] | None = None):
        self.name, self.modules, self.container, self.span = name, modules, container, span

    def __repr__(self) -> str:
        return f"RecomputeUnit({self.name!r})"


def _is_leaf(m: nn.Module) -> bool:
    return next(m.children(), None) is None


def _has_params(m: nn.Module) -> bool:
    return next(m.parameters(), None) is not None


def _span_name(path: str, a: int, b: int) -> str:
    return f"{path}[{a}:{b}]"


def recompute_units(model: nn.Module, strict: bool = True) -> list[RecomputeUnit]:
    """The blocks `apply_recompute(model)` wraps when no names are given.

    1. Repeated blocks: children of an nn.Sequential / nn.ModuleList that have submodules and
       whose class occurs at least twice there (transformer layers, residual blocks); nothing
       inside a chosen block is chosen again.
    2. Else all children of the largest nn.ModuleList.
    3. Else the largest nn.Sequential of 3+ layers is cut into about sqrt(n) runs of layers, and
       every run but the last is recomputed (its activations are needed right away anyway).
    strict: raise ConfigError when nothing qualifies; else return [].
    """
    units: list[RecomputeUnit] = []
    taken: list[str] = []

    def inside_taken(name: str) -> bool:
        return any(name == t or name.startswith(t + ".") for t in taken)

    for path, module in model.named_modules():
        if inside_taken(path) or not isinstance(module, (nn.Sequential, nn.ModuleList)):
            continue
        children = list(module.named_children())
        counts = Counter(type(c) for _, c in children if not _is_leaf(c) and _has_params(c))
        for name, child in children:
            if counts.get(type(child), 0) >= 2:
                full = f"{path}.{name}" if path else name
                units.append(RecomputeUnit(full, [child]))
                taken.append(full)
    if units:
        return units

    lists = [(p, m) for p, m in model.named_modules() if isinstance(m, nn.ModuleList) and len(m) >= 2]
    if lists:
        path, biggest = max(lists, key=lambda pm: len(pm[1]))
        return [RecomputeUnit(f"{path}.{name}" if path else name, [child]) for name, child in biggest.named_children()]

    seqs = [(p, m) for p, m in model.named_modules() if isinstance(m, nn.Sequential) and len(m) >= 3]
    if seqs:
        path, seq = max(seqs, key=lambda pm: (len(pm[1]), sum(p.numel() for p in pm[1].parameters())))
        n = len(seq)
        k = max(2, round(math.sqrt(n)))
        bounds = [round(i * n / k) for i in range(k + 1)]
        children = list(seq.children())
        for a, b in zip(bounds[:-2], bounds[1:-1]):  # every run but the last
            units.append(RecomputeUnit(_span_name(path, a, b), children[a:b], container=seq, span=(a, b)))
        return units
    if strict:
        raise ConfigError(
            f"found no repeated blocks, nn.ModuleList or nn.Sequential of 3+ layers in {type(model).__name__} "
            f"to recompute: pass the names of the submodules to recompute, e.g. {_example_names(model)}")
    return []


def _example_names(model: nn.Module, k: int = 4) -> list[str]:
    return [n for n, m in model.named_modules() if n and _has_params(m)][:k]


_SPAN = re.compile(r"^(.*)\[(\d+):(\d+)\]$")


def _resolve_target(model: nn.Module, name: str) -> RecomputeUnit:
    match = _SPAN.match(name)
    path = match.group(1) if match else name
    try:
        module = model.get_submodule(path)
    except AttributeError:
        names = [n for n, _ in model.named_modules() if n]
        close = difflib.get_close_matches(path, names, n=3)
        hint = f"did you mean {', '.join(close)}?" if close else f"submodules include {', '.join(names[:8])}"
        raise ConfigError(f"cannot recompute {name!r}: {type(model).__name__} has no submodule {path!r} ({hint})") from None
    if not match:
        if module is model:
            raise ConfigError(f"cannot recompute {name!r}: name a submodule, not the whole model")
        return RecomputeUnit(name, [module])
    a, b = int(match.group(2)), int(match.group(3))
    if not isinstance(module, nn.Sequential):
        raise ConfigError(f"cannot recompute {name!r}: [a:b] ranges need an nn.Sequential, "
                          f"{path or 'the model'} is a {type(module).__name__}")
    if not (0 <= a < b <= len(module)):
        raise ConfigError(f"cannot recompute {name!r}: {path or 'the model'} has {len(module)} layers (0..{len(module)})")
    return RecomputeUnit(name, list(module.children())[a:b], container=module, span=(a, b))


def _bn_buffers(modules: Sequence[nn.Module]) -> list[torch.Tensor]:
    return [b for m in modules for sub in m.modules() if isinstance(sub, BATCHNORM_TYPES)
            for b in sub.buffers()]


def _recomputed_call(fn: Callable, modules: Sequence[nn.Module], *args, **kwargs):
    """Run fn so that backward runs it again (non-reentrant). The recomputation in backward restores
    BatchNorm running statistics afterwards, so they are updated once per step as without recompute."""
    calls = [0]

    def run(*a, **k):
        calls[0] += 1
        if calls[0] == 1:
            return fn(*a, **k)
        # The recomputation (which may stop early, by raising, once it has what backward needs).
        buffers = _bn_buffers(modules)
        saved = [b.clone() for b in buffers]
        try:
            return fn(*a, **k)
        finally:
            with torch.no_grad():
                for b, s in zip(buffers, saved):
                    b.copy_(s)

    return checkpoint(run, *args, use_reentrant=False, **kwargs)


def _recomputed_forward(self: nn.Module, *args, **kwargs):
    forward = type(self).forward.__get__(self)  # the class's forward, not this instance attribute
    if not (torch.is_grad_enabled() and self.training):
        return forward(*args, **kwargs)
    return _recomputed_call(forward, [self], *args, **kwargs)


def _segmented_forward(self: nn.Sequential, x):
    children = list(self.children())
    spans: dict[int, int] = dict(getattr(self, "_gputrain_spans"))  # start -> end
    i, grad = 0, torch.is_grad_enabled() and self.training
    while i < len(children):
        end = spans.get(i)
        if end is None:
            x = children[i](x)
            i += 1
            continue
        run_children = children[i:end]

        def run(inp, run_children=run_children):
            for child in run_children:
                inp = child(inp)
            return inp

        x = _recomputed_call(run, run_children, x) if grad else run(x)
        i = end
    return x


def apply_recompute(model: nn.Module, targets: list[str] | None = None) -> list[str]:
    """Make blocks of `model` recompute their activations in backward instead of storing them.

    targets: submodule names (as in model.named_modules(), e.g. "blocks.3") or runs of an
    nn.Sequential ("features[0:4]"); None picks the repeated blocks (see `recompute_units`).
    Each chosen module's forward runs under torch.utils.checkpoint.checkpoint(use_reentrant=False)
    when gradients are on and the module is training; parameter names and state_dict keys do not
    change. Applying twice wraps nothing twice. Gradients equal those of the unwrapped model.
    Returns the recomputed names. Raises ConfigError for a name that is not in the model.
    """
    units = recompute_units(model) if targets is None else [_resolve_target(model, t) for t in targets]
    names = []
    for unit in units:
        if unit.container is None:
            module = unit.modules[0]
            if not getattr(module, "_gputrain_recomputed", False):
                module.forward = types.MethodType(_recomputed_forward, module)
                # Plain attributes (not tensors or modules): setattr, as Module's stub takes only those.
                setattr(module, "_gputrain_recomputed", True)
        else:
            seq = unit.container
            spans = list(getattr(seq, "_gputrain_spans", []))
            assert unit.span is not None, "a run of an nn.Sequential always has its span"
            a, b = unit.span
            for s, e in spans:
                if (s, e) != (a, b) and s < b and a < e:
                    raise ConfigError(f"cannot recompute {unit.name!r}: it overlaps layers {s}:{e}, already recomputed")
            if (a, b) not in spans:
                spans.append((a, b))
            setattr(seq, "_gputrain_spans", sorted(spans))
            seq.forward = types.MethodType(_segmented_forward, seq)
        names.append(unit.name)
    return names


def recompute_for_run(module: nn.Module, recompute: bool | Sequence[str]) -> list[str]:
    """TrainConfig.recompute applied to `module` (True: every repeated block; else the names given):
    the modules whose activations are recomputed in backward."""
    return apply_recompute(module, None if isinstance(recompute, bool) else list(recompute))
