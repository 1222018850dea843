"""Bring your own data: a Hugging Face streaming dataset (JSON lines written here, nothing downloaded)
trained for a number of steps, stopped in the middle of a pass and resumed exactly where it was."""

import json
import tempfile
from pathlib import Path

import torch
import torch.nn.functional as F
from datasets import load_dataset
from torch import nn

import gputrain

folder = Path(tempfile.mkdtemp())
g = torch.Generator().manual_seed(0)
with open(folder / "train.jsonl", "w") as f:  # token sequences where each token is the one before + 1 (mod 16)
    for start in torch.randint(0, 16, (1000,), generator=g).tolist():
        f.write(json.dumps({"input_ids": [(start + i) % 16 for i in range(12)]}) + "\n")


class NextToken(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb, self.head = nn.Embedding(16, 32), nn.Linear(32, 16)

    def forward(self, input_ids):  # batches are dicts of columns: model(**batch) returns the loss
        logits = self.head(self.emb(input_ids))
        return F.cross_entropy(logits[:, :-1].flatten(0, 1), input_ids[:, 1:].flatten())


stream = load_dataset("json", data_files=str(folder / "train.jsonl"), split="train", streaming=True)
config = gputrain.TrainConfig(steps=60, batch_size=32, lr=1e-2, run_dir=str(folder / "run"))  # no length: steps
torch.manual_seed(0)
gputrain.fit(NextToken(), stream, config=config.replace(stop_at_step=25))  # stops mid-pass, checkpointed
model = NextToken()
history = gputrain.fit(model, stream, config=config.replace(resume=True))  # goes on from example 800
ids = torch.tensor([[(s + i) % 16 for i in range(12)] for s in range(16)])
accuracy = (model.head(model.emb(ids)).argmax(-1)[:, :-1] == ids[:, 1:]).float().mean()
print(f"steps {history.summary['steps']}, next-token accuracy {accuracy:.3f}")
