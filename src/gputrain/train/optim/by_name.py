"""Several optimizers and schedulers by name, for a step of your own (train/step/own_step.py).

`fit(..., step_fn=fn, optimizer={"generator": opt_g, "discriminator": opt_d}, scheduler={...})`:
each optimizer is an instance over the parameters it updates, or a callable `model -> optimizer`
(the model as you gave it, so that it can pick `model.generator.parameters()`); each scheduler a
callable `optimizer -> LRScheduler`, stepped after every step of its optimizer.

`OptimizerSet` stands where the trainer keeps its one optimizer: its param_groups and state are
all of theirs (what the non-finite probe, the state moves, the CUDA-graph checks and a callback's
learning-rate change read), its state_dict holds each optimizer's under its name (what checkpoints
save and a resume loads back exactly), and zero_grad clears them all. `SchedulerSet` likewise for
the schedulers; the trainer's per-step `step()` does nothing, as each scheduler is stepped with its
optimizer by the step context.
"""

from __future__ import annotations

from typing import Any, Callable, Iterable, Mapping

import torch
from torch import nn

from gputrain.errors import ConfigError
from gputrain.train.optim.build import refuse_unregistered


def _trainable(optimizer: torch.optim.Optimizer) -> int:
    return sum(1 for g in optimizer.param_groups for p in g["params"] if p.requires_grad)


class OptimizerSet:
    """Named optimizers that act as one where the trainer needs one (see the module docstring)."""

    def __init__(self, optimizers: Mapping[str, torch.optim.Optimizer]):
        if not optimizers:
            raise ConfigError("optimizer={} names no optimizer: give {'name': optimizer, ...}")
        self.optimizers = dict(optimizers)
        seen: dict[int, str] = {}
        for name, opt in self.optimizers.items():
            if not isinstance(opt, torch.optim.Optimizer):
                raise ConfigError(f"optimizer {name!r} is a {type(opt).__name__}, not a torch.optim.Optimizer "
                                  "(give an instance, or a callable model -> optimizer)")
            if not _trainable(opt):
                raise ConfigError(f"optimizer {name!r} holds no parameter that trains (requires_grad=True): "
                                  "build it over the parameters it should update")
            for g in opt.param_groups:
                for p in g["params"]:
                    other = seen.setdefault(id(p), name)
                    if other != name:
                        raise ConfigError(f"a parameter is in both optimizer {other!r} and {name!r}: each "
                                          "parameter may be updated by one optimizer only")

    @classmethod
    def build(cls, spec: Mapping[str, Any], model: nn.Module) -> "OptimizerSet":
        """From {name: optimizer or callable model -> optimizer}. Refuses optimizers that update tensors
        the model does not register (train/optim/build.py: they would never be checkpointed)."""
        built = {}
        for name, value in spec.items():
            if not isinstance(name, str) or not name.isidentifier():
                raise ConfigError(f"optimizer names must be identifiers (they name logged values), got {name!r}")
            if not isinstance(value, torch.optim.Optimizer) and callable(value):
                value = value(model)
            built[name] = value
        made = cls(built)
        refuse_unregistered({f"optimizer {name!r}": opt for name, opt in made.optimizers.items()}, model.parameters())
        return made

    def __len__(self) -> int:
        return len(self.optimizers)

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return [g for opt in self.optimizers.values() for g in opt.param_groups]

    @property
    def state(self) -> dict[Any, Any]:
        # The per-parameter dicts themselves: a write into one (a move to the device) reaches its optimizer.
        return {p: s for opt in self.optimizers.values() for p, s in opt.state.items()}

    def zero_grad(self, set_to_none: bool = True) -> None:
        for opt in self.optimizers.values():
            opt.zero_grad(set_to_none=set_to_none)

    def state_dict(self) -> dict[str, Any]:
        return {"optimizers": {name: opt.state_dict() for name, opt in self.optimizers.items()}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        saved = state.get("optimizers") if isinstance(state, dict) else None
        if not isinstance(saved, dict) or set(saved) != set(self.optimizers):
            names = sorted(saved) if isinstance(saved, dict) else "one optimizer"
            raise ValueError(f"the checkpoint holds optimizers {names}, this run has {sorted(self.optimizers)}")
        for name, opt in self.optimizers.items():
            opt.load_state_dict(saved[name])

    def describe(self) -> str:
        return ", ".join(f"{name}: {type(opt).__name__}" for name, opt in self.optimizers.items())


class SchedulerSet:
    """Named schedulers (or None: the optimizer's learning rate stays as it is). step() does nothing:
    the step context steps each after its optimizer."""

    def __init__(self, schedulers: Mapping[str, Any], optimizers: OptimizerSet):
        self.schedulers = dict(schedulers)
        self.optimizers = optimizers

    @classmethod
    def build(cls, spec: Mapping[str, Callable[[torch.optim.Optimizer], Any]] | None,
              optimizers: OptimizerSet, default: Callable[[torch.optim.Optimizer], Any]) -> "SchedulerSet":
        """spec: {name: callable optimizer -> scheduler} for some of the optimizers; the others get
        `default(optimizer)` (the run's built-in schedule)."""
        from gputrain.train.optim.build import make_user_scheduler

        spec = dict(spec or {})
        unknown = sorted(set(spec) - set(optimizers.optimizers))
        if unknown:
            raise ConfigError(f"scheduler names {unknown} are not optimizers of this run ({sorted(optimizers.optimizers)})")
        made = {name: make_user_scheduler(opt, spec[name])[0] if name in spec else default(opt)
                for name, opt in optimizers.optimizers.items()}
        return cls(made, optimizers)

    def step(self) -> None:
        pass

    def step_for(self, name: str) -> None:
        self.schedulers[name].step()

    def get_last_lr(self) -> list[float]:
        """Each optimizer's first learning rate, in the order of the optimizers (host values)."""
        return [float(s.get_last_lr()[0]) for s in self.schedulers.values()]

    def last_lrs(self) -> dict[str, float]:
        return dict(zip(self.schedulers, self.get_last_lr()))

    def state_dict(self) -> dict[str, Any]:
        return {"schedulers": {name: s.state_dict() for name, s in self.schedulers.items()}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        saved = state.get("schedulers") if isinstance(state, dict) else None
        if not isinstance(saved, dict) or set(saved) != set(self.schedulers):
            raise ValueError(f"the checkpoint's schedulers do not match this run's ({sorted(self.schedulers)})")
        for name, s in self.schedulers.items():
            s.load_state_dict(saved[name])


# The settings a run may give each named optimizer ([optimizers.NAME] in a config file, a sweep's
# optimizers.NAME.KEY): set on every param group, where the optimizer has the key.
OPTIMIZER_SETTINGS = ("lr", "betas", "weight_decay", "momentum", "eps")


def check_optimizer_setting(name: str, key: str, value: Any) -> Any:
    """`value` of [optimizers.NAME] `key`, checked (betas a tuple of two numbers in [0, 1), the others a
    number >= 0, lr > 0); ConfigError naming the key otherwise."""
    what = f"[optimizers.{name}] {key}"
    if key not in OPTIMIZER_SETTINGS:
        raise ConfigError(f"unknown key {key!r} in [optimizers.{name}]: the keys are {', '.join(OPTIMIZER_SETTINGS)}")

    def number(v: Any) -> bool:
        return isinstance(v, (int, float)) and not isinstance(v, bool) and v == v and abs(v) != float("inf")

    if key == "betas":
        if not (isinstance(value, (list, tuple)) and len(value) == 2 and all(number(b) and 0 <= b < 1 for b in value)):
            raise ConfigError(f"{what} must be two numbers in [0, 1), e.g. [0.5, 0.999], got {value!r}")
        return tuple(float(b) for b in value)
    if not number(value) or value < 0 or (key == "lr" and value == 0):
        raise ConfigError(f"{what} must be a number {'above' if key == 'lr' else 'at least'} 0, got {value!r}")
    return float(value)


class NamedOptimizers:
    """A workload's named optimizers, made from the model when the run sets up, with the run's
    settings applied.

    make: {name: optimizer or callable model -> optimizer}, or one callable model -> {name: optimizer}.
    settings: {name: {key: value}} (keys of OPTIMIZER_SETTINGS), set on every param group of that
    optimizer once it is built, so that the workload's own values hold where none is given. After
    the build, `used` holds the values each optimizer trains with (defaults included) where its
    groups agree: what the run's config.toml records."""

    def __init__(self, make: Any, settings: Mapping[str, Mapping[str, Any]] | None = None):
        self.make = make
        self.settings = {name: dict(values) for name, values in (settings or {}).items()}
        self.used: dict[str, dict[str, Any]] = {}

    def build(self, model: nn.Module) -> OptimizerSet:
        spec = self.make(model) if callable(self.make) and not isinstance(self.make, Mapping) else self.make
        if not isinstance(spec, Mapping):
            raise ConfigError(f"the workload's optimizers gave a {type(spec).__name__}: give {{name: optimizer or "
                              "callable model -> optimizer}, or a callable model -> {name: optimizer}")
        optimizers = OptimizerSet.build(spec, model)
        self._check_names(optimizers.optimizers)
        for name, opt in optimizers.optimizers.items():
            for key, value in self.settings.get(name, {}).items():
                if any(key not in g for g in opt.param_groups):
                    raise ConfigError(f"[optimizers.{name}] {key}: {type(opt).__name__} takes no {key} (its settings: "
                                      f"{', '.join(k for k in OPTIMIZER_SETTINGS if k in opt.param_groups[0])})")
                for group in opt.param_groups:
                    if isinstance(group[key], torch.Tensor):  # a tensor lr (capturable): changed in place
                        group[key].fill_(value)
                    else:
                        group[key] = value
            self.used[name] = _agreed(opt)
        return optimizers


    def _check_names(self, names: Iterable[str]) -> None:
        unknown = sorted(set(self.settings) - set(names))
        if unknown:
            raise ConfigError(f"[optimizers] names {', '.join(unknown)}, which this workload has not: its optimizers "
                              f"are {', '.join(names)}")

    def check(self, make_model: Callable[[], nn.Module]) -> None:
        """Refuse what `build` would refuse of the settings (an optimizer name the workload has not, a
        key its optimizer takes not), found before the run's processes start (a launcher's, a sweep's
        trials): names from the workload's dict alone; keys on optimizers built over the model made on
        the meta device (no memory, no data). A model or optimizer that cannot be made there (one that
        reads a file, moves itself to a device) is left to the run's own start."""
        if not self.settings:
            return
        if isinstance(self.make, Mapping):
            self._check_names(list(self.make))
        try:
            with torch.device("meta"):
                model = make_model()
                NamedOptimizers(self.make, self.settings).build(model)
        except ConfigError:
            raise
        except Exception:  # noqa: BLE001 - not makeable here: the run's start builds and checks it
            return


def _agreed(opt: torch.optim.Optimizer) -> dict[str, Any]:
    """The settings of OPTIMIZER_SETTINGS that every param group of `opt` holds with one value."""
    out: dict[str, Any] = {}
    for key in OPTIMIZER_SETTINGS:
        values: list[Any] = [float(v) if isinstance(v, torch.Tensor) else v
                             for v in (g.get(key) for g in opt.param_groups)]
        first = values[0]
        if first is None or any(v != first for v in values):
            continue
        out[key] = tuple(float(b) for b in first) if isinstance(first, (tuple, list)) else float(first)
    return out
