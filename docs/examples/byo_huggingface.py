"""Bring your own model, way 3: a Hugging Face model computes its own loss from dict batches;
a torchmetrics metric sees its .logits and batch["labels"]. (Tiny config, random weights.)"""

import torch
from torchmetrics.classification import MulticlassAccuracy
from transformers import BertConfig, BertForSequenceClassification

import gputrain


def token_task(n, seed):
    """Label 1 when token 1 is 3, label 0 when it is 4; the other tokens are noise."""
    g = torch.Generator().manual_seed(seed)
    labels = torch.randint(0, 2, (n,), generator=g)
    input_ids = torch.randint(5, 50, (n, 8), generator=g)
    input_ids[:, 1] = torch.where(labels == 1, 3, 4)
    return {"input_ids": input_ids, "attention_mask": torch.ones_like(input_ids), "labels": labels}


torch.manual_seed(0)
model = BertForSequenceClassification(BertConfig(
    vocab_size=50, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
    max_position_embeddings=8, num_labels=2, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0))
history = gputrain.fit(model, token_task(512, 1), eval_data=token_task(200, 2),  # no loss_fn: model(**batch).loss
                       metrics={"acc": MulticlassAccuracy(num_classes=2, average="micro")},
                       config=gputrain.TrainConfig(epochs=4, batch_size=32, lr=3e-3))
print(f"eval accuracy {history.summary['final_eval_acc']:.3f}")
