"""gputrain.runtime.distributed's primitives in a hand-written training loop; launched by tests/test_distributed.py.

usage (under torchrun, 2 processes, gloo): primitives.py OUT_DIR

The loop is nanoGPT's: micro-batches, loss / accumulate, gradient sync only on the last micro-step.
Every global micro-batch of B rows is split between the ranks (rank r takes rows r::world), so with
DDP or FSDP2 the averaged gradient equals one process's on the whole micro-batch. The test imports
this file for `reference()` (one process, same data) and compares.

At the end it destroys the process group and makes a second one, as a script calling fit twice does.
Rank 0 writes OUT_DIR/checks.json (what every rank observed) and four checkpoints of
{"model", "optimizer"}: ddp.pt / fsdp.pt after STEPS steps, ddp_resumed.pt / fsdp_resumed.pt
after loading the one-process state at STEPS and training MORE steps further.
"""

import copy
import json
import os
import sys

import torch
import torch.nn.functional as F
from torch import nn

STEPS, MORE, ACCUMULATE, BATCH = 4, 3, 2, 32  # BATCH: global micro-batch


def make_model(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 2))


def make_optimizer(model):
    return torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)  # momentum: state to carry over


def data():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(512, 8, generator=g)
    return x, (x[:, :3].sum(1) > 0).long()


def train(model, optimizer, steps, start=0, rank=0, world=1, sync_ctx=None, after_micro=None):
    """`steps` optimizer steps from step `start`; this rank's rows of each global micro-batch."""
    x, y = data()
    for step in range(start, start + steps):
        for micro in range(ACCUMULATE):
            first = (step * ACCUMULATE + micro) * BATCH
            rows = torch.arange(first, first + BATCH)[rank::world] % len(x)
            last = micro == ACCUMULATE - 1
            ctx = sync_ctx(last) if sync_ctx else torch.enable_grad()
            with ctx:
                loss = F.cross_entropy(model(x[rows]), y[rows]) / ACCUMULATE
                loss.backward()
            if after_micro:
                after_micro(last)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)


def reference(steps):
    """One process, whole micro-batches: (model, optimizer) after `steps` steps."""
    model = make_model()
    optimizer = make_optimizer(model)
    train(model, optimizer, steps)
    return model, optimizer


def main(out_dir):
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    from gputrain.runtime import distributed as D

    info, device = D.init_distributed("cpu")
    again, _ = D.init_distributed("cpu")
    rank, world = info.rank, info.world_size
    seen = {
        "info": [info.enabled, rank, info.local_rank, world, info.backend, info.owns_group],
        "again": [again.enabled, again.rank, again.world_size, again.owns_group],
        "device": str(device),
        "is_main_process": D.is_main_process(),
        "rank_zero_only": D.rank_zero_only(lambda: "ran")(),
        "mean": D.all_reduce_mean(torch.tensor([rank + 1.0, 10.0 * rank]), info).tolist(),
        "sum": D.all_reduce_sum(torch.tensor([rank + 1.0]), info).tolist(),
        "broadcast": D.broadcast_object({"from": rank}, info),
    }
    D.barrier(info)
    save = (lambda name, obj: torch.save(obj, os.path.join(out_dir, name))) if info.is_main else (lambda *a: None)

    def state(model, optimizer):
        return {"model": D.model_state_dict(model, info), "optimizer": D.optimizer_state_dict(model, optimizer, info)}

    # The one-process run, in every rank, as the state to resume from (a checkpoint from 1 process).
    ref_model, ref_opt = reference(STEPS)

    def ref_state(part):  # a fresh copy each time: a loaded optimizer trains its state in place
        state = ref_model.state_dict() if part == "model" else ref_opt.state_dict()
        return copy.deepcopy(state) if info.is_main else {}

    # DDP, with a comm hook counting gradient all-reduces (the model fits one bucket).
    allreduces = [0]

    def count(process_group, bucket):
        allreduces[0] += 1
        return default_hooks.allreduce_hook(process_group, bucket)

    ddp = D.wrap_model(make_model(), info, device)
    ddp.register_comm_hook(None, count)
    opt = make_optimizer(ddp)
    train(ddp, opt, STEPS, rank=rank, world=world, sync_ctx=lambda last: D.no_sync(ddp, last))
    seen["ddp"] = {"wrapper": type(ddp).__name__, "unwrapped": type(D.unwrap(ddp)).__name__,
                   "allreduces": allreduces[0]}
    got = state(ddp, opt)
    seen["ddp"]["non_main_state_empty"] = got == {"model": {}, "optimizer": {}}
    save("ddp.pt", got)
    del ddp, opt

    # DDP from the one-process checkpoint (given to rank 0 only), then MORE steps.
    ddp = D.wrap_model(make_model(seed=123), info, device)
    opt = make_optimizer(ddp)
    D.load_model_state_dict(ddp, ref_state("model"), info)
    D.load_optimizer_state_dict(ddp, opt, ref_state("optimizer"), info)
    train(ddp, opt, MORE, start=STEPS, rank=rank, world=world, sync_ctx=lambda last: D.no_sync(ddp, last))
    # Rank 0 saves its replica only: the others must have received the same state to stay equal.
    mine = torch.cat([p.detach().flatten() for p in ddp.parameters()])
    seen["ddp_resumed_replica_equal"] = torch.equal(mine, D.broadcast_object(mine, info))
    save("ddp_resumed.pt", state(ddp, opt))
    del ddp, opt

    # FSDP2: after a no-sync micro-step the sharded gradients do not exist yet (nothing was
    # reduce-scattered); after the last micro-step they do.
    fsdp = D.wrap_model(make_model(), info, device, shard=True)
    opt = make_optimizer(fsdp)
    grads_after = {"no_sync": [], "sync": []}
    train(fsdp, opt, STEPS, rank=rank, world=world, sync_ctx=lambda last: D.no_sync(fsdp, last),
          after_micro=lambda last: grads_after["sync" if last else "no_sync"].append(
              sum(p.grad is not None for p in fsdp.parameters())))
    seen["fsdp"] = {"wrapper": type(fsdp).__name__, "unwrapped_is_model": D.unwrap(fsdp) is fsdp,
                    "dtensor_params": all(hasattr(p, "placements") for p in fsdp.parameters()),
                    "n_params": len(list(fsdp.parameters())), "grads_after": grads_after}
    got = state(fsdp, opt)
    seen["fsdp"]["non_main_state_empty"] = got == {"model": {}, "optimizer": {}}
    save("fsdp.pt", got)
    del fsdp, opt

    # FSDP2 from the one-process checkpoint (numbered optimizer state, rank 0 only), then MORE steps.
    fsdp = D.wrap_model(make_model(seed=123), info, device, shard=True)
    opt = make_optimizer(fsdp)
    D.load_model_state_dict(fsdp, ref_state("model"), info)
    D.load_optimizer_state_dict(fsdp, opt, ref_state("optimizer"), info)
    train(fsdp, opt, MORE, start=STEPS, rank=rank, world=world, sync_ctx=lambda last: D.no_sync(fsdp, last))
    save("fsdp_resumed.pt", state(fsdp, opt))
    del fsdp, opt

    # A second process group in the same job, as when a script calls fit twice under torchrun.
    D.cleanup(info)
    info, device = D.init_distributed("cpu")
    ddp = D.wrap_model(make_model(), info, device)
    ddp(data()[0][:4]).sum().backward()
    seen["second_group"] = [info.owns_group, D.all_reduce_sum(torch.tensor([1.0]), info).item()]
    del ddp

    everyone = _gather(seen, info)
    if info.is_main:
        with open(os.path.join(out_dir, "checks.json"), "w") as f:
            json.dump(everyone, f)
    D.cleanup(info)


def _gather(obj, info):
    import torch.distributed as dist

    out = [None] * info.world_size
    dist.all_gather_object(out, obj)
    return out


if __name__ == "__main__":
    main(sys.argv[1])
