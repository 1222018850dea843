"""Stop requests by signal: a handler that only takes note, and ranks that agree to stop together.

A cluster scheduler asks a job to stop with SIGTERM (Slurm, Kubernetes), some with SIGUSR1 ahead of a
time limit; a user with Ctrl-C (SIGINT). Python's defaults act at once: SIGTERM kills the process
mid-step, SIGINT raises KeyboardInterrupt wherever the main thread is, possibly in the middle of
writing a checkpoint. `StopSignals` replaces them, for the length of a `with` block, by a handler that
only records the signal; the training loop looks at `requested` between steps, saves a checkpoint,
and exits with `exit_code` (128 + the signal's number, what a shell reports for a process the signal
killed, so schedulers still see "terminated by SIGTERM").

The handler never raises: a second signal that arrives while a checkpoint is written is counted
and nothing else, so the save completes. (Python runs handlers in the main thread between
bytecodes; a handler that raised would unwind the save wherever it was.)

Under torch.distributed a signal may reach some ranks and not others (or at different steps);
`agree_to_stop` makes them all decide the same at the same step, else one rank would leave the
training loop while the others wait for it in their next collective.
"""

from __future__ import annotations

import logging
import signal
import threading
import weakref
from types import FrameType
from typing import Any, Callable, Iterable, TypeGuard

import torch
import torch.distributed as dist

log = logging.getLogger(__name__)

DEFAULT_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1)

# What signal.signal takes and returns: a Python callable, SIG_DFL / SIG_IGN, or None (from C).
PythonHandler = Callable[[int, FrameType | None], Any]
Handler = PythonHandler | int | signal.Handlers | None


def _is_chainable(handler: Handler) -> TypeGuard[PythonHandler]:
    """A Python callable someone installed before us, to be called from our handler.

    Not chained: SIG_DFL and SIG_IGN (not callables: the default would kill the process, which is
    what we are preventing), None (a handler installed from C, which Python cannot call), and
    signal.default_int_handler, Python's own SIGINT handler: it raises KeyboardInterrupt, which
    from inside our handler would interrupt the step, or the checkpoint being written, wherever
    the main thread happened to be.
    """
    return callable(handler) and handler is not signal.default_int_handler \
        and handler not in (signal.SIG_DFL, signal.SIG_IGN)


class StopSignals:
    """Context manager: while active, the given signals are recorded instead of acted on.

        with StopSignals() as stop:
            for step in ...:
                ...
                if agree_to_stop(stop.requested is not None, dist_info):
                    save_checkpoint(...)
                    sys.exit(stop.exit_code)

    Handlers a program installed before (Python callables) are still called, from ours, after it
    records the signal; an exception they raise is logged, not propagated. On exit the previous
    handlers are put back exactly. Only the main thread can install signal handlers: entered in
    another thread it does nothing (a debug log says so) and `requested` stays None.
    """

    def __init__(self, signals: Iterable[int] = DEFAULT_SIGNALS):
        self.signals = tuple(signal.Signals(s) for s in signals)
        self._requested: signal.Signals | None = None
        self.count = 0  # every signal received while active, the first included
        self._previous: dict[signal.Signals, Handler] = {}
        self.installed = False

    # ------------------------------------------------------------ what was received

    @property
    def requested(self) -> int | None:
        """The number of the first signal received (a signal.Signals, an int), or None."""
        return self._requested

    @property
    def name(self) -> str | None:
        """The first signal's name ("SIGTERM"), or None."""
        return self._requested.name if self._requested is not None else None

    @property
    def exit_code(self) -> int | None:
        """128 + the first signal's number (143 for SIGTERM, 130 for SIGINT, 138 for SIGUSR1 on
        Linux), the status a shell reports for a process that signal killed; None when none came."""
        return 128 + int(self._requested) if self._requested is not None else None

    # ------------------------------------------------------------ installing

    def __enter__(self) -> "StopSignals":
        if self.installed:
            raise RuntimeError("this StopSignals is already active; make a new one to nest")
        if threading.current_thread() is not threading.main_thread():
            log.debug("StopSignals: not in the main thread (%s), where Python runs signal handlers; "
                      "signals keep their current handlers", threading.current_thread().name)
            return self
        installed: dict[signal.Signals, Handler] = {}
        for sig in self.signals:
            try:
                installed[sig] = signal.signal(sig, self._handle)
            except (ValueError, OSError) as exc:  # e.g. a subinterpreter, or a signal that cannot be caught
                for done, previous in installed.items():
                    signal.signal(done, _restorable(previous))
                raise ValueError(f"cannot install a handler for {sig.name}: {exc}") from None
        self._previous = installed
        self.installed = True
        return self

    def __exit__(self, *exc_info) -> None:
        if not self.installed:
            return
        for sig, previous in self._previous.items():
            signal.signal(sig, _restorable(previous))
        self._previous = {}
        self.installed = False

    def _handle(self, signum: int, frame) -> None:
        # Runs in the main thread between two bytecodes of whatever it was doing: record, chain,
        # and never raise.
        try:
            sig = signal.Signals(signum)
            self.count += 1
            if self._requested is None:
                self._requested = sig
                log.warning("received %s: stopping after the current step (a checkpoint is saved first)",
                            sig.name)
            else:
                log.warning("received %s again (%d signals so far): already stopping", sig.name, self.count)
            previous = self._previous.get(sig)
            if _is_chainable(previous):
                try:
                    previous(signum, frame)
                except BaseException as exc:  # noqa: BLE001 - raising here would interrupt a save
                    log.warning("the %s handler installed before gputrain's raised %s: %s (ignored while "
                                "the run stops cleanly)", sig.name, type(exc).__name__, exc)
        except BaseException:  # noqa: BLE001 - e.g. logging failing at shutdown; never raise
            pass


def _restorable(previous: Handler) -> Handler:
    # signal.signal returns None for a handler installed from C, which cannot be put back from
    # Python; the default is the closest.
    return signal.SIG_DFL if previous is None else previous


# ---------------------------------------------------------------- all ranks agree

# (default group, gloo group) made for agree_to_stop, as weak references: one side group per
# default group, and none kept alive after destroy_process_group (a process group freed late, at
# interpreter shutdown, can abort the process).
_side_group: tuple[weakref.ref, weakref.ref] | None = None


def _cpu_group():
    """A process group that all-reduces CPU tensors: the default one when it has gloo for the
    CPU, else a gloo group made once (a collective: every rank calls this at the same point)."""
    global _side_group
    default = dist.group.WORLD
    backend = str(dist.get_backend())
    backends = dict(part.split(":", 1) for part in backend.split(",")) if ":" in backend else {"cpu": backend}
    if backends.get("cpu") == "gloo":
        return None  # the default group
    side = _side_group[1]() if _side_group is not None and _side_group[0]() is default else None
    if side is None:
        side = dist.new_group(backend="gloo")
        _side_group = (weakref.ref(default), weakref.ref(side))
    return side


def agree_to_stop(local_flag: bool, dist_info) -> bool:
    """True on every rank when any rank's `local_flag` is true; `local_flag` itself for one process.

    A collective under torch.distributed: every rank must call it at the same step. The flag is
    all-reduced (MAX) as a CPU int over gloo: the default group when it is gloo, else a gloo group
    made on the first call (every rank's first call is at the same point), so an NCCL job decides
    without a GPU sync or a device copy. `dist_info`: gputrain.runtime.distributed.DistInfo.
    """
    if not getattr(dist_info, "enabled", False) or not (dist.is_available() and dist.is_initialized()):
        return bool(local_flag)
    flag = torch.tensor([1 if local_flag else 0], dtype=torch.int32)
    dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=_cpu_group())
    return bool(flag.item())

