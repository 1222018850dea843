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

The body is `OwnStep.run`, a `TrainStep`: OOM recovery, the device-side sums, the EMA update and
the CUDA-graph wrapper treat it like the built-in step. A graph captures it only when asked
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

import contextlib
from typing import Any, Callable, Mapping, Sequence, cast

import torch
from torch import nn

from gputrain import batch as batches
from gputrain.errors import ConfigError, DataError
from gputrain.runtime import distributed, torch_compat
from gputrain.runtime.precision import RunPrecision
from gputrain.train.step.carried_state import CarriedState
from gputrain.train.step.loss import LossRule
from gputrain.train.optim.calls import optimizer_stepper
from gputrain.train.optim.by_name import NamedOptimizers, OptimizerSet, SchedulerSet
from gputrain.train.step.train_step import TrainStep


class StepContext:
    """What your step_fn gets (see the module docstring)."""

    def __init__(self, owner: "OwnStep", model: nn.Module, state: CarriedState):
        self._owner = owner
        self.model = model  # the plain module (not DDP-wrapped): call its parts as you named them
        self.optimizers: dict[str, torch.optim.Optimizer] = owner.optimizer.optimizers
        self.schedulers: dict[str, Any] = owner.schedulers.schedulers if owner.schedulers is not None else {}
        # What the step carries to the next one, by name (train/step/carried_state.py): in the checkpoints.
        self.state = state
        self.is_last = True  # the step's last micro-batch: step() acts only then
        self.micro_index = 0  # this micro-batch's place in the step: 0 .. pieces - 1
        self.weight: float = 1.0  # this micro-batch's share of the step's samples
        self.backwards = 0
        self.steps = 0
        self.index_read = False  # step_fn read step.index: a CUDA graph would freeze its branch
        self.stepped: set[str] = set()  # the optimizers step() was called for in this call of step_fn

    @property
    def index(self) -> int:
        """The run's optimizer steps done before this one: 0 at the first step, and after a resume
        the step the run stopped after. A Python int (the run's own count): branching on it reads
        nothing on the host. A step that reads it is not captured by a CUDA graph."""
        self.index_read = True
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
            raise TypeError(f"step.backward(loss) takes the loss tensor your step_fn computed (a scalar), got "
                            f"{type(loss).__name__}: e.g. loss = loss_fn(step.model(x), y); step.backward(loss)")
        self.backwards += 1
        owner = self._owner
        scaled = loss if self.weight == 1.0 else loss * self.weight
        scaled = owner.precision.scale(scaled)
        with owner._no_autocast():
            scaled.backward(retain_graph=retain_graph, create_graph=create_graph)

    def step(self, name: str | None = None) -> None:
        """On the last micro-batch: sync, unscale, clip, step the optimizer and its scheduler, clear its
        gradients. Before it: nothing (the gradients accumulate)."""
        name = self._name(name)
        if name in self.stepped:  # a second update from the same gradients: surely not what was meant
            raise ConfigError(f"step.step({name!r}) was called twice in one call of step_fn: each optimizer steps "
                              "once per step; call step.backward for each of its losses first, then step.step once")
        self.stepped.add(name)
        self.steps += 1
        if self.is_last:
            self._owner.step_optimizer(name)

    def zero_grad(self, name: str | None = None) -> None:
        """Clear the gradients of that optimizer's parameters (None: of every optimizer's, with one optimizer)."""
        for p in self._owner.params_of[self._name(name)]:
            p.grad = None


class OwnStep(TrainStep):
    """The training step made of your step_fn (see the module docstring); the rest as TrainStep."""

    def __init__(self, step_fn: Callable[[StepContext, Any], Any], model: nn.Module, module: nn.Module,
                 optimizers: OptimizerSet, schedulers: SchedulerSet | None, precision: RunPrecision, *,
                 device: torch.device, max_grad_norm: float | None = None,
                 dist: distributed.DistInfo | None = None, oom_recovery: bool = True,
                 after_step: Sequence[Callable[[], None]] = (), loss_list: bool | None = None,
                 index: Callable[[], int] | None = None, state: CarriedState | None = None):
        super().__init__(model, LossRule(), cast(torch.optim.Optimizer, optimizers), precision, device=device, max_grad_norm=max_grad_norm,
                         dist=dist, oom_recovery=oom_recovery, params=list(module.parameters()),
                         after_step=after_step, loss_list=loss_list)
        self.step_fn = step_fn
        self.optimizer: OptimizerSet = optimizers
        self.schedulers = schedulers
        self.params_of = {name: [p for g in opt.param_groups for p in g["params"]]
                          for name, opt in optimizers.optimizers.items()}
        self._stepper = {name: optimizer_stepper(opt) for name, opt in optimizers.optimizers.items()}
        # The run's step count (the trainer's RunState: right after a resume too); by default the steps run here.
        self.steps_run = 0
        self.index: Callable[[], int] = index if index is not None else (lambda: self.steps_run)
        self.context = StepContext(self, module, state if state is not None else CarriedState(None, device))
        # FSDP2 (shard=True): the model's own hooks reduce-scatter the gradients in backward.
        self.sharded = any(callable(getattr(p, "to_local", None)) for p in self.params)
        # The named losses since the last read and the steps that returned each, device scalars made at
        # the first step that returns the name (an eager one: a captured graph keeps their addresses).
        self.named: dict[str, torch.Tensor] = {}
        self.counts: dict[str, torch.Tensor] = {}
        self.names: tuple[str, ...] = ()
        self._one = torch.ones((), device=device, dtype=torch.float32)
        self.varied = False  # some step returned other names than another (a Python branch: not captured)
        self.named_totals: dict[str, float] = {}  # read by the last read_totals, not yet in the run state
        self.named_steps: dict[str, float] = {}  # the steps that returned each, read with named_totals

    def _no_autocast(self):
        if self._autocast is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, enabled=False)

    def step_optimizer(self, name: str) -> None:
        opt, params = self.optimizer.optimizers[name], self.params_of[name]
        grads = [p.grad for p in params if p.grad is not None]
        if self.dist is not None and self.dist.world_size > 1 and grads and not self.sharded:
            # DDP's average, for the parameters this optimizer updates: one flat all-reduce.
            flat = torch.cat([g.reshape(-1) for g in grads])
            distributed.all_reduce_sum(flat, self.dist).div_(self.dist.world_size)
            offset = 0
            for g in grads:
                g.copy_(flat[offset:offset + g.numel()].view_as(g))
                offset += g.numel()
        if grads:
            self.clip(opt, params)
        # The scale's update waits until every optimizer of this step has stepped (run's end).
        self.step_optimizer_(opt, self._stepper[name], update=False)
        if self.schedulers is not None:
            self.schedulers.step_for(name)
        for p in params:
            p.grad = None

    def run(self, micro_batches: Sequence[Any]) -> None:
        pieces = micro_batches if self.splits == 1 else [p for mb in micro_batches for p in batches.split(mb, self.splits)]
        counts = [batches.batch_size(p) for p in pieces] if len(pieces) > 1 else [1]
        total = sum(counts)
        ctx, last = self.context, len(pieces) - 1
        ctx.backwards = ctx.steps = 0
        step_losses: dict[str, torch.Tensor] = {}
        for i, piece in enumerate(pieces):
            ctx.weight, ctx.is_last, ctx.micro_index = counts[i] / total, i == last, i
            ctx.stepped = set()
            with distributed.no_sync(self.model, sync=ctx.is_last or not self.sharded):
                if self._autocast is None:
                    out = self.step_fn(ctx, piece)
                else:
                    with self._autocast():
                        out = self.step_fn(ctx, piece)
            for key, value in self._losses(out).items():
                term = value.detach().float() * ctx.weight if ctx.weight != 1.0 else value.detach().float()
                step_losses[key] = term if key not in step_losses else step_losses[key] + term
        if not ctx.backwards:
            raise ConfigError("step_fn returned without calling step.backward(loss): nothing would train. "
                              "Call step.backward(loss), then step.step(name) for the optimizer it updates")
        if not ctx.steps:
            raise ConfigError(f"step_fn never called step.step(name): no optimizer of {sorted(ctx.optimizers)} "
                              "would update. Call step.step(name) after step.backward(loss)")
        self.precision.update()
        for p in self.params:  # every gradient, also those no optimizer took (a frozen teacher's)
            p.grad = None
        for update in self.after_step:
            update()
        self._keep_named(step_losses)
        self.steps_run += 1
        self.clock.mark("optimizer")

    def _losses(self, out: Any) -> dict[str, torch.Tensor]:
        if isinstance(out, torch.Tensor):
            out = {"loss": out}
        if not isinstance(out, Mapping) or not out or not all(
                isinstance(v, torch.Tensor) and v.dim() == 0 for v in out.values()):
            raise DataError(f"step_fn returned {type(out).__name__}: return the loss (a scalar tensor) or a dict "
                            "of named scalar losses, e.g. {'d_loss': d_loss, 'g_loss': g_loss}")
        unnamed = [k for k in out if not isinstance(k, str)]
        if unnamed:
            raise DataError(f"step_fn returned a dict with the key(s) {unnamed[:3]!r}: name each loss with a string, "
                            "e.g. {'d_loss': d_loss, 'g_loss': g_loss}")
        return dict(out)

    def _keep_named(self, losses: dict[str, torch.Tensor]) -> None:
        """Each returned loss into its device sum and its step count (one foreach add for all), the
        step's total into the loss sum. A name may be returned on some steps only (a generator's
        loss one step in five): its mean is then over the steps that returned it."""
        earlier = bool(self.names)
        for key in losses:
            if key not in self.named:
                self.varied = self.varied or earlier  # a name that earlier steps did not return
                self.names += (key,)
                self.named[key] = torch.zeros((), device=self.device, dtype=torch.float32)
                self.counts[key] = torch.zeros((), device=self.device, dtype=torch.float32)
        if len(losses) != len(self.names):
            self.varied = True
        present = list(losses)
        torch_compat.foreach_add_([self.named[k] for k in present] + [self.counts[k] for k in present],
                                  list(losses.values()) + [self._one] * len(present))
        values = list(losses.values())
        self.keep_loss(values[0] if len(values) == 1 else torch.stack(values).sum())

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
        if self.varied:
            return (f"your step_fn ({name}) returns some losses on some steps only ({', '.join(self.names)}), a "
                    "Python branch that a captured step would take as it did at capture")
        return None

    def take_totals(self) -> torch.Tensor:
        """TrainStep's three totals, then each named loss's sum and then the steps that returned it,
        since the last read; resets them."""
        totals = super().take_totals()
        if not self.named:
            return totals
        named = torch.stack([self.named[k] for k in self.names] + [self.counts[k] for k in self.names])
        for v in (*self.named.values(), *self.counts.values()):
            v.zero_()
        return torch.cat([totals, named])

    def read_totals(self) -> tuple[float, int]:
        totals = distributed.all_reduce_mean(self.take_totals(), self.dist) if self.dist is not None \
            else self.take_totals()
        values = totals.tolist()  # the log point's one host read
        n = len(self.names)
        self.named_totals = dict(zip(self.names, values[3:3 + n]))
        self.named_steps = dict(zip(self.names, values[3 + n:]))
        return self._judge(values[0], values[1], values[2])

    def fold_read(self, state: Any) -> None:
        """The named losses of the last read, and the steps that returned each, into the run
        state's sums since the last log point."""
        for key, value in self.named_totals.items():
            state.named_since_log[key] = state.named_since_log.get(key, 0.0) + value
            state.named_steps_since_log[key] = state.named_steps_since_log.get(key, 0.0) + self.named_steps[key]
        self.named_totals, self.named_steps = {}, {}

    def log_values(self, state: Any, steps: int) -> dict[str, float]:
        """What a log point adds: each named loss's mean over the steps since the last log point
        that returned it (unless the one loss is "loss" itself), `<name>_steps` (how many did) for a
        name that not every step returned, each optimizer's learning rate; resets the sums."""
        out: dict[str, float] = {}
        named, state.named_since_log = state.named_since_log, {}
        counted, state.named_steps_since_log = state.named_steps_since_log, {}
        if not (len(named) == 1 and "loss" in named):
            for key, total in named.items():
                returned = int(round(counted.get(key, steps)))
                if returned:
                    out[key] = total / returned
                if returned != steps:
                    out[f"{key}_steps"] = returned
        if self.schedulers is not None and len(self.schedulers.schedulers) > 1:
            out.update({f"lr_{k}": v for k, v in self.schedulers.last_lrs().items()})
        return out


def own_optimizers(spec: Any, scheduler_spec: Any, module: nn.Module, config: Any, device: torch.device,
                   capturable: bool, built_in: tuple[Callable[[torch.optim.Optimizer], Any], str]
                   ) -> tuple[torch.optim.Optimizer, SchedulerSet, str, str]:
    """The optimizers and schedulers of a run with a step of your own, and their descriptions.

    spec: {name: optimizer or callable model -> optimizer}, or what `fit` takes for one optimizer
    (named "optimizer"); scheduler_spec: {name: callable optimizer -> scheduler} (the others get the
    built-in schedule `built_in`), or one callable for the one optimizer. Refuses what a step of your
    own cannot do yet, in one line each."""
    from gputrain.train.optim.build import make_optimizer

    if config.on_nan == "skip":
        raise ConfigError("on_nan='skip' decides per optimizer step on the device, which a step of your own does "
                          "not support yet: use on_nan='stop' (the default), which checks at log points")
    if config.compile:
        raise ConfigError("compile=True compiles the model gputrain calls, but your step_fn calls it: compile the "
                          "parts inside your step instead (torch.compile(model.generator)) and leave compile off")
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
    # The set stands where the trainer keeps its optimizer, and acts as one there (typed as one).
    return (cast(torch.optim.Optimizer, optimizers), schedulers, described,
            ", ".join(f"{n}: {'given' if n in given else built_in[1]}" for n in optimizers.optimizers))
