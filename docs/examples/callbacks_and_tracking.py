"""Extend and track: a callback of your own, EarlyStopping and EMA, your scheduler, and MLflow beside
the CSV files (MLflow needs `pip install 'gputrain[track]'`; without it the run says so and goes on)."""

import torch
from torch import nn

import gputrain


class HalveLrOnPlateau(gputrain.Callback):
    """Runs at log points, with the values already read: no extra host sync, CUDA graphs unchanged."""

    def __init__(self):
        self.best = float("inf")

    def on_log(self, run, record):
        if "eval_loss" in record:
            if record["eval_loss"] > self.best:
                run.scale_lr(0.5)  # the schedule goes on from the halved rate; saved in checkpoints
            self.best = min(self.best, record["eval_loss"])


g = torch.Generator().manual_seed(0)
x = torch.randn(2000, 10, generator=g)
y = (x[:, :3].sum(1) > 0).long()

torch.manual_seed(0)
model = nn.Sequential(nn.Linear(10, 64), nn.ReLU(), nn.Linear(64, 2))
history = gputrain.fit(
    model, (x[:1600], y[:1600]), loss_fn=nn.CrossEntropyLoss(), eval_data=(x[1600:], y[1600:]),
    callbacks=[HalveLrOnPlateau(), gputrain.EarlyStopping("eval_loss", patience=3), gputrain.EMA(0.99)],
    scheduler=lambda opt: torch.optim.lr_scheduler.StepLR(opt, step_size=100, gamma=0.7),
    config=gputrain.TrainConfig(epochs=30, batch_size=64, lr=1e-2, log_every=25, run_dir="runs/extend-and-track",
                                loggers=("csv", "mlflow")))
s = history.summary
print(f"steps {s['steps']} of {s['total_steps']}; stopped by: {s['stopped_by']}")
print(f"eval accuracy {s['final_eval_accuracy']:.3f} (EMA weights: {s['final_eval_ema_accuracy']:.3f})")
