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
"""

from __future__ import annotations

import contextlib
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


@contextlib.contextmanager
def eval_mode(model: nn.Module) -> Iterator[nn.Module]:
    """Every module in eval mode inside; each module's own mode (mixed or not) given back afterwards."""
    modes = module_modes(model)
    model.eval()
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

    def train(self, outer: nn.Module | None = None) -> None:
        """Train mode for the model, eval mode kept where the user set it. Call once, not per step
        (it walks every module). outer: a wrapper of the model (DDP, torch.compile) to set as well."""
        # `is not None`: a whole-model OptimizedModule's truth value calls its len(), which raises
        (outer if outer is not None else self.model).train()
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
        return self

    def describe(self) -> str | None:
        """'teacher (4 modules), backbone.bn1 (1 module)', or None when nothing is kept in eval mode."""
        if not self.kept_roots:
            return None
        shown = [f"{name} ({n} module{'s' if n != 1 else ''})" for name, n in self.kept_roots[:4]]
        more = f" and {len(self.kept_roots) - 4} more" if len(self.kept_roots) > 4 else ""
        return ", ".join(shown) + more

    def decision(self) -> dict[str, str]:
        """The modes' row of the run's decisions."""
        kept = self.describe()
        if kept is not None:
            return {"name": "modes", "value": f"kept in eval mode as you set it: {kept}",
                    "reason": "submodules you put in eval mode stay so while training; train mode for the rest"}
        if not self.model.training:
            return {"name": "modes", "value": "train mode", "reason": "the model came wholly in eval mode (as a "
                    "from_pretrained model does): trained in train mode, given back in eval mode after fit"}
        return {"name": "modes", "value": "train mode", "reason": "every module came in train mode"}
