"""WGAN-GP: the gradient penalty with `gradients.view(gradients.size(0), -1)` and the critic / generator
updates of PyTorch-GAN, with a convolutional critic.

Origin: github.com/eriklindernoren/PyTorch-GAN, implementations/wgan_gp/wgan_gp.py
(compute_gradient_penalty: alpha from np.random.random, autograd.grad with create_graph=True,
`gradients.view(gradients.size(0), -1)`, lambda_gp = 10; the loop: d_loss = -mean(real) + mean(fake)
+ lambda_gp * penalty, the generator stepped every n_critic batches; Adam(lr=0.0002, betas=(0.5,
0.999))) and the same repository's implementations/dcgan/dcgan.py (Generator with `out.view(...)`
to an image, Discriminator's discriminator_block convolutions and `out.view(out.shape[0], -1)`), its
final Sigmoid left out as a WGAN critic has none. Sizes made tiny: 16x16 images, latent 8.
"""

import numpy as np
import torch
import torch.autograd as autograd
import torch.nn as nn

from zoo import Case

latent_dim, img_size, channels, lambda_gp, n_critic = 8, 16, 1, 10, 2


class Generator(nn.Module):
    def __init__(self):
        super(Generator, self).__init__()
        self.init_size = img_size // 4
        self.l1 = nn.Sequential(nn.Linear(latent_dim, 16 * self.init_size ** 2))
        self.conv_blocks = nn.Sequential(
            nn.BatchNorm2d(16),
            nn.Upsample(scale_factor=2),
            nn.Conv2d(16, 16, 3, stride=1, padding=1),
            nn.BatchNorm2d(16, 0.8),
            nn.LeakyReLU(0.2, inplace=True),
            nn.Upsample(scale_factor=2),
            nn.Conv2d(16, 8, 3, stride=1, padding=1),
            nn.BatchNorm2d(8, 0.8),
            nn.LeakyReLU(0.2, inplace=True),
            nn.Conv2d(8, channels, 3, stride=1, padding=1),
            nn.Tanh(),
        )

    def forward(self, z):
        out = self.l1(z)
        out = out.view(out.shape[0], 16, self.init_size, self.init_size)
        img = self.conv_blocks(out)
        return img


class Discriminator(nn.Module):
    def __init__(self):
        super(Discriminator, self).__init__()

        def discriminator_block(in_filters, out_filters, bn=True):
            block = [nn.Conv2d(in_filters, out_filters, 3, 2, 1), nn.LeakyReLU(0.2, inplace=True), nn.Dropout2d(0.25)]
            if bn:
                block.append(nn.BatchNorm2d(out_filters, 0.8))
            return block

        self.model = nn.Sequential(
            *discriminator_block(channels, 4, bn=False),
            *discriminator_block(4, 8),
            *discriminator_block(8, 16),
        )
        ds_size = img_size // 2 ** 3
        self.adv_layer = nn.Sequential(nn.Linear(16 * ds_size ** 2, 1))

    def forward(self, img):
        out = self.model(img)
        out = out.view(out.shape[0], -1)
        validity = self.adv_layer(out)
        return validity


class WGAN(nn.Module):
    def __init__(self):
        super().__init__()
        self.generator = Generator()
        self.discriminator = Discriminator()


def compute_gradient_penalty(D, real_samples, fake_samples):
    """Calculates the gradient penalty loss for WGAN GP"""
    alpha = torch.tensor(np.random.random((real_samples.size(0), 1, 1, 1)), dtype=real_samples.dtype,
                         device=real_samples.device)
    interpolates = (alpha * real_samples + ((1 - alpha) * fake_samples)).requires_grad_(True)
    d_interpolates = D(interpolates)
    fake = torch.ones(real_samples.shape[0], 1, device=real_samples.device, dtype=d_interpolates.dtype)
    gradients = autograd.grad(
        outputs=d_interpolates,
        inputs=interpolates,
        grad_outputs=fake,
        create_graph=True,
        retain_graph=True,
        only_inputs=True,
    )[0]
    gradients = gradients.view(gradients.size(0), -1)
    gradient_penalty = ((gradients.norm(2, dim=1) - 1) ** 2).mean()
    return gradient_penalty


def batches():
    g = torch.Generator().manual_seed(7)
    return [(torch.rand(4, channels, img_size, img_size, generator=g) * 2 - 1, torch.zeros(4, dtype=torch.long))
            for _ in range(4)]


def optimizers(model):
    return {"D": torch.optim.Adam(model.discriminator.parameters(), lr=0.0002, betas=(0.5, 0.999)),
            "G": torch.optim.Adam(model.generator.parameters(), lr=0.0002, betas=(0.5, 0.999))}


def hand(model, dataloader, amp):
    generator, discriminator = model.generator, model.discriminator
    opts = optimizers(model)
    optimizer_D, optimizer_G = opts["D"], opts["G"]
    for i, (imgs, _) in enumerate(dataloader):
        real_imgs = imgs
        optimizer_D.zero_grad()
        z = torch.randn(imgs.shape[0], latent_dim, device=imgs.device)
        with amp():
            fake_imgs = generator(z)
            real_validity = discriminator(real_imgs)
            fake_validity = discriminator(fake_imgs)
            gradient_penalty = compute_gradient_penalty(discriminator, real_imgs.data, fake_imgs.data)
            d_loss = -torch.mean(real_validity) + torch.mean(fake_validity) + lambda_gp * gradient_penalty
        d_loss.backward()
        optimizer_D.step()
        optimizer_G.zero_grad()
        if i % n_critic == 0:
            with amp():
                fake_imgs = generator(z)
                fake_validity = discriminator(fake_imgs)
                g_loss = -torch.mean(fake_validity)
            g_loss.backward()
            optimizer_G.step()


def fit_kwargs(model):
    count = {"i": 0}  # the loop's batch index, for the n_critic rule

    def step_fn(step, batch):
        imgs, _ = batch
        generator, discriminator = step.model.generator, step.model.discriminator
        real_imgs = imgs
        z = torch.randn(imgs.shape[0], latent_dim, device=imgs.device)
        fake_imgs = generator(z)
        real_validity = discriminator(real_imgs)
        fake_validity = discriminator(fake_imgs)
        gradient_penalty = compute_gradient_penalty(discriminator, real_imgs.data, fake_imgs.data)
        d_loss = -torch.mean(real_validity) + torch.mean(fake_validity) + lambda_gp * gradient_penalty
        step.backward(d_loss)
        step.step("D")
        step.zero_grad("G")
        if count["i"] % n_critic == 0:
            fake_imgs = generator(z)
            fake_validity = discriminator(fake_imgs)
            g_loss = -torch.mean(fake_validity)
            step.backward(g_loss)
            step.step("G")
        count["i"] += 1
        return d_loss

    return {"step_fn": step_fn, "optimizer": optimizers(model)}


CASE = Case("WGAN-GP (grad.view)", WGAN, batches, hand, fit_kwargs)
