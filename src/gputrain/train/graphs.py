"""The whole training step (forward, backward, optimizer) replayed from one CUDA graph.

On small models the GPU spends most of a step waiting for the CPU to launch ~10-100 short
kernels. A CUDA graph launches them all with one call. Recipe (PyTorch's "whole network capture"):
warm up a few real steps on a side stream, set grads to None, capture forward + backward + clip +
optimizer.step into a graph reading static input buffers, then per step copy the batch into the
buffers and replay. The optimizer must be capturable (its step counter and lr live on the device).

A graph is fixed to one batch shape, so each shape gets its own graph (at most MAX_GRAPHS, all in
one memory pool): the last, partial batch of an epoch runs eagerly once (cuDNN picks its kernels
then) and replays its own graph from the next epoch on. A batch that is the same unchanged tensor as
the one last copied in (full-batch training) is not copied again. Anything that cannot be captured
(a host sync inside the model, an unsupported op) falls back to eager steps; a failed first capture
switches the run to eager for good, with the reason logged.
"""

from __future__ import annotations

import logging
from typing import Callable

import torch

from gputrain.runtime.precision import Precision

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


MAX_GRAPHS = 4  # distinct batch shapes captured; more shapes than this run eagerly


class _Graph:
    """One captured step for one batch shape: the graph and the buffers it reads."""

    def __init__(self, graph: torch.cuda.CUDAGraph, static_x: torch.Tensor, static_y: torch.Tensor,
                 copy_skippable: bool):
        self.graph = graph
        self.static_x, self.static_y = static_x, static_y
        # The graph does not write its own inputs (checked at capture), so a batch identical to the
        # last one copied in need not be copied again.
        self.copy_skippable = copy_skippable
        self.last: tuple | None = None  # (x, y, their identity) of the last batch copied in

    @staticmethod
    def identity(x: torch.Tensor, y: torch.Tensor) -> tuple:
        # Same address, layout and version counter (bumped by any in-place write, also through a
        # view) while we hold a reference to the tensors: the same bytes as last time.
        return (x.data_ptr(), x.stride(), x._version, y.data_ptr(), y.stride(), y._version)

    def load(self, x: torch.Tensor, y: torch.Tensor) -> None:
        if not self.copy_skippable:
            self.static_x.copy_(x, non_blocking=True)
            self.static_y.copy_(y, non_blocking=True)
            return
        ident = self.identity(x, y)
        if self.last is not None and self.last[2] == ident:
            return
        self.static_x.copy_(x, non_blocking=True)
        self.static_y.copy_(y, non_blocking=True)
        self.last = (x, y, ident)


class GraphedTrainStep:
    """Runs training steps; after WARMUP_STEPS eager ones, replays captured graphs.

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
        self.graphs: dict[tuple, _Graph] = {}
        self.side = torch.cuda.Stream(device)
        self.warm = 0
        self.failed: str | None = None  # the first capture failed: the whole run is eager
        self.uncapturable: dict[tuple, str] = {}  # shapes whose capture failed after the first
        self._seen: set[tuple] = set()  # shapes run eagerly once, to be captured when they come again
        self.replays = 0
        self.eager_fallbacks = 0

    @property
    def graph(self) -> torch.cuda.CUDAGraph | None:
        """The first captured graph (the full-batch shape), if any."""
        return next(iter(self.graphs.values())).graph if self.graphs else None

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

    def _side_stream_step(self, x: torch.Tensor, y: torch.Tensor, loss_acc: torch.Tensor) -> None:
        # Eager on a side stream, as capture needs: lazy init (optimizer state, cuBLAS workspaces,
        # cuDNN's algorithm choice for this shape) happens outside the capture, and the step is a
        # real training step.
        self.side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.side):
            self.optimizer.zero_grad(set_to_none=True)
            self._body(x, y, loss_acc)
        torch.cuda.current_stream(self.device).wait_stream(self.side)

    def step(self, x: torch.Tensor, y: torch.Tensor, loss_acc: torch.Tensor) -> None:
        if self.failed is not None:
            self.eager_step(x, y, loss_acc)
            return
        key = (tuple(x.shape), x.dtype, tuple(y.shape), y.dtype)
        captured = self.graphs.get(key)
        if captured is not None:
            captured.load(x, y)
            captured.graph.replay()
            self.replays += 1
            return
        if not self.graphs and self.warm < WARMUP_STEPS:
            self._side_stream_step(x, y, loss_acc)
            self.warm += 1
            return
        if self.graphs:
            if key in self.uncapturable or len(self.graphs) >= MAX_GRAPHS:
                self.eager_fallbacks += 1
                self.optimizer.zero_grad(set_to_none=True)
                self.eager_step(x, y, loss_acc)
                return
            if key not in self._seen:
                # A new shape (the last, partial batch): one eager step first, a graph of its own next time.
                self._seen.add(key)
                self.eager_fallbacks += 1
                self._side_stream_step(x, y, loss_acc)
                return
        self._capture(key, x, y, loss_acc)

    def _capture(self, key: tuple, x: torch.Tensor, y: torch.Tensor, loss_acc: torch.Tensor) -> None:
        static_x, static_y = x.clone(), y.clone()
        versions = (static_x._version, static_y._version)
        graph = torch.cuda.CUDAGraph()
        pool = self.graph.pool() if self.graphs else None  # later shapes share the first graph's memory
        self.optimizer.zero_grad(set_to_none=True)
        try:
            with torch.cuda.graph(graph, pool=pool):
                self._body(static_x, static_y, loss_acc)
        except Exception as exc:  # capture is all-or-nothing
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            reason = f"capture failed ({type(exc).__name__}: {first})"
            torch.cuda.synchronize(self.device)
            self.optimizer.zero_grad(set_to_none=True)
            if self.graphs:
                self.uncapturable[key] = reason
                log.warning("CUDA graphs: batch shape %s: %s; such batches run eagerly", key[0], reason)
            else:
                self.failed = reason
                log.warning("CUDA graphs: %s; training continues eagerly", reason)
            self.eager_step(x, y, loss_acc)
            return
        writes_inputs = (static_x._version, static_y._version) != versions  # in-place ops on the batch
        captured = _Graph(graph, static_x, static_y, copy_skippable=not writes_inputs)
        captured.last = (x, y, _Graph.identity(x, y))
        self.graphs[key] = captured
        # Capture records kernels without running them: replay once for this step's batch.
        graph.replay()
        self.replays += 1
        if len(self.graphs) == 1:
            log.info("CUDA graphs: whole training step captured after %d eager warm-up steps", WARMUP_STEPS)
        else:
            log.info("CUDA graphs: batch shape %s captured too (%d graphs)", key[0], len(self.graphs))
