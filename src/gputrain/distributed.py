"""Several processes on torch.distributed, started by torchrun: setup, wrapping, sync control, state.

gputrain has no launcher or communication layer of its own: `torchrun` (torch.distributed.run)
starts the processes and sets RANK / WORLD_SIZE / LOCAL_RANK / MASTER_ADDR / MASTER_PORT; this
module reads them, initializes the process group (NCCL on GPUs, gloo on the CPU), wraps the model
in DDP (or FSDP2's fully_shard with --shard), and gives the trainer the few collectives it needs,
used only at log points and checkpoints. A single process gets no-ops.

Why not nn.DataParallel: it is one process driving all GPUs, copying the model to each GPU on every
step and gathering outputs on GPU 0; the GIL and the copies make it slower than DDP even on one
machine, and PyTorch recommends DDP instead.
"""

from __future__ import annotations

import contextlib
import datetime
import functools
import gc
import os
import subprocess
import sys
import warnings
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from gputrain.errors import ConfigError

_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


@dataclass(frozen=True)
class DistInfo:
    enabled: bool
    rank: int = 0
    local_rank: int = 0
    world_size: int = 1
    backend: str | None = None
    owns_group: bool = False  # we initialized the process group (and so destroy it)

    @property
    def is_main(self) -> bool:
        return self.rank == 0


SINGLE = DistInfo(enabled=False)


def is_main_process() -> bool:
    """Rank 0 (or a single process), from the environment, without initializing anything."""
    return int(os.environ.get("RANK", "0")) == 0


def rank_zero_only(fn):
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        if is_main_process():
            return fn(*args, **kwargs)
        return None
    return wrapper


def init_distributed(device_spec: str = "auto", timeout_s: float = 300) -> tuple[DistInfo, torch.device]:
    """Join the process group torchrun set up, or run as a single process.

    Returns (DistInfo, device). Under torchrun the device is cuda:LOCAL_RANK when CUDA is available
    and the spec allows it, else the CPU. Raises ConfigError when the environment is incomplete.
    """
    from gputrain.devices import pick_device

    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world <= 1:
        return SINGLE, pick_device(device_spec)
    missing = [k for k in _ENV if k not in os.environ]
    if missing:
        raise ConfigError(f"WORLD_SIZE={world} but {', '.join(missing)} not set: start the job with torchrun "
                          "(torchrun --nproc-per-node N -m gputrain fit ...) or gputrain fit --nproc N")
    rank, local_rank = int(os.environ["RANK"]), int(os.environ["LOCAL_RANK"])
    spec = str(device_spec).lower()
    use_cuda = torch.cuda.is_available() and spec in ("auto", "cuda") or spec.startswith("cuda")
    if use_cuda:
        if local_rank >= torch.cuda.device_count():
            raise ConfigError(f"local rank {local_rank} has no GPU: this machine has {torch.cuda.device_count()}; "
                              "start at most that many processes per node")
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
        backend = "nccl"
    else:
        device = pick_device("cpu")
        backend = "gloo"
    owns = False
    if not dist.is_initialized():
        timeout = datetime.timedelta(seconds=timeout_s)
        kwargs = {"backend": backend, "timeout": timeout}
        if backend == "nccl":
            kwargs["device_id"] = device
        restart = os.environ.get("TORCHELASTIC_RESTART_COUNT")
        if restart is not None:
            # After a torchrun restart the rendezvous store still holds the dead attempt's peer
            # addresses; a per-attempt key prefix keeps the new process group from dialling them.
            use_agent = os.environ.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() == "true"
            store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world,
                                  is_master=(rank == 0 and not use_agent), timeout=timeout)
            kwargs.update(store=dist.PrefixStore(f"gputrain/attempt-{restart}", store), rank=rank, world_size=world)
        dist.init_process_group(**kwargs)
        owns = True
    return DistInfo(True, rank, local_rank, world, dist.get_backend(), owns), device


def warn_data_parallel(model: nn.Module) -> None:
    warnings.warn(
        "the model is wrapped in nn.DataParallel: one process copying the model to every GPU each step is "
        "slower than DistributedDataParallel even on one machine. gputrain uses model.module and runs DDP "
        "when started with torchrun or `gputrain fit --nproc N`", stacklevel=3)


def wrap_model(model: nn.Module, info: DistInfo, device: torch.device, shard: bool = False) -> nn.Module:
    """DDP (default) or FSDP2 fully_shard (shard=True) across processes; the model itself otherwise."""
    if isinstance(model, nn.DataParallel):
        warn_data_parallel(model)
        model = model.module
    if not info.enabled:
        return model
    if shard:
        from torch.distributed.fsdp import fully_shard

        # Shard each direct child that holds parameters, then the root (FSDP2's usual pattern).
        for child in model.children():
            if any(True for _ in child.parameters()):
                fully_shard(child)
        fully_shard(model)
        return model
    from torch.nn.parallel import DistributedDataParallel as DDP

    if device.type == "cuda":
        return DDP(model, device_ids=[device.index])
    return DDP(model)


def _is_fsdp(model: nn.Module) -> bool:
    return hasattr(model, "set_requires_gradient_sync")


def no_sync(model: nn.Module, sync: bool):
    """Skip gradient sync on non-final micro-steps (sync=False); a no-op single-process."""
    if sync:
        return contextlib.nullcontext()
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


def unwrap(model: nn.Module) -> nn.Module:
    inner = getattr(model, "_orig_mod", model)  # torch.compile
    if isinstance(inner, (nn.parallel.DistributedDataParallel, nn.DataParallel)):
        inner = inner.module
    return inner


def model_state_dict(model: nn.Module, info: DistInfo) -> dict:
    """The full model state (CPU tensors, plain key names). Collective: every rank must call it."""
    inner = unwrap(model)
    if info.enabled and _is_fsdp(inner):
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        return get_model_state_dict(inner, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    return {k: v.detach().cpu() for k, v in inner.state_dict().items()}


def load_model_state_dict(model: nn.Module, state: dict, info: DistInfo) -> None:
    inner = unwrap(model)
    if info.enabled and _is_fsdp(inner):
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

        set_model_state_dict(inner, state, options=StateDictOptions(full_state_dict=True))
        return
    inner.load_state_dict(state)


def optimizer_state_dict(model: nn.Module, optimizer: torch.optim.Optimizer, info: DistInfo) -> dict:
    """Full optimizer state, portable between 1 and N processes. Collective under FSDP2."""
    inner = unwrap(model)
    if info.enabled and _is_fsdp(inner):
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

        return get_optimizer_state_dict(inner, optimizer,
                                        options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    return optimizer.state_dict()


def load_optimizer_state_dict(model: nn.Module, optimizer: torch.optim.Optimizer, state: dict, info: DistInfo) -> None:
    inner = unwrap(model)
    if info.enabled and _is_fsdp(inner):
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

        set_optimizer_state_dict(inner, optimizer, state, options=StateDictOptions(full_state_dict=True))
        return
    optimizer.load_state_dict(state)


def all_reduce_mean(t: torch.Tensor, info: DistInfo) -> torch.Tensor:
    if not info.enabled:
        return t
    dist.all_reduce(t, op=dist.ReduceOp.SUM)
    return t / info.world_size


def all_reduce_sum(t: torch.Tensor, info: DistInfo) -> torch.Tensor:
    if info.enabled:
        dist.all_reduce(t, op=dist.ReduceOp.SUM)
    return t


def broadcast_object(obj, info: DistInfo):
    if not info.enabled:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def barrier(info: DistInfo) -> None:
    if info.enabled:
        dist.barrier()


def cleanup(info: DistInfo) -> None:
    """Destroy the process group we created. Drop your references to the wrapped model first.

    A DDP wrapper sits in reference cycles, so it outlives the trainer until the cycle collector
    runs; when that is interpreter shutdown, freeing it aborts the process ("terminate called
    without an active exception", SIGABRT, about 1 run in 4 with gloo on torch 2.13), which torchrun
    reports as a failed job. Collect it here instead.
    """
    if info.enabled and info.owns_group and dist.is_initialized():
        gc.collect()
        dist.destroy_process_group()


def launch_torchrun(nproc: int, argv: list[str], max_restarts: int = 0) -> int:
    """Run `gputrain <argv>` in `nproc` processes on this machine through torchrun; its exit code."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}"]
    if max_restarts:
        cmd.append(f"--max-restarts={max_restarts}")
    cmd += ["-m", "gputrain", *argv]
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // nproc)))
    return subprocess.call(cmd, env=env)
