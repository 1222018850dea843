"""The training step `fit` runs, built as the Trainer builds it, at lr 0: what `gputrain memory`,
`fit --batch-size auto` and the batch search measure.

`StepProbe(model, loss, config)` prepares `model` in place and builds its step from the Trainer's
own parts, in the Trainer's order:
- precision: `resolve_precision` in one `RunPrecision` (TF32 set; `close()` gives it back);
- the speed switches: `decide_speed` (channels_last, cudnn.benchmark, compile, CUDA graphs),
  applied as the Trainer applies them; channels_last "auto" on a conv net is decided by fit's rule
  and checked on the first batch the probe steps (train/step/layout.py), so a memory probe keeps
  the layout fit would train in;
- recompute where the config asks for it, then torch.compile where it does;
- the optimizer from `make_optimizer` with lr 0 (the weights do not change; its state takes its
  memory): the Trainer's fused AdamW, graph-capturable when graphs are on. Other optimizers
  (`gputrain memory --optimizer sgd`) come as a factory, as a user's would, so graphs are off
  for them exactly as fit decides for a factory;
- `TrainStep` with the config's clipping and on_nan, without OOM recovery (an out-of-memory error
  is the finding), replayed from a CUDA graph (`GraphedStep`) where fit captures it.

`probe.step(batch)` runs that step until it is in the state fit's loop reaches (graphed: warmed up
and captured); `probe.measure(batch)` gives its memory. `probe_batches(data, probe)` builds the
batches the step is fed: a workload's training columns through its transform, on the step's device.
"""

from __future__ import annotations

from typing import Any, Callable, cast

import torch
from torch import nn

from gputrain.batch import batch_size, map_tensors, tensor_leaves
from gputrain.config import TrainConfig
from gputrain.data.splits import DataSplits
from gputrain.data.transforms import BatchTransform
from gputrain.diagnostics.saved_tensors import measure_saved, nbytes, side_effect_free, unique_parameters
from gputrain.errors import ConfigError
from gputrain.outputs import loss_of
from gputrain.runtime.precision import Precision, RunPrecision, resolve_precision
from gputrain.runtime.speed import decide_speed
from gputrain.train.step.graphs import WARMUP_STEPS, GraphedStep
from gputrain.train.step.first_step import FirstPass
from gputrain.train.step.layout import LayoutDecider, MemoryFormats
from gputrain.train.step.loss import LossRule, call_model, is_pair
from gputrain.train.optim.build import make_optimizer
from gputrain.train.step.train_step import TrainStep

# Optimizers besides the Trainer's AdamW whose state `gputrain memory --optimizer` can count, as the
# factories a user would pass (lr 0).
OPTIMIZER_FACTORIES: dict[str, Callable[[list[nn.Parameter]], torch.optim.Optimizer]] = {
    "sgd": lambda params: torch.optim.SGD(params, lr=0.0, momentum=0.9),
    "rmsprop": lambda params: torch.optim.RMSprop(params, lr=0.0),
    "adagrad": lambda params: torch.optim.Adagrad(params, lr=0.0),
    "none": lambda params: torch.optim.SGD(params, lr=0.0),  # no state: the gradients alone
}
OPTIMIZERS = ("adamw", "adam", *OPTIMIZER_FACTORIES)  # adamw and adam: the Trainer's own (fused) AdamW


def as_loss_rule(loss=None, loss_fn: Callable | None = None) -> LossRule:
    """How the memory tools turn a batch into a loss: `loss` (a LossRule, or a callable
    (model, batch) -> loss or (loss, outputs)), else `loss_fn` on pairs (a LossRule passed there
    counts as `loss`), else a stand-in for a model whose loss is not given (`own_loss_or_output_sum`)."""
    if loss is None and isinstance(loss_fn, LossRule):
        loss, loss_fn = loss_fn, None
    if isinstance(loss, LossRule):
        return loss
    if loss is not None:
        if not callable(loss):
            raise ConfigError("loss must be a LossRule or a callable (model, batch) -> loss, "
                              f"got {type(loss).__name__}")
        return LossRule(compute_loss=loss)
    if loss_fn is not None:
        return LossRule(loss_fn=loss_fn)
    return LossRule(compute_loss=own_loss_or_output_sum)


def own_loss_or_output_sum(model: nn.Module, batch: Any) -> torch.Tensor:
    """The model's own loss (a scalar, `.loss` or ["loss"]), else the sum of its floating outputs:
    what is measured for a model whose loss is not given (it saves the same activations). A pair's
    inputs are what the model is called with; a pair (inputs, None) is a batch of inputs alone."""
    outputs = model(batch[0]) if is_pair(batch) else call_model(model, batch)
    own = loss_of(outputs)
    if own is not None:
        return own
    leaves = [t for t in tensor_leaves(outputs) if torch.is_floating_point(t)]
    return torch.stack([t.float().sum() for t in leaves]).sum() if leaves else torch.zeros(())


class StepProbe:
    """The step fit would run for `model` under `config`, at lr 0 (see the module docstring).

    model: on the device to measure on; prepared in place as the Trainer prepares it (channels_last,
        recompute). loss: a LossRule (`as_loss_rule` makes one from the older arguments).
    config: the run's TrainConfig (None: the defaults); its lr is not used.
    optimizer: one of OPTIMIZERS. precision: a Precision or a name, instead of config.precision.
    Use it as a context manager, or call close(): the process-wide settings (cudnn.benchmark, TF32)
    are given back there. Raises ConfigError for an unknown optimizer or an impossible precision.
    """

    def __init__(self, model: nn.Module, loss: LossRule, config: TrainConfig | None = None, *,
                 optimizer: str = "adamw", precision: Precision | str | None = None):
        name = optimizer.lower()
        if name not in OPTIMIZERS:
            raise ConfigError(f"unknown optimizer {optimizer!r}: choose one of {', '.join(OPTIMIZERS)}")
        self.config = cfg = config or TrainConfig()
        params = unique_parameters(model)
        self.device = device = params[0].device if params else torch.device("cpu")
        if not isinstance(precision, Precision):
            precision = resolve_precision(precision or cfg.precision, device)
        self.precision = RunPrecision(precision, device).apply()
        factory = OPTIMIZER_FACTORIES.get(name)  # None: the Trainer's own AdamW
        self.speed = decide_speed(cfg, model, device, use_scaler=precision.use_scaler, optimizer=factory,
                                  probe_layout=True)
        self.module = model
        formats = MemoryFormats(model)
        if self.speed.channels_last:
            # In place, as the Trainer does (Module.to takes memory_format; its stub does not say so).
            model.to(memory_format=torch.channels_last)  # pyright: ignore[reportCallIssue]
        self.speed.apply(device)
        self.recomputed: list[str] = []
        if cfg.recompute:
            from gputrain.train.step.recompute import apply_recompute

            self.recomputed = apply_recompute(self.module, None if cfg.recompute is True else list(cfg.recompute))
        self.model = self.module
        if cfg.compile:  # whole or regional, as the trainer compiles (train/loop/compiling.py), with its reason
            from gputrain.runtime.compile_regions import compile_model

            done = compile_model(self.module, regional=cfg.compile == "regional", mode=cfg.compile_mode)
            self.model = cast(nn.Module, done.model)
            self.speed.reasons["compile"] = f"{self.speed.reasons['compile']}; {done.reason}"
        self.optimizer, self.optimizer_desc = make_optimizer(
            factory, self.model.parameters(), lr=0.0, weight_decay=cfg.weight_decay, device=device,
            fused=cfg.fused_optimizer, capturable=self.speed.cuda_graphs)
        self.loss = loss
        self.train_step = TrainStep(self.model, loss, self.optimizer, self.precision, device=device,
                                    max_grad_norm=cfg.max_grad_norm, oom_recovery=False,
                                    params=list(self.module.parameters()), skip_nonfinite=cfg.on_nan == "skip")
        self._graphed: GraphedStep | None = None
        # channels_last "auto" on a conv net: decided on the first batch, as fit decides it (train/step/layout.py).
        self.layout = LayoutDecider(module=model, speed=self.speed, first_pass=FirstPass(loss),
                                    precision=self.precision, device=device, total_steps=cfg.steps or 0,
                                    optimizers=[self.optimizer], formats=formats)

    def __enter__(self) -> "StepProbe":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        """Give back cudnn.benchmark and the TF32 settings; drop a captured graph and its memory."""
        self._graphed = None
        self.speed.restore()
        self.precision.restore()

    def step(self, batch: Any) -> None:
        """Run the step on `batch` until it is in the state fit's loop reaches: one eager step, or,
        where fit captures the step, the warm-up steps and the capture. Synchronizes on CUDA."""
        self._steady(batch)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def _steady(self, batch: Any) -> Callable[[list], None]:
        self._graphed = None  # another batch shape's graph, and its memory pool, goes first
        if self.speed.layout_probe is not None:
            self.layout.decide(batch)
        if not self.speed.cuda_graphs:
            self.train_step([batch])
            return self.train_step
        self._graphed = graphed = GraphedStep(self.train_step, self.device)
        for _ in range(WARMUP_STEPS + 1):  # the eager warm-up steps, then the capture (and a replay)
            graphed([batch])
        return graphed

    def measure(self, batch: Any) -> dict[str, Any]:
        """The memory of the step on `batch` (any batch on the probe's device).

        CUDA: the allocator's peak (max_memory_allocated) over two steps in the steady state (after
        `step`'s warm-up, so graphed steps are replays), less the process's tensors that are not
        this step's; `measured` True. Elsewhere nothing bounds the memory the same way, so it is an
        estimate: parameters, gradients and the optimizer's state (as it is after a step) plus the
        bytes saved for backward at this batch; `measured` False.
        Returns {"peak_bytes", "measured", "method", "batch_size"}.
        """
        n = batch_size(batch)
        if self.device.type != "cuda":
            return {"peak_bytes": self._host_estimate(batch), "measured": False, "batch_size": n,
                    "method": "estimate: parameters + gradients + optimizer state + tensors saved for backward "
                              "at this batch"}
        device = self.device
        self._graphed = None  # the last shape's graph and its memory pool are not this step's
        torch.cuda.synchronize(device)
        # The allocator counts every live tensor of the process; what is not the model, its
        # optimizer or the batch (another model, a data set kept on the GPU, a caller's tensors) is
        # not this step's.
        others = max(0, torch.cuda.memory_allocated(device) - self._own_bytes(batch))
        step = self._steady(batch)  # cudnn.benchmark tries several algorithms on a new shape here
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)  # the peak restarts at what is allocated now
        for _ in range(2):
            step([batch])
        torch.cuda.synchronize(device)
        return {"peak_bytes": int(torch.cuda.max_memory_allocated(device)) - others, "measured": True,
                "batch_size": n,
                "method": "torch.cuda.max_memory_allocated over two training steps as fit runs them, less the "
                          "process's other tensors (the model, batch and workspaces included)"}

    def _own_bytes(self, batch: Any) -> int:
        tensors = [*self.module.parameters(), *self.module.buffers(), *tensor_leaves(batch),
                   *(p.grad for p in self.module.parameters() if p.grad is not None),
                   *(t for state in self.optimizer.state.values() for t in state.values())]
        return sum(t.untyped_storage().nbytes() for t in tensors
                   if isinstance(t, torch.Tensor) and t.device == self.device)

    def _host_estimate(self, batch: Any) -> int:
        if not self.optimizer.state:
            with side_effect_free(self.module, self.device):
                self.train_step([batch])  # the optimizer's state is made by its first step
        params = unique_parameters(self.module)
        state = sum(nbytes(t) for s in self.optimizer.state.values() for t in s.values()
                    if isinstance(t, torch.Tensor))
        grads = sum(nbytes(p) for p in params if p.requires_grad)
        with side_effect_free(self.module, self.device):
            saved = measure_saved(self.module, batch, self.loss, self.precision.precision.autocast_dtype,
                                  self.device)[0]
        return sum(nbytes(p) for p in params) + grads + state + saved


def measure_step_memory(model: nn.Module, batch: Any, loss_fn: Callable | None = None, precision=None,
                        optimizer_name: str = "adamw", loss=None) -> dict[str, Any]:
    """`StepProbe.measure` of a probe built for `model` with the default config (precision: a
    Precision, a name, or None for fp32; `loss` and `loss_fn` as `as_loss_rule` takes them)."""
    with StepProbe(model, as_loss_rule(loss, loss_fn), optimizer=optimizer_name,
                   precision=precision or "fp32") as probe:
        return probe.measure(batch)


class ProbeBatches:
    """`batches(b)`: b training samples as fit's loader hands them to the step (the workload's
    transform with train=True: normalization, augmentation, the step's memory layout), on the
    step's device. Batches larger than the data set repeat it; `n` is its number of samples."""

    def __init__(self, columns: Any, transform: BatchTransform, device: torch.device):
        from gputrain.data.resident import column_length

        self.columns, self.transform, self.device = columns, transform, device
        self.n = column_length(columns)

    def __call__(self, b: int) -> Any:
        idx = torch.arange(b) % self.n
        return self.transform(map_tensors(lambda t: t[idx].to(self.device), self.columns), train=True)


def probe_batches(data: DataSplits, probe: StepProbe) -> ProbeBatches | None:
    """The batches `probe`'s step is fed from a workload's data (None when its training data are not
    tensor columns, a tuple or dict of tensors: a Dataset or DataLoader cannot be cut to any size)."""
    from gputrain.data.placement import as_columns

    columns = as_columns(data.train)
    if columns is None:
        return None
    transform = BatchTransform(data.mean, data.std, data.augment, channels_last=probe.speed.channels_last,
                               key=data.transform_key)
    return ProbeBatches(columns, transform, probe.device)
