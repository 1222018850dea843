"""gputrain.fit in your own Ray Train TorchTrainer (`pip install 'gputrain[ray]'`): Ray starts the workers
and their process group, fit takes it as it is (no second init, Ray's rank and device), and RayReport hands
each log point and each committed checkpoint to Ray, so that Ray's Result knows the latest and the best and
a restarted worker group resumes from Ray's newest copy. Here a local Ray cluster of 2 CPUs; on a cluster,
`ray.init()` reaches the one RAY_ADDRESS names, and the folders are on storage every node reaches."""

import tempfile
from pathlib import Path

import ray
from ray.train import FailureConfig, RunConfig, ScalingConfig
from ray.train.torch import TorchTrainer

FOLDER = Path(tempfile.mkdtemp())  # on a cluster: shared storage, e.g. /shared/runs/c and /shared/ray


def train_func(settings):
    import torch
    from torch import nn

    from gputrain import TrainConfig, fit
    from gputrain.report.ray_report import RayReport, resume_from_ray

    g = torch.Generator().manual_seed(0)
    x = torch.randn(512, 8, generator=g)
    y = (x[:, :3].sum(1) > 0).long()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 2))
    config = TrainConfig(steps=20, batch_size=32, log_every=5, checkpoint_every=10, run_dir=settings["run_dir"])
    with resume_from_ray(config) as config:  # a restarted group: the newest checkpoint Ray holds
        fit(model, (x[:448], y[:448]), loss_fn=nn.CrossEntropyLoss(), eval_data=(x[448:], y[448:]),
            config=config, callbacks=[RayReport()])


ray.init(num_cpus=2, include_dashboard=False)
result = TorchTrainer(train_func, train_loop_config={"run_dir": str(FOLDER / "run")},
                      scaling_config=ScalingConfig(num_workers=2, use_gpu=False),  # use_gpu=True: one GPU each
                      run_config=RunConfig(storage_path=str(FOLDER / "ray"),
                                           failure_config=FailureConfig(max_failures=2))).fit()
print(f"Ray's latest checkpoint: {sorted(p.name for p in Path(result.checkpoint.path).iterdir())}; "
      f"eval_loss {result.metrics['eval_loss']:.3f}")
ray.shutdown()
