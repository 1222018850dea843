"""Train and eval modes as the user set them.

`UserModes(model)` records every submodule's mode when fit starts. Submodules the user put in eval
mode (a distillation teacher, a frozen BatchNorm backbone) while the model itself is in train mode
stay in eval mode during training: `train()` sets the rest to train mode and leaves those alone.
A model given wholly in eval mode (a Hugging Face `from_pretrained` model is) trains in train mode,
as the Hugging Face Trainer and a hand loop calling `model.train()` do; only its submodules' own
choices under a model in train mode are kept. `restore()` gives back exactly the modes found.

`eval_mode(model)` is the context of an evaluation (evaluate, predict, the first-step note's rerun):
every module in eval mode inside, every module's own mode back afterwards, so that a mixed state
survives an evaluation. Both set `Module.training` flag by flag: `Module.train(mode)` would reset
every child to one mode.

A model whose `train` is not `nn.Module.train(mode)` (pytorch/examples' mnist_forward_forward
defines `Net.train(x_pos, x_neg)`, its own training routine) cannot be switched with `train()` or
`eval()` (which calls `train(False)`), in the model or in any parent that recurses into it. All fit
needs is the modes, so `set_training` then sets every module's flag itself, as `nn.Module.train`
does, without calling the user's method; the run's decisions say so in one line.
"""

from __future__ import annotations

import contextlib
import inspect
import logging
from typing import Iterator

from torch import nn

log = logging.getLogger("gputrain")


def module_modes(model: nn.Module) -> list[tuple[nn.Module, bool]]:
    """(module, training) for the model and every submodule."""
    return [(m, m.training) for m in model.modules()]


def set_modes(modes: list[tuple[nn.Module, bool]]) -> None:
    for m, training in modes:
        m.training = training


def _takes_mode(module: nn.Module) -> bool:
    """Whether `module.train(mode)` can be called: nn.Module's own, or an override that takes a mode
    (a BatchNorm freeze, `train(self, mode=True)`); not a method of another meaning."""
    if type(module).train is nn.Module.train:
        return True
    try:
        inspect.signature(module.train).bind(True)
    except TypeError:
        return False
    except ValueError:  # no signature to read (a builtin): trusted
        return True
    return True


def other_trains(model: nn.Module) -> list[str]:
    """'Net.train(x_pos, x_neg)' for each class in the model whose train() takes other arguments than a mode."""
    out: list[str] = []
    for m in model.modules():
        if not _takes_mode(m):
            params = list(inspect.signature(m.train).parameters)
            shown = f"{type(m).__name__}.train({', '.join(params)})"
            if shown not in out:
                out.append(shown)
    return out


def set_training(model: nn.Module, mode: bool, flags_only: bool | None = None) -> None:
    """`model.train(mode)`, or, where a module's train() takes other arguments (see the module
    docstring; `flags_only` when the caller knows already), every module's flag set as
    nn.Module.train sets it."""
    if flags_only is None:
        flags_only = bool(other_trains(model))
    if not flags_only:
        model.train(mode)
        return
    for m in model.modules():
        m.training = mode


@contextlib.contextmanager
def eval_mode(model: nn.Module) -> Iterator[nn.Module]:
    """Every module in eval mode inside; each module's own mode (mixed or not) given back afterwards."""
    modes = module_modes(model)
    set_training(model, False)
    try:
        yield model
    finally:
        set_modes(modes)


def _kept_roots(model: nn.Module) -> list[tuple[str, int]]:
    """(name, modules) of each outermost submodule in eval mode under modules in train mode."""
    roots: list[tuple[str, int]] = []

    def walk(prefix: str, module: nn.Module) -> None:
        for name, child in module.named_children():
            full = f"{prefix}.{name}" if prefix else name
            if child.training:
                walk(full, child)
            else:
                roots.append((full, sum(1 for m in child.modules() if not m.training)))

    walk("", model)
    return roots


class UserModes:
    """The modes of `model`'s modules when fit starts (see the module docstring)."""

    def __init__(self, model: nn.Module):
        self.model = model
        self.found = module_modes(model)
        # Kept in eval mode while training: eval-mode modules under a model in train mode.
        self.kept = [m for m, training in self.found if not training] if model.training else []
        self.kept_roots = _kept_roots(model) if model.training else []
        self.other_trains = other_trains(model)  # train() methods of another meaning: modes set flag by flag

    def train(self, outer: nn.Module | None = None) -> None:
        """Train mode for the model, eval mode kept where the user set it. Call once, not per step
        (it walks every module). outer: a wrapper of the model (DDP, torch.compile) to set as well."""
        # `is not None`: a whole-model OptimizedModule's truth value calls its len(), which raises
        set_training(outer if outer is not None else self.model, True, flags_only=bool(self.other_trains))
        for m in self.kept:
            m.training = False

    def restore(self) -> None:
        """Every module back in the mode it was in when fit started."""
        set_modes(self.found)

    def said(self, main: bool = True) -> "UserModes":
        """Log what is kept in eval mode (one line, on the main process); returns self."""
        kept = self.describe()
        if kept and main:
            log.info("kept in eval mode as you set it: %s", kept)
        if self.other_trains and main:
            log.info("%s", self._flag_by_flag())
        return self

    def _flag_by_flag(self) -> str:
        return (f"{', '.join(self.other_trains)} is not nn.Module.train(mode): fit sets train and eval mode module by "
                "module (the training flag, as nn.Module.train does) and never calls it")

    def describe(self) -> str | None:
        """'teacher (4 modules), backbone.bn1 (1 module)', or None when nothing is kept in eval mode."""
        if not self.kept_roots:
            return None
        shown = [f"{name} ({n} module{'s' if n != 1 else ''})" for name, n in self.kept_roots[:4]]
        more = f" and {len(self.kept_roots) - 4} more" if len(self.kept_roots) > 4 else ""
        return ", ".join(shown) + more

    def decision(self) -> dict[str, str]:
        """The modes' row of the run's decisions."""
        row = self._decision()
        if self.other_trains:
            row["reason"] += f"; {self._flag_by_flag()}"
        return row

    def _decision(self) -> dict[str, str]:
        kept = self.describe()
        if kept is not None:
            return {"name": "modes", "value": f"kept in eval mode as you set it: {kept}",
                    "reason": "submodules you put in eval mode stay so while training; train mode for the rest"}
        if not self.model.training:
            return {"name": "modes", "value": "train mode", "reason": "the model came wholly in eval mode (as a "
                    "from_pretrained model does): trained in train mode, given back in eval mode after fit"}
        return {"name": "modes", "value": "train mode", "reason": "every module came in train mode"}
