"""Evaluation: the loss, the built-in accuracy and the user's metrics over a whole eval set.

Metrics are given as `{"name": metric}`, where a metric is either
- a torchmetrics `Metric` (anything with update/compute/reset): moved to the device once, updated
  with (predictions, targets) per batch, computed once per evaluation (torchmetrics syncs across
  ranks itself). Predictions are the model's outputs (their `.logits` where they have them), targets
  the pair's second element or `batch["labels"]`;
- a callable `(outputs, batch) -> dict[str, Tensor]` whose values are averaged over the eval set on
  the device, weighted by batch size (and summed across ranks).
Every value comes back as `eval_<name>` (a callable's keys as `eval_<name>_<key>`, or `eval_<key>`
when it returns a single key equal to its name). All values are read with one host transfer.
"""

from __future__ import annotations

from typing import Any, Callable, Mapping

import torch
from torch import nn

from gputrain import batch as batches
from gputrain.errors import ConfigError
from gputrain.outputs import logits_of
from gputrain.runtime import distributed
from gputrain.runtime.precision import RunPrecision
from gputrain.train.step.loss import LossRule
from gputrain.train.modes import eval_mode


def infer_task(loss_fn: Callable | None) -> str | None:
    """classification / binary / regression from a pair's loss (decides the built-in accuracy)."""
    if loss_fn is None:
        return None
    if isinstance(loss_fn, (nn.CrossEntropyLoss, nn.NLLLoss)):
        return "classification"
    if isinstance(loss_fn, (nn.BCEWithLogitsLoss, nn.BCELoss)):
        return "binary"
    name = getattr(loss_fn, "__name__", "")
    if name in ("cross_entropy", "nll_loss"):
        return "classification"
    if name.startswith("binary_cross_entropy"):
        return "binary"
    return "regression"


def is_torchmetric(metric: Any) -> bool:
    return all(callable(getattr(metric, a, None)) for a in ("update", "compute", "reset"))


def check_metrics(metrics: Mapping[str, Any] | None) -> dict[str, Any]:
    if metrics is None:
        return {}
    if not isinstance(metrics, Mapping):
        raise ConfigError(f"metrics must be a dict {{name: metric}}, got {type(metrics).__name__}")
    for name, m in metrics.items():
        if not isinstance(name, str) or not name:
            raise ConfigError(f"metric names must be non-empty strings, got {name!r}")
        if not (is_torchmetric(m) or callable(m)):
            raise ConfigError(f"metric {name!r} is {type(m).__name__}: give a torchmetrics Metric or a callable "
                              "(outputs, batch) -> dict of tensors")
    return dict(metrics)


class Evaluator:
    """Runs the model over an eval loader and returns {"eval_loss": ..., "eval_<metric>": ...}."""

    def __init__(self, loss: LossRule, precision: RunPrecision, device: torch.device,
                 dist: distributed.DistInfo, task: str | None = None, metrics: Mapping[str, Any] | None = None):
        self.loss = loss
        self.precision = precision
        self.device = device
        self.dist = dist
        self.task = task
        self.metrics = check_metrics(metrics)
        for name, m in self.metrics.items():
            if is_torchmetric(m) and hasattr(m, "to"):
                self.metrics[name] = m.to(device)

    @torch.no_grad()
    def __call__(self, model: nn.Module, loader) -> dict[str, float]:
        with eval_mode(model):  # every module's own mode (a mixed one too) back afterwards (train/modes.py)
            sums, loss_sum, correct, count = self._run(model, loader)
        return self._reduce(sums, loss_sum, correct, count)

    def _run(self, model: nn.Module, loader) -> tuple[dict[str, torch.Tensor], torch.Tensor, torch.Tensor, int]:
        loss_sum = torch.zeros((), device=self.device)
        correct = torch.zeros((), device=self.device)
        sums: dict[str, torch.Tensor] = {}  # callable metrics: value * samples, summed
        count = 0
        for m in self.metrics.values():
            if is_torchmetric(m):
                m.reset()
        for batch in loader.iter_epoch(0, 0):
            with self.precision.autocast():
                loss, outputs = self.loss(model, batch)
            n = batches.batch_size(batch)
            count += n
            loss_sum += loss.float() * n
            targets = self.loss.targets(batch)
            preds = logits_of(outputs)
            if self.task == "classification" and isinstance(preds, torch.Tensor):
                correct += (preds.argmax(dim=1) == targets).sum()
            elif self.task == "binary" and isinstance(preds, torch.Tensor):
                correct += ((preds > 0).to(targets.dtype) == targets).sum()
            for name, m in self.metrics.items():
                if is_torchmetric(m):
                    if targets is None:
                        raise ConfigError(f"metric {name!r} needs targets: batches are neither pairs nor carry "
                                          "'labels'; use a callable metric (outputs, batch) -> dict instead")
                    m.update(preds.float() if torch.is_floating_point(preds) else preds, targets)
                else:
                    for key, value in m(outputs, batch).items():
                        label = name if key == name else f"{name}_{key}"
                        value = torch.as_tensor(value, device=self.device).float() * n
                        sums[label] = sums[label] + value if label in sums else value
        return sums, loss_sum, correct, count

    def _reduce(self, sums: dict[str, torch.Tensor], loss_sum: torch.Tensor, correct: torch.Tensor,
                count: int) -> dict[str, float]:
        labels = ["eval_loss", "correct"] + [f"eval_{k}" for k in sums]
        totals = distributed.all_reduce_sum(torch.stack([loss_sum, correct.float(), *sums.values()]), self.dist)
        computed = {f"eval_{name}": m.compute() for name, m in self.metrics.items() if is_torchmetric(m)}
        computed = {k: v.float().reshape(()) for k, v in computed.items() if isinstance(v, torch.Tensor) and v.numel() == 1}
        values = torch.cat([totals, torch.stack(list(computed.values())).to(totals.device)]) if computed else totals
        host = values.tolist()  # the one host read of an evaluation
        total = max(1, count * self.dist.world_size)
        out: dict[str, float] = {}
        for label, v in zip(labels, host[:len(labels)]):
            if label == "correct":
                if self.task in ("classification", "binary"):
                    out["eval_accuracy"] = v / total
            else:
                out[label] = v / total
        out.update(zip(computed.keys(), host[len(labels):]))
        return out
