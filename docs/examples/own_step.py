"""A step of your own: a GAN on the digits data set, distillation from a frozen teacher, a
WGAN-style gradient penalty, and WGAN-GP with n_critic (branching on step.index), each through
`gputrain.fit(..., step_fn=...)`.

Your step gets the batch and a context that owns what gputrain must: `step.backward(loss)` (precision,
accumulation), `step.step(name)` (gradient averaging over processes, clipping, the optimizer and its
scheduler), and the optimizers by name. It returns its losses by name; they are summed on the device
and logged at log points (no host read per step). Checkpoints hold every optimizer and scheduler.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

import gputrain
from gputrain.workloads import get_workload

NOISE = 16


def digits(n: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The 8x8 digits as (N, 64) floats in [-1, 1], and their labels."""
    x, y = get_workload("digits-cnn").make_data().train
    x = x.reshape(len(x), 64).float() / 8.0 - 1.0  # pixel values 0..16
    return (x[:n], y[:n]) if n else (x, y)


class GAN(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.generator = nn.Sequential(nn.Linear(NOISE, 64), nn.ReLU(), nn.Linear(64, 64), nn.Tanh())
        self.discriminator = nn.Sequential(nn.Linear(64, 64), nn.LeakyReLU(0.2), nn.Linear(64, 1))


# --8<-- [start:gan_step]
def gan_step(step, batch):
    """One discriminator step, then one generator step (non-saturating loss)."""
    real, _ = batch
    model = step.model
    z = torch.randn(real.shape[0], NOISE, device=real.device)
    fake = model.generator(z)
    ones = torch.ones(real.shape[0], 1, device=real.device)
    d_loss = F.binary_cross_entropy_with_logits(model.discriminator(real), ones) + \
        F.binary_cross_entropy_with_logits(model.discriminator(fake.detach()), 1 - ones)
    step.backward(d_loss)
    step.step("discriminator")
    g_loss = F.binary_cross_entropy_with_logits(model.discriminator(fake), ones)
    step.backward(g_loss)
    step.step("generator")
    return {"d_loss": d_loss, "g_loss": g_loss}
# --8<-- [end:gan_step]


def gan_optimizers(model: GAN):
    # fused: one kernel per step that reads its own step count (the for-loop Adam reads it with .item())
    return {"generator": torch.optim.Adam(model.generator.parameters(), lr=2e-3, betas=(0.5, 0.999), fused=True),
            "discriminator": torch.optim.Adam(model.discriminator.parameters(), lr=2e-3, betas=(0.5, 0.999),
                                              fused=True)}


class Distill(nn.Module):
    """A small student learns a frozen teacher's soft labels (and the true ones)."""

    def __init__(self, teacher: nn.Module):
        super().__init__()
        torch.manual_seed(1)
        self.teacher = teacher.requires_grad_(False).eval()
        self.student = nn.Sequential(nn.Linear(64, 16), nn.ReLU(), nn.Linear(16, 10))

    def forward(self, x):  # what evaluation calls (with loss_fn): the student alone
        return self.student(x)


def distill_step(step, batch, temperature: float = 2.0):
    x, y = batch
    with torch.no_grad():
        soft = F.softmax(step.model.teacher(x) / temperature, dim=-1)
    logits = step.model.student(x)
    kd = F.kl_div(F.log_softmax(logits / temperature, dim=-1), soft, reduction="batchmean") * temperature ** 2
    ce = F.cross_entropy(logits, y)
    step.backward(kd + ce)
    step.step()  # the one optimizer: the student's
    return {"kd_loss": kd, "ce_loss": ce}


def critic_step(step, real: torch.Tensor, weight: float) -> tuple[torch.Tensor, torch.Tensor]:
    """A WGAN-GP critic step: the gradient penalty is a backward through a gradient (create_graph).
    Returns the critic's loss and the penalty."""
    model = step.model
    fake = model.generator(torch.randn(real.shape[0], NOISE, device=real.device)).detach()
    mix = torch.rand(real.shape[0], 1, device=real.device)
    between = (mix * real + (1 - mix) * fake).requires_grad_(True)
    grad, = torch.autograd.grad(model.discriminator(between).sum(), between, create_graph=True)
    penalty = ((grad.norm(dim=1) - 1) ** 2).mean()
    critic = model.discriminator(fake).mean() - model.discriminator(real).mean()
    step.backward(critic + weight * penalty)
    step.step("discriminator")
    return critic, penalty


def penalty_step(step, batch, weight: float = 10.0):
    """WGAN-GP: a critic step, then a generator step."""
    real, _ = batch
    model = step.model
    critic, penalty = critic_step(step, real, weight)
    g_loss = -model.discriminator(model.generator(torch.randn(real.shape[0], NOISE, device=real.device))).mean()
    step.backward(g_loss)
    step.step("generator")
    return {"critic": critic, "penalty": penalty, "g_loss": g_loss}


N_CRITIC = 5  # critic steps per generator step (WGAN's n_critic)


def wgan_gp_step(step, batch, weight: float = 10.0):
    """WGAN-GP with n_critic: the critic steps every step, the generator on one step in N_CRITIC.

    The branch reads step.index, the run's step count (a Python int: no host read, right after a
    resume too). The generator's loss is returned on its steps only: it is logged as the mean over
    those steps, with `g_loss_steps` saying how many there were."""
    real, _ = batch
    model = step.model
    critic, penalty = critic_step(step, real, weight)
    if step.index % N_CRITIC != N_CRITIC - 1:
        return {"critic": critic, "penalty": penalty}
    g_loss = -model.discriminator(model.generator(torch.randn(real.shape[0], NOISE, device=real.device))).mean()
    step.backward(g_loss)
    step.step("generator")
    return {"critic": critic, "penalty": penalty, "g_loss": g_loss}


if __name__ == "__main__":
    config = gputrain.TrainConfig(epochs=20, batch_size=64, log_every=50)
    gan = GAN()
    history = gputrain.fit(gan, digits(), step_fn=gan_step, optimizer=gan_optimizers(gan), config=config)
    print("GAN:", {k: round(history.final(k), 3) for k in ("d_loss", "g_loss")})

    teacher = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 10))
    gputrain.fit(teacher, digits(), loss_fn=nn.CrossEntropyLoss(), config=config)
    student = Distill(teacher)
    history = gputrain.fit(student, digits(), step_fn=distill_step, loss_fn=nn.CrossEntropyLoss(),  # for evaluation
                           optimizer={"student": lambda m: torch.optim.AdamW(m.student.parameters(), lr=3e-3)},
                           eval_data=digits(300), config=config)
    print(f"student accuracy {history.final('eval_accuracy'):.3f}")

    wgan = GAN()
    history = gputrain.fit(wgan, digits(), step_fn=penalty_step, optimizer=gan_optimizers(wgan), config=config)
    print("WGAN-GP:", {k: round(history.final(k), 3) for k in ("critic", "penalty", "g_loss")})

    wgan = GAN()
    history = gputrain.fit(wgan, digits(), step_fn=wgan_gp_step, optimizer=gan_optimizers(wgan), config=config)
    print(f"WGAN-GP, n_critic={N_CRITIC}:", {k: round(history.final(k), 3) for k in ("critic", "g_loss")},
          f"(g_loss over {history.final('g_loss_steps')} of the last {config.log_every} steps)")
