"""Use a trained model: `evaluate` (loss, accuracy, metrics) and `predict` (outputs), batched on the device.

Both take data in the forms `fit` takes (tensor columns, a dict of tensors, a Dataset, a
DataLoader, a workload's DataSplits, whose test split and normalization they use) plus a bare
tensor of inputs, and turn batches into calls of the model by fit's rule (train/step/loss.py):
`compute_loss(model, batch)` when given; a pair `(inputs, targets)` with `loss_fn`; else the model
called with the batch (`model(**batch)` for a dict, `model(*batch)` for a tuple, `model(batch)`).
They run under the precision fit would pick for the device (bf16 autocast on recent GPUs, fp32 on
the CPU), in eval mode and without gradients, and read the device once per call (evaluate) or once
per batch while copying outputs to the host (predict).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Callable, Mapping

import torch
from torch import nn

from gputrain import batch as batches
from gputrain.data import BatchTransform, make_loader
from gputrain.errors import ConfigError
from gputrain.outputs import logits_of
from gputrain.runtime import distributed
from gputrain.runtime.devices import pick_device
from gputrain.runtime.precision import RunPrecision, resolve_precision
from gputrain.train.evaluation.evaluate import Evaluator, infer_task
from gputrain.train.step.loss import LossRule, call_model, is_pair
from gputrain.train.modes import module_modes, set_modes, set_training


def _setup(model: nn.Module, data: Any, device: str | torch.device, precision: str, batch_size: int,
           transform: BatchTransform | None):
    from gputrain.data.splits import DataSplits

    if isinstance(data, DataSplits):
        transform = transform or BatchTransform(data.mean, data.std, key=data.transform_key)
        if data.test is None:
            raise ConfigError("these DataSplits have no test split: pass the data to use (e.g. splits.train)")
        data = data.test
    if isinstance(data, torch.Tensor):
        data = (data,)  # inputs alone: batches are 1-tuples, and the model is called as model(x)
    dev = device if isinstance(device, torch.device) else pick_device(device)
    if not isinstance(batch_size, int) or isinstance(batch_size, bool) or batch_size < 1:
        raise ConfigError(f"batch_size must be a positive integer, got {batch_size!r}")
    model = distributed.unwrap_data_parallel(model)
    model.to(dev)
    run_precision = RunPrecision(resolve_precision(precision, dev), dev)
    loader, _ = make_loader(data, batch_size, device=dev, train=False,
                            transform=(transform or BatchTransform()).for_eval())
    return model, dev, run_precision, loader


def evaluate(model: nn.Module, data: Any, *, loss_fn: Callable | None = None, compute_loss: Callable | None = None,
             metrics: Mapping[str, Any] | None = None, task: str | None = None, batch_size: int = 256,
             device: str | torch.device = "auto", precision: str = "auto",
             transform: BatchTransform | None = None) -> dict[str, float]:
    """The model's loss over `data`, the built-in accuracy (classification pairs) and `metrics`, as
    fit's evaluation computes them: {"eval_loss": ..., "eval_accuracy": ..., "eval_<metric>": ...}.

    task: "classification" / "binary" / "regression" (default: from loss_fn, as fit does).
    Raises DataError when a batch cannot become a loss (the message names the three ways).
    """
    model, dev, run_precision, loader = _setup(model, data, device, precision, batch_size, transform)
    rule = LossRule(loss_fn, compute_loss)
    task = task or (infer_task(loss_fn) if compute_loss is None else None)
    run_precision.apply()  # TF32 as fit sets it, given back below
    try:
        return Evaluator(rule, run_precision, dev, distributed.SINGLE, task, metrics)(model, loader)
    finally:
        run_precision.restore()


@torch.no_grad()
def predict(model: nn.Module, data: Any, *, loss_fn: Callable | None = None, compute_loss: Callable | None = None,
            batch_size: int = 256, device: str | torch.device = "auto", precision: str = "auto",
            transform: BatchTransform | None = None, out: str | os.PathLike | None = None) -> Any:
    """The model's outputs for every sample of `data`, in order, on the CPU.

    Outputs are the model's output tensor (its `.logits` / ["logits"] when it returns an object),
    batches concatenated along dim 0; a nested output (a tuple, a dict) keeps its structure with
    each tensor concatenated. With `compute_loss`, its `outputs` (it must return (loss, outputs),
    so batches need their targets); with `loss_fn`, a pair's inputs go to the model and the targets
    are ignored; else the model is called with the whole batch.
    out: also write them to this file: `.pt` (torch.save) or `.npy` (one tensor).
    """
    model, dev, run_precision, loader = _setup(model, data, device, precision, batch_size, transform)
    rule = LossRule(loss_fn, compute_loss)
    modes = module_modes(model)  # each module's own mode, given back below (train/modes.py)
    set_training(model, False)  # model.eval(), also for a train() of another meaning
    run_precision.apply()
    pieces: list[Any] = []
    try:
        for batch in loader.iter_epoch(0, 0):
            with run_precision.autocast():
                if compute_loss is not None:
                    _, outputs = rule(model, batch)
                    if outputs is None:
                        raise ConfigError("predict with compute_loss needs it to return (loss, outputs)")
                elif loss_fn is not None and is_pair(batch):
                    outputs = model(batch[0])
                else:
                    outputs = call_model(model, batch)
            pieces.append(batches.map_tensors(lambda t: t.detach().to("cpu"), logits_of(outputs)))
    finally:
        set_modes(modes)
        run_precision.restore()
    result = _concatenate(pieces)
    if out is not None:
        save_outputs(result, out)
    return result


def _concatenate(pieces: list[Any]) -> Any:
    if not pieces:
        raise ConfigError("predict got no data: the data set is empty")
    leaves0, spec = batches.flatten(pieces[0])
    columns = [batches.flatten(p)[0] for p in pieces]
    merged = []
    for i, leaf in enumerate(leaves0):
        if isinstance(leaf, torch.Tensor) and leaf.dim() > 0:
            merged.append(torch.cat([c[i] for c in columns]))
        else:
            merged.append(leaf)  # a scalar (a loss) or a non-tensor: the first batch's
    return batches.unflatten(merged, spec)


def save_outputs(result: Any, path: str | os.PathLike) -> Path:
    """Write predict's outputs to `path`, whole or not at all: .npy (one tensor) or anything else
    with torch.save. Raises ConfigError when .npy cannot hold them; OSError as the disk says."""
    from gputrain.io.atomic import atomic_file

    path = Path(path)
    if path.suffix == ".npy":
        import numpy as np

        if not isinstance(result, torch.Tensor):
            raise ConfigError(f"{path}: .npy holds one array, but the outputs are {batches.describe(result)}; "
                              "write them to a .pt file")
        with atomic_file(path, "wb") as f:
            np.save(f, result.float().numpy() if result.dtype == torch.bfloat16 else result.numpy())
        return path
    with atomic_file(path, "wb") as f:
        torch.save(result, f)
    return path
