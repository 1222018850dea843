"""A Hugging Face BERT classifier built from a tiny config, trained as the Transformers docs do.

Origin: github.com/huggingface/transformers, docs/source/en/training.md ("Train in native PyTorch":
model.train(); outputs = model(**batch); loss = outputs.loss; loss.backward(); optimizer.step();
lr_scheduler.step(); optimizer.zero_grad(), with AdamW(lr=5e-5) and get_scheduler("linear")).
BertConfig tiny (2 layers, width 32), dropout at its default 0.1; no download.
"""

import torch
from transformers import BertConfig, BertForSequenceClassification, get_scheduler

from zoo import Case

STEPS = 3


def make():
    return BertForSequenceClassification(BertConfig(vocab_size=64, hidden_size=32, num_hidden_layers=2,
                                                    num_attention_heads=2, intermediate_size=64,
                                                    max_position_embeddings=16, num_labels=3))


def batches():
    g = torch.Generator().manual_seed(13)
    return [{"input_ids": torch.randint(5, 64, (4, 10), generator=g), "attention_mask": torch.ones(4, 10, dtype=torch.long),
             "labels": torch.randint(0, 3, (4,), generator=g)} for _ in range(STEPS)]


def schedule(optimizer):
    return get_scheduler(name="linear", optimizer=optimizer, num_warmup_steps=0, num_training_steps=STEPS)


def hand(model, train_dataloader, amp):
    optimizer = torch.optim.AdamW(model.parameters(), lr=5e-5)
    lr_scheduler = schedule(optimizer)
    model.train()
    for batch in train_dataloader:
        with amp():
            outputs = model(**batch)
            loss = outputs.loss
        loss.backward()
        optimizer.step()
        lr_scheduler.step()
        optimizer.zero_grad()


CASE = Case("Hugging Face BERT (tiny config)", make, batches, hand,
            lambda model: {"optimizer": torch.optim.AdamW(model.parameters(), lr=5e-5), "scheduler": schedule})
