"""Slurm: the process group from srun's variables, and a job that requeues itself when told to stop.

Under `srun`, every task (one per GPU) gets SLURM_PROCID (its rank), SLURM_STEP_NUM_TASKS /
SLURM_NTASKS (the world size), SLURM_LOCALID (its index on the node) and the node list, often
compressed (`node[01-04,07]`). `slurm_task` turns them into what torchrun would have set, with the
first node of the list as the rendezvous (rank 0 runs there and hosts the store), so a job needs no
torchrun. torchrun's own variables win when both are present (torchrun started inside an
allocation).

`sbatch --signal=USR1@120` makes Slurm send SIGUSR1 to every task 120 s before the time limit; the
trainer then checkpoints and stops (train/loop/signals.py), and `requeue_after_stop` puts a requeuable
job (`sbatch --requeue`) back in the queue with `scontrol requeue $SLURM_JOB_ID`. The next start
runs the same script, whose `--resume RUN_DIR` continues from the newest checkpoint that verifies.
`gputrain slurm` (commands/slurm.py) writes such a script.
"""

from __future__ import annotations

import itertools
import logging
import os
import re
import shutil
import signal
import subprocess
from dataclasses import dataclass
from typing import Callable, Mapping

from gputrain.errors import ConfigError

log = logging.getLogger("gputrain")

DEFAULT_PORT_BASE = 20000  # MASTER_PORT when the job does not set one: 20000 + job id mod 10000
# The longest wait for scontrol (a slurmctld that does not answer): the job's SIGUSR1 comes 120 s
# (--signal-seconds) before its time limit, and the checkpoint has been written by then.
SCONTROL_TIMEOUT_S = 30.0


def env_int(env: Mapping[str, str], name: str, default: int | None = None, *, low: int = 0,
            high: int | None = None) -> int:
    """The integer a launcher put in environment variable `name` (`default` when unset or empty).
    Raises ConfigError naming the variable and its value when it is not an integer in [low, high]."""
    raw = env.get(name, "")
    if not raw.strip() and default is not None:
        return default
    # ASCII digits alone: int() would take " 29511 " and full-width digits, which torch's C++ side and
    # other tools reading the same variable do not.
    value = int(raw) if re.fullmatch(r"[+-]?[0-9]+", raw) else None
    if value is None or value < low or (high is not None and value > high):
        bounds = f"an integer from {low} to {high}" if high is not None else f"an integer >= {low}"
        raise ConfigError(f"the environment variable {name}={raw!r} is not {bounds}: fix or unset it (torchrun, srun "
                          "and `gputrain fit --nproc` set it themselves)")
    return value


def launcher_numbers(env: Mapping[str, str], world: int) -> tuple[int, int, int]:
    """RANK, LOCAL_RANK and MASTER_PORT of one process of `world` (torchrun's, or slurm_task's as_env()),
    with LOCAL_WORLD_SIZE when set, and MASTER_ADDR resolved. Raises ConfigError naming the first that
    is malformed or out of range, or the address that does not resolve (before any rendezvous, which
    would retry it until its timeout)."""
    rank = env_int(env, "RANK", high=world - 1)
    local_world = env_int(env, "LOCAL_WORLD_SIZE", world, low=1, high=world)
    numbers = (rank, env_int(env, "LOCAL_RANK", high=local_world - 1), env_int(env, "MASTER_PORT", low=1, high=65535))
    resolve_master_addr(env.get("MASTER_ADDR", ""), numbers[2])
    return numbers


def resolve_master_addr(addr: str, port: int) -> None:
    """Raise ConfigError, in one line, when MASTER_ADDR names no host this machine can resolve."""
    import socket

    try:
        socket.getaddrinfo(addr, port, type=socket.SOCK_STREAM)
    except (OSError, UnicodeError) as exc:
        why = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc) or type(exc).__name__
        raise ConfigError(f"the environment variable MASTER_ADDR={addr!r} does not resolve ({why}): set it to the "
                          "host name or address of rank 0's machine, or unset it (torchrun, srun and `gputrain fit "
                          "--nproc` set it themselves)") from None


@dataclass(frozen=True)
class SlurmTask:
    """This process as srun described it: rank, world size, rank on the node, rendezvous, job."""

    rank: int
    world_size: int
    local_rank: int
    master_addr: str
    master_port: int
    job_id: str | None
    restart_count: int = 0  # SLURM_RESTART_COUNT: how many times the job was requeued

    def as_env(self) -> dict[str, str]:
        """The variables torchrun would have set for this process."""
        return {"RANK": str(self.rank), "WORLD_SIZE": str(self.world_size), "LOCAL_RANK": str(self.local_rank),
                "MASTER_ADDR": self.master_addr, "MASTER_PORT": str(self.master_port)}


def parse_nodelist(nodelist: str) -> list[str]:
    """Host names of a Slurm node list: "node[01-04,07],gpu5" -> node01 node02 node03 node04 node07
    gpu5. Ranges keep their zero padding; several bracket groups in one name multiply out
    ("r[1-2]-n[1,3]" -> r1-n1 r1-n3 r2-n1 r2-n3). Raises ConfigError on a malformed list."""
    hosts: list[str] = []
    for item in _split_top_level(nodelist.strip()):
        parts = re.split(r"(\[[^\]]*\])", item)
        choices: list[list[str]] = []
        for part in parts:
            if part.startswith("["):
                choices.append(_expand_ranges(part[1:-1], nodelist))
            elif "[" in part or "]" in part:
                raise ConfigError(f"malformed Slurm node list {nodelist!r}: unbalanced brackets in {item!r}")
            else:
                choices.append([part])
        hosts += ["".join(combo) for combo in itertools.product(*choices)]
    if not hosts or any(not h for h in hosts):
        raise ConfigError(f"malformed Slurm node list {nodelist!r}")
    return hosts


def _split_top_level(text: str) -> list[str]:
    items, depth, start = [], 0, 0
    for i, ch in enumerate(text):
        depth += (ch == "[") - (ch == "]")
        if depth < 0:
            raise ConfigError(f"malformed Slurm node list {text!r}: unbalanced brackets")
        if ch == "," and depth == 0:
            items.append(text[start:i])
            start = i + 1
    if depth:
        raise ConfigError(f"malformed Slurm node list {text!r}: unbalanced brackets")
    items.append(text[start:])
    return [item for item in items if item]


def _expand_ranges(spec: str, whole: str) -> list[str]:
    out = []
    for piece in spec.split(","):
        match = re.fullmatch(r"(\d+)(?:-(\d+))?", piece.strip())
        if not match:
            raise ConfigError(f"malformed Slurm node list {whole!r}: {piece!r} is not a number or a range")
        first, last = match.group(1), match.group(2) or match.group(1)
        if int(last) < int(first):
            raise ConfigError(f"malformed Slurm node list {whole!r}: the range {piece!r} runs backwards")
        width = len(first)
        out += [str(n).zfill(width) for n in range(int(first), int(last) + 1)]
    return out


def slurm_task(env: Mapping[str, str] | None = None) -> SlurmTask | None:
    """This process's place in the job when srun started it as one of several tasks and no launcher
    set RANK / WORLD_SIZE; None otherwise (one task, the batch script itself, torchrun).

    The rendezvous is the first node of SLURM_STEP_NODELIST (the nodes this srun runs on, where rank
    0 is), else of SLURM_JOB_NODELIST; MASTER_ADDR / MASTER_PORT in the environment override it.
    Raises ConfigError when srun's variables are incomplete or malformed.
    """
    env = os.environ if env is None else env
    if "RANK" in env and "WORLD_SIZE" in env:  # torchrun (or the user) already said
        return None
    if "SLURM_PROCID" not in env or not ("SLURM_STEP_ID" in env or "SLURM_STEPID" in env):
        return None  # not a task of an srun step (e.g. the batch script itself)
    world = env_int(env, "SLURM_STEP_NUM_TASKS" if env.get("SLURM_STEP_NUM_TASKS") else "SLURM_NTASKS", 1)
    if world <= 1:
        return None
    rank = env_int(env, "SLURM_PROCID", high=world - 1)
    # SLURM_NTASKS_PER_NODE is one number (the "2(x3)" form is SLURM_TASKS_PER_NODE's): checked when set
    per_node = env_int(env, "SLURM_NTASKS_PER_NODE", world, low=1)
    local_rank = env_int(env, "SLURM_LOCALID", 0, high=per_node - 1)
    nodelist = env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST")
    if env.get("MASTER_ADDR"):
        addr = env["MASTER_ADDR"]
    elif nodelist:
        addr = parse_nodelist(nodelist)[0]
    else:
        raise ConfigError("srun started this task but SLURM_JOB_NODELIST is not set: cannot find the first node "
                          "(the rendezvous); set MASTER_ADDR")
    job_id = env.get("SLURM_JOB_ID") or env.get("SLURM_JOBID")
    if env.get("MASTER_PORT"):
        port = env_int(env, "MASTER_PORT", low=1, high=65535)
    elif job_id and job_id.isdigit():
        port = DEFAULT_PORT_BASE + int(job_id) % 10000
    else:
        port = DEFAULT_PORT_BASE
    return SlurmTask(rank, world, local_rank, addr, port, job_id, env_int(env, "SLURM_RESTART_COUNT", 0))


def launcher_rank(env: Mapping[str, str] | None = None) -> int:
    """This process's rank as its launcher set it, without initializing anything: torchrun's RANK,
    else srun's SLURM_PROCID for a task of several; 0 without either (or when they are malformed)."""
    env = os.environ if env is None else env
    try:
        task = slurm_task(env)
        return task.rank if task is not None else env_int(env, "RANK", 0)
    except ConfigError:
        return 0  # init_distributed says what is wrong with them, when the run starts


# ---------------------------------------------------------------- requeue


def requeue_after_stop(local_signal: int | None, dist_info, env: Mapping[str, str] | None = None,
                       any_rank: Callable[[bool], bool] = bool) -> bool:
    """After a stop's checkpoint: when the stop was Slurm's SIGUSR1 (on any rank) in a Slurm job that
    is requeuable, rank 0 runs `scontrol requeue $SLURM_JOB_ID`. Returns True on the rank that
    requeued. `any_rank(flag)`: whether any rank's flag is true, a collective the caller provides with
    several processes (train/loop/signals.py's agree_to_stop), so every rank calls this at the same point.
    """
    env = os.environ if env is None else env
    usr1 = any_rank(local_signal == signal.SIGUSR1)
    job_id = env.get("SLURM_JOB_ID") or env.get("SLURM_JOBID")
    if not usr1 or not job_id or not getattr(dist_info, "is_main", True):
        return False
    scontrol = shutil.which("scontrol", path=env.get("PATH"))
    if scontrol is None:
        log.warning("Slurm job %s asked to stop (SIGUSR1) but scontrol is not on PATH: not requeued; submit the "
                    "script again to resume", job_id)
        return False
    requeuable = _requeuable(scontrol, job_id, env)
    if requeuable is False:
        log.warning("Slurm job %s is not requeuable (submit with sbatch --requeue): not requeued; submit the "
                    "script again to resume from the checkpoint", job_id)
        return False
    try:
        done = subprocess.run([scontrol, "requeue", job_id], capture_output=True, text=True, env=dict(env),
                              timeout=SCONTROL_TIMEOUT_S)
    except (OSError, subprocess.TimeoutExpired) as exc:
        why = f"no answer in {SCONTROL_TIMEOUT_S:.0f} s" if isinstance(exc, subprocess.TimeoutExpired) else \
            (exc.strerror or str(exc))
        log.warning("scontrol requeue %s failed (%s): not requeued; submit the script again to resume from the "
                    "checkpoint", job_id, why)
        return False
    if done.returncode != 0:
        log.warning("scontrol requeue %s failed (exit %d): %s", job_id, done.returncode,
                    (done.stderr or done.stdout).strip()[:300])
        return False
    log.warning("Slurm job %s requeued (scontrol requeue): its next start resumes from the checkpoint", job_id)
    return True


def _requeuable(scontrol: str, job_id: str, env: Mapping[str, str]) -> bool | None:
    """Requeue=1 / Requeue=0 from `scontrol show job`; None when it cannot tell (then try)."""
    try:
        shown = subprocess.run([scontrol, "show", "job", "-o", job_id], capture_output=True, text=True,
                               env=dict(env), timeout=SCONTROL_TIMEOUT_S)
    except (OSError, subprocess.TimeoutExpired):
        return None
    match = re.search(r"\bRequeue=(\d)", shown.stdout)
    return None if match is None else match.group(1) == "1"
