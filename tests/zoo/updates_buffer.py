"""A forward that updates buffers: the VQ-VAE-2 quantizer's EMA codebook.

Origin: github.com/rosinality/vq-vae-2-pytorch, vqvae.py (Quantize: nearest code by distance,
`if self.training:` the cluster sizes and code sums are updated in place as exponential moving
averages and the codebook `embed` is replaced by their normalized ratio; the straight-through
`input + (quantize - input).detach()`; diff = commitment loss) and train_vqvae.py (loss = recon MSE
+ 0.25 * latent loss, Adam(lr=3e-4)). The single-process all_reduce calls are left out (no-ops).
A small linear encoder and decoder around it.
"""

import torch
import torch.nn.functional as F
from torch import nn

from zoo import Case


class Quantize(nn.Module):
    def __init__(self, dim, n_embed, decay=0.99, eps=1e-5):
        super().__init__()

        self.dim = dim
        self.n_embed = n_embed
        self.decay = decay
        self.eps = eps

        embed = torch.randn(dim, n_embed)
        self.register_buffer("embed", embed)
        self.register_buffer("cluster_size", torch.zeros(n_embed))
        self.register_buffer("embed_avg", embed.clone())

    def forward(self, input):
        flatten = input.reshape(-1, self.dim)
        dist = (
            flatten.pow(2).sum(1, keepdim=True)
            - 2 * flatten @ self.embed
            + self.embed.pow(2).sum(0, keepdim=True)
        )
        _, embed_ind = (-dist).max(1)
        embed_onehot = F.one_hot(embed_ind, self.n_embed).type(flatten.dtype)
        embed_ind = embed_ind.view(*input.shape[:-1])
        quantize = self.embed_code(embed_ind)

        if self.training:
            embed_onehot_sum = embed_onehot.sum(0)
            embed_sum = flatten.transpose(0, 1) @ embed_onehot

            self.cluster_size.data.mul_(self.decay).add_(
                embed_onehot_sum, alpha=1 - self.decay
            )
            self.embed_avg.data.mul_(self.decay).add_(embed_sum, alpha=1 - self.decay)
            n = self.cluster_size.sum()
            cluster_size = (
                (self.cluster_size + self.eps) / (n + self.n_embed * self.eps) * n
            )
            embed_normalized = self.embed_avg / cluster_size.unsqueeze(0)
            self.embed.data.copy_(embed_normalized)

        diff = (quantize.detach() - input).pow(2).mean()
        quantize = input + (quantize - input).detach()

        return quantize, diff, embed_ind

    def embed_code(self, embed_id):
        return F.embedding(embed_id, self.embed.transpose(0, 1))


class TinyVQ(nn.Module):
    def __init__(self):
        super().__init__()
        self.enc = nn.Linear(16, 8)
        self.quantize = Quantize(8, 12)
        self.dec = nn.Linear(8, 16)

    def forward(self, input):
        quant, diff, _ = self.quantize(self.enc(input))
        return self.dec(quant), diff


def batches():
    g = torch.Generator().manual_seed(11)
    return [(torch.randn(8, 16, generator=g),) for _ in range(4)]


def compute_loss(model, batch):
    img = batch[0]
    out, latent_loss = model(img)
    recon_loss = F.mse_loss(out, img)
    return recon_loss + 0.25 * latent_loss.mean()


def hand(model, loader, amp):
    optimizer = torch.optim.Adam(model.parameters(), lr=3e-4)
    model.train()
    for (img,) in loader:
        model.zero_grad()
        with amp():
            loss = compute_loss(model, (img,))
        loss.backward()
        optimizer.step()


CASE = Case("forward updating buffers (VQ-VAE EMA codebook)", TinyVQ, batches, hand,
            lambda model: {"compute_loss": compute_loss, "optimizer": torch.optim.Adam(model.parameters(), lr=3e-4)})
