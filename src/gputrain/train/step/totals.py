"""The step's device accumulators: what a step adds on the device and the loop reads at log points.

Each step adds its detached loss (weighted by its pieces' shares) to a device scalar; nothing is
read on the host per step. An eager CUDA step appends the loss to a list instead (an append launches
no kernel, an add_ one per step), summed every FOLD_EVERY steps and where it is read; a captured step
and any step elsewhere add it in place (one small op; the graph keeps the accumulator's address).
On the CPU each kept 4-byte tensor would land between the step's activations on glibc's heap, which
then grew by ~2 MB a step (500 MB by the fold, a 2 MB-activation model) and took page faults to refill.

Named losses (a step of your own returns {name: loss}) are summed each in its own scalar, with a
count of the steps that returned it: a name returned on some steps only is averaged over those.

on_nan="stop" counts nothing per step: a non-finite loss leaves the loss sum non-finite, and a
non-finite gradient leaves non-finite parameters or optimizer state once the optimizer has stepped,
so one probe of the parameters, their gradients and the optimizer's state where the sum is read
(`take`) finds either. on_nan="skip" counts its flagged steps (train/step/nonfinite.py) in `nonfinite`.
`take()` returns all of it as one device tensor, for the one host read at a log point
(`read_totals` in train/step/train_step.py); `judge` turns what was read into counts.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence, cast

import torch
from torch import nn

from gputrain import torch_compat
from gputrain.runtime import distributed

FOLD_EVERY = 256  # eager steps' losses kept before they are summed into the accumulator (bounded memory)


def keeps_losses_in_a_list(device: torch.device) -> bool:
    """Whether eager steps on `device` keep their losses in a list (no op per step) rather than add
    them in place: on CUDA only (see the module docstring for the CPU heap)."""
    return device.type == "cuda"


@dataclass
class TotalsRead:
    """What one read of the totals gave: the loss summed since the last read (all ranks' mean), the
    non-finite steps, and a step of your own's named losses' sums and the steps that returned each."""

    loss: float
    nonfinite_steps: int
    named: dict[str, float] = field(default_factory=dict)
    named_steps: dict[str, float] = field(default_factory=dict)


class StepTotals:
    """The device sums of a run's steps (see the module docstring).

    params, optimizers: what the non-finite state probe reads (on_nan="stop"); counted: whether the
    steps flag their non-finite steps themselves (on_nan="skip"); loss_list: keep eager steps' losses
    in a list (True) or add each in place (False); None: `keeps_losses_in_a_list(device)`.
    """

    def __init__(self, device: torch.device, params: Sequence[torch.Tensor],
                 optimizers: Sequence[torch.optim.Optimizer], *, counted: bool = False,
                 loss_list: bool | None = None):
        self.device, self.params, self.optimizers, self.counted = device, list(params), list(optimizers), counted
        # Device accumulators whose storage never changes (a captured graph writes to their address).
        self.loss_sum = torch.zeros((), device=device, dtype=torch.float32)  # sum of step losses since read
        self.nonfinite = torch.zeros((), device=device, dtype=torch.float32)  # steps flagged non-finite
        self.pending: list[torch.Tensor] = []  # eager CUDA steps' losses not yet in loss_sum
        listed = keeps_losses_in_a_list(device) if loss_list is None else loss_list
        self.keep: Callable[[torch.Tensor], Any] = self.pending.append if listed else self.loss_sum.add_
        # Named losses and the steps that returned each: made at the first step that returns the name
        # (an eager one: a captured graph keeps their addresses).
        self.named: dict[str, torch.Tensor] = {}
        self.counts: dict[str, torch.Tensor] = {}
        self.names: tuple[str, ...] = ()
        self.varied = False  # some step returned other names than another (a Python branch: not captured)
        self._one = torch.ones((), device=device, dtype=torch.float32)

    def keep_named(self, losses: dict[str, torch.Tensor]) -> None:
        """Each returned loss into its device sum and its step count (one foreach add for all), the
        step's total into the loss sum."""
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
        values = list(losses.values())
        torch_compat.foreach_add_([self.named[k] for k in present] + [self.counts[k] for k in present],
                                  values + [self._one] * len(present))
        self.keep(values[0] if len(values) == 1 else torch.stack(values).sum())

    def after_eager_step(self) -> None:
        """Bound the kept list, however long the interval between reads."""
        if len(self.pending) >= FOLD_EVERY:
            self.fold()

    def sum_in_place(self) -> None:
        """Add every step's loss to loss_sum in place: what a captured step must do (its replays write
        to that address); train/step/graphs.py calls it for all of a graphed run's steps, eager ones too."""
        self.fold()
        self.keep = self.loss_sum.add_

    def fold(self) -> None:
        """The kept losses into loss_sum: one stack and one sum (fp32)."""
        if self.pending:
            # stack promotes mixed dtypes (a bf16 loss beside fp32 ones); the sum is taken in fp32
            self.loss_sum.add_(torch.stack(self.pending).sum(dtype=torch.float32))
            self.pending.clear()

    def take(self) -> torch.Tensor:
        """[loss sum, non-finite steps, state probe, named sums..., named counts...] since the last
        call, one device tensor (one host read for the loop); resets the sums.

        The state probe (on_nan="stop"; 0 with "skip") is finite when the parameters, their gradients
        and the optimizer's state are: where it is not, `state_is_finite` settles whether a value is,
        or only the probe's norm overflowed.
        """
        self.fold()
        probe = self._state_probe() if not self.counted else torch.zeros_like(self.loss_sum)
        parts = [self.loss_sum, self.nonfinite, probe]
        parts += [self.named[k] for k in self.names] + [self.counts[k] for k in self.names]
        totals = torch.stack(parts)  # a copy: the accumulators keep their storage
        for v in (self.loss_sum, self.nonfinite, *self.named.values(), *self.counts.values()):
            v.zero_()
        return totals

    def judge(self, values: list[float], dist: distributed.DistInfo | None) -> TotalsRead:
        """What `take()`'s values, read on the host, say. on_nan="skip" counted its non-finite steps;
        on_nan="stop" gives 1 for "one or more steps since the last read" when the loss sum or the
        state probe is not finite (and the exact check agrees)."""
        n = len(self.names)
        named, named_steps = dict(zip(self.names, values[3:3 + n])), dict(zip(self.names, values[3 + n:]))
        loss_total, bad, probe = values[0], values[1], values[2]
        if self.counted:
            return TotalsRead(loss_total, int(round(bad)), named, named_steps)
        finite = math.isfinite(loss_total) and (math.isfinite(probe) or self._all_ranks_finite(dist))
        return TotalsRead(loss_total, 0 if finite else 1, named, named_steps)

    def _state(self) -> list[torch.Tensor]:
        """The tensors a non-finite gradient would spoil: parameters, gradients still held (a
        parameter outside the optimizer keeps its own), the optimizers' state; floating-point ones
        only (no lazy parameter not yet materialized), sharded (DTensor) ones as this rank's shard."""
        out: list[torch.Tensor] = []
        for p in self.params:
            out.append(p)
            if p.grad is not None:
                out.append(p.grad)
        for optimizer in self.optimizers:
            for state in optimizer.state.values():
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

    def _all_ranks_finite(self, dist: distributed.DistInfo | None) -> bool:
        """Whether every rank's state is finite although the probe's norm was not (it overflows past
        ~1e19): the exact check, on this rare path only; collective, as every rank read the same probe."""
        bad = torch.tensor(0.0 if self.state_is_finite() else 1.0, device=self.device)
        if dist is not None:
            bad = distributed.all_reduce_mean(bad, dist)
        return bad.item() == 0.0

    @torch.no_grad()
    def state_is_finite(self) -> bool:
        """The exact check behind a non-finite state probe (host reads: only on that rare path)."""
        return all(bool(torch.isfinite(t).all()) for t in self._state())


def _shard(t: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a sharded (FSDP2 DTensor) tensor; a plain tensor as it is."""
    to_local = getattr(t, "to_local", None)
    return cast(torch.Tensor, to_local()) if callable(to_local) else t  # DTensor.to_local() -> Tensor
