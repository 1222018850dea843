"""The training step, written once: `TrainStep` runs one optimizer step on its micro-batches.

In order (the step contract of the design notes):
1. for each micro-batch: forward under the run's precision, the loss (`LossRule`), backward of
   `loss * weight`, where weight is the micro-batch's share of the step's samples (or of its items,
   with `num_items`), so that the step's gradient is the mean over all of its samples however the
   micro-batches are cut; gradient sync (DDP/FSDP) only on the last micro-batch;
2. clip (after unscaling, fp16), optimizer step through the scaler, scaler update, zero_grad, then
   the device-only updates it was given (`after_step`: an EMA of the weights, say);
3. the detached loss, weighted the same way, is kept on the device: an eager CUDA step appends it
   to a list (no kernel; the list is summed every FOLD_EVERY steps and where it is read), a
   captured step and any step elsewhere add it to an accumulator in place (one small op; the graph
   keeps the accumulator's address). Nothing is read on the host: the trainer reads the sum at log
   points and before checkpoints (`take_totals`).

Non-finite steps cost nothing per step with on_nan="stop": a non-finite loss leaves the loss sum
non-finite, and a non-finite gradient leaves non-finite parameters or optimizer state once the
optimizer has stepped (clipping by a NaN/inf norm included), so one probe of the parameters, their
gradients and the optimizer's state where the loss sum is read (`take_totals`) finds either; the
stop names the interval between two reads. on_nan="skip" must decide every step, on the device:
a flag per step (from the clipping norm when there is one, else one GradScaler-style check of the
gradients and the loss) that a fused optimizer reads to skip the update, counted in a second
accumulator.

`run(micro_batches)` is that body and nothing else: the CUDA-graph wrapper (train/step/graphs.py)
captures exactly it, so eager and graphed steps cannot drift apart. Its phases are marked on
`self.clock`: a no-op (`NO_CLOCK`) unless `gputrain profile` lends a timing one, so the body has
no branch for it. `__call__` adds what cannot be captured: OOM recovery, which splits every
micro-batch in two (every leaf carrying the batch dimension) and retries the same step with the
same effective batch.
"""

from __future__ import annotations

import logging
import math
from typing import Any, Callable, Sequence, cast

import torch
from torch import nn

from gputrain import batch as batches
from gputrain.errors import ConfigError, GputrainError
from gputrain.runtime import distributed, torch_compat
from gputrain.runtime.oom import free_after_oom, is_oom
from gputrain.runtime.precision import RunPrecision
from gputrain.runtime.timing import NO_CLOCK, PhaseClock
from gputrain.train.step.loss import LossRule
from gputrain.train.optim.calls import grad_clearer, optimizer_stepper

log = logging.getLogger("gputrain")

FOLD_EVERY = 256  # eager steps' losses kept before they are summed into the accumulator (bounded memory)


def skips_nonfinite(on_nan: str, use_scaler: bool, optimizer, optimizer_desc: str) -> bool:
    """Whether the step skips non-finite steps (on_nan="skip"). Without a loss scaler that is decided
    on the device, which needs a fused optimizer (it reads a found_inf flag in its kernel): refused
    with a ConfigError for one that is not."""
    skip = on_nan == "skip"
    if skip and not use_scaler and not all(g.get("fused", False) for g in optimizer.param_groups):
        raise ConfigError(
            f"on_nan='skip' decides on the device whether a step is applied, which needs a fused optimizer "
            f"(it reads a found_inf flag in its kernel); {optimizer_desc} is not fused: use the default "
            "optimizer (fused AdamW), create yours with fused=True, or use on_nan='stop'")
    return skip


class TrainStep:
    """One optimizer step over a list of micro-batches (see the module docstring).

    model: the module to call (possibly DDP/FSDP-wrapped or compiled); params: what to clip.
    num_items: optional `batch -> count` (a tensor or int): the loss is averaged over those items
        (non-padding tokens, say) instead of samples; the model's loss must then be a mean over the
        micro-batch's items.
    world_size: processes whose gradients DDP averages; with num_items the global item count is
        summed across them on the device.
    loss_list: keep eager steps' losses in a list (True) or add each to the sum in place (False);
        None: `keeps_losses_in_a_list(device)`.
    """

    def __init__(self, model: nn.Module, loss: LossRule, optimizer: torch.optim.Optimizer,
                 precision: RunPrecision, *, device: torch.device, max_grad_norm: float | None = None,
                 num_items: Callable[[Any], Any] | None = None, dist: distributed.DistInfo | None = None,
                 oom_recovery: bool = True, params: Sequence[nn.Parameter] | None = None,
                 skip_nonfinite: bool = False, after_step: Sequence[Callable[[], None]] = (),
                 loss_list: bool | None = None):
        self.model = model
        self.loss = loss
        self.optimizer = optimizer
        self.precision = precision
        self.device = device
        self.max_grad_norm = max_grad_norm
        self.num_items = num_items
        self.dist = dist
        self.oom_recovery = oom_recovery
        self.params = list(params if params is not None else model.parameters())
        # Device-only updates run after the optimizer step, e.g. an EMA of the weights (a foreach lerp):
        # part of the body, so a CUDA graph captures them with it. They must not read values on the host.
        self.after_step = tuple(after_step)
        # on_nan="skip": every step's flag, counted on the device (on_nan="stop" needs none: see the
        # module docstring). Without a scaler a step whose loss or gradient is not finite leaves
        # parameters and optimizer state as they were, decided on the device (fused optimizers read
        # `found_inf` in their kernel, as GradScaler uses it), so it works inside a captured graph too.
        self.count_nonfinite = skip_nonfinite
        self.skip_nonfinite = skip_nonfinite and not precision.precision.use_scaler  # fp16: the scaler skips
        # Device accumulators whose storage never changes (a captured graph writes to their address).
        self.loss_sum = torch.zeros((), device=device, dtype=torch.float32)  # sum of step losses since read
        # Eager CUDA steps' detached losses not yet in loss_sum: `keep_loss` appends them (a list
        # append launches no kernel, an add_ one per step; `__call__` folds them every FOLD_EVERY
        # steps); under CUDA graphs it is loss_sum.add_ (`sum_in_place`). Elsewhere (loss_list None
        # decides by the device) the loss is added in place every step: CUDA's caching allocator
        # keeps small tensors apart from large ones, but on the CPU each kept 4-byte tensor lands
        # between the step's activations on glibc's heap, which then grew by ~2 MB a step (500 MB
        # by the fold, a 2 MB-activation model here) and took page faults to refill.
        self.pending: list[torch.Tensor] = []
        listed = keeps_losses_in_a_list(device) if loss_list is None else loss_list
        self.keep_loss: Callable[[torch.Tensor], Any] = self.pending.append if listed else self.loss_sum.add_
        self.nonfinite = torch.zeros((), device=device, dtype=torch.float32)  # steps with a non-finite loss/grad
        self.splits = 1  # each micro-batch is cut into this many pieces after OOM recovery (1 = none)
        self.clock: PhaseClock = NO_CLOCK  # marks forward, backward, optimizer (profile's breakdown)
        # Decided once, not per step: autocast (None: fp32/tf32, no context to enter) and the foreach
        # kernels of the norms (CUDA; None: torch's choice).
        self._autocast = precision.autocast if precision.precision.autocast_dtype is not None else None
        self._scaled = precision.precision.use_scaler  # fp16: backward and step go through the GradScaler
        self._foreach = device.type == "cuda" or None
        # optimizer.step() and zero_grad without torch's per-call profiler range (train/optim/calls.py)
        self._step_optimizer = optimizer_stepper(optimizer)
        self._zero_grad = grad_clearer(optimizer)
        if self.skip_nonfinite:
            self._skip_on_device()

    def follow_precision(self) -> None:
        """Take the run's precision again after it changed (train/step/precision_gate.py: fp32 instead of an
        automatic autocast the first step refused): autocast, the scaler, on_nan="skip" without one."""
        p = self.precision.precision
        self._autocast = self.precision.autocast if p.autocast_dtype is not None else None
        self._scaled = p.use_scaler
        if self.count_nonfinite and not self.skip_nonfinite and not p.use_scaler:
            self.skip_nonfinite = True  # the scaler skipped non-finite steps: now the device check does
            self._skip_on_device()

    def _skip_on_device(self) -> None:
        """on_nan="skip" decided on the device: the flag a fused optimizer reads (needs one)."""
        optimizer, device = self.optimizer, self.device
        # The flag the fused optimizer reads, in a buffer of its own (a captured graph keeps its
        # address); checked like GradScaler's (one kernel over the gradients) unless the
        # gradients are sharded DTensors or on another device, where a norm is reduced instead.
        self._found_inf = torch.zeros((), device=device, dtype=torch.float32)
        self._one = torch.ones((), device=device, dtype=torch.float32)
        self._grad_check = all(p.device == device and not callable(getattr(p, "to_local", None))
                               for p in self.params)
        # Attributes Optimizer does not declare: torch's fused kernels read them with getattr, as
        # GradScaler sets them.
        setattr(optimizer, "grad_scale", None)
        setattr(optimizer, "found_inf", self._found_inf)

    # ------------------------------------------------------------ the body (captured as is)

    def _weights(self, pieces: Sequence[Any]) -> list[Any]:
        """Each piece's share of the step: samples (host ints, no sync) or items (device tensors)."""
        if self.num_items is None:
            if len(pieces) == 1:
                return [1.0]  # the whole step: no batch size to read
            counts = [batches.batch_size(p) for p in pieces]
            total = sum(counts)
            return [c / total for c in counts]
        counts = [torch.as_tensor(self.num_items(p), device=self.device, dtype=torch.float32) for p in pieces]
        total = torch.stack(counts).sum()
        if self.dist is not None and self.dist.world_size > 1:
            # DDP averages gradients over ranks; scale so the result is the mean over all ranks' items.
            total = distributed.all_reduce_sum(total, self.dist) / self.dist.world_size
        return [c / total.clamp_min(1.0) for c in counts]

    def run(self, micro_batches: Sequence[Any]) -> None:
        """Forward, backward, clip, optimizer step, zero_grad; losses into the device accumulators."""
        if self.splits == 1 and len(micro_batches) == 1 and self.num_items is None:
            # The whole step in one piece (the common case): weight 1, no gradient-sync context, the
            # loss in its own dtype (the accumulator's add promotes it to fp32).
            step_loss = self._forward_backward(micro_batches[0], 1.0)
        else:
            step_loss = self._pieces(micro_batches)
        norm = self.clip(self.optimizer, self.params)
        if self.count_nonfinite:
            step_loss = self._flag_nonfinite(step_loss, norm)
        self.step_optimizer_(self.optimizer, self._step_optimizer)
        self._zero_grad()
        for update in self.after_step:
            update()
        self.keep_loss(step_loss)
        self.clock.mark("optimizer")

    # The optimizer's part of a step, written once: the built-in step calls these for its one optimizer,
    # your own step (train/step/own_step.py) for each optimizer that step.step(name) names.

    def clip(self, optimizer: torch.optim.Optimizer, params: Sequence[torch.Tensor]) -> torch.Tensor | None:
        """Unscale `optimizer`'s gradients (fp16) and clip `params`' to max_grad_norm: their total norm
        before clipping (a device scalar), or None without max_grad_norm."""
        if self.max_grad_norm is None:
            return None
        self.precision.unscale_(optimizer)
        return nn.utils.clip_grad_norm_(params, self.max_grad_norm, foreach=self._foreach)

    def step_optimizer_(self, optimizer: torch.optim.Optimizer, stepper: Callable[[], None],
                        update: bool = True) -> None:
        """`optimizer`'s step: through the scaler in fp16 (it skips a step whose gradients hold an inf or
        NaN; `update=False` leaves the scale's update to the caller), else `stepper`, its step() without
        the profiler's per-call range (train/optim/calls.py)."""
        if self._scaled:
            self.precision.step(optimizer, update=update)
        else:
            stepper()

    def _pieces(self, micro_batches: Sequence[Any]) -> torch.Tensor:
        """Forward and backward of every piece (micro-batches, each cut in `splits` after an OOM),
        weighted by its share; gradients sync on the last piece only. Returns the step's fp32 loss."""
        pieces = micro_batches if self.splits == 1 else [p for mb in micro_batches for p in batches.split(mb, self.splits)]
        if not pieces:
            raise GputrainError("a training step needs at least one micro-batch; got none")
        weights = self._weights(pieces)
        last = len(pieces) - 1
        step_loss = None
        for i, piece in enumerate(pieces):
            if i == last:  # the last piece syncs gradients (DDP/FSDP): no context to enter
                term = self._forward_backward(piece, weights[i])
            else:
                with distributed.no_sync(self.model, sync=False):
                    term = self._forward_backward(piece, weights[i])
            term = term if term.dtype == torch.float32 else term.float()
            step_loss = term if step_loss is None else step_loss + term
        assert step_loss is not None  # at least one piece
        return step_loss

    def sum_in_place(self) -> None:
        """Add every step's loss to loss_sum in place: what a captured step must do (its replays write
        to that address); train/step/graphs.py calls it for all of a graphed run's steps, eager ones too."""
        self._fold()
        self.keep_loss = self.loss_sum.add_

    def _fold(self) -> None:
        """The kept losses into loss_sum: one stack and one sum (fp32)."""
        if self.pending:
            # stack promotes mixed dtypes (a bf16 loss beside fp32 ones); the sum is taken in fp32
            self.loss_sum.add_(torch.stack(self.pending).sum(dtype=torch.float32))
            self.pending.clear()

    def _forward_backward(self, piece: Any, weight: Any) -> torch.Tensor:
        """One piece's forward (under autocast where the precision has one), loss and backward of
        `loss * weight`; returns the detached loss times the weight (in the loss's dtype)."""
        if self._autocast is None:
            loss, _ = self.loss(self.model, piece)
        else:
            with self._autocast():
                loss, _ = self.loss(self.model, piece)
        self.clock.mark("forward")
        # A whole step in one piece has weight 1.0 (a host float): no multiply kernel.
        whole = weight.__class__ is float and weight == 1.0
        if self._scaled:
            self.precision.backward(loss if whole else loss * weight)
        else:
            (loss if whole else loss * weight).backward()
        self.clock.mark("backward")
        term = loss.detach()
        return term if whole else term * weight

    def _flag_nonfinite(self, step_loss: torch.Tensor, norm: torch.Tensor | None) -> torch.Tensor:
        """on_nan="skip": flag this step when its loss or a gradient is not finite, on the device,
        and count it; without a scaler the fused optimizer skips the flagged step and its loss stays
        out of the sum. Returns the loss to add to the sum."""
        if not self.skip_nonfinite or norm is not None or not self._grad_check:
            if norm is None and not self.precision.precision.use_scaler:
                grads = [p.grad for p in self.params if p.grad is not None]
                norm = nn.utils.get_total_norm(grads, foreach=self._foreach) if grads else None
            # Non-finite loss or norm in three small kernels (isfinite alone is four: ==, abs, !=,
            # *): the sum is finite when both are (norm >= 0; a sum past fp32's max, ~3e38, counts
            # as non-finite), and x - x is NaN exactly when x is inf or NaN.
            probe = step_loss if norm is None else step_loss + _local(norm)
            bad = (probe - probe).ne(0)  # bool, shape ()
            if self.skip_nonfinite:
                self._found_inf.copy_(bad)
        else:
            # GradScaler's check with a scale of 1: one kernel sets the flag when any gradient (or
            # the loss) holds an inf or NaN; exact, no norm to overflow. Grouped by dtype, so that
            # every group takes the multi-tensor kernel.
            found = self._found_inf.zero_()
            groups: dict[torch.dtype, list[torch.Tensor]] = {step_loss.dtype: [step_loss]}
            for p in self.params:
                if p.grad is not None:
                    groups.setdefault(p.grad.dtype, []).append(p.grad)
            for tensors in groups.values():
                torch_compat.non_finite_check_and_unscale_(tensors, found, self._one)
            bad = found.ne(0)
        self.nonfinite.add_(bad)  # float += bool: 1.0 per non-finite step
        return step_loss.masked_fill(bad, 0.0) if self.skip_nonfinite else step_loss  # keep the mean finite

    # ------------------------------------------------------------ eager entry: OOM recovery

    def __call__(self, micro_batches: Sequence[Any]) -> None:
        while True:
            try:
                self.run(micro_batches)
                if len(self.pending) >= FOLD_EVERY:  # bounded, however long the interval between reads
                    self._fold()
                return
            except Exception as exc:  # only OOM is handled; everything else propagates
                if not (self.oom_recovery and is_oom(exc)):
                    raise
                del exc
                self._halve(micro_batches)

    def _halve(self, micro_batches: Sequence[Any]) -> None:
        smallest = min(batches.batch_size(b) for b in micro_batches)
        if self.splits * 2 > smallest:
            raise GputrainError(
                f"out of memory on {self.device} even with micro-batches of {math.ceil(smallest / self.splits)} "
                "sample(s): use a smaller model, bf16, recompute (--recompute), or a device "
                "with more memory") from None
        self.optimizer.zero_grad(set_to_none=True)
        free_after_oom(self.device)
        self.splits *= 2
        log.warning("out of memory: each micro-batch is now cut in %d (%d samples or fewer each), same effective "
                    "batch; retrying the same step", self.splits, math.ceil(smallest / self.splits))

    def count_flops(self, batch: Any) -> int:
        """FLOPs of one forward + backward of `batch` (FlopCounterMode), for profile's MFU. No
        optimizer step, and the gradients are cleared after: the weights are left unchanged."""
        from torch.utils.flop_counter import FlopCounterMode

        counter = FlopCounterMode(display=False)
        with counter:
            with self.precision.autocast():
                loss, _ = self.loss(self.model, batch)
            loss.backward()
        self.optimizer.zero_grad(set_to_none=True)
        return int(counter.get_total_flops())

    # ------------------------------------------------------------ reading the accumulators

    def take_totals(self) -> torch.Tensor:
        """[loss sum, non-finite steps, state probe] since the last call, one device tensor (one
        host read for the trainer); resets the sums.

        The non-finite steps are counted with on_nan="skip" only. The state probe (on_nan="stop";
        0 with "skip") is finite when the parameters, their gradients and the optimizer's state
        are: where it is not, `state_is_finite` settles whether a value is, or only the probe's
        norm overflowed.
        """
        self._fold()
        probe = self._state_probe() if not self.count_nonfinite else torch.zeros_like(self.loss_sum)
        totals = torch.stack([self.loss_sum, self.nonfinite, probe])  # a copy: the accumulators keep their storage
        self.loss_sum.zero_()
        self.nonfinite.zero_()
        return totals

    def _state(self) -> list[torch.Tensor]:
        """The tensors a non-finite gradient would spoil: parameters, gradients still held (a
        parameter outside the optimizer keeps its own), the optimizer's state; floating-point ones
        only (no lazy parameter not yet materialized), sharded (DTensor) ones as this rank's shard."""
        out: list[torch.Tensor] = []
        for p in self.params:
            out.append(p)
            if p.grad is not None:
                out.append(p.grad)
        for state in self.optimizer.state.values():
            out.extend(v for v in state.values() if isinstance(v, torch.Tensor))
        return [_shard(t) for t in out if (t.is_floating_point() or t.is_complex())
                and not nn.parameter.is_lazy(t)]

    @torch.no_grad()
    def _state_probe(self) -> torch.Tensor:
        """One device scalar: the sum of the 2-norms of the run's state (`_state`), finite exactly
        when every value is, except that finite values past ~1e19 overflow it (fp32)."""
        groups: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
        for t in self._state():
            groups.setdefault((t.device, t.dtype), []).append(t)
        # One foreach norm per (device, dtype) (on the CPU too), summed: a few ops per log point.
        sums = [torch.stack(torch_compat.foreach_norm(g)).sum()
                .to(device=self.device, dtype=torch.float32) for g in groups.values()]
        if not sums:
            return torch.zeros((), device=self.device, dtype=torch.float32)
        return sums[0] if len(sums) == 1 else torch.stack(sums).sum()

    def read_totals(self) -> tuple[float, int]:
        """The loss summed since the last read (all ranks' mean) and the non-finite steps: one host
        sync (collective with several processes); resets the sums.

        on_nan="skip" counts the non-finite steps on the device. on_nan="stop" counts nothing per
        step: a non-finite loss shows in the loss sum, a non-finite gradient in the state probe read
        with it; either gives 1, for "one or more steps since the last read".
        """
        totals = distributed.all_reduce_mean(self.take_totals(), self.dist) if self.dist is not None \
            else self.take_totals()
        loss_total, bad, probe = totals.tolist()
        return self._judge(loss_total, bad, probe)

    def _judge(self, loss_total: float, bad: float, probe: float) -> tuple[float, int]:
        """(loss sum, non-finite steps) from the totals read (see read_totals)."""
        if self.count_nonfinite:
            return loss_total, int(round(bad))
        if math.isfinite(loss_total) and (math.isfinite(probe) or self._all_ranks_finite()):
            return loss_total, 0
        return loss_total, 1

    def capture_blocker(self) -> str | None:
        """Why a CUDA graph must not capture this step, as seen in its eager steps so far; None: it
        may be captured (a step of your own that reads step.index may not, train/step/own_step.py)."""
        return None

    def fold_read(self, state: Any) -> None:
        """Add what the last `read_totals` read besides the loss to the run state (a step of your
        own: its named losses, train/step/own_step.py)."""

    def log_values(self, state: Any, steps: int) -> dict[str, float]:
        """Values a log point adds besides the loss, from the run state (a step of your own: its
        named losses' means, and its optimizers' learning rates); no host read."""
        return {}

    def _all_ranks_finite(self) -> bool:
        """Whether every rank's state is finite although the probe's norm was not (it overflows past
        ~1e19): the exact check, on this rare path only; collective, as every rank read the same probe."""
        bad = torch.tensor(0.0 if self.state_is_finite() else 1.0, device=self.device)
        if self.dist is not None:
            bad = distributed.all_reduce_mean(bad, self.dist)
        return bad.item() == 0.0

    @torch.no_grad()
    def state_is_finite(self) -> bool:
        """The exact check behind a non-finite state probe (host reads: only on that rare path)."""
        return all(bool(torch.isfinite(t).all()) for t in self._state())


def keeps_losses_in_a_list(device: torch.device) -> bool:
    """Whether eager steps on `device` keep their losses in a list (no op per step) rather than add
    them in place: on CUDA only (see `TrainStep.__init__` for the CPU heap)."""
    return device.type == "cuda"


def _shard(t: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a sharded (FSDP2 DTensor) tensor; a plain tensor as it is."""
    to_local = getattr(t, "to_local", None)
    return cast(torch.Tensor, to_local()) if callable(to_local) else t  # DTensor.to_local() -> Tensor


def _local(t: torch.Tensor) -> torch.Tensor:
    """A plain tensor from a norm over sharded (FSDP2 DTensor) gradients: the full value, on every rank."""
    full = getattr(t, "full_tensor", None)
    return cast(torch.Tensor, full()) if callable(full) else t  # DTensor.full_tensor() -> Tensor
