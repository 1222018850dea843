"""Which calls of a training step make the host wait for the device, and on which line.

- `detect_syncs(step_fn, steps)`: every call that makes the host wait for the GPU, with the file
  and line that made it (CUDA's sync debug mode).
- `count_host_reads(step_fn, steps)`: the same question on any device: the calls that read a tensor
  on the host (.item(), .tolist(), `if tensor:` ...), each of which syncs when the tensor is on a GPU
  (a TorchFunctionMode counts them).

Both attribute each call to a source line with `_SiteCounter` (user code first, then gputrain's).
"""

from __future__ import annotations

import linecache
import os
import sys
import sysconfig
import warnings
from typing import Any, Callable

import torch
from torch.overrides import TorchFunctionMode


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

    def hit(self, frame, what: str) -> None:
        file, line, func = _call_site(frame, self.boundary)
        site = self.sites.get((file, line))
        if site is None:
            site = self.sites[(file, line)] = {
                "file": file, "line": line, "function": func,
                "code": linecache.getline(file, line).strip(), "what": set(), "count": 0}
        site["count"] += 1
        site["what"].add(what)

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


def _to_host(args, kwargs) -> bool:
    """Whether a .to(...) call copies a device tensor to the host."""
    if not args or not isinstance(args[0], torch.Tensor) or args[0].device.type == "cpu":
        return False
    targets = list(args[1:]) + [kwargs.get("device")]
    return any((isinstance(t, str) and t.startswith("cpu")) or (isinstance(t, torch.device) and t.type == "cpu")
               for t in targets)


class _HostReadMode(TorchFunctionMode):
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
        if what is not None:
            self.counter.hit(sys._getframe(1), what)
        return func(*args, **kwargs)


def count_host_reads(step_fn: Callable[[], Any], steps: int = 3, warmup: int = 0) -> dict[str, Any]:
    """The calls in `steps` calls of `step_fn()` that read tensor values on the host, on any device.

    Counts .item(), .tolist(), .numpy(), .cpu(), .to('cpu'), float()/int()/bool() of a tensor
    (`if loss < best:`), formatting a tensor (f"{loss:.3f}"), boolean-mask indexing and ops whose
    output size depends on the data (nonzero, masked_select, unique). On a GPU each of these makes
    the host wait for the device; on the CPU they are free, so this shows what would sync there.
    Returns the same shape as `detect_syncs` with kind "host-reads".
    """
    for _ in range(warmup):
        step_fn()
    counter = _SiteCounter(sys._getframe())
    with _HostReadMode(counter):
        for s in range(steps):
            counter.step = s
            step_fn()
    return counter.result(steps, kind="host-reads")
