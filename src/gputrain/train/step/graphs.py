"""The whole training step replayed from a CUDA graph: `GraphedStep` wraps a `TrainStep`.

On small models the GPU spends most of a step waiting for the CPU to launch ~10-100 short
kernels. A CUDA graph launches them all with one call. Recipe (PyTorch's "whole network capture",
and torchtitan's wrapping of its forward-backward function): warm up a few real steps on a side
stream, capture `TrainStep.run` (forward, loss, backward, clip, optimizer step, zero_grad, the
device accumulators) reading static input buffers, then per step copy the batch into the buffers
and replay. The captured callable is the eager one: nothing here calls back into the trainer.

Batches are any nesting (batch.py): a graph keeps a static buffer per tensor leaf and is keyed by
the batch's signature (structure, every leaf's shape and dtype, and the values of non-tensor
leaves). Each signature gets its own graph (at most MAX_GRAPHS, all in one memory pool): a new one
(the last, partial batch of an epoch) runs eagerly once, then is captured when it comes again.
A batch whose tensors are the same unchanged tensors as the ones last copied in (full-batch
training) is not copied again. When the non-tensor leaves change from step to step with the same
tensor shapes (Python values the graph would freeze), graphs are switched off with that reason.
Anything that cannot be captured falls back to eager steps; a failed first capture switches the run
to eager for good, with the reason logged.

A graph keeps every Python number it was given at capture: the optimizer's betas, eps, weight
decay (and its lr, unless that is a tensor, as gputrain's capturable optimizer makes it). Before
each replay the optimizer's Python numbers are compared with those of the capture (`_PythonValues`,
a few dict reads); when a scheduler or callback has rewritten one (OneCycleLR's cycled momentum, a
float lr that a schedule moves), graphs are switched off with that reason and the step runs eagerly.

A deferred batch (data/deferred.py: resident data, not yet gathered) is assembled inside the graph:
the capture records `build` (gather by the epoch's order, normalize, augment, layout) together with
the step, and per step the host only writes the batch's start position into a device scalar. Its
key is the deferred batch's own (the data source and the batch size).

The CUDA calls (side stream, capture, memory pool) sit in `CudaGraphs`; the CPU suite puts a
stand-in there with CUDA's capture semantics (tests/graph_capture.py: the ops recorded once, re-issued
on replay with the Python numbers of the capture, no Python run), so that what a replay computes is
checked against eager steps without a GPU.
"""

from __future__ import annotations

import logging
from typing import Any, Protocol, Sequence

import torch

from gputrain import batch as batches
from gputrain.data.deferred import DeferredBatch, materialize
from gputrain import torch_compat
from gputrain.train.step.totals import StepTotals

log = logging.getLogger("gputrain")

WARMUP_STEPS = 3  # real training steps run eagerly on a side stream before capture
MAX_GRAPHS = 4  # distinct batch signatures captured; more run eagerly


def _built(batch: Any) -> Any:
    if not isinstance(batch, DeferredBatch):
        return batch
    inputs = batch.new_inputs()
    batch.load(inputs)
    return batch.build(inputs)


class _Graph:
    """One captured step for one batch signature: the graph and the buffers it reads."""

    def __init__(self, graph: torch.cuda.CUDAGraph, static: list[torch.Tensor], copy_skippable: bool):
        self.graph = graph
        self.static = static  # one buffer per tensor leaf, in flatten order
        # The graph does not write its own inputs (checked at capture), so a batch identical to the
        # last one copied in need not be copied again.
        self.copy_skippable = copy_skippable
        self.last: tuple | None = None  # (the tensors last copied in, their identity)

    @staticmethod
    def identity(tensors: list[torch.Tensor]) -> tuple:
        # Same address, layout and version counter (bumped by any in-place write, also through a
        # view) while we hold a reference to the tensors: the same bytes as last time.
        return tuple((t.data_ptr(), t.stride(), _version(t)) for t in tensors)

    def load(self, tensors: list[torch.Tensor]) -> None:
        """Copy this step's tensor leaves into the buffers the graph reads."""
        if self.copy_skippable:
            ident = self.identity(tensors)
            if self.last is not None and self.last[1] == ident:
                return
            self.last = (tensors, ident)
        for dst, src in zip(self.static, tensors):
            dst.copy_(src, non_blocking=True)


class StepBody(Protocol):
    """A training step the wrapper can capture (train/step/train_step.py's TrainStep, own_step.py's
    OwnStep): `run` is the body a graph records, calling the step runs it eagerly."""

    optimizers: list[torch.optim.Optimizer]
    totals: StepTotals

    def run(self, micro_batches: Sequence[Any]) -> None: ...

    def __call__(self, micro_batches: Sequence[Any]) -> None: ...

    def zero_grad(self) -> None: ...

    def capture_blocker(self) -> str | None: ...


class _PythonValues:
    """The optimizers' hyperparameters that are Python numbers (or tuples of them, as betas), read as
    a captured step saw them: a replay keeps those values whatever is written later."""

    def __init__(self, optimizers: Sequence[torch.optim.Optimizer]):
        self.optimizers = list(optimizers)
        self.keys = [(o, i, k) for o, opt in enumerate(self.optimizers) for i, g in enumerate(opt.param_groups)
                     for k, v in g.items() if _is_number(v) or (isinstance(v, tuple) and all(_is_number(x) for x in v))]
        self.values = self.read()

    def read(self) -> list[Any]:
        # The groups looked up each time: load_state_dict replaces them.
        return [self.optimizers[o].param_groups[i][k] for o, i, k in self.keys]

    def changed(self) -> str | None:
        """Which value differs from its capture-time one, as a sentence; None when none does."""
        now = self.read()
        if now == self.values:
            return None
        (_, i, key), was, new = next((k, a, b) for k, a, b in zip(self.keys, self.values, now) if a != b)
        return (f"the optimizer's {key!r} (group {i}) changed from {was!r} to {new!r} after capture, written as a "
                "Python number (by the scheduler or a callback), and a replayed graph keeps the captured value")


def _version(t: torch.Tensor) -> int:
    """The tensor's version counter (torch_compat.py; -1 on a torch without one)."""
    read = torch_compat.tensor_version
    return read(t) if read is not None else -1


def _is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _tensors(batch: Any) -> tuple[list[torch.Tensor], list[Any], Any]:
    leaves, spec = batches.flatten(batch)
    tensors = [x for x in leaves if isinstance(x, torch.Tensor)]
    others = [x for x in leaves if not isinstance(x, torch.Tensor)]
    return tensors, others, (leaves, spec)


class CudaGraphs:
    """The CUDA side of GraphedStep: eager steps on a side stream, capture into one memory pool."""

    def __init__(self, device: torch.device):
        self.device = device
        self.side = torch.cuda.Stream(device)

    def eager(self, fn) -> None:
        # Eager on a side stream, as capture needs: lazy init (optimizer state, cuBLAS workspaces,
        # cuDNN's algorithm choice for this shape) happens outside the capture.
        self.side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.side):
            fn()
        torch.cuda.current_stream(self.device).wait_stream(self.side)

    def capture(self, fn, share_pool_with: torch.cuda.CUDAGraph | None = None) -> torch.cuda.CUDAGraph:
        """Record fn's kernels (without running them) into a new graph."""
        graph = torch.cuda.CUDAGraph()
        pool = share_pool_with.pool() if share_pool_with is not None else None
        with torch.cuda.graph(graph, pool=pool):
            fn()
        return graph

    def synchronize(self) -> None:
        torch.cuda.synchronize(self.device)


class GraphedStep:
    """Runs training steps through `step`; after WARMUP_STEPS eager ones, replays captured graphs.

    Only single-micro-batch steps are captured (the graph eligibility rules in runtime/speed.py
    keep accumulation and several processes off this path); anything else runs `step` eagerly.
    """

    def __init__(self, step: StepBody, device: torch.device, backend: CudaGraphs | None = None):
        self.step = step
        step.totals.sum_in_place()  # the captured step adds its loss to the accumulator the replays write
        self.device = device
        self.backend = backend if backend is not None else CudaGraphs(device)
        self.graphs: dict[tuple, _Graph] = {}
        self.warm = 0
        self.failed: str | None = None  # the first capture failed, or graphs were switched off: eager
        self.uncapturable: dict[tuple, str] = {}  # signatures whose capture failed after the first
        self._seen: set[tuple] = set()  # signatures run eagerly once, to be captured when they come again
        self._last_layout: tuple | None = None  # (tensor shapes, non-tensor leaves) of the last batch
        self.replays = 0
        self.eager_fallbacks = 0
        self._values: _PythonValues | None = None  # the optimizer's Python numbers at the first capture

    @property
    def graph(self) -> torch.cuda.CUDAGraph | None:
        """The first captured graph (the full-batch signature), if any."""
        return next(iter(self.graphs.values())).graph if self.graphs else None

    @property
    def status(self) -> str:
        if self.failed is not None:
            return f"off: {self.failed}"
        return f"on ({len(self.graphs)} graph{'s' if len(self.graphs) != 1 else ''})" if self.graphs else "on"

    def _side_stream_step(self, micro_batches: Sequence[Any]) -> None:
        # A real training step, eagerly, on the side stream, before a capture. A deferred batch is
        # assembled by the code the capture will record (`build` from its loaded inputs), so that
        # its lazy initialization also happens here, outside the capture.
        self.backend.eager(lambda: self.step([_built(b) for b in micro_batches]))

    def _values_changed(self, tensors: list[torch.Tensor], others: list[Any]) -> bool:
        layout = (tuple((tuple(t.shape), t.dtype) for t in tensors), others)
        last, self._last_layout = self._last_layout, layout
        if last is None or last[0] != layout[0]:
            return False
        try:
            return bool(last[1] != layout[1])
        except Exception:  # values that cannot be compared: treat as changing
            return True

    def _eager(self, micro_batches: Sequence[Any]) -> None:
        self.step([materialize(b) for b in micro_batches])

    def __call__(self, micro_batches: Sequence[Any]) -> None:
        if self.failed is not None or len(micro_batches) != 1:
            self._eager(micro_batches)
            return
        batch = micro_batches[0]
        tensors: list[torch.Tensor] | None = None  # a plain batch's tensors; None: a deferred batch
        if isinstance(batch, DeferredBatch):
            key = ("deferred",) + tuple(batch.key)
        else:
            tensors, others, _ = _tensors(batch)
            if others and self._values_changed(tensors, others):
                self.failed = ("the batch's non-tensor values change between steps with the same tensor shapes, "
                               "and a replayed graph would keep the first ones")
                log.warning("CUDA graphs: %s; training continues eagerly", self.failed)
                self.step(micro_batches)
                return
            key = batches.signature(batch)
        captured = self.graphs.get(key)
        if captured is not None and self._values is not None:
            changed = self._values.changed()
            if changed is not None:
                self.failed = changed
                log.warning("CUDA graphs: %s; training continues eagerly", changed)
                self._eager(micro_batches)
                return
        if captured is not None:
            if tensors is None:
                batch.load(captured.static)  # a deferred batch's start position: one fill_
            else:
                captured.load(tensors)
            captured.graph.replay()
            self.replays += 1
            return
        if not self.graphs and self.warm < WARMUP_STEPS:
            self._side_stream_step(micro_batches)
            self.warm += 1
            return
        if self.graphs:
            if key in self.uncapturable or len(self.graphs) >= MAX_GRAPHS:
                self.eager_fallbacks += 1
                self._eager(micro_batches)
                return
            if key not in self._seen:
                # A new signature (the last, partial batch): one eager step first, a graph next time.
                self._seen.add(key)
                self.eager_fallbacks += 1
                self._side_stream_step(micro_batches)
                return
        self._capture(key, batch)

    def _capture(self, key: tuple, batch: Any) -> None:
        blocker = self.step.capture_blocker()  # seen in the eager steps before (a step of your own's)
        if blocker is not None:
            self.failed = blocker
            log.warning("CUDA graphs: %s; training continues eagerly", blocker)
            self._eager([batch])
            return
        if isinstance(batch, DeferredBatch):
            # The graph reads the deferred batch's inputs (its start position) and assembles it.
            static = batch.new_inputs()
            batch.load(static)
            static_batch = None
            build = batch.build
        else:
            tensors, _, (leaves, spec) = _tensors(batch)
            static = [t.clone() for t in tensors]
            it = iter(static)
            static_batch = batches.unflatten([next(it) if isinstance(x, torch.Tensor) else x for x in leaves], spec)
            build = None
        versions = [_version(t) for t in static]
        self.step.zero_grad()
        try:
            # Later signatures share the first graph's memory pool.
            graph = self.backend.capture(
                lambda: self.step.run([build(static) if build is not None else static_batch]),
                share_pool_with=self.graph)
        except Exception as exc:  # capture is all-or-nothing
            text = str(exc).strip()
            reason = f"capture failed ({type(exc).__name__}: {text.splitlines()[0] if text else ''})"
            self.backend.synchronize()
            self.step.zero_grad()
            if self.graphs:
                self.uncapturable[key] = reason
                log.warning("CUDA graphs: batch %s: %s; such batches run eagerly",
                            batch if isinstance(batch, DeferredBatch) else batches.describe(batch), reason)
            else:
                self.failed = reason
                log.warning("CUDA graphs: %s; training continues eagerly", reason)
            self._eager([batch])
            return
        # in-place ops on the batch (or no version counter on this torch: taken as written, copied every step)
        writes_inputs = [_version(t) for t in static] != versions or torch_compat.tensor_version is None
        captured = _Graph(graph, static, copy_skippable=build is None and not writes_inputs)
        if captured.copy_skippable:
            tensors = _tensors(batch)[0]
            captured.last = (tensors, _Graph.identity(tensors))
        self.graphs[key] = captured
        if self._values is None:
            self._values = _PythonValues(self.step.optimizers)
        # Capture records kernels without running them: replay once for this step's batch.
        graph.replay()
        self.replays += 1
        if len(self.graphs) == 1:
            log.info("CUDA graphs: whole training step captured after %d eager warm-up steps%s", WARMUP_STEPS,
                     ", the batch assembled inside the graph" if build is not None else "")
        else:
            log.info("CUDA graphs: another batch shape captured (%d graphs)", len(self.graphs))
