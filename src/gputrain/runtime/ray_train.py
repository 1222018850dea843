"""Ray Train as a launcher beside torchrun and Slurm: the process side of a run on Ray.

On a worker: whether this process is a Ray Train worker, the device Ray gave it, and the newest
checkpoint Ray holds for the run. Ray Train's TorchTrainer creates the process group before the
training function runs (gloo on CPU workers, NCCL on GPU ones) and sets RANK / WORLD_SIZE /
LOCAL_RANK; `runtime/distributed.init_distributed` takes that group as it is (no second
init_process_group, and it is Ray's to destroy) and asks `worker_device` for the device.

On the driver: reaching a Ray cluster (RAY_ADDRESS, or a local one started here) that has room for
the workers asked for, each refusal one line (`ConfigError`).

Ray is an optional extra (pip install 'gputrain[ray]'): it is imported inside these functions only,
so that `import gputrain` never imports it.
"""

from __future__ import annotations

import contextlib
import os
import socket
import sys
from pathlib import Path
from typing import Any, Iterator, Mapping

import torch

from gputrain.errors import ConfigError

RAY_EXTRA = "pip install 'gputrain[ray]'"
REACH_TIMEOUT_S = 5.0  # a TCP connect to the cluster's address before ray.init, which retries for minutes


def import_ray() -> Any:
    """The `ray` module with Ray Train loaded; ConfigError naming the extra when Ray is not installed."""
    try:
        import ray
        import ray.train  # noqa: F401  (Ray Train: TorchTrainer, report, Checkpoint)
        import ray.train.torch  # noqa: F401
    except ImportError as exc:
        raise ConfigError(f"Ray is not installed ({exc.msg if hasattr(exc, 'msg') else exc}): install the extra "
                          f"with {RAY_EXTRA}") from None
    return ray


def in_ray_worker() -> bool:
    """True inside a function that Ray Train runs on its workers (TorchTrainer's train_func).

    A Ray worker has imported ray before it calls the function, so a process that has not is none
    (and this never imports ray)."""
    if "ray.train" not in sys.modules:
        return False
    import ray.train

    try:
        ray.train.get_context().get_world_rank()
    except Exception:  # noqa: BLE001 - Ray raises RuntimeError (or others by version) outside a worker
        return False
    return True


def worker_device(device_spec: str) -> torch.device | None:
    """The device Ray Train gave this worker (its GPU when the trainer asked for GPUs, else the CPU),
    for device "auto" or "cuda..." on a Ray Train worker; None elsewhere (or for "cpu")."""
    spec = str(device_spec).strip().lower()
    if spec == "cpu" or not in_ray_worker():
        return None
    from ray.train.torch import get_device

    device = get_device()
    if device.type == "cuda":
        torch.cuda.set_device(device)
    elif spec.startswith("cuda"):
        from gputrain.runtime.devices import pick_device

        pick_device(spec)  # the usual DeviceError: the trainer gave this worker no GPU
    return device


@contextlib.contextmanager
def ray_checkpoint_dir() -> Iterator[Path | None]:
    """The folder of the newest checkpoint Ray holds for this run (ray.train.get_checkpoint(): the
    one a restarted worker group resumes from), local while the context lasts; None when Ray holds
    none (the first start) or outside a Ray Train worker."""
    if not in_ray_worker():
        yield None
        return
    import ray.train

    checkpoint = ray.train.get_checkpoint()
    if checkpoint is None:
        yield None
        return
    with checkpoint.as_directory() as folder:  # the folder itself on a local or shared file system
        yield Path(folder)


# ---------------------------------------------------------------- the driver


def check_reachable(address: str) -> None:
    """Refuse, in a few seconds, a Ray cluster address nothing answers at (ray.init would retry for
    minutes). "auto" and "local" are ray.init's own to resolve."""
    if address in ("auto", "local"):
        return
    where = address.split("://", 1)[-1]
    host, sep, port_text = where.rpartition(":")
    if not sep or not port_text.isdigit() or not host:
        raise ConfigError(f"RAY_ADDRESS={address!r} is not HOST:PORT (or ray://HOST:PORT, or auto): set it to the "
                          "address `ray start --head` printed, or unset it to start a Ray cluster on this machine")
    try:
        with socket.create_connection((host.strip("[]"), int(port_text)), timeout=REACH_TIMEOUT_S):
            pass
    except OSError as exc:
        reason = "no answer in %g s" % REACH_TIMEOUT_S if isinstance(exc, socket.timeout) else exc.strerror or str(exc)
        raise ConfigError(f"cannot reach the Ray cluster at RAY_ADDRESS={address!r} ({reason}): start it "
                          "(`ray start --head`) or unset RAY_ADDRESS to start a Ray cluster on this machine") from None


def check_room(nproc: int, resources: Mapping[str, float], gpus: bool, where: str) -> None:
    """Refuse more workers than the cluster has room for: one CPU each (and one GPU each with `gpus`);
    Ray Train would otherwise wait for them for ever."""
    kind = "GPU" if gpus else "CPU"
    have = int(resources.get(kind, 0))
    if nproc > have:
        raise ConfigError(f"--nproc {nproc}: {nproc} Ray workers need {nproc} {kind}s (one each) but {where} has "
                          f"{have}: use --nproc {max(1, have)} or fewer, or a larger cluster (RAY_ADDRESS)")


@contextlib.contextmanager
def _address_given_once() -> Iterator[None]:
    """RAY_ADDRESS left out of this process's environment while ray.init runs: `connect` gives the
    address itself (a blank one is unset: a local cluster), and ray.init would read the variable
    again (refusing a blank one, printing a line of its own for "auto"). Put back afterwards."""
    saved = os.environ.pop("RAY_ADDRESS", None)
    try:
        yield
    finally:
        if saved is not None:
            os.environ["RAY_ADDRESS"] = saved


def connect(nproc: int, device_spec: str, env: Mapping[str, str] = os.environ) -> tuple[str, bool]:
    """Join the Ray cluster RAY_ADDRESS names (a blank one is unset), or start one on this machine, and
    check that it has room for `nproc` workers: one CPU each, and one GPU each when the device asks for CUDA ("auto": when
    the cluster has GPUs). Returns (where, whether the workers get GPUs). A local cluster's room is
    this machine's, checked before Ray starts."""
    spec = str(device_spec).strip().lower()
    address = env.get("RAY_ADDRESS", "").strip()
    if not address:
        local = {"CPU": float(os.cpu_count() or 1), "GPU": float(torch.cuda.device_count())}
        gpus = spec.startswith("cuda") or (spec == "auto" and local["GPU"] > 0)
        check_room(nproc, local, gpus, "this machine (a local Ray cluster)")
    else:
        check_reachable(address)
    ray = import_ray()
    try:
        with _address_given_once():
            if address:
                ray.init(address=address, include_dashboard=False, log_to_driver=True)
            else:
                ray.init(num_cpus=os.cpu_count() or 1, include_dashboard=False, log_to_driver=True)
    except ConnectionError as exc:
        raise ConfigError(f"cannot connect to the Ray cluster at RAY_ADDRESS={address!r} "
                          f"({str(exc).splitlines()[0]}): start it (`ray start --head`) or unset RAY_ADDRESS") from None
    where = f"the Ray cluster at {address}" if address else "a local Ray cluster"
    resources = ray.cluster_resources()
    gpus = spec.startswith("cuda") or (spec == "auto" and resources.get("GPU", 0) > 0)
    try:
        check_room(nproc, resources, gpus, where)
    except ConfigError:
        ray.shutdown()
        raise
    return where, gpus
