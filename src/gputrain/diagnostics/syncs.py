"""Which calls of a training step make the host wait for the device, and on which line.

- `detect_syncs(step_fn, steps)`: every call that makes the host wait for the GPU, with the file
  and line that made it (CUDA's sync debug mode).
- `count_host_reads(step_fn, steps)` / `watch_host_reads()`: the same question on any device, the
  CPU included: every read of a tensor's value on the host, each of which syncs when the tensor is
  on a GPU. Two views make it whole. At the dispatcher (a TorchDispatchMode) every aten op is seen,
  also those that a C++ op issues for itself before its kernel: `aten._local_scalar_dense` is the
  `.item()` that turning a 0-dim tensor into a Scalar argument costs (`torch._foreach_lerp_(a, b,
  tensor)`), ops whose output size depends on the values (`nonzero`, boolean masks, `unique`),
  answers the host waits for (`equal`, `is_nonzero`), and device-to-host copies. At Python calls (a
  TorchFunctionMode) `.tolist()` and `.numpy()`, which read memory without an op. A read seen by
  both is counted once, at the Python call.
- `host_read(func, args, kwargs)`: the dispatcher's rule alone, for one op: why it reads the host,
  or None. The CPU tests' CUDA-graph stand-in raises on exactly these, as CUDA capture does.

All attribute each read to a source line with `_SiteCounter` (user code first, then gputrain's).
"""

from __future__ import annotations

import contextlib
import linecache
import os
import sys
import sysconfig
import warnings
from typing import Any, Callable

import torch
from torch.overrides import TorchFunctionMode

from gputrain import torch_compat

# The dispatcher's view needs torch's private TorchDispatchMode (torch_compat.py); without it
# only the Python calls are counted.
_DispatchMode: Any = torch_compat.torch_dispatch_mode() or object


# ---------------------------------------------------------------- whose line is it


_TORCH_DIR = os.path.dirname(torch.__file__) + os.sep
_GPUTRAIN_DIR = os.path.dirname(os.path.abspath(__file__)) + os.sep
_STDLIB_DIRS = tuple({os.path.abspath(sysconfig.get_paths()[k]) + os.sep for k in ("stdlib", "platstdlib")})


def _kind_of(filename: str) -> str:
    path = os.path.abspath(filename) if not filename.startswith("<") else filename
    if path.startswith(_TORCH_DIR):
        return "torch"
    if path.startswith(_GPUTRAIN_DIR):
        return "gputrain"
    if path.startswith(_STDLIB_DIRS) and "site-packages" not in path:
        return "stdlib"
    return "user"


def _call_site(frame, boundary) -> tuple[str, int, str]:
    """The (file, line, function) responsible for the call being made in `frame`'s stack.

    Walks outward until `boundary` (the frame of detect_syncs/count_host_reads): the first frame in
    user code wins; failing that, the first in gputrain; failing that, the innermost.
    """
    frames = []
    f = frame
    while f is not None and f is not boundary:
        frames.append(f)
        f = f.f_back
    best = None
    for wanted in ("user", "gputrain"):
        best = next((f for f in frames if _kind_of(f.f_code.co_filename) == wanted), None)
        if best is not None:
            break
    best = best or (frames[0] if frames else frame)
    return best.f_code.co_filename, best.f_lineno, best.f_code.co_name


class _SiteCounter:
    """Counts calls per (file, line) and per step."""

    def __init__(self, boundary):
        self.boundary = boundary
        self.step = 0
        self.sites: dict[tuple[str, int], dict[str, Any]] = {}
        self.total = 0
        # > 0 while a read counted at a Python call runs: the ops it dispatches are that same read
        self.quiet = 0

    def hit(self, frame, what: str) -> None:
        file, line, func = _call_site(frame, self.boundary)
        site = self.sites.get((file, line))
        if site is None:
            site = self.sites[(file, line)] = {
                "file": file, "line": line, "function": func,
                "code": linecache.getline(file, line).strip(), "what": set(), "count": 0}
        site["count"] += 1
        site["what"].add(what)
        self.total += 1

    def result(self, steps: int, **extra: Any) -> dict[str, Any]:
        sites = sorted(self.sites.values(), key=lambda s: -s["count"])
        for s in sites:
            s["what"] = ", ".join(sorted(s["what"]))
            s["per_step"] = s["count"] / max(steps, 1)
        total = sum(s["count"] for s in sites)
        return {"supported": True, "reason": None, "steps": steps, "total": total,
                "per_step": total / max(steps, 1), "sites": sites, **extra}


def _unsupported(reason: str, **extra: Any) -> dict[str, Any]:
    return {"supported": False, "reason": reason, "steps": 0, "total": None, "per_step": None, "sites": [], **extra}


# ---------------------------------------------------------------- syncs (CUDA)


def detect_syncs(step_fn: Callable[[], Any], steps: int = 3, warmup: int = 1,
                 device: torch.device | str | None = None) -> dict[str, Any]:
    """Every synchronizing CUDA call that `steps` calls of `step_fn()` make, with its source line.

    Runs `warmup` steps first (lazy initialization syncs once; it is not counted), then `steps`
    steps under torch.cuda.set_sync_debug_mode("warn"), catches each "called a synchronizing CUDA
    operation" warning and walks the Python stack to the line that caused it (frames inside torch
    are skipped, and gputrain's unless nothing else is there).

    Returns {"supported", "reason", "steps", "total", "per_step", "sites": [{"file", "line",
    "function", "code", "what", "count", "per_step"}], "kind": "cuda-syncs"}, sites most frequent
    first. Without a CUDA GPU it returns supported=False and a reason, and runs nothing. Not every
    sync is reported: CUDA's debug mode misses some (torch.distributed, sparse ops).
    """
    if not torch.cuda.is_available():
        return _unsupported("the sync detector needs a CUDA GPU (it uses CUDA's sync debug mode); on this "
                            "machine `count_host_reads` lists the .item()/.cpu()/`if tensor:` calls that "
                            "would sync on one", kind="cuda-syncs")
    device = torch.device(device) if device is not None else torch.device("cuda", torch.cuda.current_device())
    for _ in range(warmup):
        step_fn()
    torch.cuda.synchronize(device)
    counter = _SiteCounter(sys._getframe())
    previous = torch.cuda.get_sync_debug_mode()

    def on_warning(message, category, filename, lineno, file=None, line=None):
        if "synchroniz" in str(message):
            counter.hit(sys._getframe(1), str(message).split(" (Triggered")[0])

    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = on_warning
        torch.cuda.set_sync_debug_mode("warn")
        try:
            for s in range(steps):
                counter.step = s
                step_fn()
        finally:
            torch.cuda.set_sync_debug_mode(previous)
    torch.cuda.synchronize(device)
    return counter.result(steps, kind="cuda-syncs")


# ---------------------------------------------------------------- host reads (any device)

_READS = {"item", "tolist", "numpy", "__bool__", "__float__", "__int__", "__index__", "__format__", "cpu"}
_DATA_DEPENDENT = {"nonzero", "argwhere", "masked_select", "unique", "unique_consecutive"}


def _aten_ops(*names: str) -> frozenset:
    """The aten overload packets of these names that this torch has."""
    aten = torch.ops.aten
    return frozenset(op for op in (getattr(aten, n, None) for n in names) if op is not None)


# The host waits for a device value: a Scalar made of a tensor (.item(), `if t:`, float(t), and a
# 0-dim tensor passed where an op takes a Scalar), or an answer returned to Python.
# aten's .item() (private: torch_compat.py)
_ITEM_OPS = frozenset(op for op in (torch_compat.resolve("torch.ops.aten._local_scalar_dense"),
                                    getattr(torch.ops.aten, "item", None)) if op is not None)
_VALUE_OPS = _ITEM_OPS | _aten_ops("is_nonzero", "equal", "allclose")
# The output's size depends on the values: the host reads the count before it can allocate.
_SIZE_OPS = _aten_ops("nonzero", "nonzero_numpy", "argwhere", "masked_select", "_unique", "_unique2", "unique_dim",
                      "unique_consecutive", "unique_dim_consecutive", "bincount")
_INDEX_OPS = _aten_ops("index", "index_put", "index_put_", "_index_put_impl_")
# A tensor made of Python data (torch.tensor, as_tensor of a list): on a GPU it is copied from pageable
# host memory, a blocking copy (and its value is the one of that moment, frozen into a captured graph).
_FROM_HOST_OPS = _aten_ops("lift_fresh", "lift_fresh_copy")
_TO_COPY = torch_compat.resolve("torch.ops.aten._to_copy")


def _leaves(values) -> list:
    out = []
    for v in values:
        if isinstance(v, (list, tuple)):
            out.extend(_leaves(v))
        else:
            out.append(v)
    return out


def _off_host(t: Any) -> bool:
    return isinstance(t, torch.Tensor) and t.device.type not in ("cpu", "meta")


def host_read(func, args: tuple = (), kwargs: dict | None = None) -> str | None:
    """Why the aten op `func` (an OpOverload, as a TorchDispatchMode sees it) makes the host wait
    for a device value, or None. On a CPU tensor the same op costs nothing, which is why this is
    decided by the op and not by the device: what is a read on the CPU syncs on a GPU."""
    kwargs = kwargs or {}
    packet = getattr(func, "overloadpacket", func)
    name = getattr(packet, "__name__", str(func))
    if packet in _VALUE_OPS:
        return ".item() (a device value read on the host)" if packet in _ITEM_OPS \
            else f"{name} (answers the host with a device value)"
    if packet in _SIZE_OPS:
        return f"{name} (output size depends on the data)"
    if packet in _INDEX_OPS and len(args) > 1 and any(
            isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8) for i in _leaves([args[1]])):
        return "boolean-mask indexing (output size depends on the data)"
    if packet is torch.ops.aten.repeat_interleave and kwargs.get("output_size") is None \
            and isinstance(args[0] if args else None, torch.Tensor) and (len(args) < 2 or isinstance(args[1], torch.Tensor)):
        return "repeat_interleave with tensor repeats and no output_size (output size depends on the data)"
    if packet in _FROM_HOST_OPS:
        return "torch.tensor() of host values (a blocking copy to a GPU)"
    if packet is _TO_COPY and args and _off_host(args[0]):
        device = kwargs.get("device")
        if device is not None and torch.device(device).type == "cpu":
            return ".to('cpu') (a device-to-host copy)"
    if packet is torch.ops.aten.copy_ and len(args) > 1 and isinstance(args[0], torch.Tensor) \
            and args[0].device.type == "cpu" and _off_host(args[1]):
        return "copy_ into a host tensor (a device-to-host copy)"
    return None


def _to_host(args, kwargs) -> bool:
    """Whether a .to(...) call copies a device tensor to the host."""
    if not args or not isinstance(args[0], torch.Tensor) or args[0].device.type == "cpu":
        return False
    targets = list(args[1:]) + [kwargs.get("device")]
    return any((isinstance(t, str) and t.startswith("cpu")) or (isinstance(t, torch.device) and t.type == "cpu")
               for t in targets)


class _HostReadMode(TorchFunctionMode):
    """Reads at Python calls: what the user wrote (.item(), `if loss < best:`), and .tolist() /
    .numpy(), which read a CPU tensor's memory without dispatching an op."""

    def __init__(self, counter: _SiteCounter):
        super().__init__()
        self.counter = counter

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        what = None
        if name in _READS:
            what = f".{name}()" if not name.startswith("__") else name
        elif name in _DATA_DEPENDENT:
            what = f"{name} (output size depends on the data)"
        elif name == "to" and _to_host(args, kwargs):
            what = ".to('cpu')"
        elif name in ("__getitem__", "__setitem__") and len(args) > 1 and isinstance(args[1], torch.Tensor) \
                and args[1].dtype == torch.bool:
            what = "boolean-mask indexing"
        if what is None:
            return func(*args, **kwargs)
        self.counter.hit(sys._getframe(1), what)
        self.counter.quiet += 1  # the ops this call dispatches are the read just counted
        try:
            return func(*args, **kwargs)
        finally:
            self.counter.quiet -= 1


class _HostReadDispatch(_DispatchMode):
    """Reads at the dispatcher: every aten op, those a C++ op issues for itself included."""

    def __init__(self, counter: _SiteCounter):
        super().__init__()
        self.counter = counter

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if not self.counter.quiet:
            what = host_read(func, args, kwargs)
            if what is not None:
                self.counter.hit(sys._getframe(1), what)
        return func(*args, **kwargs)


class HostReads:
    """`with watch_host_reads() as reads:` counts every host read of the block (see the module
    docstring); `reads.total`, and `reads.result(steps)` in `count_host_reads`'s shape."""

    def __init__(self, boundary):
        self.counter = _SiteCounter(boundary)
        self._modes = (_HostReadMode(self.counter),) + (
            (_HostReadDispatch(self.counter),) if _DispatchMode is not object else ())

    @property
    def total(self) -> int:
        return self.counter.total

    def __enter__(self) -> "HostReads":
        # The Python view outside, the dispatcher's inside: each op reaches the function mode first.
        self._stack = contextlib.ExitStack()
        with self._stack as stack:
            for mode in self._modes:
                stack.enter_context(mode)
            self._stack = stack.pop_all()
        return self

    def __exit__(self, *exc) -> None:
        self._stack.__exit__(*exc)

    def result(self, steps: int) -> dict[str, Any]:
        return self.counter.result(steps, kind="host-reads")


def watch_host_reads() -> HostReads:
    """A context manager that counts every host read made inside it, with its source line (lines
    are looked for below the caller's frame)."""
    return HostReads(sys._getframe(1))


def count_host_reads(step_fn: Callable[[], Any], steps: int = 3, warmup: int = 0) -> dict[str, Any]:
    """The host reads that `steps` calls of `step_fn()` make, on any device.

    Counts .item(), .tolist(), .numpy(), .cpu(), .to('cpu'), float()/int()/bool() of a tensor
    (`if loss < best:`), formatting a tensor (f"{loss:.3f}"), boolean-mask indexing, ops whose
    output size depends on the data (nonzero, masked_select, unique), and the reads that ops make
    for themselves (a 0-dim tensor passed as a Scalar). On a GPU each of these makes the host wait
    for the device; on the CPU they are free, so this shows what would sync there.
    Returns the same shape as `detect_syncs` with kind "host-reads".
    """
    for _ in range(warmup):
        step_fn()
    reads = HostReads(sys._getframe())
    with reads:
        for s in range(steps):
            reads.counter.step = s
            step_fn()
    return reads.result(steps)
