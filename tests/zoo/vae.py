"""pytorch/examples' VAE and its loss_function.

Origin: github.com/pytorch/examples, vae/main.py: VAE (fc1 784->400, fc21/fc22 ->20, fc3, fc4,
reparameterize with torch.randn_like), loss_function (binary cross entropy summed + KLD),
Adam(lr=1e-3); train() calls model.train().
"""

import torch
import torch.nn.functional as F
from torch import nn, optim

from zoo import Case


class VAE(nn.Module):
    def __init__(self):
        super(VAE, self).__init__()

        self.fc1 = nn.Linear(784, 400)
        self.fc21 = nn.Linear(400, 20)
        self.fc22 = nn.Linear(400, 20)
        self.fc3 = nn.Linear(20, 400)
        self.fc4 = nn.Linear(400, 784)

    def encode(self, x):
        h1 = F.relu(self.fc1(x))
        return self.fc21(h1), self.fc22(h1)

    def reparameterize(self, mu, logvar):
        std = torch.exp(0.5*logvar)
        eps = torch.randn_like(std)
        return mu + eps*std

    def decode(self, z):
        h3 = F.relu(self.fc3(z))
        return torch.sigmoid(self.fc4(h3))

    def forward(self, x):
        mu, logvar = self.encode(x.view(-1, 784))
        z = self.reparameterize(mu, logvar)
        return self.decode(z), mu, logvar


# Reconstruction + KL divergence losses summed over all elements and batch
def loss_function(recon_x, x, mu, logvar):
    BCE = F.binary_cross_entropy(recon_x, x.view(-1, 784), reduction='sum')
    KLD = -0.5 * torch.sum(1 + logvar - mu.pow(2) - logvar.exp())
    return BCE + KLD


def batches():
    g = torch.Generator().manual_seed(4)
    return [(torch.rand(8, 1, 28, 28, generator=g), torch.zeros(8, dtype=torch.long)) for _ in range(3)]


def hand(model, train_loader, amp):
    optimizer = optim.Adam(model.parameters(), lr=1e-3)
    model.train()
    for batch_idx, (data, _) in enumerate(train_loader):
        optimizer.zero_grad()
        with amp():
            recon_batch, mu, logvar = model(data)
            loss = loss_function(recon_batch, data, mu, logvar)
        loss.backward()
        optimizer.step()


def compute_loss(model, batch):
    data, _ = batch
    recon_batch, mu, logvar = model(data)
    return loss_function(recon_batch, data, mu, logvar)


CASE = Case("pytorch/examples VAE", VAE, batches, hand,
            lambda model: {"compute_loss": compute_loss, "optimizer": optim.Adam(model.parameters(), lr=1e-3)})
