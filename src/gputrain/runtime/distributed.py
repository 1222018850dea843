"""Several processes on torch.distributed, started by torchrun: setup, wrapping, sync control, state.

gputrain has no launcher or communication layer of its own: `torchrun` (torch.distributed.run)
starts the processes and sets RANK / WORLD_SIZE / LOCAL_RANK / MASTER_ADDR / MASTER_PORT; this
module reads them, initializes the process group (NCCL on GPUs, gloo on the CPU), wraps the model
in DDP (or FSDP2's fully_shard with shard=True), and gives the trainer the few collectives it needs,
used only at log points and checkpoints. A single process gets no-ops, so the training loop has no
`if distributed` branches.

Why not nn.DataParallel: it is one process driving all GPUs, copying the model to each GPU on every
step and gathering outputs on GPU 0; the GIL and the copies make it slower than DDP even on one
machine, it cannot span machines, and PyTorch recommends DDP instead.
"""

from __future__ import annotations

import contextlib
import datetime
import functools
import gc
import os
import warnings
from dataclasses import dataclass
from typing import Any, Mapping

import torch
import torch.distributed as dist
from torch import nn

from gputrain.batch import OptimizerLike, torch_optimizers
from gputrain.errors import ConfigError
from gputrain.runtime.launch import launch_torchrun  # noqa: F401  (fit --nproc's launcher, by its usual name)
from gputrain.torch_compat import compiled_inner

_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
# torchrun's store, and the process groups init_distributed made on it in this process (see there).
_store = None
_groups_made = 0


@dataclass(frozen=True)
class DistInfo:
    enabled: bool
    rank: int = 0
    local_rank: int = 0
    world_size: int = 1
    backend: str | None = None
    owns_group: bool = False  # we initialized the process group (and so cleanup() destroys it)

    @property
    def is_main(self) -> bool:
        return self.rank == 0


SINGLE = DistInfo(enabled=False)


def is_main_process() -> bool:
    """Rank 0 (or a single process): from the process group when there is one, else from the
    environment torchrun set, without initializing anything."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank() == 0
    from gputrain.runtime.slurm import launcher_rank

    return launcher_rank() == 0  # torchrun's RANK, or srun's SLURM_PROCID


def rank_zero_only(fn):
    """Decorator: `fn` runs on rank 0 only; other ranks get None."""
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        if is_main_process():
            return fn(*args, **kwargs)
        return None
    return wrapper


# ---------------------------------------------------------------- setup


def _rank_device(device_spec: str, local_rank: int) -> torch.device:
    """One process per GPU: cuda:LOCAL_RANK when CUDA is wanted and present, else the CPU."""
    from gputrain.runtime.devices import pick_device

    spec = str(device_spec).strip().lower()
    if spec.startswith("cuda"):
        pick_device("cuda")  # raises DeviceError with the usual explanation when CUDA is unusable
    elif spec != "auto" or not torch.cuda.is_available():
        if spec not in ("auto", "cpu"):
            warnings.warn(f"device {device_spec!r} is not supported with several processes: using the CPU "
                          "(gloo); use 'cuda' (NCCL, one GPU per process) or 'cpu'", stacklevel=3)
        return torch.device("cpu")
    count = torch.cuda.device_count()
    if local_rank >= count:
        raise ConfigError(f"local rank {local_rank} has no GPU: this machine has {count} visible "
                          f"(CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES')!r}); "
                          f"start at most {count} processes per node (--nproc-per-node / --nproc)")
    device = torch.device("cuda", local_rank)
    torch.cuda.set_device(device)
    return device


def process_device(device_spec: str = "auto") -> torch.device:
    """The device this process trains on, as `init_distributed` will give it, decided without joining a
    process group: for what a run does before its trainer (the batch-size search, autotune), so that
    they use the device the trainer will. One process: `pick_device(device_spec)`; one of several
    (a process group that exists, torchrun's or Slurm's environment): the rank's device."""
    from gputrain.runtime.devices import pick_device
    from gputrain.runtime.slurm import env_int, slurm_task

    if dist.is_available() and dist.is_initialized():
        return _rank_device(device_spec, env_int(os.environ, "LOCAL_RANK", dist.get_rank()))
    task = slurm_task()
    env: Mapping[str, str] = {**os.environ, **task.as_env()} if task is not None else os.environ
    if env_int(env, "WORLD_SIZE", 1) <= 1:
        return pick_device(device_spec)
    return _rank_device(device_spec, env_int(env, "LOCAL_RANK", 0))


def init_distributed(device_spec: str = "auto", timeout_s: float = 300) -> tuple[DistInfo, torch.device]:
    """Join the process group torchrun describes, or run as a single process.

    Returns (DistInfo, device). Without torchrun's environment (WORLD_SIZE unset or 1): a disabled
    DistInfo and `pick_device(device_spec)`. Under torchrun: cuda:LOCAL_RANK with NCCL when CUDA is
    available and the spec allows it ("auto" or "cuda..."), else the CPU with gloo. Collectives
    time out after `timeout_s` seconds instead of hanging on a lost peer. A process group that
    already exists is reused (and left for its owner to destroy).
    Raises ConfigError when WORLD_SIZE > 1 but torchrun's variables are incomplete, or when a
    local rank has no GPU; DeviceError when "cuda" is asked for and unusable.
    """
    from gputrain.runtime.devices import pick_device
    from gputrain.runtime.slurm import env_int, launcher_numbers, slurm_task

    if dist.is_available() and dist.is_initialized():  # someone (Ray Train, a test, mp.spawn, the user) set it up
        from gputrain.runtime.ray_train import worker_device

        rank, world = dist.get_rank(), dist.get_world_size()
        local_rank = env_int(os.environ, "LOCAL_RANK", rank)
        # Ray Train's workers: the device Ray gave this one (runtime/ray_train.py); else one per local rank
        device = worker_device(device_spec) or _rank_device(device_spec, local_rank)
        return DistInfo(world > 1, rank, local_rank, world, dist.get_backend(), owns_group=False), device

    # Started by srun as one of several tasks (no torchrun): the variables torchrun would have set,
    # from Slurm's (runtime/slurm.py).
    task = slurm_task()
    env: Mapping[str, str] = {**os.environ, **task.as_env()} if task is not None else os.environ
    world = env_int(env, "WORLD_SIZE", 1)
    if world <= 1:
        return SINGLE, pick_device(device_spec)
    missing = [k for k in _ENV if k not in env]
    if missing:
        raise ConfigError(f"WORLD_SIZE={world} but {', '.join(missing)} not set: start the job with torchrun "
                          "(torchrun --nproc-per-node N -m gputrain fit ...) or gputrain fit --nproc N")
    if not dist.is_available():
        raise ConfigError("WORLD_SIZE > 1 but this PyTorch build has no torch.distributed support")
    rank, local_rank, port = launcher_numbers(env, world)  # each named when malformed, before any rendezvous
    device = _rank_device(device_spec, local_rank)
    backend = "nccl" if device.type == "cuda" else "gloo"
    timeout = datetime.timedelta(seconds=timeout_s)
    kwargs = {"backend": backend, "timeout": timeout}
    if backend == "nccl":
        kwargs["device_id"] = device  # eager NCCL init, bound to this rank's GPU
    restart = os.environ.get("TORCHELASTIC_RESTART_COUNT")
    if restart is None and task is not None:  # no torchrun: rank 0 hosts the store on the first node
        restart = f"slurm-{task.restart_count}"
    if restart is not None:
        # torchrun's c10d rendezvous keeps one store server for the whole job, so a process group
        # made after a restart, or after an earlier group in this process was destroyed (fit called
        # twice), would find the old group's peer addresses under the same keys and dial dead ports
        # ("Gloo connectFullMesh failed ... Connection refused"). A prefix per attempt and per
        # group keeps them apart; every rank makes its groups in the same order.
        global _store, _groups_made
        if _store is None:  # one connection per process, kept for later groups
            use_agent = os.environ.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() == "true"
            # dist.TCPStore, dist.PrefixStore: documented public API that torch's __init__ imports
            # without re-exporting it.
            _store = dist.TCPStore(  # pyright: ignore[reportPrivateImportUsage]
                env["MASTER_ADDR"], port, world,
                is_master=(rank == 0 and not use_agent), timeout=timeout)
        _groups_made += 1
        # torch names the default group "0" again after destroy_process_group, so without the
        # group number a second group reads the first one's stale gloo addresses and hangs.
        prefix = f"gputrain/attempt-{restart}/group-{_groups_made}"
        kwargs.update(store=dist.PrefixStore(prefix, _store),  # pyright: ignore[reportPrivateImportUsage]
                      rank=rank, world_size=world)
    dist.init_process_group(**kwargs)
    return DistInfo(True, rank, local_rank, world, dist.get_backend(), owns_group=True), device


def cleanup(info: DistInfo) -> None:
    """Destroy the process group init_distributed created. Drop your references to the wrapped
    model first.

    A DDP wrapper sits in reference cycles, so it outlives the trainer until the cycle collector
    runs; when that is interpreter shutdown, freeing it aborts the process ("terminate called
    without an active exception", SIGABRT, about 1 run in 4 with gloo on torch 2.13), which torchrun
    reports as a failed job. Collect it here instead.
    """
    if info.enabled and info.owns_group and dist.is_initialized():
        gc.collect()
        dist.destroy_process_group()


# ---------------------------------------------------------------- wrapping


def unwrap_data_parallel(model: nn.Module) -> nn.Module:
    """model.module for an nn.DataParallel (with the warning below), else the model itself."""
    if isinstance(model, nn.DataParallel):
        warn_data_parallel(model)
        return model.module
    return model


def warn_data_parallel(model: nn.Module) -> None:
    warnings.warn(
        "the model is wrapped in nn.DataParallel: one process copying the model to every GPU each step is "
        "slower than DistributedDataParallel even on one machine, and cannot span machines. gputrain trains "
        "model.module instead (pass the plain model to avoid this warning) and runs DDP, one process per GPU, "
        "when started with torchrun or `gputrain fit --nproc N`", stacklevel=4)


def wrap_model(model: nn.Module, info: DistInfo, device: torch.device, shard: bool = False) -> nn.Module:
    """The model ready for several processes; the model itself for one.

    DDP by default (gradients all-reduced in buckets during backward). shard=True: FSDP2 —
    fully_shard on each direct child that holds parameters, then on the root, so parameters,
    gradients and optimizer state are split across ranks (the model class becomes FSDP<Class>,
    it is not wrapped). The model must already be on `device`. An nn.DataParallel is unwrapped
    with a warning.
    """
    model = unwrap_data_parallel(model)
    if not info.enabled:
        return model
    if shard:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        # An explicit mesh: FSDP2's default picks CUDA whenever it exists, even for a gloo/CPU job.
        mesh = init_device_mesh(device.type, (info.world_size,))
        for child in model.children():
            if any(True for _ in child.parameters()):
                fully_shard(child, mesh=mesh)
        fully_shard(model, mesh=mesh)
        return model
    from torch.nn.parallel import DistributedDataParallel as DDP

    if device.type == "cuda":
        return DDP(model, device_ids=[device.index], output_device=device.index)
    return DDP(model)


def _peel_compile(model: nn.Module) -> nn.Module:
    return compiled_inner(model)


def _is_fsdp(model: nn.Module) -> bool:
    from torch.distributed.fsdp import FSDPModule

    return isinstance(model, FSDPModule)


def unwrap(model: nn.Module) -> nn.Module:
    """The user's module: without torch.compile, DDP or DataParallel wrappers (FSDP2 is the module)."""
    while True:
        inner = _peel_compile(model)
        if isinstance(inner, (nn.parallel.DistributedDataParallel, nn.DataParallel)):
            inner = inner.module
        if inner is model:
            return model
        model = inner


def no_sync(model: nn.Module, sync: bool):
    """Context for one micro-step's backward: sync=False skips the gradient all-reduce (DDP) or
    reduce-scatter (FSDP2) and keeps the gradients local, for the non-final micro-steps of gradient
    accumulation. sync=True, or a single process: does nothing."""
    if sync:
        return contextlib.nullcontext()
    model = _peel_compile(model)
    if isinstance(model, nn.parallel.DistributedDataParallel):
        return model.no_sync()
    if _is_fsdp(model):
        return _fsdp_no_sync(model)
    return contextlib.nullcontext()


@contextlib.contextmanager
def _fsdp_no_sync(model):
    model.set_requires_gradient_sync(False)
    try:
        yield
    finally:
        model.set_requires_gradient_sync(True)


# ---------------------------------------------------------------- state (checkpoints)
#
# Checkpoints hold full, unsharded CPU tensors under the plain model's names, so a run saved by N
# processes (DDP or FSDP2) resumes in one and the other way round. Every function here is a
# collective when info.enabled: all ranks must call it.


def _fsdp_options(**kwargs):
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return StateDictOptions(full_state_dict=True, **kwargs)


def model_state_dict(model: nn.Module, info: DistInfo) -> dict:
    """The full model state: CPU tensors, the plain model's key names (no "module." prefix).

    Rank 0 (and a single process) gets the dict; other ranks get {} (under FSDP2 the full tensors
    are gathered to rank 0 only).
    """
    inner = unwrap(model)
    if info.enabled and _is_fsdp(inner):
        from torch.distributed.checkpoint.state_dict import get_model_state_dict

        state = get_model_state_dict(inner, options=_fsdp_options(cpu_offload=True))
        return state if info.is_main else {}
    if info.enabled and not info.is_main:
        return {}
    return {k: v.detach().cpu() for k, v in inner.state_dict().items()}


def load_model_state_dict(model: nn.Module, state: dict, info: DistInfo) -> None:
    """Load a full state (as model_state_dict returns it) into the model, wrapped or not.

    Rank 0's `state` is what every rank ends up with: other ranks may pass {} (or the same dict).
    Raises the usual load_state_dict errors for missing or unexpected keys.
    """
    inner = unwrap(model)
    if not info.enabled:
        inner.load_state_dict(state)
        return
    if _is_fsdp(inner):
        from torch.distributed.checkpoint.state_dict import set_model_state_dict

        # A copy: torch writes this rank's sharded tensors into the dict it is given.
        set_model_state_dict(inner, dict(state), options=_fsdp_options(broadcast_from_rank0=True))
        return
    if state:
        inner.load_state_dict(state)
    with torch.no_grad():  # DDP: make every replica rank 0's, whatever the other ranks were given
        for tensor in inner.state_dict().values():
            dist.broadcast(tensor, src=0)


def _param_names(model: nn.Module) -> dict[int, str]:
    return {id(p): name for name, p in unwrap(model).named_parameters()}


def _keyed_by_name(model: nn.Module, optimizer: OptimizerLike, state: dict) -> dict:
    """An optimizer.state_dict() (parameters numbered 0..n-1 in param-group order) re-keyed by
    parameter name, the form torch.distributed.checkpoint loads into a sharded model."""
    groups = state.get("param_groups", [])
    if not any(isinstance(i, int) for g in groups for i in g["params"]):
        return state
    names = _param_names(model)
    number_to_name = {}
    for saved, live in zip(groups, optimizer.param_groups):
        if len(saved["params"]) != len(live["params"]):
            raise ValueError(f"the saved optimizer state has a group of {len(saved['params'])} parameters where "
                             f"this optimizer has {len(live['params'])}")
        for number, p in zip(saved["params"], live["params"]):
            number_to_name[number] = names[id(p)]
    return {
        "state": {number_to_name[k]: v for k, v in state.get("state", {}).items()},
        "param_groups": [{**g, "params": [number_to_name[i] for i in g["params"]]} for g in groups],
    }


def _copy_structure(state: dict) -> dict:
    """New dicts and lists around the same tensors (torch's loaders rewrite what they are given)."""
    if isinstance(state, dict):
        return {k: _copy_structure(v) for k, v in state.items()}
    if isinstance(state, list):
        return [_copy_structure(v) for v in state]
    return state


def optimizer_state_dict(model: nn.Module, optimizer: OptimizerLike, info: DistInfo) -> dict:
    """The full optimizer state on the CPU, portable between 1 and N processes.

    DDP and one process: optimizer.state_dict() (every rank holds the full state). FSDP2: the
    shards gathered into full tensors keyed by parameter name. Rank 0 gets the dict; other ranks {}.
    """
    inner = unwrap(model)
    if info.enabled and _is_fsdp(inner):
        from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

        state = get_optimizer_state_dict(inner, torch_optimizers(optimizer), options=_fsdp_options(cpu_offload=True))
        return state if info.is_main else {}
    if info.enabled and not info.is_main:
        return {}
    return optimizer.state_dict()


def load_optimizer_state_dict(model: nn.Module, optimizer: OptimizerLike, state: dict,
                              info: DistInfo) -> None:
    """Load a full optimizer state written by any process count (DDP, FSDP2 or one process).

    Rank 0's `state` is what every rank ends up with; other ranks may pass {} (or the same dict).
    Optimizer state tensors stay on the CPU for DDP and one process (move them after loading).
    """
    inner = unwrap(model)
    if info.enabled and _is_fsdp(inner):
        from torch.distributed.checkpoint.state_dict import set_optimizer_state_dict

        state = _keyed_by_name(inner, optimizer, state) if info.is_main else {}
        set_optimizer_state_dict(inner, torch_optimizers(optimizer), _copy_structure(state),
                                 options=_fsdp_options(broadcast_from_rank0=True))
        return
    if info.enabled:
        # Broadcast (pickled) only when some rank was not given the state.
        have = torch.tensor([1.0 if state else 0.0], device=_collective_device(info))
        if all_reduce_sum(have, info).item() < info.world_size:
            state = broadcast_object(state if info.is_main else None, info)
    optimizer.load_state_dict(state)


# ---------------------------------------------------------------- collectives (log points only)


def _collective_device(info: DistInfo) -> torch.device:
    if info.backend == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def all_reduce_mean(t: torch.Tensor, info: DistInfo) -> torch.Tensor:
    """The mean of `t` over ranks (in place where possible; use the result). Single process: `t`."""
    if not info.enabled:
        return t
    dist.all_reduce(t, op=dist.ReduceOp.SUM)
    return t / info.world_size


def all_reduce_sum(t: torch.Tensor, info: DistInfo) -> torch.Tensor:
    """The sum of `t` over ranks, in place. Single process: `t`."""
    if info.enabled:
        dist.all_reduce(t, op=dist.ReduceOp.SUM)
    return t


def broadcast_object(obj: Any, info: DistInfo) -> Any:
    """Rank 0's picklable `obj` on every rank (unpickled: of any type). Single process: `obj`."""
    if not info.enabled:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0, device=_collective_device(info))
    return box[0]


def all_gather_object(obj: Any, info: DistInfo) -> list[Any]:
    """Every rank's picklable `obj`, in rank order (a collective). Single process: [obj]."""
    if not info.enabled:
        return [obj]
    out: list[Any] = [None] * info.world_size
    dist.all_gather_object(out, obj)
    return out


def barrier(info: DistInfo) -> None:
    if info.enabled:
        dist.barrier()
