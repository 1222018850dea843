"""What a workload is: data + model + loss + sensible defaults, under a name."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import torch
from torch import nn

from gputrain.data.splits import DataSplits  # noqa: F401  (re-exported: workloads build DataSplits)
from gputrain.errors import ConfigError

TASKS = ("classification", "binary", "regression")


@dataclass
class Workload:
    name: str
    description: str
    make_data: Callable[[], DataSplits]
    make_model: Callable[[], nn.Module]
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None
    task: str | None = "classification"  # "classification" | "binary" | "regression" | None (loss only)
    defaults: dict[str, Any] = field(default_factory=dict)  # TrainConfig overrides, e.g. {"epochs": 20}
    full_batch: bool = False  # batch_size defaults to the whole training set
    data_summary: str = ""  # e.g. "4000 train / 1000 test, 40 floats"
    # For models that are not trained on (inputs, targets) pairs, and for custom metrics (see fit):
    compute_loss: Callable[[nn.Module, Any], Any] | None = None
    metrics: dict[str, Any] | None = None
    num_items: Callable[[Any], Any] | None = None
    # A step of your own (train/step/own_step.py; fit's step_fn): fn(step, batch), with its optimizers by name,
    # {name: optimizer or callable model -> optimizer} or one callable model -> {name: optimizer}, and
    # schedulers {name: callable optimizer -> scheduler}. eval_part: the model's attribute (a submodule,
    # e.g. "generator") that eval / predict / export use when no --part is given.
    step_fn: Callable[[Any, Any], Any] | None = None
    optimizers: Any = None
    schedulers: dict[str, Callable[[Any], Any]] | None = None
    eval_part: str | None = None

    def __post_init__(self) -> None:
        if self.task is not None and self.task not in TASKS:
            raise ValueError(f"task must be one of {TASKS} or None, got {self.task!r}")
        if (self.optimizers is not None or self.schedulers is not None) and self.step_fn is None:
            raise ValueError("optimizers / schedulers by name are for a step of your own: give step_fn too")

    def loss_kwargs(self) -> dict[str, Any]:
        """What fit needs besides data and config: loss_fn, compute_loss, metrics, num_items."""
        return {"loss_fn": self.loss_fn, "compute_loss": self.compute_loss, "metrics": self.metrics,
                "num_items": self.num_items}

    def part(self, model: nn.Module, name: str | None = None) -> tuple[nn.Module, str | None]:
        """(the part of `model` that eval / predict / export use, its name): `name` (--part), else the
        workload's eval_part; (model, None) when neither names one. ConfigError for a blank name (it
        would name the whole model) or one the model has not, naming its parts. `fit` checks
        eval_part before training, so that a run is not found wrong only at its first eval."""
        chosen = name if name is not None else self.eval_part
        if chosen is None:
            return model, None
        said = f"--part {chosen}" if name is not None else f"{self.name}'s eval_part {chosen!r}"
        parts = ", ".join(n for n, _ in model.named_children()) or "none"
        if not chosen.strip():
            said = f"--part {chosen!r}" if name is not None else said
            raise ConfigError(f"{said} is blank: name a part of the model (its parts are {parts}), or leave it out "
                              "for the whole model")
        try:
            return model.get_submodule(chosen), chosen
        except AttributeError:
            raise ConfigError(f"{said}: the model of {self.name} has no such part; its parts are {parts}") from None
