"""torch's ReduceLROnPlateau as its documentation uses it, on pytorch/examples' MNIST CNN and test().

Origin: the ReduceLROnPlateau docstring in torch/optim/lr_scheduler.py (SGD(lr=0.1, momentum=0.9),
`ReduceLROnPlateau(optimizer, 'min')`, then per epoch `train(...)`, `val_loss = validate(...)`,
`scheduler.step(val_loss)`), with pytorch/examples' mnist/main.py for the model (tests/zoo/mnist.py's
Net), train() and test() (the summed F.nll_loss over the test set divided by its size). patience=0
and threshold=0.5: a validation loss that does not fall by half within an epoch halves the learning
rate, so that three epochs take the scheduler's decisions three times. fit evaluates at each epoch's
end and steps the scheduler on eval_loss (scheduler_interval="epoch").
"""

import torch
import torch.nn.functional as F
import torch.optim as optim
from torch.optim.lr_scheduler import ReduceLROnPlateau

from zoo import Case
from zoo.mnist import Net

EPOCHS, BATCHES = 3, 2


def batches():
    g = torch.Generator().manual_seed(11)
    return [(torch.randn(4, 1, 28, 28, generator=g), torch.randint(0, 10, (4,), generator=g))
            for _ in range(BATCHES)]


def validation():
    g = torch.Generator().manual_seed(12)
    return [(torch.randn(8, 1, 28, 28, generator=g), torch.randint(0, 10, (8,), generator=g))]


def _plateau(optimizer):
    return ReduceLROnPlateau(optimizer, 'min', factor=0.5, patience=0, threshold=0.5)


def test(model, test_loader):
    model.eval()
    test_loss = 0
    with torch.no_grad():
        for data, target in test_loader:
            output = model(data)
            test_loss += F.nll_loss(output, target, reduction='sum').item()  # sum up batch loss
    test_loss /= sum(len(t) for _, t in test_loader)
    return test_loss


def hand(model, data, amp):
    optimizer = optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    scheduler = _plateau(optimizer)
    val = [(x.to(data[0][0].device), y.to(data[0][0].device)) for x, y in validation()]
    for epoch in range(EPOCHS):
        model.train()
        for x, target in data:
            optimizer.zero_grad()
            with amp():
                loss = F.nll_loss(model(x), target)
            loss.backward()
            optimizer.step()
        val_loss = test(model, val)
        # Note that step should be called after validate()
        scheduler.step(val_loss)
    assert optimizer.param_groups[0]["lr"] < 0.1, "the case must take a plateau decision"


CASE = Case("torch's ReduceLROnPlateau on the MNIST CNN (per epoch, on eval_loss)", Net, batches, hand,
            lambda model: {"loss_fn": F.nll_loss, "optimizer": optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                           "scheduler": _plateau, "eval_data": validation()},
            config={"steps": EPOCHS * BATCHES, "scheduler_interval": "epoch", "scheduler_monitor": "eval_loss"})
