"""pytorch/examples' DCGAN: generator, discriminator, weights_init and the two-step GAN update.

Origin: github.com/pytorch/examples, dcgan/main.py (Generator, Discriminator with
`output.view(-1, 1).squeeze(1)`, weights_init, BCELoss, Adam(lr=0.0002, betas=(0.5, 0.999)), the
loop "(1) Update D network ... (2) Update G network"). Sizes made tiny: nz=8, ngf=ndf=4, 64x64 RGB.
"""

import torch
import torch.nn as nn
import torch.optim as optim

from zoo import Case

nz, ngf, ndf, nc, ngpu = 8, 4, 4, 3, 1
real_label, fake_label = 1, 0


def weights_init(m):
    classname = m.__class__.__name__
    if classname.find('Conv') != -1:
        torch.nn.init.normal_(m.weight, 0.0, 0.02)
    elif classname.find('BatchNorm') != -1:
        torch.nn.init.normal_(m.weight, 1.0, 0.02)
        torch.nn.init.zeros_(m.bias)


class Generator(nn.Module):
    def __init__(self, ngpu):
        super(Generator, self).__init__()
        self.ngpu = ngpu
        self.main = nn.Sequential(
            nn.ConvTranspose2d(nz, ngf * 8, 4, 1, 0, bias=False),
            nn.BatchNorm2d(ngf * 8),
            nn.ReLU(True),
            nn.ConvTranspose2d(ngf * 8, ngf * 4, 4, 2, 1, bias=False),
            nn.BatchNorm2d(ngf * 4),
            nn.ReLU(True),
            nn.ConvTranspose2d(ngf * 4, ngf * 2, 4, 2, 1, bias=False),
            nn.BatchNorm2d(ngf * 2),
            nn.ReLU(True),
            nn.ConvTranspose2d(ngf * 2, ngf, 4, 2, 1, bias=False),
            nn.BatchNorm2d(ngf),
            nn.ReLU(True),
            nn.ConvTranspose2d(ngf, nc, 4, 2, 1, bias=False),
            nn.Tanh()
        )

    def forward(self, input):
        if input.is_cuda and self.ngpu > 1:
            output = nn.parallel.data_parallel(self.main, input, range(self.ngpu))
        else:
            output = self.main(input)
        return output


class Discriminator(nn.Module):
    def __init__(self, ngpu):
        super(Discriminator, self).__init__()
        self.ngpu = ngpu
        self.main = nn.Sequential(
            nn.Conv2d(nc, ndf, 4, 2, 1, bias=False),
            nn.LeakyReLU(0.2, inplace=True),
            nn.Conv2d(ndf, ndf * 2, 4, 2, 1, bias=False),
            nn.BatchNorm2d(ndf * 2),
            nn.LeakyReLU(0.2, inplace=True),
            nn.Conv2d(ndf * 2, ndf * 4, 4, 2, 1, bias=False),
            nn.BatchNorm2d(ndf * 4),
            nn.LeakyReLU(0.2, inplace=True),
            nn.Conv2d(ndf * 4, ndf * 8, 4, 2, 1, bias=False),
            nn.BatchNorm2d(ndf * 8),
            nn.LeakyReLU(0.2, inplace=True),
            nn.Conv2d(ndf * 8, 1, 4, 1, 0, bias=False),
            nn.Sigmoid()
        )

    def forward(self, input):
        if input.is_cuda and self.ngpu > 1:
            output = nn.parallel.data_parallel(self.main, input, range(self.ngpu))
        else:
            output = self.main(input)
        return output.view(-1, 1).squeeze(1)


class GAN(nn.Module):
    """The two networks in one module, as fit takes one model (their code unchanged)."""

    def __init__(self):
        super().__init__()
        self.netG = Generator(ngpu)
        self.netG.apply(weights_init)
        self.netD = Discriminator(ngpu)
        self.netD.apply(weights_init)


def batches():
    g = torch.Generator().manual_seed(3)
    return [(torch.rand(4, nc, 64, 64, generator=g) * 2 - 1, torch.zeros(4, dtype=torch.long)) for _ in range(4)]


def optimizers(gan):
    return {"D": optim.Adam(gan.netD.parameters(), lr=0.0002, betas=(0.5, 0.999)),
            "G": optim.Adam(gan.netG.parameters(), lr=0.0002, betas=(0.5, 0.999))}


criterion = nn.BCELoss()


def hand(gan, dataloader, amp):
    netG, netD = gan.netG, gan.netD
    opts = optimizers(gan)
    optimizerD, optimizerG = opts["D"], opts["G"]
    for i, data in enumerate(dataloader, 0):
        # (1) Update D network: maximize log(D(x)) + log(1 - D(G(z)))
        netD.zero_grad()
        real_cpu = data[0]
        batch_size = real_cpu.size(0)
        label = torch.full((batch_size,), real_label, dtype=real_cpu.dtype, device=real_cpu.device)
        with amp():
            output = netD(real_cpu)
            errD_real = criterion(output, label)
        errD_real.backward()
        noise = torch.randn(batch_size, nz, 1, 1, device=real_cpu.device)
        with amp():
            fake = netG(noise)
            label.fill_(fake_label)
            output = netD(fake.detach())
            errD_fake = criterion(output, label)
        errD_fake.backward()
        optimizerD.step()
        # (2) Update G network: maximize log(D(G(z)))
        netG.zero_grad()
        label.fill_(real_label)
        with amp():
            output = netD(fake)
            errG = criterion(output, label)
        errG.backward()
        optimizerG.step()


def step_fn(step, data):
    """The same update through fit's step: backward/step by optimizer name instead of the calls on them."""
    netG, netD = step.model.netG, step.model.netD
    real_cpu = data[0]
    batch_size = real_cpu.size(0)
    label = torch.full((batch_size,), real_label, dtype=real_cpu.dtype, device=real_cpu.device)
    output = netD(real_cpu)
    errD_real = criterion(output, label)
    step.backward(errD_real)
    noise = torch.randn(batch_size, nz, 1, 1, device=real_cpu.device)
    fake = netG(noise)
    label.fill_(fake_label)
    output = netD(fake.detach())
    errD_fake = criterion(output, label)
    step.backward(errD_fake)
    step.step("D")
    step.zero_grad("G")
    label.fill_(real_label)
    output = netD(fake)
    errG = criterion(output, label)
    step.backward(errG)
    step.step("G")
    return {"errD": errD_real + errD_fake, "errG": errG}


CASE = Case("pytorch/examples DCGAN", GAN, batches, hand, lambda gan: {"step_fn": step_fn, "optimizer": optimizers(gan)})
