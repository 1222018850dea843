"""Use the trained model: evaluate it, predict with it (batched, on the device, outputs on the CPU),
and export its weights to safetensors (`pip install 'gputrain[export]'`)."""

import torch
from safetensors.torch import load_file
from torch import nn

import gputrain
from gputrain.export import export_safetensors

g = torch.Generator().manual_seed(0)
x = torch.randn(1200, 10, generator=g)
y = (x[:, :3].sum(1) > 0).long()


def make_model():
    return nn.Sequential(nn.Linear(10, 32), nn.ReLU(), nn.Linear(32, 2))


torch.manual_seed(0)
model = make_model()
gputrain.fit(model, (x[:1000], y[:1000]), loss_fn=nn.CrossEntropyLoss(),
             config=gputrain.TrainConfig(epochs=10, batch_size=64, lr=1e-2))

# The same batch and loss rules as fit: a pair with loss_fn gives eval_loss and eval_accuracy.
metrics = gputrain.evaluate(model, (x[1000:], y[1000:]), loss_fn=nn.CrossEntropyLoss())
# Inputs alone: model(x) batch by batch; the logits come back on the CPU (or go to a file with out=).
logits = gputrain.predict(model, x[1000:], out="predictions.pt")

export_safetensors(model.state_dict(), "model.safetensors")
fresh = make_model()
fresh.load_state_dict(load_file("model.safetensors"))
same = torch.equal(gputrain.predict(fresh, x[1000:]), logits)
print(f"eval accuracy {metrics['eval_accuracy']:.3f}; predictions {tuple(logits.shape)}; reloaded model agrees: {same}")
