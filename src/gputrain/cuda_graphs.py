"""The whole training step (forward, backward, optimizer) replayed from one CUDA graph.

On small models the GPU spends most of a step waiting for the CPU to launch ~10-100 short
kernels. A CUDA graph launches them all with one call. Recipe (PyTorch's "whole network capture"):
warm up a few real steps on a side stream, set grads to None, capture forward + backward + clip +
optimizer.step into a graph reading static input buffers, then per step copy the batch into the
buffers and replay. The optimizer must be capturable (its step counter and lr live on the device).

Anything that cannot be captured (a batch of another shape, a host sync inside the model, an
unsupported op) falls back to an eager step; a failed capture switches the run to eager for good,
with the reason logged.
"""

from __future__ import annotations

import logging
from typing import Callable

import torch

from gputrain.precision import Precision

log = logging.getLogger("gputrain")

WARMUP_STEPS = 3  # real training steps run eagerly on a side stream before capture


def graph_blockers(*, device: torch.device, accumulate: int, world_size: int, precision: Precision,
                   compiled: bool, checkpointing: bool, optimizer: torch.optim.Optimizer) -> str | None:
    """Why the step cannot be captured, or None when it can."""
    if device.type != "cuda":
        return f"CUDA graphs need a CUDA device (running on {device.type})"
    if accumulate > 1:
        return "gradient accumulation (several backward passes per step) is not captured"
    if world_size > 1:
        return "distributed gradient sync is not captured"
    if precision.use_scaler:
        return "fp16 loss scaling checks for inf on the host every step"
    if compiled:
        return "torch.compile is on (use compile mode 'reduce-overhead' for its own graphs)"
    if checkpointing:
        return "activation checkpointing recomputes inside backward"
    if not all(g.get("capturable", False) for g in optimizer.param_groups):
        return f"the optimizer ({type(optimizer).__name__}) was not created with capturable=True"
    return None


class GraphedTrainStep:
    """Runs training steps; after WARMUP_STEPS eager ones, replays a captured graph.

    step(x, y, loss_acc) adds the step's (detached) loss to loss_acc, a device scalar whose
    storage must stay the same for the whole run (the graph writes to its address).
    """

    def __init__(self, model: torch.nn.Module, loss_fn: Callable, optimizer: torch.optim.Optimizer,
                 precision: Precision, device: torch.device, max_grad_norm: float | None,
                 eager_step: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], None]):
        self.model = model
        self.loss_fn = loss_fn
        self.optimizer = optimizer
        self.precision = precision
        self.device = device
        self.max_grad_norm = max_grad_norm
        self.eager_step = eager_step  # (x, y, loss_acc) -> None, includes optimizer step and zero_grad
        self.graph: torch.cuda.CUDAGraph | None = None
        self.static: tuple[torch.Tensor, torch.Tensor] | None = None
        self.side = torch.cuda.Stream(device)
        self.warm = 0
        self.failed: str | None = None
        self.replays = 0
        self.eager_fallbacks = 0

    def _body(self, x: torch.Tensor, y: torch.Tensor, loss_acc: torch.Tensor) -> None:
        # Autocast's weight-cast cache must be off under capture (cached casts would be stale).
        ctx = (torch.autocast("cuda", dtype=self.precision.autocast_dtype, cache_enabled=False)
               if self.precision.autocast_dtype is not None else torch.autocast("cuda", enabled=False))
        with ctx:
            loss = self.loss_fn(self.model(x), y)
        loss.backward()
        if self.max_grad_norm is not None:
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.max_grad_norm, foreach=True)
        self.optimizer.step()
        loss_acc.add_(loss.detach().float())

    def step(self, x: torch.Tensor, y: torch.Tensor, loss_acc: torch.Tensor) -> None:
        if self.failed is not None:
            self.eager_step(x, y, loss_acc)
            return
        if self.graph is not None:
            sx, sy = self.static
            if x.shape != sx.shape or y.shape != sy.shape or x.dtype != sx.dtype:
                # e.g. the last, partial batch of an epoch: one eager step, the graph stays valid.
                self.eager_fallbacks += 1
                self.optimizer.zero_grad(set_to_none=True)
                self.eager_step(x, y, loss_acc)
                return
            sx.copy_(x, non_blocking=True)
            sy.copy_(y, non_blocking=True)
            self.graph.replay()
            self.replays += 1
            return
        if self.warm < WARMUP_STEPS:
            # Warm-up on a side stream: lazy init (optimizer state, cuBLAS workspaces) happens
            # outside the capture, and the steps are real training steps.
            self.side.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(self.side):
                self.optimizer.zero_grad(set_to_none=True)
                self._body(x, y, loss_acc)
            torch.cuda.current_stream(self.device).wait_stream(self.side)
            self.warm += 1
            return
        self._capture(x, y, loss_acc)

    def _capture(self, x: torch.Tensor, y: torch.Tensor, loss_acc: torch.Tensor) -> None:
        static_x, static_y = x.clone(), y.clone()
        graph = torch.cuda.CUDAGraph()
        self.optimizer.zero_grad(set_to_none=True)
        try:
            with torch.cuda.graph(graph):
                self._body(static_x, static_y, loss_acc)
        except Exception as exc:  # capture is all-or-nothing: fall back to eager for the run
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            self.failed = f"capture failed ({type(exc).__name__}: {first})"
            log.warning("CUDA graphs: %s; training continues eagerly", self.failed)
            torch.cuda.synchronize(self.device)
            self.optimizer.zero_grad(set_to_none=True)
            self.eager_step(x, y, loss_acc)
            return
        self.graph, self.static = graph, (static_x, static_y)
        # Capture records kernels without running them: replay once for this step's batch.
        graph.replay()
        self.replays += 1
        log.info("CUDA graphs: whole training step captured after %d eager warm-up steps", WARMUP_STEPS)
