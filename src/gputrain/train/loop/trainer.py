"""The training loop over a run's parts (train/loop/parts.py, made once by train/loop/build.py).

The loop (`_iterate`, also what `run_steps` runs for profile) pulls one optimizer step's
micro-batches from the stream, runs the step (`parts.step.run`: the first step's gate over the
graphed or eager step), and reads the device-side loss only every `log_every` steps (the one host
sync of the hot loop); evaluation and checkpoints happen there. Its phases are marked on
`self.clock`, a no-op unless profile lends one (`timed_phases`).
"""

from __future__ import annotations

import contextlib
import functools
import logging
import sys
import time
from pathlib import Path
from typing import Any, Callable

from gputrain.data.deferred import materialize, num_samples
from gputrain.data.stream import DataExhausted
from gputrain.errors import GputrainError
from gputrain.io.history import History
from gputrain.runtime.devices import synchronizer, take_peak_memory
from gputrain.runtime.host_memory import StepFaults
from gputrain.runtime.timing import NO_CLOCK, PhaseClock
from gputrain.train.loop import run_summary
from gputrain.train.loop.build import build_run
from gputrain.train.loop.loop_pass import LoopPass
from gputrain.train.loop.parts import RunParts
from gputrain.train.loop.signals import agree_to_stop
from gputrain.train.loop.stops import checkpoint_after_error, stop_for_signal
from gputrain.train.optim.by_name import SchedulerSet

log = logging.getLogger("gputrain")

SIGNAL_SYNC_EVERY = 10  # steps between the ranks' agreement on a stop signal (several processes)


class Trainer:
    """One training run: `Trainer(model, data, ...)` takes `fit`'s arguments (`build_run` makes the
    parts, `parts`); `run()` trains and returns the History. `fit` is the usual entry point."""

    def __init__(self, model, train_data, **kwargs: Any):
        self.parts: RunParts = build_run(model, train_data, **kwargs)
        self.clock: PhaseClock = NO_CLOCK  # the loop's phase marks: a timing clock only while profiled
        self.step_once: Callable[[], None] = self.train_one_step  # what the loop runs per step
        self._bare_loop: LoopPass | None = None  # run_steps' loop (no outputs, progress bar or signals)

    # ------------------------------------------------------------ one step

    def next_step_batches(self) -> list:
        """The micro-batches of the next optimizer step (advances the data stream and samples_seen)."""
        p = self.parts
        stream, st, world = p.data.stream, p.state, p.dist.world_size
        if p.config.accumulate == 1:
            batch = stream.next()[2]
            st.samples_seen += num_samples(batch) * world  # shapes are host metadata: no sync
            return [batch]
        micro = []
        for _ in range(p.config.accumulate):
            micro.append(stream.next()[2])
            st.samples_seen += num_samples(micro[-1]) * world  # shapes are host metadata: no sync
        return micro

    def train_one_step(self) -> None:
        """One optimizer step exactly as the loop runs it (also what autotune and bench time).

        A step interrupted before its optimizer update (Ctrl-C, an error in user code) gives its
        batches back, so that a checkpoint written then resumes with exactly that step.
        """
        p = self.parts
        st, stream = p.state, p.data.stream
        epoch, batch_in_epoch, samples_seen = stream.epoch, stream.batch_in_epoch, st.samples_seen
        try:
            batches = self.next_step_batches()
            self.clock.mark("data")
            p.step.run(batches)
        except BaseException:
            stream.rewind(epoch, batch_in_epoch)
            st.samples_seen = samples_seen
            p.step.body.zero_grad()
            raise
        p.optim.steps.per_step()  # the scheduler, unless it steps after each epoch
        st.step += 1
        st.steps_since_log += 1

    def _first_step(self, loop: LoopPass, on_ready: Callable[[], None] | None) -> None:
        """The run's first step, timed to its end (the time to the first step), then the compile cache
        kept, and the run goes ahead (`_go_ahead`)."""
        p = self.parts
        self.step_once = self.train_one_step  # the loop's next stretch runs the step itself
        compiled = p.model.compile
        p.startup.time_first_step(self.train_one_step, synchronizer(p.device),
                                  compiled.seconds if compiled is not None else (lambda: 0.0))
        if compiled is not None:
            compiled.after_first_step(p.is_main)
            p.speed.reasons["compile"] = compiled.describe()
        self._go_ahead(loop, on_ready)
        log.info("time to the first step: %s", p.startup.describe())

    def _go_ahead(self, loop: LoopPass, on_ready: Callable[[], None] | None) -> None:
        """Once per run, after its first step (or before its first checkpoint, or at its end, when no
        step ran): the run announces itself, `on_ready` records it (the caller's RUN_DIR/config.toml
        and workload.json) and its outputs open. A run refused before (a step of your own that misuses
        the API says so at its first step) has printed nothing but its error and written nothing."""
        if loop.opened:
            return
        p = self.parts
        run_summary.announce(p)
        if p.state.stopped_by:
            log.info("this run was stopped after step %d (%s): nothing more to train; train further in a new run",
                     p.state.step, p.state.stopped_by)
        if on_ready is not None:
            on_ready()
        loop.open_outputs(p.run_dir, p.config, main=p.is_main)

    # ------------------------------------------------------------ the run

    def run(self, on_ready: Callable[[], None] | None = None) -> History:
        """Train and return the History. `on_ready`: called once the run goes ahead (its first step
        done: `_go_ahead`), where a caller writes what belongs to a run that trains, so that a run
        refused at its first step leaves nothing behind."""
        p = self.parts
        cfg, st = p.config, p.state
        p.callbacks.run_start(p.control)
        loop = LoopPass.open(cfg, main=p.is_main, total_steps=p.data.total_steps,
                             description=f"{p.device} {p.precision.name}", callbacks=p.callbacks,
                             world=p.dist.world_size, state=st)
        p.model.modes.train(p.model.model)  # train mode, eval mode kept where the user set it (train/modes.py)
        p.startup.mark("callbacks' start, progress and stop signals")
        self.step_once = functools.partial(self._first_step, loop, on_ready)
        stop = min(p.data.total_steps, cfg.stop_at_step) if cfg.stop_at_step else p.data.total_steps
        finished = False
        try:
            with loop.progress, loop.signals:
                while st.step < stop and not st.stopped_by:
                    self._iterate(loop, stop)
            finished = True
        except DataExhausted as exc:  # a one-shot iterable ran out: the run ends here, saved and summarized
            log.warning("%s", exc)
            p.warnings.append(str(exc))
        except KeyboardInterrupt:
            if p.run_dir:
                self._go_ahead(loop, on_ready)  # a checkpoint belongs to a recorded run
                log.warning("interrupted at step %d: saving a checkpoint to resume from", st.step)
                self.save_checkpoint()
                p.checkpoints.wait()
            raise
        except GputrainError:
            raise
        except Exception as exc:
            checkpoint_after_error(p, self.save_checkpoint, exc)
            raise
        finally:
            error = None if finished else sys.exc_info()[1]  # the error leaving the loop
            if error is not None:
                p.callbacks.exception(p.control, error)
            loop.outputs.close(error=error)
        self._go_ahead(loop, on_ready)  # a run with no step to take (a resume at its end) goes ahead here
        synchronizer(p.device)()
        elapsed = time.perf_counter() - loop.t_start
        if p.run_dir:
            self.save_checkpoint()
            p.checkpoints.wait()  # an asynchronous save is committed before the run ends
        run_summary.summarize(p, elapsed, loop.peak, stopped=st.step < p.data.total_steps,
                              start_step=loop.start_step)
        p.callbacks.run_end(p.control, p.history)
        loop.outputs.finish(p.history)
        return p.history

    def _iterate(self, loop: LoopPass, stop: int, most: int | None = None) -> None:
        """The loop's steps up to the next log point, checkpoint or `stop` (at most `most` steps).

        Every step: the step, per-step hooks, [the log point (and evaluation) every log_every steps,
        a checkpoint every checkpoint_every], the stop-signal check, the "logging" mark. The bracketed
        events fall on the stretch's last step only, so the steps before it run in a tight loop.
        """
        p = self.parts
        cfg, st, total = p.config, p.state, p.data.total_steps
        every, ckpt_every = cfg.log_every, cfg.checkpoint_every
        ends = min(stop, total, (st.step // every + 1) * every, st.step + (most or stop),
                   p.data.eval_points.next_after(st.step))  # an evaluation is a log point too
        if ckpt_every:
            ends = min(ends, (st.step // ckpt_every + 1) * ckpt_every)
        if (epoch_end := p.optim.steps.epoch_end_after(st.step)) is not None:  # a scheduler stepped per epoch
            ends = min(ends, epoch_end)
        clock, step_once, on_step, control = self.clock, self.step_once, loop.on_step, p.control
        signals, one_process = loop.signals, loop.world == 1
        while True:
            clock.start()
            step_once()
            step_once = self.step_once  # the first step hands over to the step itself
            if on_step is not None:
                on_step(control)  # may request a stop (st.stopped_by): the stretch ends after this step
            if st.step >= ends or st.stopped_by:
                break
            if not one_process or signals.requested is not None:  # one process: a flag read, no call
                self._check_signals(loop)
            clock.mark("logging")
        # The run's last step is a log point; an early stop is not (the loss since the last log
        # point goes into the checkpoint, so a resumed history matches).
        if st.step % every == 0 or st.step == total or self._eval_due():
            record = self._log_point(loop.t_log, loop.samples_at_log, loop.faults)
            loop.peak = max(loop.peak, record.get("peak_memory_bytes") or 0)
            loop.t_log, loop.samples_at_log = time.perf_counter(), st.samples_seen
            record["wall_time_s"] = loop.t_log - loop.t_start
            p.history.add(record)
            loop.outputs.append(record)
            loop.progress.update(st.step, epoch=record["epoch"], loss=record["loss"],
                                 samples_per_s=record["samples_per_s"], memory_bytes=record.get("peak_memory_bytes"))
            p.callbacks.log(control, record)  # may request a stop: the loop ends here
            loop.t_log = time.perf_counter()  # evaluation and logging stay out of samples/s
            loop.faults.restart()  # evaluation, trackers, callbacks: not the steps' page faults
        p.optim.steps.after(st.step, p.history.records)  # a scheduler stepped per epoch, after its evaluation
        if ckpt_every and st.step % ckpt_every == 0 and st.step < stop and p.run_dir:
            with loop.faults.excluded():  # nor a checkpoint's
                self.save_checkpoint()
        self._check_signals(loop)
        clock.mark("logging")

    def _check_signals(self, loop: LoopPass) -> None:
        """A signal is only recorded by its handler; the step it came in has finished. One process
        checks every step (a flag read); several agree every SIGNAL_SYNC_EVERY steps (a small gloo
        all-reduce, no GPU sync), as the signal may reach one rank only."""
        signals, dist = loop.signals, self.parts.dist
        if ((loop.world == 1 and signals.requested is not None)
                or (loop.world > 1 and self.parts.state.step % SIGNAL_SYNC_EVERY == 0
                    and agree_to_stop(signals.requested is not None, dist))):
            stop_for_signal(self.parts, self.save_checkpoint, signals,
                            functools.partial(agree_to_stop, dist_info=dist))

    def run_steps(self, n: int) -> None:
        """n iterations of the training loop's own body (`_iterate`: the step, log points with the
        loss read and evaluation, checkpoints) outside `run`, without output files, progress bar
        or signal handlers: what `gputrain profile` times."""
        p = self.parts
        if self._bare_loop is None:
            self._bare_loop = LoopPass.bare(p.config, p.data.total_steps, p.callbacks, p.dist.world_size, p.state)
        if not p.model.model.training:  # train() walks every module: not once per call
            p.model.modes.train(p.model.model)
        done = p.state.step
        while p.state.step < done + n:
            self._iterate(self._bare_loop, p.data.total_steps, most=done + n - p.state.step)

    @contextlib.contextmanager
    def timed_phases(self, clock: PhaseClock):
        """While active, the loop and its step mark their phases on `clock`, and the step runs eagerly
        (a CUDA graph cannot be split into phases; deferred batches are assembled in the "data" phase)."""
        step = self.parts.step
        run = step.run
        step.run = lambda micro_batches: step.body([materialize(b) for b in micro_batches])
        self.clock = step.body.clock = clock
        try:
            yield clock
        finally:
            step.run, self.clock, step.body.clock = run, NO_CLOCK, NO_CLOCK

    @contextlib.contextmanager
    def steps_inside(self, context: Callable[[], contextlib.AbstractContextManager]):
        """While active, the loop runs each step inside `context()`: profile's labelled range per step,
        so that a trace tells the steps from the loop's other work."""
        step = self.step_once

        def inside() -> None:
            with context():
                step()

        self.step_once = inside  # _iterate reads it once per stretch
        try:
            yield
        finally:
            self.step_once = step

    # ------------------------------------------------------------ log points

    def collect_step_totals(self) -> None:
        """Read the step's device accumulators into the run state: the loss summed since the last
        read and the non-finite steps (one host sync; collective with several processes). With
        on_nan="stop" a non-finite step raises here, so no checkpoint ever holds a non-finite state.
        Log points and checkpoints call it; `state_dict()` does not read the device."""
        p = self.parts
        st = p.state
        read = p.step.body.read_totals()
        st.nonfinite_steps += read.nonfinite_steps
        p.guards.nonfinite.check(read.nonfinite_steps, st.step, p.checkpoints.last)  # on_nan="stop": raises here
        st.loss_since_log += read.loss
        for key, value in read.named.items():  # a step of your own's named losses
            st.named_since_log[key] = st.named_since_log.get(key, 0.0) + value
            st.named_steps_since_log[key] = st.named_steps_since_log.get(key, 0.0) + read.named_steps[key]

    def _log_point(self, t_log: float, samples_at_log: int, faults: StepFaults | None = None) -> dict[str, Any]:
        """Read the device-side loss (one sync), evaluate, and build the record. `faults`: the loop's
        count of its steps' page faults (runtime/host_memory.py)."""
        p = self.parts
        st = p.state
        self.collect_step_totals()
        loss = st.loss_since_log / st.steps_since_log
        p.guards.spikes.update(st.step, loss)
        extra = self._named_values(st.steps_since_log)
        st.loss_since_log, st.steps_since_log = 0.0, 0
        now = time.perf_counter()
        record: dict[str, Any] = {
            "step": st.step,
            "epoch": p.data.stream.epochs_done(st.samples_seen, p.dist.world_size),
            "loss": loss,
            "lr": p.optim.scheduler.get_last_lr()[0],  # host value: no device read
            "samples_per_s": (st.samples_seen - samples_at_log) / max(1e-9, now - t_log),
            "peak_memory_bytes": take_peak_memory(p.device),
            "step_page_faults": faults.take() if faults is not None else None,  # the steps' own since the last
            **extra,
        }
        if p.model.compile is not None:
            record.update(p.model.compile.counts())  # recompilations and graph breaks
        if p.data.eval is not None and self._eval_due():
            metrics = self.evaluate()
            record.update(metrics)
            record.update(p.callbacks.evaluate(p.control, metrics))  # e.g. the EMA weights' metrics
        return record

    def _named_values(self, steps: int) -> dict[str, float]:
        """A step of your own's log values: each named loss's mean over the steps since the last log
        point that returned it (unless the one loss is "loss" itself), `<name>_steps` for a name that
        not every step returned, each optimizer's learning rate; resets the sums. No host read."""
        st = self.parts.state
        out: dict[str, float] = {}
        named, st.named_since_log = st.named_since_log, {}
        counted, st.named_steps_since_log = st.named_steps_since_log, {}
        if named and not (len(named) == 1 and "loss" in named):
            for key, total in named.items():
                returned = int(round(counted.get(key, steps)))
                if returned:
                    out[key] = total / returned
                if returned != steps:
                    out[f"{key}_steps"] = returned
        schedulers = self.parts.optim.scheduler
        if isinstance(schedulers, SchedulerSet) and len(schedulers.schedulers) > 1:
            out.update({f"lr_{k}": v for k, v in schedulers.last_lrs().items()})
        return out

    def _eval_due(self) -> bool:  # at epoch ends unless eval_every says otherwise (train/evaluation/points.py)
        return self.parts.data.eval_points.due(self.parts.state.step)

    def evaluate(self) -> dict[str, float]:
        """Loss, the built-in accuracy and the run's metrics over the whole eval set; one host read."""
        p = self.parts
        return p.evaluator(p.model.eval_model, p.data.eval)

    # ------------------------------------------------------------ checkpoints and the end

    def state_dict(self) -> dict[str, Any]:
        """The checkpoint's contents from the named parts (checkpoint/parts.py), as they stand:
        no device accumulator is read (`collect_step_totals` first for the loss of the steps since
        the last log point, as `save_checkpoint` does). Its tensors are the live ones: save or copy it
        before training on. Collective with several processes."""
        return self.parts.checkpoints.state_dict()

    def save_checkpoint(self, path: Path | None = None) -> Path | None:
        """The loss still on the device folded into the run state (a non-finite one raises: no
        checkpoint holds a non-finite state), then a checkpoint (checkpoint/manager.py)."""
        self.collect_step_totals()
        return self.parts.checkpoints.save(path)

    def close(self) -> None:
        """Give back the process-wide settings the run changed (cudnn.benchmark, TF32); stop watching compiles."""
        p = self.parts
        p.speed.restore()
        p.precision.restore()
        p.model.modes.restore()  # every module in the mode the user gave it
        p.model.formats.restore(p.optim.all())  # and its parameters in the layout it gave them
        p.checkpoints.writer.close()  # a save still in flight (an error left the loop) completes first
        if p.model.compile is not None:
            p.model.compile.watcher.stop()

    def graph_status(self) -> str:
        return run_summary.graph_status(self.parts.step.graphed, self.parts.speed)
