"""A refused command under `gputrain fit --nproc N`: one line, once, and exit status 2.

`fit --nproc N` starts its processes through torchrun. A refusal inside them (a missing GPU, a
resume of another workload's run, a damaged sharded checkpoint) is raised on every rank, and
torchrun would answer each rank's exit with its own logs and a ChildFailedError traceback. So the
launcher (runtime/distributed.launch_torchrun) runs torchrun through this module's `main`, with a
folder named in GPUTRAIN_REFUSALS: each refusing rank writes its line there instead of printing it
(`say_refusal`), torchrun's reports of that exit are left out, and the launcher prints the lowest
rank's line once and exits 2. Any other failure keeps torchrun's whole report.

Run as `python -m gputrain.runtime.launch TORCHRUN_ARGS...` (torchrun's own arguments).
"""

from __future__ import annotations

import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

REFUSALS_ENV = "GPUTRAIN_REFUSALS"  # the folder each refusing rank writes its line into
REFUSED = 2  # gputrain's exit status for a refused command (cli.py), argparse's too


def say_refusal(line: str) -> None:
    """Print a refused command's one line on stderr; under `fit --nproc`'s torchrun, write it to
    GPUTRAIN_REFUSALS/rank-N for the launcher to print once instead."""
    folder = os.environ.get(REFUSALS_ENV)
    rank = os.environ.get("RANK", "")
    if folder and rank.isdigit() and Path(folder).is_dir():
        from gputrain.io.atomic import write_text

        try:
            write_text(Path(folder) / f"rank-{int(rank):06d}", line + "\n")
            return
        except OSError:
            pass  # said here, then
    print(line, file=sys.stderr)


def first_refusal(folder: str | os.PathLike) -> str | None:
    """The lowest rank's refusal line written in `folder`, if any rank refused."""
    try:
        files = sorted(p for p in Path(folder).iterdir() if p.name.startswith("rank-"))
    except OSError:
        return None
    for path in files:
        try:
            line = path.read_text(encoding="utf-8").strip()
        except OSError:
            continue
        if line:
            return line
    return None


class _QuietRefusal(logging.Filter):
    """Leaves out torchrun's own reports once a worker wrote a refusal (it writes before it exits, so
    before torchrun sees the exit): the closing signals to the other ranks, "failed (exitcode: 2)"."""

    def __init__(self, folder: str):
        super().__init__()
        self.folder = folder
        self.refused = False

    def filter(self, record: logging.LogRecord) -> bool:
        if record.name.startswith("torch.distributed") and not self.refused:
            self.refused = first_refusal(self.folder) is not None
        return not (self.refused and record.name.startswith("torch.distributed"))


def launch_torchrun(nproc: int, argv: list[str], max_restarts: int = 0) -> int:
    """Run `python -m gputrain <argv>` (argv starts with the subcommand, e.g. ["fit", ...]) in
    `nproc` processes on this machine through torchrun; returns torchrun's exit code.

    Ctrl-C and SIGTERM reach torchrun, which stops its workers; this waits for it to finish.
    """
    # torchrun, quiet about a refusal: the processes' line is said once (runtime/launch.py)
    cmd = [sys.executable, "-m", "gputrain.runtime.launch", "--standalone", f"--nproc-per-node={nproc}"]
    if max_restarts:
        cmd.append(f"--max-restarts={max_restarts}")
    cmd += ["-m", "gputrain", *argv]
    env = dict(os.environ)
    refusals = tempfile.mkdtemp(prefix="gputrain-refusals-")
    env[REFUSALS_ENV] = refusals
    # torchrun would set 1 (with a warning); share the cores between the processes instead.
    env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // nproc)))
    proc = subprocess.Popen(cmd, env=env)
    in_main_thread = threading.current_thread() is threading.main_thread()  # signal handlers live there
    stopped_by: list[int] = []  # the stop signal this launcher received, if any

    def forward(signum, _frame):
        stopped_by.append(signum)
        proc.send_signal(signum)

    previous = signal.signal(signal.SIGTERM, forward) if in_main_thread else None
    try:
        try:
            code = proc.wait()
        except KeyboardInterrupt:
            # From a terminal torchrun got the same SIGINT and is stopping its workers: give it
            # time; a SIGINT sent to this process alone is passed on as SIGTERM.
            stopped_by.append(signal.SIGINT)
            try:
                code = proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.terminate()
                code = proc.wait()
    finally:
        if in_main_thread:
            # None: a handler installed from C, which Python cannot put back; the default is the closest.
            signal.signal(signal.SIGTERM, signal.SIG_DFL if previous is None else previous)
    refused = first_refusal(refusals)
    shutil.rmtree(refusals, ignore_errors=True)
    if refused is not None and code == REFUSED:
        print(refused, file=sys.stderr)
        return REFUSED
    if code < 0:
        return 128 - code  # killed by signal N: the shell's 128 + N
    if code != 0 and stopped_by:
        # torchrun exits 1 when a signal stops it (its SignalException), whatever its workers did;
        # a scheduler reads 128 + N as "stopped by signal N" (the workers checkpointed on their way out).
        return 128 + int(stopped_by[0])
    return code


def main(argv: list[str]) -> int:
    """torchrun with `argv`; REFUSED (nothing more said) when a worker refused, else torchrun's own
    exit and report."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_args, run

    folder = os.environ.get(REFUSALS_ENV, "")
    quiet = _QuietRefusal(folder)
    loggers = [logging.getLogger(), *(v for v in logging.Logger.manager.loggerDict.values()
                                      if isinstance(v, logging.Logger))]
    for handler in {logging.lastResort, *(h for lg in loggers for h in lg.handlers)}:  # torch's included
        if handler is not None:
            handler.addFilter(quiet)
    try:
        run(parse_args(argv))
    except ChildFailedError as exc:
        _, failure = exc.get_first_failure()
        if failure.exitcode == REFUSED and first_refusal(folder) is not None:
            return REFUSED
        raise
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
