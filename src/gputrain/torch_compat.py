"""Torch's private corners in one place: every private torch name gputrain uses, resolved once, each
with what gputrain does on a torch that lacks it.

A private name (a leading underscore, or any name inside a private module such as
`torch._dynamo.utils`) can be renamed or dropped by any torch release without notice. Reached only
through here, a rename costs one entry of `ENTRIES` instead of a crash in every step, and
tests/test_torch_compat.py, which resolves every entry on the installed torch (`make test` on the
suite's torch, `make test-torch TORCH=X.Y.Z` on another), names the entry that broke.

Each entry gives where the name lives, the torch releases checked to have it, and its fallback.
Names inside `torch` itself (the foreach ops) are resolved when this module is imported; the others,
some behind a heavy import (dynamo, DCP), on first use. A missing name is logged once at debug level
with its fallback. One public API that behaves differently between releases is told apart here too
(`dcp_stager_reusable`: torch 2.11's DCP stager stages only once).

    from gputrain import torch_compat
    torch_compat.missing()        # [] on a torch that has everything
    torch_compat.ENTRIES["torch.autograd.profiler._is_profiler_enabled"].fallback
"""

from __future__ import annotations

import collections
import functools
import importlib
import logging
import os
import tempfile
from dataclasses import dataclass
from typing import Any, Callable, Mapping

import torch
from torch import nn

# The pytree functions that move and split nested batches (gputrain/batch.py). No fallback: without
# them no batch can be moved, so the import fails here, naming the module.
try:
    from torch.utils import _pytree as pytree
except ImportError as exc:  # pragma: no cover - every torch gputrain supports has it
    raise ImportError(f"gputrain needs torch.utils._pytree, which torch {torch.__version__} lacks: "
                      "use a torch that the README lists as supported") from exc

log = logging.getLogger("gputrain")

# The torch releases the whole suite passed on (`make test-torch TORCH=...`); each entry is resolved on them.
CHECKED = "2.10.0, 2.11.0, 2.13.0"


@dataclass(frozen=True)
class Private:
    """One private torch name: where it lives, who uses it, since when, and the fallback."""

    path: str  # where torch keeps it, e.g. "torch.autograd.profiler._is_profiler_enabled"
    users: str  # the gputrain modules that reach it through this module
    versions: str  # the torch releases known to have it
    fallback: str  # what gputrain does on a torch without it
    find: Callable[[], Any] | None = None  # finds the object, raising when missing; default: import `path`

    def locate(self) -> Any:
        """The object on this torch; raises (ImportError, AttributeError, ...) when it is missing."""
        return self.find() if self.find is not None else _attribute(self.path)()


def _attribute(path: str) -> Callable[[], Any]:
    """A finder for `package.module.attr`: attributes from `torch` down, importing a submodule where
    no attribute of that name is there yet (no failed imports: they search the disk)."""

    def find() -> Any:
        parts = path.split(".")
        obj = importlib.import_module(parts[0])
        for i, name in enumerate(parts[1:], start=2):
            try:
                obj = getattr(obj, name)
            except AttributeError:
                obj = importlib.import_module(".".join(parts[:i]))
        return obj

    return find


def _tiny_optimizer() -> torch.optim.Optimizer:
    return torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=1.0)


def _instance_attributes(make: Callable[[], Any], names: tuple[str, ...], kind: type = dict) -> Callable[[], Any]:
    """A finder for attributes that torch sets on every instance (checked on one made by `make`)."""

    def find() -> tuple[str, ...]:
        attrs = vars(make())
        for name in names:
            if not isinstance(attrs.get(name), kind):
                raise AttributeError(f"a new {type(make()).__name__} has no {kind.__name__} {name!r}")
        return names

    return find


def _find_last_lr() -> str:
    scheduler = torch.optim.lr_scheduler.LambdaLR(_tiny_optimizer(), lambda _: 1.0)
    if "_last_lr" not in vars(scheduler):
        raise AttributeError("LRScheduler sets no _last_lr")
    scheduler._last_lr = [0.5]
    if scheduler.get_last_lr() != [0.5]:
        raise AttributeError("LRScheduler.get_last_lr() does not report _last_lr")
    return "_last_lr"


def _find_compilation_metrics() -> collections.deque:
    metrics = _attribute("torch._dynamo.utils._compilation_metrics")()
    if not isinstance(metrics, collections.deque):
        raise AttributeError(f"torch._dynamo.utils._compilation_metrics is a {type(metrics).__name__}, not a deque")
    return metrics


def _find_compiled_module_attr() -> str:
    compiled = torch.compile(nn.Identity())  # nothing compiles before the first call
    if not isinstance(getattr(compiled, "_orig_mod", None), nn.Identity):
        raise AttributeError("torch.compile's module wrapper keeps no _orig_mod")
    return "_orig_mod"


def _find_tensor_version() -> Callable[[torch.Tensor], int]:
    t = torch.zeros(1)
    before = t._version
    t.view(1).add_(1)  # an in-place write through a view bumps the base's counter
    if t._version != before + 1:
        raise AttributeError("Tensor._version does not count in-place writes")
    return lambda t: t._version


def _find_pytree() -> Any:
    for name in ("SUPPORTED_NODES", "register_pytree_node", "tree_flatten", "tree_unflatten", "TreeSpec"):
        getattr(pytree, name)
    return pytree


_MODULE_HOOKS = ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks")
_GLOBAL_MODULE_HOOKS = tuple(f"torch.nn.modules.module._global{name}" for name in _MODULE_HOOKS)
_FOREACH = ("_foreach_lerp_", "_foreach_sub", "_foreach_mul_", "_foreach_add_", "_foreach_copy_", "_foreach_norm")

_ENTRIES = [
    # ---- torch.compile (runtime/recompiles.py, runtime/distributed.py, checkpoint/format.py)
    Private("torch._dynamo.utils._compilation_metrics", "runtime/recompiles.py",
            f"{CHECKED}: a deque of the last 64 compilations",
            "each poll copies get_compilation_metrics() and compares its last entry (a list copy per poll)",
            _find_compilation_metrics),
    Private("torch._dynamo.utils.get_compilation_metrics", "runtime/recompiles.py", CHECKED,
            "no compilation is seen: the run reports 0 recompilations"),
    Private("torch._dynamo.utils.counters", "runtime/recompiles.py", CHECKED,
            "no graph break is seen: the run reports 0 graph breaks"),
    Private("torch._dynamo.external_utils.__file__", "runtime/recompiles.py",
            f"{CHECKED}: the file that wraps a compiled module's forward",
            "a recompiled module's forward is named by its function and file, not as \"a compiled module's forward\""),
    Private("torch._inductor.list_mode_options", "config.py", f"{CHECKED}: torch.compile's modes",
            "the modes torch 2.10-2.13 take: default, reduce-overhead, max-autotune, max-autotune-no-cudagraphs"),
    Private("torch._inductor.runtime.cache_dir_utils.default_cache_dir", "runtime/compile_cache.py",
            "2.11.0, 2.13.0: the folder inductor uses, and writes into TORCHINDUCTOR_CACHE_DIR, when none is set",
            "a TORCHINDUCTOR_CACHE_DIR that inductor set for itself is taken as the user's: a named compile cache "
            "folder keeps torch's artifacts but not inductor's cache"),
    Private("torch._dynamo.eval_frame.OptimizedModule._orig_mod", "runtime/distributed.py, checkpoint/format.py",
            CHECKED, "none needed at run time: a model without it is taken as not compiled",
            _find_compiled_module_attr),
    # ---- the optimizer's per-step calls (train/optim/calls.py)
    Private("torch.optim.Optimizer.profile_hook_step", "train/optim/calls.py",
            f"{CHECKED}: the wrapper around every optimizer class's step",
            "optimizer.step() is called through torch's wrapper (its host time: see train/optim/calls.py)"),
    Private("torch.optim.optimizer._global_optimizer_pre_hooks", "train/optim/calls.py", CHECKED,
            "optimizer.step() is called through torch's wrapper"),
    Private("torch.optim.optimizer._global_optimizer_post_hooks", "train/optim/calls.py", CHECKED,
            "optimizer.step() is called through torch's wrapper"),
    Private("torch.optim.Optimizer()._optimizer_step_pre_hooks/_optimizer_step_post_hooks", "train/optim/calls.py",
            CHECKED, "optimizer.step() is called through torch's wrapper",
            _instance_attributes(_tiny_optimizer, ("_optimizer_step_pre_hooks", "_optimizer_step_post_hooks"))),
    Private("torch.autograd.profiler._is_profiler_enabled", "train/optim/calls.py",
            f"{CHECKED}: a module-level bool, True while a profiler runs",
            "taken as always True: step() and zero_grad() go through torch's own calls"),
    # ---- LR schedulers (train/loop/callbacks.py)
    Private("torch.optim.lr_scheduler.LRScheduler()._last_lr", "train/loop/callbacks.py",
            f"{CHECKED}: what get_last_lr() returns",
            "after a callback scales the learning rate, get_last_lr() gives the old rate until the "
            "scheduler's next step", _find_last_lr),
    # ---- DCP (checkpoint/sharded.py)
    Private("torch.distributed.checkpoint.state_dict_loader._load_state_dict", "checkpoint/sharded.py", CHECKED,
            "a whole checkpoint is read through DCP's public dcp_to_torch_save, by way of a temporary file"),
    Private("torch.distributed.checkpoint.default_planner._EmptyStateDictLoadPlanner", "checkpoint/sharded.py",
            CHECKED, "as for _load_state_dict"),
    # ---- CUDA (diagnostics/gpu_util.py)
    Private("torch.cuda._get_nvml_device_index", "diagnostics/gpu_util.py",
            f"{CHECKED}: in every build, CUDA or not",
            "NVML's index is taken to be the CUDA index (wrong under a reordering CUDA_VISIBLE_DEVICES)"),
    # ---- modules and batches
    Private("torch.utils._pytree", "batch.py", CHECKED,
            "none: importing gputrain fails, naming it", _find_pytree),
    Private("torch.nn.modules.batchnorm._BatchNorm", "train/step/recompute.py", CHECKED,
            "the public BatchNorm1d/2d/3d, SyncBatchNorm and their lazy forms"),
    Private("torch.nn.Module()." + "/".join(_MODULE_HOOKS), "runtime/speed.py", CHECKED,
            "every module is taken as hooked: no whole-step CUDA graph",
            _instance_attributes(lambda: nn.Linear(1, 1), _MODULE_HOOKS)),
    *[Private(path, "runtime/speed.py", CHECKED, "taken as registered: no whole-step CUDA graph")
      for path in _GLOBAL_MODULE_HOOKS],
    # ---- ops without a public name (train/loop/ema.py, train/step/train_step.py)
    *[Private(f"torch.{name}", "train/loop/ema.py, train/step/train_step.py", CHECKED,
              "a Python loop of the per-tensor op (one kernel per tensor)")
      for name in _FOREACH],
    Private("torch._amp_foreach_non_finite_check_and_unscale_", "train/step/train_step.py", CHECKED,
            "per tensor: isfinite().all() into the flag, then the multiply"),
    Private("torch.Tensor._version", "train/step/graphs.py", CHECKED,
            "None: a caller must take every batch as written (copy it in again)", _find_tensor_version),
    # ---- dispatch (diagnostics/syncs.py)
    Private("torch.utils._python_dispatch.TorchDispatchMode", "diagnostics/syncs.py", CHECKED,
            "None: host reads are counted by the Python-level TorchFunctionMode only"),
    Private("torch.ops.aten._local_scalar_dense", "diagnostics/syncs.py", CHECKED,
            "None: .item() is counted where Python calls it, not where an op reads a 0-dim tensor"),
    Private("torch.ops.aten._to_copy", "diagnostics/syncs.py", "2.11.0, 2.13.0",
            "None: a .to('cpu') of a device tensor is not named as a host read"),
]
ENTRIES: dict[str, Private] = {e.path: e for e in _ENTRIES}

_MISSING = object()
_resolved: dict[str, Any] = {}


def resolve(path: str) -> Any | None:
    """The object of entry `path` on this torch, found once; None when this torch lacks it."""
    value = _resolved.get(path, _MISSING)
    if value is _MISSING:
        entry = ENTRIES[path]
        try:
            # A finder may build a small module (its weights drawn at random): with the CPU generator
            # given back, the first lookup in a process cannot shift a seeded run's random numbers.
            with torch.random.fork_rng(devices=[]):
                value = entry.locate()
        except Exception as exc:  # noqa: BLE001 - any failure to find it means: use the fallback
            log.debug("torch %s has no %s (%s): %s", torch.__version__, path, exc, entry.fallback)
            value = None
        _resolved[path] = value
    return value


def missing() -> list[str]:
    """The entries this torch lacks (each then runs its fallback)."""
    return [path for path in ENTRIES if resolve(path) is None]


# ---------------------------------------------------------------- torch.compile


def compilation_metrics_log() -> collections.deque | None:
    """Dynamo's live deque of compilation records (read, never copied), or None."""
    return resolve("torch._dynamo.utils._compilation_metrics")


def compile_modes() -> list[str]:
    """The modes torch.compile takes ("default" first); imports torch._inductor (seconds): call it only
    when a mode is given."""
    list_modes = resolve("torch._inductor.list_mode_options")
    known = list_modes() if list_modes is not None else ["reduce-overhead", "max-autotune",
                                                          "max-autotune-no-cudagraphs"]
    return list(dict.fromkeys(["default", *known]))


def inductor_default_cache_dir() -> str | None:
    """The folder inductor caches in when TORCHINDUCTOR_CACHE_DIR is unset (its first use writes it
    into the variable); None when this torch has no such function."""
    find = resolve("torch._inductor.runtime.cache_dir_utils.default_cache_dir")
    return os.path.abspath(find()) if find is not None else None


def compilation_metrics() -> list:
    """A copy of dynamo's recent compilation records ([] when this torch has no such list)."""
    get = resolve("torch._dynamo.utils.get_compilation_metrics")
    return list(get()) if get is not None else []


def dynamo_counters() -> Mapping[str, collections.Counter]:
    """Dynamo's counters by kind ("graph_break": a Counter of messages); {} when missing."""
    counters = resolve("torch._dynamo.utils.counters")
    return counters if counters is not None else {}


def is_compiled_forward_wrapper(filename: str) -> bool:
    """Whether a compiled function's file is torch's wrapper around a compiled module's forward."""
    wrapper = resolve("torch._dynamo.external_utils.__file__")
    return wrapper is not None and bool(filename) and \
        os.path.normcase(os.path.realpath(filename)) == os.path.normcase(os.path.realpath(wrapper))


COMPILED_MODULE_ATTR = "_orig_mod"  # torch.compile(module)'s wrapper keeps the module here (and in its keys)


def compiled_inner(model: nn.Module) -> nn.Module:
    """The module inside torch.compile's wrapper (the model itself when not compiled)."""
    return getattr(model, COMPILED_MODULE_ATTR, model)


# ---------------------------------------------------------------- the optimizer's calls


def optimizer_step_wrapper() -> Callable | None:
    """torch's decorator around every optimizer class's `step` (Optimizer.profile_hook_step), or None."""
    return resolve("torch.optim.Optimizer.profile_hook_step")


def optimizer_global_hooks() -> tuple[Mapping, Mapping] | None:
    """The module-level step pre- and post-hook dicts (register_optimizer_step_pre/post_hook), or None."""
    pre = resolve("torch.optim.optimizer._global_optimizer_pre_hooks")
    post = resolve("torch.optim.optimizer._global_optimizer_post_hooks")
    return (pre, post) if pre is not None and post is not None else None


def optimizer_step_hook_attrs() -> tuple[str, ...] | None:
    """The names of an optimizer's own step pre- and post-hook dicts (register_step_pre/post_hook), or None."""
    return resolve("torch.optim.Optimizer()._optimizer_step_pre_hooks/_optimizer_step_post_hooks")


def _profiler_flag() -> Callable[[], bool]:
    import torch.autograd.profiler as autograd_profiler

    if resolve("torch.autograd.profiler._is_profiler_enabled") is None:
        return lambda: True
    return lambda: autograd_profiler._is_profiler_enabled  # read per call: a profiler may start any time


profiler_enabled: Callable[[], bool] = _profiler_flag()
"""Whether torch's autograd profiler is recording now (always True on a torch without the flag)."""


# ---------------------------------------------------------------- LR schedulers


def set_last_lr(scheduler: Any, lrs: list) -> None:
    """Make `scheduler.get_last_lr()` report `lrs` (a torch LRScheduler; other schedulers untouched)."""
    if resolve("torch.optim.lr_scheduler.LRScheduler()._last_lr") is not None and hasattr(scheduler, "_last_lr"):
        setattr(scheduler, "_last_lr", lrs)


# ---------------------------------------------------------------- DCP


def read_whole_dcp(path: str | os.PathLike, no_dist: bool = True) -> dict[str, Any]:
    """Every entry of the DCP checkpoint at `path`, loaded whole in this process (full CPU tensors,
    nested as saved), without a model or a process group."""
    from torch.distributed.checkpoint.filesystem import FileSystemReader

    load = resolve("torch.distributed.checkpoint.state_dict_loader._load_state_dict")
    planner = resolve("torch.distributed.checkpoint.default_planner._EmptyStateDictLoadPlanner")
    if load is not None and planner is not None:
        state: dict[str, Any] = {}
        load(state, storage_reader=FileSystemReader(str(path)), planner=planner(), no_dist=no_dist)
        return state
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    with tempfile.TemporaryDirectory(prefix="gputrain-dcp-") as tmp:
        file = os.path.join(tmp, "whole.pt")
        dcp_to_torch_save(str(path), file)
        return torch.load(file, map_location="cpu", weights_only=False)


@functools.cache
def dcp_stager_reusable() -> bool:
    """Whether one DCP `DefaultStager` stages more than once (public API, but torch releases differ).

    torch 2.11's `DefaultStager._stage` closes its state-dict copier after every stage, which empties
    the copier's table of types, so a second stage raises `KeyError: <class 'type'>`; 2.10's and
    2.13's keep the copier (and its cached host buffers) until `close()`. Found by staging a small
    state twice."""
    from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

    stager = DefaultStager(StagingOptions(False, False, False, False))
    try:
        for _ in range(2):
            stager.stage({"model": {"w": torch.zeros(2)}, "step": [1]})
        return True
    except Exception:  # noqa: BLE001 - any failure of the second stage: a stager per save
        return False
    finally:
        stager.close()


# ---------------------------------------------------------------- CUDA


def nvml_device_index(device: torch.device) -> int:
    """NVML's index of a CUDA device (CUDA_VISIBLE_DEVICES may number them differently); the CUDA
    index when this torch cannot say."""
    find = resolve("torch.cuda._get_nvml_device_index")
    if find is not None:
        try:
            return int(find(device))
        except Exception:  # noqa: BLE001 - a private helper that parses the environment: fall back
            pass
    return device.index or 0


# ---------------------------------------------------------------- modules


def _batchnorm_types() -> tuple[type, ...]:
    base = resolve("torch.nn.modules.batchnorm._BatchNorm")
    if base is not None:
        return (base,)
    return (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d, nn.SyncBatchNorm,
            nn.LazyBatchNorm1d, nn.LazyBatchNorm2d, nn.LazyBatchNorm3d)


BATCHNORM_TYPES: tuple[type, ...] = _batchnorm_types()
"""The BatchNorm layers (with running statistics), for isinstance."""


def module_has_hooks(module: nn.Module) -> bool:
    """Whether forward or backward hooks are registered on this module (True when this torch keeps
    them where gputrain cannot see)."""
    if resolve("torch.nn.Module()." + "/".join(_MODULE_HOOKS)) is None:
        return True
    attrs = vars(module)
    return any(attrs.get(name) for name in _MODULE_HOOKS)


def global_module_hooks() -> bool:
    """Whether hooks were registered for every module (nn.modules.module.register_module_*_hook);
    True when this torch keeps them where gputrain cannot see."""
    hooks = [resolve(path) for path in _GLOBAL_MODULE_HOOKS]
    return any(h is None or bool(h) for h in hooks)


# ---------------------------------------------------------------- ops without a public name


def _loop_lerp_(dst: list[torch.Tensor], src: list[torch.Tensor], weight: Any) -> None:
    for d, s in zip(dst, src):
        d.lerp_(s, weight)


def _loop_sub(a: list[torch.Tensor], b: list[torch.Tensor]) -> list[torch.Tensor]:
    return [x - y for x, y in zip(a, b)]


def _loop_mul_(tensors: list[torch.Tensor], other: Any) -> None:
    for t in tensors:
        t.mul_(other)


def _loop_add_(tensors: list[torch.Tensor], other: list[torch.Tensor]) -> None:
    for t, o in zip(tensors, other):
        t.add_(o)


def _loop_copy_(dst: list[torch.Tensor], src: list[torch.Tensor]) -> None:
    for d, s in zip(dst, src):
        d.copy_(s)


def _loop_norm(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    return [torch.linalg.vector_norm(t) for t in tensors]


def _loop_non_finite_check_and_unscale_(tensors: list[torch.Tensor], found_inf: torch.Tensor,
                                        inv_scale: torch.Tensor) -> None:
    for t in tensors:
        found_inf.copy_(torch.maximum(found_inf, t.isfinite().all().logical_not().to(found_inf.dtype)))
        t.mul_(inv_scale)


def _op(name: str, fallback: Callable) -> Callable:
    found = resolve(f"torch.{name}")
    return found if callable(found) else fallback


# One multi-tensor kernel (per device and dtype) for a list of tensors; a per-tensor loop without it.
foreach_lerp_: Callable = _op("_foreach_lerp_", _loop_lerp_)
foreach_sub: Callable = _op("_foreach_sub", _loop_sub)
foreach_mul_: Callable = _op("_foreach_mul_", _loop_mul_)
foreach_add_: Callable = _op("_foreach_add_", _loop_add_)
foreach_copy_: Callable = _op("_foreach_copy_", _loop_copy_)
foreach_norm: Callable = _op("_foreach_norm", _loop_norm)
# GradScaler's check: sets found_inf (a 1-element float tensor) to 1 when any tensor holds an inf or
# NaN, and multiplies every tensor by inv_scale.
non_finite_check_and_unscale_: Callable = _op("_amp_foreach_non_finite_check_and_unscale_",
                                              _loop_non_finite_check_and_unscale_)

tensor_version: Callable[[torch.Tensor], int] | None = resolve("torch.Tensor._version")
"""A tensor's version counter (bumped by every in-place write, through views too), or None."""


def torch_dispatch_mode() -> type | None:
    """torch's TorchDispatchMode base class (sees every aten op), or None."""
    return resolve("torch.utils._python_dispatch.TorchDispatchMode")
