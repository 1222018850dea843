"""`gputrain slurm WORKLOAD --nodes N --gpus-per-node G --run-dir DIR`: print an sbatch script.

The script starts one task per GPU with srun (gputrain reads Slurm's variables: no torchrun), asks
Slurm for SIGUSR1 some seconds before the time limit (the tasks checkpoint and the job requeues
itself) and marks the job requeuable; every start resumes from the run directory, which must be
on storage all nodes see. Submit it with `sbatch`.
"""

from __future__ import annotations

import argparse
import re
import shlex
import sys
from pathlib import Path

from gputrain.commands.argtypes import positive_int as _positive_int
from gputrain.errors import ConfigError

_LOCAL_PREFIXES = ("/tmp", "/dev/shm", "/var/tmp", "/run")  # per-node storage on most clusters


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("workload", help="what `gputrain fit` trains (a built-in workload or module:function)")
    p.add_argument("--nodes", type=_positive_int, default=1, help="machines (default 1)")
    p.add_argument("--gpus-per-node", type=_positive_int, default=8, help="GPUs per machine, one task each (default 8)")
    p.add_argument("--run-dir", required=True,
                   help="the run directory, on storage every node sees (checkpoints: every rank writes its part)")
    p.add_argument("--time", default="04:00:00", help="the job's time limit (sbatch --time), default 04:00:00")
    p.add_argument("--signal-seconds", type=_positive_int, default=120,
                   help="SIGUSR1 this many seconds before the time limit: checkpoint and requeue (default 120)")
    p.add_argument("--checkpoint-every", type=_positive_int, default=500,
                   help="steps between periodic checkpoints (default 500)")
    p.add_argument("--cpus-per-task", type=_positive_int, default=None, help="CPU cores per task (data loading)")
    p.add_argument("--partition", default=None)
    p.add_argument("--account", default=None)
    p.add_argument("--job-name", default=None, help="default gputrain-WORKLOAD")
    p.add_argument("--python", default="python", help="the interpreter on the nodes (default: python on PATH)")
    p.add_argument("--setup", action="append", default=[], metavar="LINE",
                   help="a shell line run before srun, e.g. 'source ~/venv/bin/activate' (repeatable)")
    p.add_argument("--output", default=None, help="write the script to this file instead of printing it")
    p.add_argument("--fit-args", default="", metavar="FLAGS",
                   help='more `gputrain fit` flags, one string: --fit-args="--async-checkpoint --shard --steps 100000"')


def render_sbatch(workload: str, *, nodes: int, gpus_per_node: int, run_dir: str, time: str = "04:00:00",
                  signal_seconds: int = 120, checkpoint_every: int = 500, cpus_per_task: int | None = None,
                  partition: str | None = None, account: str | None = None, job_name: str | None = None,
                  python: str = "python", setup: list[str] | None = None, fit_args: list[str] | None = None) -> str:
    """The sbatch script as text. Raises ConfigError for a time limit sbatch would refuse or a
    run directory that is not absolute."""
    if not re.fullmatch(r"(\d+-)?\d+(:\d{2}){0,2}", time):
        raise ConfigError(f"--time {time!r}: use sbatch's forms, e.g. 04:00:00, 90, or 2-00:00:00")
    if not Path(run_dir).is_absolute():
        raise ConfigError(f"--run-dir {run_dir!r}: give an absolute path on shared storage (every node writes "
                          "its part of each checkpoint there)")
    name = job_name or "gputrain-" + re.sub(r"[^A-Za-z0-9_.-]", "_", Path(workload.split(":")[0]).stem)
    fit_args = list(fit_args or [])
    # (comment, sbatch option): sbatch reads no comment on an #SBATCH line itself, so each goes above.
    sbatch: list[tuple[str, str]] = [
        ("", f"--job-name={name}"), ("", f"--nodes={nodes}"),
        ("one task (process) per GPU", f"--ntasks-per-node={gpus_per_node}"),
        ("", f"--gpus-per-node={gpus_per_node}"), ("", f"--time={time}"),
        (f"SIGUSR1 to every task {signal_seconds} s before the time limit: each checkpoints, the job requeues itself",
         f"--signal=USR1@{signal_seconds}"),
        ("the job may go back to the queue (on SIGUSR1, or when preempted)", "--requeue"),
        ("a requeued run appends to its log", "--open-mode=append"),
        ("", "--output=%x-%j.out")]
    if cpus_per_task:
        sbatch.append(("", f"--cpus-per-task={cpus_per_task}"))
    if partition:
        sbatch.append(("", f"--partition={partition}"))
    if account:
        sbatch.append(("", f"--account={account}"))
    directives = [line for comment, option in sbatch for line in ([f"# {comment}"] if comment else [])
                  + [f"#SBATCH {option}"]]
    fit = [python, "-m", "gputrain", "fit", workload, "--device", "cuda", "--run-dir", '"$RUN_DIR"',
           "--resume", '"$RUN_DIR"', "--checkpoint-every", str(checkpoint_every), *map(shlex.quote, fit_args)]
    lines = ["#!/bin/bash",
             f"# Written by `gputrain slurm {workload} --nodes {nodes} --gpus-per-node {gpus_per_node} ...`; "
             "submit with: sbatch THIS_FILE",
             *directives,
             "",
             "set -euo pipefail",
             "# On storage every node sees: each rank writes its part of every checkpoint here.",
             f"RUN_DIR={shlex.quote(run_dir)}",
             'mkdir -p "$RUN_DIR"',
             *(setup or []),
             "export OMP_NUM_THREADS=${SLURM_CPUS_PER_TASK:-1}",
             "# srun starts one gputrain per GPU. gputrain takes its rank, the world size and its GPU from",
             "# SLURM_PROCID, SLURM_NTASKS and SLURM_LOCALID, and meets the others on the first node of",
             "# SLURM_JOB_NODELIST (no torchrun). --resume: a requeued job continues from the newest checkpoint.",
             "srun --kill-on-bad-exit=1 " + " ".join(fit)]
    return "\n".join(lines) + "\n"


def run(args) -> int:
    run_dir = args.run_dir
    _check_workload(args.workload)
    if args.output:
        from gputrain.io.preflight import check_output_file

        check_output_file(args.output, "--output", example="train.sbatch")
    try:
        fit_args = shlex.split(args.fit_args)
    except ValueError as exc:  # an unclosed quote
        raise ConfigError(f"--fit-args {args.fit_args!r}: {exc}; quote it as one shell string, e.g. "
                          "--fit-args=\"--steps 1000 --shard\"") from None
    _check_fit_args(args.workload, fit_args)
    if any(run_dir == p or run_dir.startswith(p + "/") for p in _LOCAL_PREFIXES):
        print(f"gputrain slurm: warning: {run_dir} is usually local to each node; the checkpoints of a job on "
              "several nodes need storage every node sees", file=sys.stderr)
    script = render_sbatch(args.workload, nodes=args.nodes, gpus_per_node=args.gpus_per_node,
                           run_dir=str(Path(run_dir).absolute()),  # sbatch runs the script where it was submitted
                           time=args.time, signal_seconds=args.signal_seconds, checkpoint_every=args.checkpoint_every,
                           cpus_per_task=args.cpus_per_task, partition=args.partition, account=args.account,
                           job_name=args.job_name, python=args.python, setup=args.setup,
                           fit_args=fit_args)
    if args.output:
        from gputrain.io.atomic import write_text

        try:
            write_text(args.output, script)
        except OSError as exc:
            raise ConfigError(f"--output {args.output}: cannot write the script ({exc.strerror or exc}); nothing was "
                              "written: choose another --output, or leave it out to print the script") from None
        print(f"wrote {args.output}: submit it with sbatch {args.output}", file=sys.stderr)
    else:
        sys.stdout.write(script)
    return 0


def _check_workload(spec: str) -> None:
    """A built-in name must exist (a typo would fail on the cluster, after the job waited in the
    queue); module:function is checked only for its form, since its module lives where the job runs."""
    if ":" in spec:
        module, _, function = spec.rpartition(":")
        if not module or not function:
            raise ConfigError(f"workload {spec!r}: give a built-in name or module:function (e.g. "
                              "mypkg.tasks:make_workload)")
        return
    from gputrain.workloads import WORKLOADS, get_workload

    if spec not in WORKLOADS:
        get_workload(spec)  # raises the registry's error: the names, and the closest one


class _RefusingParser(argparse.ArgumentParser):
    def error(self, message: str):
        raise ConfigError(f"--fit-args: `gputrain fit` on the cluster would refuse them ({message}); see "
                          "gputrain fit --help")


def _check_fit_args(workload: str, fit_args: list[str]) -> None:
    """Parse the flags as `gputrain fit` will, here: a typo fails now, not after the job waited in the queue."""
    from gputrain.commands import fit

    parser = _RefusingParser(prog="gputrain fit", add_help=False)
    fit.add_arguments(parser)
    parser.parse_args([workload, *fit_args])
