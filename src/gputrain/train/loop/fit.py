"""`fit`: the one call that trains a model; `fit_workload`: the same for a built-in or user Workload."""

from __future__ import annotations

from typing import Any, Callable, Mapping, MutableMapping, Sequence

import torch
from torch import nn

from gputrain.config import TrainConfig, workload_config
from gputrain.io.history import History
from gputrain.runtime import distributed
from gputrain.train.optim.by_name import NamedOptimizers
from gputrain.train.loop.trainer import Trainer


def fit(model: nn.Module, train_data, *, loss_fn: Callable | None = None, compute_loss: Callable | None = None,
        optimizer=None, config: TrainConfig | None = None, eval_data=None, task: str | None = None,
        metrics: Mapping[str, Any] | None = None, num_items: Callable | None = None,
        callbacks: Sequence[Any] | None = None, scheduler=None, collate_fn: Callable | None = None,
        step_fn: Callable | None = None, state: MutableMapping[str, Any] | None = None) -> History:
    """Train `model` and return its History.

    train_data / eval_data: tensor columns ((inputs, targets), or a dict of equal-length tensors such
        as a tokenizer's output), a Dataset (of pairs, dicts, any nesting), a DataLoader, a torch
        IterableDataset, a Hugging Face Dataset or IterableDataset (streaming), any iterable of
        batches (a list, a generator: read once), or a workload's DataSplits (which brings its test
        split, normalization and augmentation). Data without a length need config.steps.
    collate_fn: makes a batch from a Dataset's or IterableDataset's samples (e.g. a tokenizer's
        DataCollatorWithPadding); a DataLoader keeps its own.
    How a batch becomes a loss, the first that applies: `compute_loss(model, batch)` returning the
        loss or (loss, outputs); a pair (inputs, targets) with `loss_fn(model(inputs), targets)`; the
        model called with the batch (`model(**batch)` for a dict) returning a scalar, `.loss` or
        `["loss"]`.
    metrics: {"name": torchmetrics Metric or callable (outputs, batch) -> dict of tensors}, reported
        as eval_<name> at each evaluation. num_items: batch -> count of the items the loss averages
        over (e.g. non-padding tokens); the step's gradient is then the mean over items.
    optimizer: an optimizer, a callable params -> optimizer, or None for AdamW(config.lr).
    callbacks: objects with hooks at log points (gputrain.Callback, EarlyStopping, EMA; see
        train/loop/callbacks.py): they may stop the run, change the learning rate, keep state in checkpoints.
    scheduler: a callable optimizer -> LRScheduler (any torch.optim.lr_scheduler), stepped after every
        optimizer step and checkpointed; None: config.schedule with config.warmup_steps.
    step_fn: a step of your own, fn(step, batch) (train/step/own_step.py): it calls step.backward(loss) and
        step.step(name) itself and returns its loss or {name: loss}; then optimizer may be
        {name: optimizer or callable model -> optimizer} and scheduler {name: callable optimizer ->
        scheduler}. Evaluation, when eval_data is given, still uses compute_loss or loss_fn.
    state: what your steps carry from one step to the next (an RNN's hidden state, a counter, a
        memory bank; train/step/carried_state.py), by name: objects with state_dict() / load_state_dict(),
        or tensors, numbers and containers of them. The run keeps this very dict: your compute_loss
        or loss_fn reads and assigns its entries (a step of your own also as `step.state`); the
        checkpoints save it and a resume puts it back.
    config: TrainConfig; None means the defaults. Raises ConfigError / DeviceError / DataError /
    CheckpointError with a message saying what to change.
    """
    return _train(lambda: Trainer(model, train_data, loss_fn=loss_fn, compute_loss=compute_loss, optimizer=optimizer,
                                  config=config, eval_data=eval_data, task=task, metrics=metrics,
                                  num_items=num_items, callbacks=callbacks, scheduler=scheduler,
                                  collate_fn=collate_fn, step_fn=step_fn, state=state))


def _train(make_trainer: Callable[[], Trainer], on_ready: Callable[[], None] | None = None) -> History:
    """Set up a trainer, run it (`on_ready` once its first step is done), and release it and its
    process group, also on an error. The trainer is made here so that this frame holds its only
    reference (see the `del`)."""
    trainer = make_trainer()
    info = trainer.parts.dist
    try:
        return trainer.run(on_ready)
    finally:
        trainer.close()
        del trainer  # cleanup() frees the DDP wrapper before the process group goes (see there)
        distributed.cleanup(info)


def fit_workload(workload, config: TrainConfig | None = None, full_batch: bool | None = None, *,
                 callbacks: Sequence[Any] | None = None, scheduler: Callable[[Any], Any] | None = None,
                 on_ready: Callable[[], None] | None = None,
                 optimizers: NamedOptimizers | None = None) -> tuple[History, nn.Module]:
    """Train a Workload with its defaults under `config`; returns (history, trained model).

    A workload with a step of its own (step_fn) trains with its named optimizers and schedulers;
    `optimizers`: those optimizers with the run's settings ([optimizers.NAME]), else as it makes them.

    on_ready: called once the run goes ahead (every check passed, a resume's checkpoint loaded and
    found to fit, and the first step done): where a caller writes what belongs to a run that trains
    (the CLI's RUN_DIR/workload.json), so that a refused run leaves nothing behind.
    """
    config = workload_config(workload, config, full_batch)
    torch.manual_seed(config.seed)  # the same initial weights on every rank and every rerun
    data = workload.make_data()
    model = workload.make_model()
    workload.part(model)  # its eval_part names a part of the model: refused now, not at the first eval
    own: dict[str, Any] = {}
    if workload.step_fn is not None:
        own = {"step_fn": workload.step_fn, "scheduler": scheduler if scheduler is not None else workload.schedulers,
               "optimizer": optimizers if optimizers is not None else
               NamedOptimizers(workload.optimizers) if workload.optimizers is not None else None}
    else:
        own = {"scheduler": scheduler}
    history = _train(lambda: Trainer(model, data, config=config, task=workload.task, callbacks=callbacks,
                                     **own, **workload.loss_kwargs()), on_ready)
    return history, model
