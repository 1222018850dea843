"""The optimizer's two per-step calls, `step()` and `zero_grad(set_to_none=True)`, without the
host time torch adds to each call for a profiler that is not running.

torch wraps every `Optimizer.step` (`Optimizer.profile_hook_step`) and `zero_grad` in a
`record_function` range, which opens and closes a dispatcher op whether a profiler runs or not.
Measured here on the CPU (2 cores, fused AdamW over an MLP 32-128-10): `optimizer.step()` 47.5 us
a call against 35.3 us for the step it wraps in `timeit`, 100 against 65 us inside a run (colder
caches); `zero_grad` 10.4 us against 1.4 us for its loop. Whole steps of that run: 523 against
472 us. Host time a launch-bound GPU step waits for, too.

Both fall back to the optimizer's own call whenever anything could see the difference: the
wrapper's pre- and post-hooks (global or the optimizer's, looked at every call, so a hook
registered mid-run is called from its next step on), a running profiler (its trace keeps the
"Optimizer.step#..." range), a `step` or `zero_grad` set on the instance (an LR scheduler's step
counter, a library's wrapper) or defined by the optimizer's class in place of torch's. The wrapper,
its hook dicts and the profiler's flag are torch's private corners (torch_compat.py): on a
torch without one of them, every call goes through torch's own `step()` / `zero_grad()`.
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from gputrain import torch_compat
from gputrain.torch_compat import profiler_enabled


def _torch_step_wrapper_code() -> Any:
    """The code object of torch's step wrapper (every optimizer class's `step` is wrapped in a
    function with this code): tells torch's wrapper from any other decorator. None when this torch
    has no such wrapper (then `optimizer.step()` is called as it is)."""
    wrap = torch_compat.optimizer_step_wrapper()
    return getattr(wrap(lambda *a, **k: None), "__code__", None) if callable(wrap) else None


_STEP_WRAPPER_CODE = _torch_step_wrapper_code()
# The hook dicts torch's wrapper reads: module-level (register_optimizer_step_pre/post_hook) and
# per optimizer (register_step_pre/post_hook). Missing in a torch that moved them: no shortcut.
_GLOBAL_HOOKS = torch_compat.optimizer_global_hooks()
_OWN_HOOKS = torch_compat.optimizer_step_hook_attrs()


def _unwrapped_step(optimizer: torch.optim.Optimizer) -> Callable[[torch.optim.Optimizer], Any] | None:
    """The class's step without torch's profiler wrapper, or None when the class's step is not
    exactly torch's wrapper around it (another decorator, an optimizer outside torch.optim.Optimizer)."""
    step = getattr(type(optimizer), "step", None)
    if _STEP_WRAPPER_CODE is None or _GLOBAL_HOOKS is None or _OWN_HOOKS is None or \
            getattr(step, "__code__", None) is not _STEP_WRAPPER_CODE:
        return None
    inner = getattr(step, "__wrapped__", None)
    return inner if callable(inner) else None


def optimizer_stepper(optimizer: torch.optim.Optimizer) -> Callable[[], Any]:
    """`optimizer.step()`, as a call without arguments for every step (see the module docstring)."""
    inner = _unwrapped_step(optimizer)
    if inner is None or _GLOBAL_HOOKS is None or _OWN_HOOKS is None:
        return lambda: optimizer.step()  # looked up per call: a scheduler made later may wrap it
    pre_global, post_global = _GLOBAL_HOOKS
    pre_own, post_own = _OWN_HOOKS
    attrs = vars(optimizer)

    def step() -> Any:
        if (pre_global or post_global or profiler_enabled() or "step" in attrs
                or attrs.get(pre_own) or attrs.get(post_own)):
            return optimizer.step()  # torch's wrapper: hooks, the profiler's range, a wrapped instance step
        return inner(optimizer)

    return step


def grad_clearer(optimizer: torch.optim.Optimizer) -> Callable[[], None]:
    """`optimizer.zero_grad(set_to_none=True)`, as a call without arguments for every step.

    For an optimizer that keeps torch's `zero_grad` the loop is run here (the same parameters, read
    from `param_groups` at each call: a loaded state dict replaces the list); an optimizer with a
    `zero_grad` of its own (its class's, or one set on the instance) has it called.
    """
    own = type(optimizer).zero_grad is not torch.optim.Optimizer.zero_grad or "zero_grad" in vars(optimizer)
    if own:
        zero_grad = optimizer.zero_grad
        return lambda: zero_grad(set_to_none=True)

    def clear() -> None:
        if profiler_enabled():  # the trace keeps torch's "Optimizer.zero_grad#..." range
            optimizer.zero_grad(set_to_none=True)
            return
        for group in optimizer.param_groups:
            for p in group["params"]:
                p.grad = None

    return clear

