"""How a run ends early: on a stop signal (checkpoint, Slurm's requeue, `StopRequested` with how to
resume), or on an error in user code (the checkpoint of the last finished step, and notes on the
error that say where it came from and how to resume).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Callable

import torch

from gputrain.data.checks import first_step_note
from gputrain.errors import StopRequested, user_frame
from gputrain.runtime.speed import choices_made
from gputrain.train.loop.parts import RunParts
from gputrain.train.loop.signals import StopSignals

log = logging.getLogger("gputrain")


def stop_for_signal(parts: RunParts, save: Callable[[], Path | None], signals: StopSignals,
                    any_rank: Callable[[bool], bool]) -> None:
    """A stop signal came: checkpoint (every rank takes part; rank 0 writes), requeue a Slurm job that
    asked for it, and raise StopRequested with how to resume. `save`: the loop's save (the device
    totals folded in first); `any_rank(flag)`: whether any rank's flag is true (a collective)."""
    st, run_dir = parts.state, parts.run_dir
    name = signals.name or "a stop signal (on another rank)"
    code = signals.exit_code or 143
    path = save() if run_dir else None
    if path is not None:
        parts.checkpoints.wait()  # committed before the process leaves
        from gputrain.runtime.slurm import requeue_after_stop

        # Slurm's SIGUSR1 before the time limit (on any rank): rank 0 puts a requeuable job back in the queue
        requeue_after_stop(signals.requested, parts.dist, any_rank=any_rank)
    resume = (f"resume with: gputrain fit ... --resume {run_dir} (from Python: the same fit(...) with "
              f"TrainConfig(..., run_dir={str(run_dir)!r}, resume=True))" if path
              else "nothing was saved (no run directory): set run_dir to make runs resumable")
    log.warning("%s: stopped after step %d%s", name, st.step, f", checkpoint {path}" if path else "")
    raise StopRequested(f"stopped by {name} after step {st.step} of {parts.data.total_steps}; {resume}",
                        exit_code=code, step=st.step, checkpoint=str(path) if path else None)


def checkpoint_after_error(parts: RunParts, save: Callable[[], Path | None], exc: BaseException) -> None:
    """An error in user code (model, loss, data) after the first step: checkpoint the last
    finished step when its state is finite, and add a line saying where and how to resume."""
    kept = len(getattr(exc, "__notes__", ()))
    try:
        _checkpoint_after_error(parts, save, exc)
    except RuntimeError as late:
        if late is exc or not _lost_worker(late):
            raise
        # torch's SIGCHLD handler reports a dead DataLoader worker wherever the main process is, once:
        # after the error the death caused (the connection to the worker's queue reset mid-batch) it
        # can land in here, in a save (which then writes nothing: writes are whole or absent) or
        # anywhere else. Said with the error, and done again.
        if hasattr(exc, "__notes__"):
            del exc.__notes__[kept:]
        exc.add_note(f"gputrain: {str(late).splitlines()[0]}")
        _checkpoint_after_error(parts, save, exc)


def _checkpoint_after_error(parts: RunParts, save: Callable[[], Path | None], exc: BaseException) -> None:
    st, run_dir, stream, last = parts.state, parts.run_dir, parts.data.stream, parts.checkpoints.last
    where = user_frame(exc)
    saved = None
    # Several processes: the other ranks are inside a collective of their own step, so a
    # checkpoint (itself collective) cannot be written; the periodic ones remain.
    if run_dir and st.step > 0 and parts.dist.world_size == 1:
        try:
            saved = save()
        except Exception as save_exc:  # a non-finite state, a full disk: the error stays the first one
            if _lost_worker(save_exc):
                raise
            log.warning("no checkpoint after the error: %s", save_exc)
    how = (f"a checkpoint of step {st.step} is at {saved}: fix the cause and resume with --resume {run_dir}"
           if saved else "no checkpoint was written after the error"
           + (f" (resume from the last periodic one with --resume {run_dir})" if last else ""))
    stream.name_a_lost_worker(exc)
    exc.add_note(f"gputrain: training failed in step {st.step + 1} at {where}; {how}")
    if st.step == 0 and (stepping := _optimizer_frame(exc)) is not None:
        optimizers = ", ".join(type(o).__name__ for o in parts.optim.all())
        exc.add_note(f"gputrain: the first training step failed inside the optimizer's step ({stepping}), after "
                     f"the forward and backward ran: the cause is the optimizer ({optimizers}) or how it is called, "
                     "not the batch (an optimizer whose step needs a closure gets one from fit: fit(optimizer=...) "
                     "with the built-in loss, or step.step(name, closure=fn) in a step of your own)")
    elif st.step == 0 and stream.load_error is not exc and stream.last_batch is not None:
        precision = parts.precision
        choices = choices_made(parts.speed, precision.name, precision.precision.autocast_dtype,
                               parts.config.precision)
        exc.add_note(first_step_note(stream.last_batch, parts.model.module, parts.step.loss, choices))  # data/checks.py


def _optimizer_frame(exc: BaseException) -> str | None:
    """`Class.step at file:line` when `exc` was raised inside an optimizer's step (a frame of torch's
    optim package, or a `step` method of a torch.optim.Optimizer of yours), else None."""
    import traceback

    for frame, _ in reversed(list(traceback.walk_tb(exc.__traceback__))):
        path = frame.f_code.co_filename.replace("\\", "/")
        owner = frame.f_locals.get("self")
        if isinstance(owner, torch.optim.Optimizer) and (frame.f_code.co_name == "step" or "/torch/optim/" in path):
            return f"{type(owner).__name__}.{frame.f_code.co_name} at {path}:{frame.f_lineno}"
    return None


def _lost_worker(exc: BaseException) -> bool:
    """torch's report of a DataLoader worker that died (raised by its SIGCHLD handler)."""
    return isinstance(exc, RuntimeError) and "DataLoader worker" in str(exc) and "exited unexpectedly" in str(exc)
