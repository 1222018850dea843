"""gputrain.runtime.distributed's pieces in a loop of your own: the process group from torchrun's
environment (one process without it), DDP (or FSDP2 with shard=True), gradients all-reduced on the last
micro-batch only, the loss read at log points only, a checkpoint that every rank helps to write.

    torchrun --standalone --nproc-per-node 2 docs/examples/own_loop_ddp.py   # or python ... for one process
"""

import os
import tempfile

import torch
from torch import nn

from gputrain.runtime import distributed as D

steps, accumulate, log_every = 20, 2, 5
info, device = D.init_distributed("auto")        # torchrun's env -> process group; else one process
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 2))
model = D.wrap_model(model.to(device), info, device, shard=False)   # DDP; shard=True: FSDP2
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
loss_fn = nn.CrossEntropyLoss()
g = torch.Generator().manual_seed(info.rank)                        # this rank's share of the data
batches = iter([(x.to(device), (x[:, :3].sum(1) > 0).long().to(device))
                for x in torch.randn(steps * accumulate, 16, 8, generator=g)])
for step in range(steps):
    for micro in range(accumulate):
        x, y = next(batches)
        with D.no_sync(model, sync=(micro == accumulate - 1)):      # all-reduce on the last only
            loss = loss_fn(model(x), y) / accumulate
            loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    if step % log_every == 0:
        mean = D.all_reduce_mean(loss.detach(), info)               # the only syncs: at log points
        if info.is_main:
            print(f"step {step}: loss {mean.item() * accumulate:.3f}")
state = {"model": D.model_state_dict(model, info),                  # every rank calls these;
         "optimizer": D.optimizer_state_dict(model, optimizer, info)}  # rank 0 gets the dict, others {}
if info.is_main:
    path = os.path.join(tempfile.mkdtemp(), "checkpoint.pt")
    torch.save(state, path)
    print(f"saved {sorted(state['model'])} to {path}")
D.barrier(info)
del model
D.cleanup(info)
