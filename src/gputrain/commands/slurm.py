"""`gputrain slurm WORKLOAD --nodes N --gpus-per-node G --run-dir DIR`: print an sbatch script.

The script starts one task per GPU with srun (gputrain reads Slurm's variables: no torchrun), asks
Slurm for SIGUSR1 some seconds before the time limit (the tasks checkpoint and the job requeues
itself) and marks the job requeuable; every start resumes from the run directory, which must be
on storage all nodes see. Submit it with `sbatch`.

`gputrain slurm --sweep sweep.toml --tasks N --sweep-dir DIR`: a job array instead, each task one more
worker of the sweep's shared study (`gputrain sweep --storage ... --study ...`, sweeps/storage.py), its
trials under DIR/task-K; the study's budget, not the array's size, ends the sweep. The sweep is checked
here as `gputrain sweep` checks it, less what only the nodes can (the database's reach, their GPUs), and
the script never holds the study's password: the tasks read the URL from GPUTRAIN_SWEEP_STORAGE (sbatch
passes the submitter's environment), PGPASSWORD or ~/.pgpass.
"""

from __future__ import annotations

import argparse
import os
import re
import shlex
import sys
from pathlib import Path

from gputrain.commands.argtypes import positive_int as _positive_int
from gputrain.errors import ConfigError

_LOCAL_PREFIXES = ("/tmp", "/dev/shm", "/var/tmp", "/run")  # per-node storage on most clusters


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("workload", nargs="?", default=None,
                   help="what `gputrain fit` trains (a built-in workload or module:function); with --sweep, the "
                        "sweep's workload (default: the file's)")
    p.add_argument("--nodes", type=_positive_int, default=None, help="machines (default 1)")
    p.add_argument("--gpus-per-node", type=_positive_int, default=None,
                   help="GPUs per machine, one task each (default 8); with --sweep, GPUs per array task, one trial "
                        "each (default 1)")
    p.add_argument("--run-dir", default=None,
                   help="the run directory, on storage every node sees (checkpoints: every rank writes its part)")
    p.add_argument("--time", default="04:00:00", help="the job's time limit (sbatch --time), default 04:00:00")
    p.add_argument("--signal-seconds", type=_positive_int, default=None,
                   help="SIGUSR1 this many seconds before the time limit: checkpoint and requeue (default 120)")
    p.add_argument("--checkpoint-every", type=_positive_int, default=None,
                   help="steps between periodic checkpoints (default 500)")
    p.add_argument("--cpus-per-task", type=_positive_int, default=None, help="CPU cores per task (data loading)")
    p.add_argument("--partition", default=None)
    p.add_argument("--account", default=None)
    p.add_argument("--job-name", default=None, help="default gputrain-WORKLOAD (with --sweep, gputrain-sweep-STUDY)")
    p.add_argument("--python", default="python", help="the interpreter on the nodes (default: python on PATH)")
    p.add_argument("--setup", action="append", default=[], metavar="LINE",
                   help="a shell line run before srun, e.g. 'source ~/venv/bin/activate' (repeatable)")
    p.add_argument("--output", default=None, help="write the script to this file instead of printing it")
    p.add_argument("--fit-args", default=None, metavar="FLAGS",
                   help='more `gputrain fit` flags, one string: --fit-args="--async-checkpoint --shard --steps 100000"')
    sweep = p.add_argument_group("a sweep as a job array (instead of one training job)")
    sweep.add_argument("--sweep", default=None, metavar="FILE",
                       help="the sweep's TOML file (as gputrain sweep --config): write a job array whose every task is "
                            "one more worker of its study")
    sweep.add_argument("--tasks", type=_positive_int, default=None,
                       help="array tasks, each a worker on its own node (default 4): the study's budget ends the "
                            "sweep, not this")
    sweep.add_argument("--sweep-dir", default=None, metavar="DIR",
                       help="on storage every node sees: task K keeps its trials in DIR/task-K")
    sweep.add_argument("--storage", default=None, metavar="URL",
                       help="the study's database (postgresql://USER@HOST/DB, no password) or journal file "
                            "(default: the file's [sweep] storage, else GPUTRAIN_SWEEP_STORAGE on the nodes)")
    sweep.add_argument("--study", default=None, metavar="NAME",
                       help="the study's name (default: the file's [sweep] study, else gputrain)")
    sweep.add_argument("--trials", type=_positive_int, default=None,
                       help="the study's budget of finished trials (default: the file's)")


# The flags of each kind of job (the other kind refuses them): (dest, flag).
_FIT_ONLY = (("run_dir", "--run-dir"), ("nodes", "--nodes"), ("signal_seconds", "--signal-seconds"),
             ("checkpoint_every", "--checkpoint-every"), ("fit_args", "--fit-args"))
_SWEEP_ONLY = (("tasks", "--tasks"), ("sweep_dir", "--sweep-dir"), ("storage", "--storage"), ("study", "--study"),
               ("trials", "--trials"))


def render_sbatch(workload: str, *, nodes: int, gpus_per_node: int, run_dir: str, time: str = "04:00:00",
                  signal_seconds: int = 120, checkpoint_every: int = 500, cpus_per_task: int | None = None,
                  partition: str | None = None, account: str | None = None, job_name: str | None = None,
                  python: str = "python", setup: list[str] | None = None, fit_args: list[str] | None = None) -> str:
    """The sbatch script as text. Raises ConfigError for a time limit sbatch would refuse or a
    run directory that is not absolute."""
    _check_time(time)
    if not Path(run_dir).is_absolute():
        raise ConfigError(f"--run-dir {run_dir!r}: give an absolute path on shared storage (every node writes "
                          "its part of each checkpoint there)")
    name = job_name or "gputrain-" + re.sub(r"[^A-Za-z0-9_.-]", "_", Path(workload.split(":")[0]).stem)
    fit_args = list(fit_args or [])
    sbatch: list[tuple[str, str]] = [
        ("", f"--job-name={name}"), ("", f"--nodes={nodes}"),
        ("one task (process) per GPU", f"--ntasks-per-node={gpus_per_node}"),
        ("", f"--gpus-per-node={gpus_per_node}"), ("", f"--time={time}"),
        (f"SIGUSR1 to every task {signal_seconds} s before the time limit: each checkpoints, the job requeues itself",
         f"--signal=USR1@{signal_seconds}"),
        ("the job may go back to the queue (on SIGUSR1, or when preempted)", "--requeue"),
        ("a requeued run appends to its log", "--open-mode=append"),
        ("", "--output=%x-%j.out")]
    directives = _directives(sbatch, cpus_per_task=cpus_per_task, partition=partition, account=account)
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
    other = _FIT_ONLY if args.sweep is not None else _SWEEP_ONLY  # the other kind of job's flags
    stray = [flag for dest, flag in other if getattr(args, dest) is not None]
    if stray:
        job = ("a sweep's array (--sweep): its trials go under --sweep-dir, each task is one node" if args.sweep
               is not None else "--sweep's job array; without --sweep the script trains one run")
        raise ConfigError(f"{', '.join(stray)}: belong{'s' if len(stray) == 1 else ''} to {job}; leave "
                          f"{'it' if len(stray) == 1 else 'them'} out")
    if args.output:
        from gputrain.io.preflight import check_output_file

        check_output_file(args.output, "--output", example="train.sbatch")
    script = _sweep_script(args) if args.sweep is not None else _fit_script(args)
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


def _fit_script(args) -> str:
    if args.workload is None:
        raise ConfigError("give the workload to train (gputrain slurm WORKLOAD --run-dir DIR), or "
                          "--sweep FILE for a sweep's job array")
    if args.run_dir is None:
        raise ConfigError("--run-dir DIR is needed: the run directory, on storage every node sees")
    run_dir = args.run_dir
    _check_workload(args.workload)
    try:
        fit_args = shlex.split(args.fit_args or "")
    except ValueError as exc:  # an unclosed quote
        raise ConfigError(f"--fit-args {args.fit_args!r}: {exc}; quote it as one shell string, e.g. "
                          "--fit-args=\"--steps 1000 --shard\"") from None
    _check_fit_args(args.workload, fit_args)
    _warn_if_node_local(run_dir, "the checkpoints of a job on several nodes need storage every node sees")
    return render_sbatch(args.workload, nodes=args.nodes or 1, gpus_per_node=args.gpus_per_node or 8,
                         run_dir=str(Path(run_dir).absolute()),  # sbatch runs the script where it was submitted
                         time=args.time, signal_seconds=args.signal_seconds or 120,
                         checkpoint_every=args.checkpoint_every or 500, cpus_per_task=args.cpus_per_task,
                         partition=args.partition, account=args.account, job_name=args.job_name,
                         python=args.python, setup=args.setup, fit_args=fit_args)


def _sweep_script(args) -> str:
    """The sweep's config checked as `gputrain sweep` checks it (less the database's reach and the
    nodes' GPUs), then the array script."""
    from gputrain.runs.stated import load_run_config
    from gputrain.sweeps.runner import checked_sweep
    from gputrain.sweeps.storage import ENV, has_password, without_password

    if args.sweep_dir is None:
        raise ConfigError("--sweep needs --sweep-dir DIR: on storage every node sees (task K "
                          "keeps its trials in DIR/task-K)")
    overrides = {k: v for k, v in (("storage", args.storage), ("study", args.study), ("trials", args.trials))
                 if v is not None}
    _, settings, _ = checked_sweep(load_run_config(args.sweep, what="--sweep"), workload=args.workload, overrides=overrides)
    storage = settings.storage
    if storage is not None and has_password(storage):
        raise ConfigError(f"--storage {without_password(storage)}: a password in the URL would be written into the "
                          f"script; give the URL without it, and the password to the tasks in PGPASSWORD, ~/.pgpass or "
                          f"{ENV} (the whole URL), which sbatch passes on from your environment")
    if storage is not None and "://" not in storage:  # a journal file: every node opens the same one
        if not Path(storage).is_absolute():
            raise ConfigError(f"--storage {storage!r}: give the journal file's absolute path on storage every node "
                              "sees (the tasks run in other folders, on other machines)")
        _warn_if_node_local(storage, "every task must open the same journal file")
    elif storage is None and not os.environ.get(ENV):
        print(f"gputrain slurm: note: no --storage and no [sweep] storage: the tasks take the study's URL from {ENV}; "
              "set it before sbatch (sbatch passes your environment on) or in a --setup line, or the tasks stop at "
              "once saying so", file=sys.stderr)
    _warn_if_node_local(args.sweep_dir, "the tasks' trials and the sweep's report need storage you can read")
    _warn_if_node_local(args.sweep, "every node reads the sweep's file")
    return render_sweep_array(str(Path(args.sweep).absolute()), workload=args.workload,
                              sweep_dir=str(Path(args.sweep_dir).absolute()), tasks=args.tasks or 4,
                              gpus_per_task=args.gpus_per_node or 1, study=settings.study, storage=storage,
                              trials=args.trials, time=args.time, cpus_per_task=args.cpus_per_task,
                              partition=args.partition, account=args.account, job_name=args.job_name,
                              python=args.python, setup=args.setup)


def render_sweep_array(config: str, *, sweep_dir: str, tasks: int, gpus_per_task: int, study: str,
                       storage: str | None, workload: str | None = None, trials: int | None = None,
                       time: str = "04:00:00", cpus_per_task: int | None = None, partition: str | None = None,
                       account: str | None = None, job_name: str | None = None, python: str = "python",
                       setup: list[str] | None = None) -> str:
    """A job array of `tasks` sweep workers as text: task K runs `gputrain sweep --config CONFIG --study
    STUDY --sweep-dir SWEEP_DIR/task-K --workers GPUS_PER_TASK` (and --storage when `storage`, which
    must hold no password; else the tasks need GPUTRAIN_SWEEP_STORAGE). Raises ConfigError for a time
    limit sbatch would refuse or a relative path."""
    from gputrain.sweeps.storage import ENV

    _check_time(time)
    for flag, path in (("--sweep", config), ("--sweep-dir", sweep_dir)):
        if not Path(path).is_absolute():
            raise ConfigError(f"{flag} {path!r}: give an absolute path (the tasks run on other machines)")
    name = job_name or "gputrain-sweep-" + re.sub(r"[^A-Za-z0-9_.-]", "_", study)
    sbatch: list[tuple[str, str]] = [
        ("", f"--job-name={name}"),
        ("each task one more worker of the study: its budget of finished trials, not the array's size, ends the "
         "sweep (a task that finds it reached exits at once)", f"--array=0-{tasks - 1}"),
        ("", "--nodes=1"), ("", "--ntasks=1"), ("one trial at a time per GPU", f"--gpus={gpus_per_task}"),
        ("", f"--time={time}"),
        ("a preempted task goes back to the queue and its worker joins again; the trial it was running is "
         "failed by the heartbeat of the other workers and run again", "--requeue"),
        ("", "--open-mode=append"), ("", "--output=%x-%A_%a.out")]
    directives = _directives(sbatch, cpus_per_task=cpus_per_task, partition=partition, account=account)
    command = [python, "-m", "gputrain", "sweep", *([shlex.quote(workload)] if workload else []), "--config",
               '"$CONFIG"', "--study", shlex.quote(study), "--sweep-dir", '"$SWEEP_DIR/task-$SLURM_ARRAY_TASK_ID"',
               "--workers", str(gpus_per_task), *(["--storage", shlex.quote(storage)] if storage else []),
               *(["--trials", str(trials)] if trials else [])]
    where = ([f"# The study's URL comes from {ENV} (the password with it, never in this file): sbatch passes",
              "# it on from the environment you submit from.",
              ': "${%s:?set %s to the URL of the study (postgresql://USER:PASSWORD@HOST/DB) before sbatch}"' % (ENV, ENV)]
             if storage is None else
             ["# The password, if the database asks one, from GPUTRAIN_SWEEP_STORAGE (the URL with it) or, for",
              "# PostgreSQL, PGPASSWORD or ~/.pgpass on the nodes: never in this file."])
    lines = ["#!/bin/bash",
             f"# Written by `gputrain slurm --sweep ... --tasks {tasks}`; submit with: sbatch THIS_FILE",
             *directives,
             "",
             "set -euo pipefail",
             f"CONFIG={shlex.quote(config)}",
             "# On storage you can read from anywhere: task K's trials are ordinary run directories under",
             "# $SWEEP_DIR/task-K, and its report.html lists every trial of the study.",
             f"SWEEP_DIR={shlex.quote(sweep_dir)}",
             *(setup or []),
             *where,
             "export OMP_NUM_THREADS=${SLURM_CPUS_PER_TASK:-1}",
             " ".join(command)]
    return "\n".join(lines) + "\n"


def _directives(sbatch: list[tuple[str, str]], *, cpus_per_task: int | None, partition: str | None,
                account: str | None) -> list[str]:
    """The #SBATCH lines of (comment, option) pairs and the optional options, each comment on a line of
    its own above its option (sbatch reads no comment on an #SBATCH line itself)."""
    optional = (("--cpus-per-task", cpus_per_task), ("--partition", partition), ("--account", account))
    sbatch = sbatch + [("", f"{option}={value}") for option, value in optional if value]
    return [line for comment, option in sbatch for line in ([f"# {comment}"] if comment else []) + [f"#SBATCH {option}"]]


def _check_time(time: str) -> None:
    if not re.fullmatch(r"(\d+-)?\d+(:\d{2}){0,2}", time):
        raise ConfigError(f"--time {time!r}: use sbatch's forms, e.g. 04:00:00, 90, or 2-00:00:00")


def _warn_if_node_local(path: str, why: str) -> None:
    if any(path == p or path.startswith(p + "/") for p in _LOCAL_PREFIXES):
        print(f"gputrain slurm: warning: {path} is usually local to each node; {why}", file=sys.stderr)


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
