"""The speed switches of a run, decided once, each with its reason (printed in the run log).

`decide_speed` answers channels_last, cudnn.benchmark, torch.compile and CUDA graphs before the
optimizer is built: the optimizer is made graph-capturable only when graphs will be used, and the
answer is never asked again. `restore()` gives back the process-wide cudnn.benchmark setting.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import torch
from torch import nn

from gputrain import torch_compat
from gputrain.batch import needs_closure

# Where a whole step can be captured. The CPU suite adds "cpu" with its stand-in for CUDA graphs
# (tests/graph_capture.py), so that the graph path runs there with CUDA's capture semantics.
GRAPH_DEVICE_TYPES: tuple[str, ...] = ("cuda",)


def has_conv(model: nn.Module) -> bool:
    return any(isinstance(m, (nn.Conv2d, nn.Conv3d)) for m in model.modules())


def hooked_modules(model: nn.Module) -> list[str]:
    """Names of submodules with forward/backward hooks (Python that a replayed graph would skip)."""
    return [name or "(the model)" for name, m in model.named_modules() if torch_compat.module_has_hooks(m)]


def global_hooks() -> bool:
    """Whether module hooks were registered for every module (nn.modules.module.register_module_*)."""
    return torch_compat.global_module_hooks()


def graph_blockers(*, device: torch.device, accumulate: int, world_size: int, use_scaler: bool, compiled: bool | str,
                   recompute: bool, optimizer=None, model: nn.Module | None = None,
                   step_hooks: Sequence[str] = ()) -> str | None:
    """Why the whole step cannot be captured in a CUDA graph, or None when it can.

    step_hooks: the callbacks that asked for a hook after every step (train/loop/callbacks.py); callbacks
    that run at log points only do not change the answer.

    optimizer: None when gputrain builds it (then capturable), an Optimizer instance given by the
    user (it must have been created with capturable=True), a factory (unknown: not captured), or
    {name: either} for a step of your own (each must be a capturable instance).
    """
    if device.type not in GRAPH_DEVICE_TYPES:
        return f"CUDA graphs need a CUDA device (running on {device.type})"
    if accumulate > 1:
        return "gradient accumulation (several backward passes per step) is not captured"
    if world_size > 1:
        return "distributed gradient sync is not captured"
    if use_scaler:
        return "fp16 loss scaling checks for inf on the host every step"
    if compiled and compiled in ("reduce-overhead", "max-autotune"):
        return f"torch.compile mode {compiled!r} captures its own CUDA graphs (cudagraph trees)"
    if recompute:
        return "recompute runs forward passes again inside backward"
    if step_hooks:
        return (f"callback {', '.join(step_hooks)} asked for a hook after every step (every_step=True); "
                "callbacks that run at log points keep graphs on")
    for name, opt in (optimizer.items() if isinstance(optimizer, dict) else ()):
        if not isinstance(opt, torch.optim.Optimizer) or not all(g.get("capturable", False) for g in opt.param_groups):
            return (f"optimizer {name!r} is not an instance created with capturable=True (e.g. "
                    "AdamW(params, lr=torch.tensor(1e-3), fused=True, capturable=True))")
    if optimizer is not None and not isinstance(optimizer, dict):
        if isinstance(optimizer, torch.optim.Optimizer):
            if "capturable" not in optimizer.defaults and needs_closure(optimizer):  # LBFGS: its step(closure) reads the loss on the host
                return (f"the optimizer ({type(optimizer).__name__}) has no capturable form: its step(closure) reads "
                        "the loss on the host")
            if not all(g.get("capturable", False) for g in optimizer.param_groups):
                return f"the optimizer ({type(optimizer).__name__}) was not created with capturable=True"
        else:
            return "the optimizer comes from a factory (create it with capturable=True and pass the instance)"
    if model is not None:
        hooked = hooked_modules(model)
        if hooked:
            return (f"module hooks on {', '.join(hooked[:3])}{' ...' if len(hooked) > 3 else ''} would run at "
                    "capture only, never on replay")
        if global_hooks():
            return "global module hooks are registered; they would run at capture only, never on replay"
    return None


def scheduler_blocker(scheduler) -> str | None:
    """Why the run's scheduler keeps the step out of a CUDA graph, or None. A captured optimizer step
    keeps the Python numbers it was given; torch's OneCycleLR and CyclicLR (cycle_momentum=True, their
    default) write beta1 / momentum as Python numbers every step. (train/step/graphs.py also switches graphs
    off at the first replay after any such value changes; this says so before the run starts.)"""
    if getattr(scheduler, "cycle_momentum", False):
        return (f"the scheduler {type(scheduler).__name__} cycles the momentum (cycle_momentum=True): it writes the "
                "optimizer's beta1/momentum as a Python number every step, which a replayed graph would keep at its "
                "capture value; create it with cycle_momentum=False to keep CUDA graphs")
    return None


@dataclass
class SpeedSwitches:
    """The speed decisions of a run, each with its reason."""

    channels_last: bool
    cudnn_benchmark: bool
    cuda_graphs: bool
    compile: bool
    reasons: dict[str, str] = field(default_factory=dict)
    layout_probe: str | None = None  # "check" / "time": channels_last decided on the first batch (train/step/layout.py)
    _benchmark_before: bool | None = None

    def apply(self, device: torch.device) -> None:
        """Set cudnn.benchmark for the run (process-wide; `restore` gives it back)."""
        if device.type == "cuda":
            self._benchmark_before = torch.backends.cudnn.benchmark
            torch.backends.cudnn.benchmark = self.cudnn_benchmark

    def restore(self) -> None:
        if self._benchmark_before is not None:
            torch.backends.cudnn.benchmark = self._benchmark_before
            self._benchmark_before = None

    def refuse_graphs(self, reason: str | None) -> None:
        """Graphs off for `reason`, found after the decision (the scheduler is built after the
        optimizer, which is made capturable when graphs are on); None: the decision stands."""
        if reason is not None and self.cuda_graphs:
            self.cuda_graphs = False
            self.reasons["cuda_graphs"] = reason

    def decisions(self) -> list[dict[str, str]]:
        """[{name, value, reason}] for the log, the summary and the report."""
        return [{"name": n, "value": "on" if getattr(self, n) else "off", "reason": r} for n, r in self.reasons.items()]


def decide_speed(config, model: nn.Module, device: torch.device, *, world_size: int = 1, use_scaler: bool = False,
                 optimizer=None, step_hooks: Sequence[str] = (), own_step=None,
                 probe_layout: bool = False) -> SpeedSwitches:
    """Decide every switch once from the config ("auto" or a forced value), the model and the device.
    own_step: your step_fn (train/step/own_step.py), captured only when cuda_graphs=True asks for it.
    probe_layout: the caller runs the first step through train/step/layout.py's LayoutDecider, which decides
    channels_last there ("auto" on a conv net); else the rule without a probe (`_layout`)."""
    cuda = device.type == "cuda"
    conv = has_conv(model)
    reasons: dict[str, str] = {}

    def pick(name: str, value, auto_value: bool, auto_reason: str) -> bool:
        if value == "auto":
            reasons[name] = auto_reason
            return auto_value
        reasons[name] = "requested"
        return bool(value)

    channels_last, probe = _layout(config.channels_last, conv, device, world_size, probe_layout, reasons)
    benchmark = pick("cudnn_benchmark", config.cudnn_benchmark, cuda and conv,
                     "fixed input shapes: cuDNN picks the fastest algorithm once" if cuda and conv
                     else "not a CUDA conv net")
    # Compiled kernels (inductor, no cudagraphs of its own) inside gputrain's whole-step graph: the
    # warm-up steps compile, then forward + backward + optimizer are captured as one graph.
    reasons["compile"] = (f"requested (mode {config.compile_mode or 'default'}"
                          + ("; inside gputrain's whole-step CUDA graph" if cuda and config.compile_mode not in
                             ("reduce-overhead", "max-autotune") else "") + ")") if config.compile else "not requested"
    blocker = graph_blockers(device=device, accumulate=config.accumulate, world_size=world_size,
                             use_scaler=use_scaler,
                             compiled=(config.compile_mode or "default") if config.compile else False,
                             recompute=bool(config.recompute), optimizer=optimizer, model=model,
                             step_hooks=step_hooks)
    if config.cuda_graphs == "auto":
        if blocker is None and own_step is not None:
            blocker = (f"a step of your own ({getattr(own_step, '__name__', 'step_fn')}) is captured only when "
                       "asked (cuda_graphs=True): its Python runs once, at capture, so a branch on a step count "
                       "or a Python number would be frozen")
        graphs = blocker is None
        reasons["cuda_graphs"] = (blocker if blocker is not None
                                  else "one graph launch per step instead of one launch per kernel")
    elif config.cuda_graphs:
        graphs = blocker is None
        reasons["cuda_graphs"] = blocker if blocker is not None else "requested"
    else:
        graphs = False
        reasons["cuda_graphs"] = "switched off (cuda_graphs=False)"
    return SpeedSwitches(channels_last, benchmark, graphs, bool(config.compile), reasons, layout_probe=probe)


def _layout(value, conv: bool, device: torch.device, world_size: int, probe_layout: bool,
            reasons: dict[str, str]) -> tuple[bool, str | None]:
    """(channels_last now, the first-step check still to run: "check" or None), its reason in `reasons`.

    Decided by rule, never by a timing (a timing would make a seeded run's numbers depend on the
    machine's load: NHWC kernels sum in another order). A forced value stands. "auto": off without 2-D
    convolutions; on CUDA the first step checks that NHWC runs and gives the same loss, and cuDNN's NHWC
    kernels decide the rest (the CUDA rule; with several processes every rank takes the rule unchecked,
    so the ranks cannot disagree); elsewhere the user's layout (on the CPU whether NHWC pays depends on
    the CPU: `--autotune` measures it and writes its choice into the run). A caller that runs no first
    step through a LayoutDecider (probe_layout False) gets the CUDA rule unchecked on CUDA."""
    if value != "auto":
        reasons["channels_last"] = "requested"
        return bool(value), None
    if not conv:
        reasons["channels_last"] = "no 2D convolutions"
        return False, None
    if device.type == "cuda" and (not probe_layout or world_size > 1):
        reasons["channels_last"] = ("2D convolutions on CUDA: cuDNN's NHWC kernels (the CUDA rule"
                                    + (", not probed with several processes)" if world_size > 1 else ")"))
        return True, None
    if device.type == "cuda":
        reasons["channels_last"] = "decided on the first batch: NHWC kept where it runs and gives the same loss"
        return False, "check"
    reasons["channels_last"] = (f"your layout on {device.type}: whether NHWC pays there depends on the "
                                "machine, and a timing must not decide a seeded run's numbers (--autotune "
                                "measures it and records its choice; channels_last=True forces it)")
    return False, None


REQUESTED = "as you requested"  # marks a choice in `choices_made` that the user made


def choices_made(speed: SpeedSwitches, precision_name: str, autocast_dtype: torch.dtype | None,
                 precision_asked: str = "auto") -> list[str]:
    """The choices gputrain made on its own that change the layout, dtype or kernels of the step, each
    with the switch that turns it off (for the note after a failed first step); forced ones are the
    user's, except autocast, which is named either way ("as you requested": REQUESTED), since torch
    refuses some ops under it ("unsafe to autocast") and an automatic one the first step refuses is
    already undone (train/step/autocast_decider.py)."""
    out = []
    if speed.channels_last and speed.reasons.get("channels_last") != "requested":
        out.append("channels_last (NHWC weights and inputs; off: channels_last=False, --channels-last off)")
    if autocast_dtype is not None:
        asked = "" if (precision_asked or "auto").strip().lower() == "auto" else f", {REQUESTED}"
        out.append(f"{precision_name} autocast{asked} (off: precision='fp32', --precision fp32)")
    if speed.cuda_graphs and speed.reasons.get("cuda_graphs") != "requested":
        out.append("CUDA graphs (off: cuda_graphs=False, --cuda-graphs off)")
    return out
