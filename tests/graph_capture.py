"""A CUDA graph on the CPU, with CUDA's capture semantics: the stand-in for `train/step/graphs.py`'s
`CudaGraphs` in the CPU suite.

A CUDA graph is a recorded list of kernels whose arguments and memory are fixed at capture; the
Python that launched them runs once, at capture, never on replay. `CaptureGraphs` does the same
with the aten ops a step dispatches:

- capture runs the step once under a TorchDispatchMode that records every op with its arguments
  and outputs (the outputs are the graph's static memory), and raises where CUDA capture raises: a
  host read, an output whose size depends on the values, a tensor made from host values
  (`gputrain.diagnostics.syncs.host_read`, the rule the host-read sentinel counts by). CUDA's
  capture launches nothing, so afterwards every tensor that existed before the capture is given
  its old contents back, and the random generators their old state;
- replay re-issues the recorded ops on the same tensors with the same scalar arguments, copying
  each fresh result into the output tensor the capture made (ops that return a view of, or write
  into, their inputs need no copy); random ops draw anew from the generator, as graph-safe RNG
  does. No gputrain or test code runs on replay: a profile hook fails the replay if any does.

So what a graph would freeze on a GPU freezes here too: a Python float given to an op (an lr,
momentum or weight that a scheduler rewrites), a Python branch taken at capture, a tensor replaced
by a new object instead of written in place. What it cannot show: which tensors are host tensors on
a GPU (here everything is on the CPU, and an op on a real host tensor would run at capture only).

`EagerGraphs` is the reference: a backend whose every capture fails, so that the same GraphedStep,
optimizer and tensors run every step eagerly. The `capture_graphs` fixture (conftest.py) makes
`fit` on the CPU take the graph path with either.
"""

from __future__ import annotations

import gc
import os
import sys
from typing import Any, Callable

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from gputrain.diagnostics.syncs import host_read
from gputrain import torch_compat


def _version(t: torch.Tensor) -> int | None:
    """The tensor's version counter (bumped by every in-place write, also through a view), or None."""
    return torch_compat.tensor_version(t) if torch_compat.tensor_version is not None else None

# Output tensors of these ops hold no defined values: nothing to copy on replay.
_UNDEFINED = frozenset(op for op in (getattr(torch.ops.aten, n, None) for n in (
    "empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided")) if op is not None)
_WATCHED_DIRS = tuple(os.path.abspath(p) + os.sep for p in (
    os.path.join(os.path.dirname(__file__), "..", "src", "gputrain"), os.path.dirname(__file__)))
_HANDLERS = ("__torch_dispatch__", "__torch_function__")


class CaptureError(RuntimeError):
    """What CUDA raises inside a capture (torch's message starts the same way)."""


def _tensors(values: Any) -> list[torch.Tensor]:
    return [x for x in tree_flatten(values)[0] if isinstance(x, torch.Tensor)]


def _copied_returns(func) -> list[bool]:
    """For each return of the op: whether it is fresh memory (True), or an alias of an input (a view,
    an in-place or out= result), which the replayed op itself updates."""
    return [r.alias_info is None for r in func._schema.returns]


class _Op:
    __slots__ = ("func", "args", "kwargs", "outputs")

    def __init__(self, func, args, kwargs, out):
        self.func, self.args, self.kwargs = func, args, kwargs
        # (recorded output, index of the return) for every fresh output tensor
        self.outputs: list[torch.Tensor] = []
        if func in _UNDEFINED or func.overloadpacket in _UNDEFINED:
            return
        fresh = _copied_returns(func)
        results = out if isinstance(out, tuple) and len(fresh) > 1 else (out,)
        for is_fresh, result in zip(fresh, results):
            if is_fresh:
                self.outputs.extend(_tensors(result))

    def replay(self) -> None:
        if not self.outputs:
            self.func(*self.args, **self.kwargs)
            return
        out = self.func(*self.args, **self.kwargs)
        fresh = _copied_returns(self.func)
        results = out if isinstance(out, tuple) and len(fresh) > 1 else (out,)
        new = [t for is_fresh, r in zip(fresh, results) if is_fresh for t in _tensors(r)]
        for static, value in zip(self.outputs, new):
            static.copy_(value)


class _Recorder(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops: list[_Op] = []
        self.made: set[int] = set()  # ids of tensors the capture made (alive: the ops hold them)
        # (tensor from before, its contents then, its version counter then)
        self.saved: list[tuple[torch.Tensor, torch.Tensor, int | None]] = []
        self._saved_ids: set[int] = set()
        self.generators: dict[int, tuple[torch.Generator, torch.Tensor]] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func.namespace == "profiler":  # record_function ranges: host bookkeeping, no kernel
            return func(*args, **kwargs)
        why = host_read(func, args, kwargs)
        if why is not None:
            raise CaptureError(f"operation not permitted when stream is capturing: {why} [{func}]")
        for t in _tensors((args, kwargs)):
            if id(t) not in self.made and id(t) not in self._saved_ids:
                self._saved_ids.add(id(t))
                self.saved.append((t, t.detach().clone(), _version(t)))
        gen = kwargs.get("generator")
        if isinstance(gen, torch.Generator) and id(gen) not in self.generators:
            self.generators[id(gen)] = (gen, gen.get_state())
        out = func(*args, **kwargs)
        if out is not None and not isinstance(out, (torch.Tensor, tuple, list)):
            raise CaptureError(f"operation not permitted when stream is capturing: {func} returns a host "
                               f"value ({type(out).__name__})")
        self.ops.append(_Op(func, args, kwargs, out))
        for t in _tensors(out):
            self.made.add(id(t))
        return out

    def undo(self) -> None:
        """Give every tensor from before the capture its contents back (the latest-saved first, so
        that the earliest copy of memory seen through several views wins), and the generators
        their state: CUDA's capture launches nothing."""
        with torch.no_grad():
            for t, before, version in reversed(self.saved):
                if version is not None and _version(t) == version and torch.equal(t, before):
                    continue  # not written: left as it is, its version counter too (graphs.py reads it)
                if t.is_contiguous() or t.stride().count(0) == 0:  # an expanded view cannot be written
                    t.copy_(before)
        for gen, state in self.generators.values():
            gen.set_state(state)
        self.saved.clear()


class CapturedGraph:
    """One recorded step: `replay()` re-issues its ops; `pool()` as torch.cuda.CUDAGraph has it."""

    def __init__(self, owner: "CaptureGraphs"):
        self.owner = owner
        self.ops: list[_Op] = []
        self.replays = 0

    def record(self, fn: Callable[[], Any]) -> None:
        recorder = _Recorder()
        cpu_rng = torch.get_rng_state()
        try:
            with recorder:
                fn()
        finally:
            recorder.undo()
            torch.set_rng_state(cpu_rng)
        self.ops = recorder.ops

    def replay(self) -> None:
        python: list[str] = []
        top = sys._getframe()

        def watch(frame, event, arg):
            if event != "call" or not frame.f_code.co_filename.startswith(_WATCHED_DIRS) \
                    or frame.f_code.co_filename == __file__:
                return
            f = frame
            while f is not None and f is not top:  # a test's own dispatch mode counting ops may run
                if f.f_code.co_name in _HANDLERS:
                    return
                f = f.f_back
            python.append(f"{frame.f_code.co_filename}:{frame.f_lineno} {frame.f_code.co_name}")

        self.owner.replaying = True
        before, collecting = sys.getprofile(), gc.isenabled()
        gc.disable()  # a collection would finalize unrelated objects (an old epoch's generator) mid-replay
        sys.setprofile(watch)
        try:
            with torch.no_grad():
                for op in self.ops:
                    op.replay()
        finally:
            sys.setprofile(before)
            if collecting:
                gc.enable()
            self.owner.replaying = False
        if python:
            raise AssertionError(f"Python ran during a graph replay: {python[:5]}")
        self.replays += 1

    def pool(self) -> None:
        return None


class CaptureGraphs:
    """`train/step/graphs.py`'s CudaGraphs, on the CPU, with capture semantics (see the module docstring)."""

    instances: list["CaptureGraphs"] = []  # every backend made while the fixture is active

    def __init__(self, device: torch.device | None = None):
        self.device = device
        self.graphs: list[CapturedGraph] = []
        self.replaying = False
        CaptureGraphs.instances.append(self)

    @property
    def captures(self) -> int:
        return len(self.graphs)

    def eager(self, fn: Callable[[], Any]) -> None:
        fn()

    def capture(self, fn: Callable[[], Any], share_pool_with: Any = None) -> CapturedGraph:
        graph = CapturedGraph(self)
        graph.record(fn)
        self.graphs.append(graph)
        return graph

    def synchronize(self) -> None:
        pass


class EagerGraphs(CaptureGraphs):
    """The eager reference: every capture fails, so the GraphedStep runs each step eagerly with the
    same optimizer and tensors as the graphed run."""

    def capture(self, fn: Callable[[], Any], share_pool_with: Any = None) -> CapturedGraph:
        raise CaptureError("the eager reference captures nothing")
