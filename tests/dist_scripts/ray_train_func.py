"""Ray Train's TorchTrainer running gputrain.fit in its train function, with RayReport and
resume_from_ray; launched by tests/test_ray.py (a local Ray cluster of 2 CPUs, 2 gloo workers).

usage: ray_train_func.py OUT

Each worker writes OUT/worker-RANK.json: how often torch.distributed.init_process_group was called
inside the train function, what init_distributed returned (owns_group, rank, world size, device),
whether the process group still exists after fit. Rank 0 writes OUT/final.pt (the trained weights).
The driver writes OUT/result.json: Ray's Result (the latest checkpoint's files, the best ones with
their metrics, the metrics reported last).
"""

import json
import os
import sys
from pathlib import Path

import ray
from ray.train import CheckpointConfig, RunConfig, ScalingConfig
from ray.train.torch import TorchTrainer

OUT = Path(sys.argv[1])
STEPS = 12


def data():
    import torch

    g = torch.Generator().manual_seed(0)
    x = torch.randn(320, 8, generator=g)
    y = (x[:, :3].sum(1) > 0).long()
    return (x[:256], y[:256]), (x[256:], y[256:])


def train_func(loop_config):
    import torch
    import torch.distributed as dist
    from torch import nn

    from gputrain import TrainConfig, fit
    from gputrain.report.ray_report import RayReport, resume_from_ray
    from gputrain.runtime import distributed

    inits = []
    real_init = dist.init_process_group

    def counted_init(*args, **kwargs):
        inits.append(1)
        return real_init(*args, **kwargs)

    dist.init_process_group = counted_init
    seen = {}
    real_setup = distributed.init_distributed

    def watched(*args, **kwargs):
        info, device = real_setup(*args, **kwargs)
        seen.update(owns_group=info.owns_group, rank=info.rank, world_size=info.world_size, device=str(device))
        return info, device

    distributed.init_distributed = watched
    train, test = data()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 2))
    config = TrainConfig(device="auto", batch_size=16, steps=STEPS, log_every=2, checkpoint_every=4, seed=1,
                         run_dir=loop_config["run_dir"], eval_every=2, progress=False, loggers=())
    with resume_from_ray(config) as config:
        fit(model, train, eval_data=test, loss_fn=nn.CrossEntropyLoss(), config=config, callbacks=[RayReport()],
            optimizer=lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9))
    rank = dist.get_rank()
    seen.update(init_calls=len(inits), initialized_after=dist.is_initialized())
    (OUT / f"worker-{rank}.json").write_text(json.dumps(seen))
    if rank == 0:
        torch.save({k: v.detach().clone() for k, v in model.state_dict().items()}, OUT / "final.pt")


def files(checkpoint):
    return sorted(str(p.relative_to(checkpoint.path)) for p in Path(checkpoint.path).iterdir())


if __name__ == "__main__":
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=True)
    trainer = TorchTrainer(
        train_func, train_loop_config={"run_dir": str(OUT / "run")},
        scaling_config=ScalingConfig(num_workers=2, resources_per_worker={"CPU": 1}),
        run_config=RunConfig(storage_path=str(OUT / "ray"), name="api",
                             checkpoint_config=CheckpointConfig(num_to_keep=2, checkpoint_score_attribute="eval_loss",
                                                                checkpoint_score_order="min")))
    result = trainer.fit()
    doc = {"latest": files(result.checkpoint), "metrics": result.metrics,
           "best": [{"files": files(c), "metrics": m} for c, m in result.best_checkpoints]}
    (OUT / "result.json").write_text(json.dumps(doc, default=str))
    ray.shutdown()
