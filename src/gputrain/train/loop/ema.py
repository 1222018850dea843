"""EMA: an exponential moving average of the weights, updated on the device inside the training step.

After every optimizer step, `ema = ema + (w - ema) * (1 - decay_t)` over all parameters and
floating-point buffers (BatchNorm's running statistics), with integer buffers copied. The update
is given to the `TrainStep` (`step_update`), so it runs in the step's body: inside the CUDA graph
when the step is captured, with no host read per step. With `warmup`, decay_t = min(decay,
(1 + n) / (10 + n)) after n updates, computed on the device, so that an early average is not
dominated by the initial weights.

The weight 1 - decay_t is a device scalar with warm-up, a host constant without. A constant is one
`torch._foreach_lerp_`. A device scalar cannot go to that op: it takes its weight as a Scalar, and
a 0-dim tensor given there is read on the host first (`aten._local_scalar_dense`, a sync per step
on a GPU and an error inside graph capture). So the warm-up update is three multi-tensor kernels
that take a tensor: the difference, times the weight (`_foreach_mul_`'s Tensor overload), added.

At each evaluation the averaged model is evaluated too (`eval_ema_<metric>` beside `eval_<metric>`:
one more host read per evaluation, none per step); checkpoints hold its weights beside the raw ones
(`gputrain export` takes them when present), and a resume restores them.
"""

from __future__ import annotations

import copy
from typing import Any, Callable

import torch
from torch import nn

from gputrain.errors import ConfigError
from gputrain import torch_compat
from gputrain.train.loop.callbacks import Callback, RunControl
from gputrain.train.modes import set_training

STATE_KEY = "EMA"


class EMA(Callback):
    """Average the weights over steps; evaluate and save the average beside the raw weights.

    decay: the weight of the old average per step, in (0, 1) (0.999: about the last 1000 steps).
    warmup: ramp the decay up over the first steps ((1 + n) / (10 + n)), as is usual for short runs.
    evaluate: evaluate the averaged model at each evaluation (as eval_ema_<metric>).
    """

    state_key = STATE_KEY

    def __init__(self, decay: float = 0.999, warmup: bool = True, evaluate: bool = True):
        if not (isinstance(decay, (int, float)) and 0 < decay < 1):
            raise ConfigError(f"EMA decay must be in (0, 1), e.g. 0.999; got {decay!r}")
        self.decay, self.warmup, self.evaluate = float(decay), bool(warmup), bool(evaluate)
        self.model: nn.Module | None = None  # the averaged copy, made when the trainer hands over its module
        self.updates: torch.Tensor | None = None  # device counter of updates (float32, shape ())
        self._live: list[torch.Tensor] = []
        self._shadow: list[torch.Tensor] = []
        self._live_other: list[torch.Tensor] = []  # integer buffers: copied, not averaged
        self._shadow_other: list[torch.Tensor] = []
        self._loaded = False

    # ---------------------------------------------------------------- the device update (in the step)

    def step_update(self, module: nn.Module) -> Callable[[], None]:
        """Make the averaged copy of `module` and return the update the step runs after its optimizer step."""
        shadow = copy.deepcopy(module)
        set_training(shadow, False)  # .eval(), also for a train() of another meaning (train/modes.py)
        shadow.requires_grad_(False)
        self.model = shadow
        live_tensors = _tensors(module)
        shadow_tensors = _tensors(shadow)
        for live, avg in zip(live_tensors, shadow_tensors):
            if live.is_floating_point():
                self._live.append(live)
                self._shadow.append(avg)
            else:
                self._live_other.append(live)
                self._shadow_other.append(avg)
        device = live_tensors[0].device if live_tensors else torch.device("cpu")
        self.updates = torch.zeros((), device=device, dtype=torch.float32)
        return self.update

    @torch.no_grad()
    def update(self) -> None:
        """One EMA step on the device (no host read; captured with the training step)."""
        if self.updates is None:
            return
        self.updates.add_(1.0)
        if self.warmup:
            # 1 - min(decay, n / (9 + n)) after n updates ((1 + m) / (10 + m) for m = n - 1 before this
            # one), as a device scalar (shape ()): the lerp weight.
            weight = 1.0 - torch.clamp(self.updates / (self.updates + 9.0), max=self.decay)
            _lerp_by_tensor_(self._shadow, self._live, weight)
        else:
            _lerp_(self._shadow, self._live, 1.0 - self.decay)
        if self._shadow_other:
            _copy_(self._shadow_other, self._live_other)

    # ---------------------------------------------------------------- hooks at log points

    def on_run_start(self, run: RunControl) -> None:
        if self.model is None:
            raise ConfigError("EMA was not set up by the trainer (its step_update was never called)")
        if run.step > 0 and not self._loaded:
            # Added on a resumed run: start the average from the resumed weights.
            with torch.no_grad():
                _copy_(self._shadow + self._shadow_other, self._live + self._live_other)

    def on_evaluate(self, run: RunControl, metrics: dict[str, float]) -> dict[str, float] | None:
        if not self.evaluate or self.model is None:
            return None
        values = run.evaluate(self.model)
        return {"eval_ema_" + k[len("eval_"):] if k.startswith("eval_") else "ema_" + k: v for k, v in values.items()}

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The averaged weights (the model's state_dict layout)."""
        if self.model is None:
            raise ConfigError("EMA has no weights yet: it is set up when training starts")
        return self.model.state_dict()

    def on_checkpoint_save(self, run: RunControl) -> dict[str, Any]:
        return {"weights": self.state_dict(), "updates": self.updates, "decay": self.decay}

    def on_checkpoint_load(self, run: RunControl, state: dict[str, Any]) -> None:
        if self.model is None:
            return
        # In place: the step (and a captured graph) holds these tensors.
        with torch.no_grad():
            own = self.model.state_dict()
            for name, value in state["weights"].items():
                if name in own:
                    own[name].copy_(value)
            if self.updates is not None and isinstance(state.get("updates"), torch.Tensor):
                self.updates.copy_(state["updates"])
        self._loaded = True


def _tensors(module: nn.Module) -> list[torch.Tensor]:
    """Parameters and buffers in a fixed order (the same for a module and its deepcopy). The tensors
    themselves, not detached aliases: fit may re-lay out the live weights through `.data` during the run
    (channels_last decided on the first step, or given back after a failure, train/step/layout.py), and an
    alias would go on reading the storage they had before. The updates run under no_grad."""
    return [*module.parameters(), *module.buffers()]


# The foreach ops have no public name: torch_compat.py resolves them (a per-tensor loop without).
def _lerp_(shadow: list[torch.Tensor], live: list[torch.Tensor], weight: float) -> None:
    torch_compat.foreach_lerp_(shadow, live, weight)


def _lerp_by_tensor_(shadow: list[torch.Tensor], live: list[torch.Tensor], weight: torch.Tensor) -> None:
    """shadow += (live - shadow) * weight, weight a 0-dim device tensor never read on the host. The
    difference is a transient copy of the averaged tensors; the step has just freed the gradients."""
    step = torch_compat.foreach_sub(live, shadow)
    torch_compat.foreach_mul_(step, weight)  # the Tensor overload: the weight stays on the device
    torch_compat.foreach_add_(shadow, step)


def _copy_(dst: list[torch.Tensor], src: list[torch.Tensor]) -> None:
    torch_compat.foreach_copy_(dst, src)
