"""Your own training step: `fit(model, data, step_fn=fn, optimizer={...})`, the fourth way beside the
loss rule (train/step/loss.py), for steps that are not "one loss, one optimizer": a GAN's generator and
discriminator stepped in turn, distillation from a frozen teacher, a gradient penalty (a backward
through a gradient), conditional updates.

    def gan_step(step, batch):
        real, _ = batch
        fake = step.model.generator(torch.randn(real.shape[0], 16, device=real.device))
        d_loss = bce(step.model.discriminator(real), ones) + bce(step.model.discriminator(fake.detach()), zeros)
        step.backward(d_loss)
        step.step("discriminator")
        g_loss = bce(step.model.discriminator(fake), ones)
        step.backward(g_loss)
        step.step("generator")
        return {"d_loss": d_loss, "g_loss": g_loss}

`fn(step, batch)` is called once per micro-batch under the run's precision (autocast), with a
`StepContext` that owns what gputrain must own:
- `step.backward(loss)`: backward of loss times the micro-batch's share of the step's samples, through
  the GradScaler in fp16, outside autocast;
- `step.step(name)`: on the step's last micro-batch (earlier ones accumulate), the gradients of that
  optimizer's parameters averaged over the processes (several processes), unscaled (fp16) and
  clipped (max_grad_norm), the optimizer's step, its scheduler's step, its gradients cleared;
  `step.step(name, closure=fn)` for an optimizer that steps with a closure (LBFGS): `fn()` clears
  the gradients, computes the loss, calls `step.backward(loss)` and returns the loss, as
  `optimizer.step(closure)` wants it (each evaluation's gradients averaged and clipped as above);
- `step.zero_grad(name)`, `step.optimizers`, `step.schedulers`, `step.model` (the model as you gave
  it), `step.is_last`;
- `step.index` (the run's optimizer steps done before this one, right after a resume too) and
  `step.micro_index` (the micro-batch's place in the step): Python ints, no host read;
- `step.state`: what the step carries to the next one, by name, saved in the checkpoints
  (train/step/carried_state.py).
It returns the loss, or a dict of named losses (each logged as its name, detached and summed on the
device: no host read per step; the run's "loss" is their sum). A name returned on some steps only is
logged as the mean over the steps that returned it, counted on the device, and `<name>_steps` says
how many did. Every gradient is cleared at the end of the step, and the GradScaler updated once (fp16).

The body is `OwnStep.run`, made of the built-in step's pieces (train/step/micro.py: the micro-batches
and their weights, the out-of-memory recovery; totals.py: the device sums; the precision's contract):
the EMA update and the CUDA-graph wrapper treat it like the built-in step. A graph captures it only when asked
(`cuda_graphs=True`): Python of yours that branches on a step count would run once, at capture, so a
step that read `step.index` or returned other losses on some steps (in the eager steps before the
capture) is not captured (`capture_blocker`), and the run's decisions say why.
Checkpoints hold every optimizer and scheduler by name (train/optim/by_name.py).

Several processes: without sharding the model is not DDP-wrapped (your step calls its parts, which
DDP's hooks would not see) and `step.step(name)` averages that optimizer's gradients in one flat
all-reduce. With FSDP2 (shard=True) the model is sharded as for the built-in step (each direct child a
unit, runtime/distributed.py): the units reduce-scatter their gradients in backward, so the step leaves
them be and only holds that sync back on the micro-batches before the last.
"""

from __future__ import annotations

from typing import Any, Callable, Mapping, Sequence

import torch
from torch import nn

from gputrain.batch import needs_closure
from gputrain.errors import ConfigError, DataError
from gputrain.runtime import distributed
from gputrain.runtime.precision import RunPrecision
from gputrain.runtime.timing import NO_CLOCK, PhaseClock
from gputrain.train.optim.by_name import NamedOptimizers, OptimizerSet, SchedulerSet
from gputrain.train.optim.calls import optimizer_stepper
from gputrain.train.step.carried_state import CarriedState
from gputrain.train.step.micro import MicroBatches
from gputrain.train.step.totals import StepTotals, TotalsRead


def _is_one(weight: Any) -> bool:
    """Weight 1.0 as a host float (a step in one piece): no multiply; a device weight (items) is never
    compared on the host."""
    return weight.__class__ is float and weight == 1.0


class StepContext:
    """What your step_fn gets (see the module docstring). Its attributes are gputrain's: assigning one
    (`step.state = {...}`, `step.micro_index = 3`) is refused, since the run would not see the value
    (a resume would lose a replaced state; the step's place and counts are the run's own). OwnStep
    and the methods below set them (`_set`)."""

    _owner: "OwnStep"
    model: nn.Module
    optimizers: dict[str, torch.optim.Optimizer]
    schedulers: dict[str, Any]
    state: CarriedState
    is_last: bool
    micro_index: int
    weight: Any
    backwards: int
    steps: int
    index_read: bool
    stepped: set[str]

    def __init__(self, owner: "OwnStep", model: nn.Module, state: CarriedState):
        self._set(
            _owner=owner,
            model=model,  # the plain module (not DDP-wrapped): call its parts as you named them
            optimizers=owner.optimizer.optimizers,
            schedulers=owner.schedulers.schedulers if owner.schedulers is not None else {},
            state=state,  # what the step carries to the next one, by name (train/step/carried_state.py)
            is_last=True,  # the step's last micro-batch: step() acts only then
            micro_index=0,  # this micro-batch's place in the step: 0 .. pieces - 1
            weight=1.0,  # this micro-batch's share of the step's samples (a device scalar with num_items)
            backwards=0, steps=0,  # calls of backward and step in this step so far
            index_read=False,  # step_fn read step.index: a CUDA graph would freeze its branch
            stepped=set())  # the optimizers step() was called for in this call of step_fn

    def _set(self, **values: Any) -> None:
        for name, value in values.items():
            object.__setattr__(self, name, value)

    def __setattr__(self, name: str, value: Any) -> None:
        fix = ("assign its entries instead, step.state['hidden'] = h (a replaced mapping would not be saved in the "
               "checkpoints)" if name == "state" else
               "keep values of your own in step.state['name'] (saved in the checkpoints) or in your own variables")
        raise ConfigError(f"step.{name} = ... in your step_fn: the step's attributes are gputrain's and read-only; "
                          f"{fix}")

    @property
    def index(self) -> int:
        """The run's optimizer steps done before this one: 0 at the first step, and after a resume
        the step the run stopped after. A Python int (the run's own count): branching on it reads
        nothing on the host. A step that reads it is not captured by a CUDA graph."""
        self._set(index_read=True)
        return self._owner.index()

    def _name(self, name: str | None) -> str:
        if name is None:
            if len(self.optimizers) == 1:
                return next(iter(self.optimizers))
            raise ConfigError(f"this run has optimizers {sorted(self.optimizers)}: say which, step.step(name)")
        if name not in self.optimizers:
            raise ConfigError(f"no optimizer named {name!r}: this run has {sorted(self.optimizers)}")
        return name

    def backward(self, loss: torch.Tensor, retain_graph: bool | None = None, create_graph: bool = False) -> None:
        """Backward of `loss` times this micro-batch's share, through the scaler in fp16, outside autocast."""
        if not isinstance(loss, torch.Tensor):
            raise DataError(f"step.backward(loss) takes the loss tensor your step_fn computed (a scalar), got "
                            f"{type(loss).__name__}: e.g. loss = loss_fn(step.model(x), y); step.backward(loss)")
        self._set(backwards=self.backwards + 1)
        precision = self._owner.precision
        with precision.no_autocast():
            precision.backward(loss if _is_one(self.weight) else loss * self.weight, retain_graph=retain_graph,
                               create_graph=create_graph)

    def step(self, name: str | None = None, closure: Callable[[], Any] | None = None) -> Any:
        """On the last micro-batch: sync, unscale, clip, step the optimizer and its scheduler, clear its
        gradients. Before it: nothing (the gradients accumulate). `closure`: for an optimizer whose
        step takes one (LBFGS); what the optimizer's step returns is returned."""
        name = self._name(name)
        if name in self.stepped:  # a second update from the same gradients: surely not what was meant
            raise ConfigError(f"step.step({name!r}) was called twice in one call of step_fn: each optimizer steps "
                              "once per step; call step.backward for each of its losses first, then step.step once")
        self.stepped.add(name)
        self._set(steps=self.steps + 1)
        if self.is_last:
            return self._owner.step_optimizer(name, closure)
        return None

    def zero_grad(self, name: str | None = None) -> None:
        """Clear the gradients of that optimizer's parameters (None: of every optimizer's, with one optimizer)."""
        for p in self._owner.params_of[self._name(name)]:
            p.grad = None


class OwnStep:
    """The training step made of your step_fn and the step's pieces (see the module docstring)."""

    def __init__(self, step_fn: Callable[[StepContext, Any], Any], model: nn.Module, module: nn.Module,
                 optimizers: OptimizerSet, schedulers: SchedulerSet | None, precision: RunPrecision, *,
                 device: torch.device, max_grad_norm: float | None = None,
                 dist: distributed.DistInfo | None = None, oom_recovery: bool = True,
                 num_items: Callable[[Any], Any] | None = None,
                 after_step: Sequence[Callable[[], None]] = (), loss_list: bool | None = None,
                 index: Callable[[], int] | None = None, state: CarriedState | None = None):
        self.step_fn, self.model, self.precision = step_fn, model, precision
        self.optimizer, self.schedulers = optimizers, schedulers
        self.optimizers = list(optimizers.optimizers.values())
        self.params = list(module.parameters())
        self.max_grad_norm, self.dist, self.after_step = max_grad_norm, dist, tuple(after_step)
        self.micro = MicroBatches(model, device, num_items=num_items, dist=dist, oom_recovery=oom_recovery)
        self.totals = StepTotals(device, self.params, self.optimizers, loss_list=loss_list)
        self.params_of = {name: [p for g in opt.param_groups for p in g["params"]]
                          for name, opt in optimizers.optimizers.items()}
        self._stepper = {name: optimizer_stepper(opt) for name, opt in optimizers.optimizers.items()}
        self._closure = {name for name, opt in optimizers.optimizers.items() if needs_closure(opt)}
        self.closure_used = False  # a closure optimizer stepped (it reads the host: not captured)
        self._named: set[tuple[Any, ...]] = set()  # the returned dicts' key tuples found good (_losses)
        # The run's step count (the run state: right after a resume too); by default the steps run here.
        self.steps_run = 0
        self.index: Callable[[], int] = index if index is not None else (lambda: self.steps_run)
        self.context = StepContext(self, module, state if state is not None else CarriedState(None, device))
        # FSDP2 (shard=True): the model's own hooks reduce-scatter the gradients in backward.
        self.sharded = any(callable(getattr(p, "to_local", None)) for p in self.params)
        self.clock: PhaseClock = NO_CLOCK
        self._foreach = device.type == "cuda" or None

    def step_optimizer(self, name: str, closure: Callable[[], Any] | None = None) -> Any:
        """One optimizer's part of the step: its gradients averaged over the processes, unscaled and
        clipped, its step (with `closure` for a closure optimizer), its scheduler, its gradients cleared."""
        opt, params = self.optimizer.optimizers[name], self.params_of[name]
        if name in self._closure and closure is None:
            raise ConfigError(f"optimizer {name!r} ({type(opt).__name__}) steps with a closure: call "
                              f"step.step({name!r}, closure=fn), where fn() clears the gradients (step.zero_grad), "
                              "computes the loss, calls step.backward(loss) and returns the loss")
        if closure is not None:
            if self.micro.splits > 1 or not self.context.is_last or self.context.micro_index > 0:
                raise ConfigError("step.step(name, closure=...) evaluates the loss of this micro-batch only, so "
                                  "under accumulate > 1 (or after an out-of-memory split) its step would not be the "
                                  "mean over the step's samples: use accumulate=1 with a closure optimizer")
            self.closure_used = True

            def evaluate() -> Any:
                loss = closure()
                self._reduce_and_clip(opt, params)
                return loss

            out = self.precision.step(opt, lambda: opt.step(evaluate), update=False)
        else:
            self._reduce_and_clip(opt, params)
            # The scale's update waits until every optimizer of this step has stepped (run's end).
            out = self.precision.step(opt, self._stepper[name], update=False)
        if self.schedulers is not None:
            self.schedulers.step_for(name)
        for p in params:
            p.grad = None
        return out

    def _reduce_and_clip(self, opt: torch.optim.Optimizer, params: list[torch.Tensor]) -> None:
        """DDP's average for the parameters this optimizer updates (one flat all-reduce), then unscale
        and clip. FSDP2's units reduce-scatter in backward already."""
        grads = [p.grad for p in params if p.grad is not None]
        if not grads:
            return
        if self.dist is not None and self.dist.world_size > 1 and not self.sharded:
            flat = torch.cat([g.reshape(-1) for g in grads])
            distributed.all_reduce_sum(flat, self.dist).div_(self.dist.world_size)
            offset = 0
            for g in grads:
                g.copy_(flat[offset:offset + g.numel()].view_as(g))
                offset += g.numel()
        self.precision.unscale_and_clip(opt, params, self.max_grad_norm, self._foreach)

    def run(self, micro_batches: Sequence[Any]) -> None:
        ctx = self.context
        ctx._set(backwards=0, steps=0)
        step_losses: dict[str, torch.Tensor] = {}
        for i, (piece, weight, last) in enumerate(self.micro.plan(micro_batches)):
            ctx._set(weight=weight, is_last=last, micro_index=i, stepped=set())
            with self.micro.held_back(not last):  # FSDP2 holds its reduce-scatter back; a plain module: no-op
                out = self.precision.forward(self.step_fn, ctx, piece)
            for key, value in _losses(out, self._named).items():
                term = value.detach().float() if _is_one(weight) else value.detach().float() * weight
                step_losses[key] = term if key not in step_losses else step_losses[key] + term
        if not ctx.backwards:
            raise ConfigError("step_fn returned without calling step.backward(loss): nothing would train. "
                              "Call step.backward(loss), then step.step(name) for the optimizer it updates")
        if not ctx.steps:
            raise ConfigError(f"step_fn never called step.step(name): no optimizer of {sorted(ctx.optimizers)} "
                              "would update. Call step.step(name) after step.backward(loss)"
                              + (" (with a closure optimizer: step.step(name, closure=fn))" if self._closure else ""))
        self.precision.update()
        for p in self.params:  # every gradient, also those no optimizer took (a frozen teacher's)
            p.grad = None
        for update in self.after_step:
            update()
        self.totals.keep_named(step_losses)
        self.steps_run += 1
        self.clock.mark("optimizer")

    def __call__(self, micro_batches: Sequence[Any]) -> None:
        """The eager step: `run`, cut finer after an out-of-memory error (train/step/micro.py)."""
        self.micro.run(self.run, micro_batches, self.zero_grad)
        self.totals.after_eager_step()

    def zero_grad(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)

    def capture_blocker(self) -> str | None:
        """Why a CUDA graph must not capture this step, seen in the eager steps before the capture:
        Python that runs once at capture and would decide every replay."""
        name = getattr(self.step_fn, "__name__", "step_fn")
        if self.context.index_read:
            return (f"your step_fn ({name}) reads step.index, and a captured step runs its Python once, at "
                    "capture: a branch on the index would be frozen there")
        carried = self.context.state.graph_blocker()
        if carried is not None:
            return carried
        if self.totals.varied:
            return (f"your step_fn ({name}) returns some losses on some steps only ({', '.join(self.totals.names)}), "
                    "a Python branch that a captured step would take as it did at capture")
        if self.closure_used:
            return f"your step_fn ({name}) steps a closure optimizer, which evaluates the loss on the host"
        return None

    def read_totals(self) -> TotalsRead:
        from gputrain.train.step.train_step import read_totals

        return read_totals(self.totals, self.dist)


# What a log point's record holds besides a step of your own's losses (train/loop/trainer.py's _log_point:
# lr_NAME is each optimizer's rate, eval_* an evaluation's): a loss of one of these names would be hidden
# by the run's own value, or hide it. "loss" alone is the run's loss itself.
RECORD_KEYS = frozenset({"step", "epoch", "loss", "lr", "samples_per_s", "peak_memory_bytes", "step_page_faults",
                         "wall_time_s", "recompilations", "graph_breaks"})
RECORD_PREFIXES = ("lr_", "eval_")
_EXAMPLE = "{'d_loss': d_loss, 'g_loss': g_loss}"


def _described(value: Any) -> str:
    """A returned value as the refusal names it: a tensor's shape, else its type."""
    if isinstance(value, torch.Tensor):
        return f"a tensor of shape {tuple(value.shape)}"
    return "None" if value is None else f"a {type(value).__name__}"


def _losses(out: Any, named: set[tuple[Any, ...]]) -> dict[str, torch.Tensor]:
    """What step_fn returned as {name: scalar loss}; DataError saying what to return instead.
    named: the key tuples already found good (checked once each, not every step)."""
    if isinstance(out, torch.Tensor):
        if out.dim() != 0:
            raise DataError(f"step_fn returned {_described(out)}: return the loss as a scalar tensor (e.g. "
                            f"loss.mean()), or a dict of named scalar losses, e.g. {_EXAMPLE}")
        return {"loss": out}
    if not isinstance(out, Mapping):
        raise DataError(f"step_fn returned {_described(out)}: return the loss (a scalar tensor) or a dict of named "
                        f"scalar losses, e.g. {_EXAMPLE}")
    if not out:
        raise DataError(f"step_fn returned an empty dict: return the loss (a scalar tensor) or a dict of at least "
                        f"one named scalar loss, e.g. {_EXAMPLE}")
    keys = tuple(out)
    if keys not in named:
        _check_names(keys)
        named.add(keys)
    for name, value in out.items():
        if not isinstance(value, torch.Tensor) or value.dim() != 0:
            raise DataError(f"step_fn returned {{{name!r}: {_described(value)}}}: each loss must be a scalar tensor "
                            f"(e.g. {name} = {name}.mean())")
    return dict(out)


def _check_names(keys: tuple[Any, ...]) -> None:
    """Each returned loss named by a non-empty string that no value of the run's records holds."""
    unnamed = [k for k in keys if not isinstance(k, str)]
    if unnamed:
        raise DataError(f"step_fn returned a dict with the key(s) {unnamed[:3]!r}: name each loss with a string, "
                        f"e.g. {_EXAMPLE}")
    for name in keys:
        if not name.strip():
            raise DataError(f"step_fn returned a loss named {name!r}: name each loss (it is logged under its name), "
                            f"e.g. {_EXAMPLE}")
        if name == "loss" and len(keys) > 1:
            raise DataError(f"step_fn returned 'loss' beside {', '.join(repr(k) for k in keys if k != 'loss')}: the "
                            "run's loss is the sum of the losses returned, so name each loss for what it is "
                            f"(e.g. {_EXAMPLE}) or return the one loss alone")
        taken = ("a learning rate" if name == "lr" or name.startswith("lr_") else "an evaluation" if name.startswith("eval_")
                 else "the loop's" if name in RECORD_KEYS and name != "loss" else
                 f"the count of steps that returned {name[:-6]!r}" if name.endswith("_steps") and name[:-6] in keys
                 else None)
        if taken is not None:
            raise DataError(f"step_fn returned a loss named {name!r}, a name the run's records give to a value of "
                            f"their own ({taken}): name it otherwise, e.g. {{'d_loss': d_loss}}")


def refuse_unsupported(config: Any) -> None:
    """What a step of your own cannot do yet, refused in one line each: on_nan="skip", compile. Called
    where the run is resolved (runs/resolve.py, so a sweep's sampled value too) and where it is built."""
    if config.on_nan == "skip":
        raise ConfigError("on_nan='skip' decides per optimizer step on the device, which a step of your own does "
                          "not support yet: use on_nan='stop' (the default), which checks at log points")
    if config.compile:
        raise ConfigError(f"compile={config.compile!r} compiles the model gputrain calls, but your step_fn calls it: "
                          "compile the parts inside your step instead (torch.compile(model.generator)) and leave "
                          "compile off")


def own_optimizers(spec: Any, scheduler_spec: Any, module: nn.Module, config: Any, device: torch.device,
                   capturable: bool, built_in: tuple[Callable[[torch.optim.Optimizer], Any], str]
                   ) -> tuple[OptimizerSet, SchedulerSet, str, str]:
    """The optimizers and schedulers of a run with a step of your own, and their descriptions.

    spec: {name: optimizer or callable model -> optimizer}, or what `fit` takes for one optimizer
    (named "optimizer"); scheduler_spec: {name: callable optimizer -> scheduler} (the others get the
    built-in schedule `built_in`), or one callable for the one optimizer. Refuses what a step of your
    own cannot do yet, in one line each."""
    from gputrain.train.optim.build import make_optimizer

    refuse_unsupported(config)
    if isinstance(spec, (Mapping, NamedOptimizers)):  # a workload's: made from the model, the run's settings set
        optimizers = spec.build(module) if isinstance(spec, NamedOptimizers) else OptimizerSet.build(spec, module)
        described = f"{optimizers.describe()} (yours, stepped by step_fn)"
    else:  # one optimizer, named "optimizer": as make_optimizer describes it ("Adam (given)", the default AdamW)
        one, made = make_optimizer(spec, module.parameters(), lr=config.lr, weight_decay=config.weight_decay,
                                   device=device, fused=config.fused_optimizer, capturable=capturable)
        optimizers = OptimizerSet({"optimizer": one})
        described = f"{made}, stepped by step_fn"
    if scheduler_spec is not None and not isinstance(scheduler_spec, Mapping):
        if len(optimizers) != 1:
            raise ConfigError(f"scheduler= names no optimizer, but this run has {sorted(optimizers.optimizers)}: "
                              "give {name: callable optimizer -> scheduler}")
        scheduler_spec = {next(iter(optimizers.optimizers)): scheduler_spec}
    schedulers = SchedulerSet.build(scheduler_spec, optimizers, built_in[0])
    given = sorted(scheduler_spec or {})
    return (optimizers, schedulers, described,
            ", ".join(f"{n}: {'given' if n in given else built_in[1]}" for n in optimizers.optimizers))
