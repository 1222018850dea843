"""A Hugging Face GPT-2 language model built from a tiny config; labels = input_ids (the model shifts).

Origin: github.com/huggingface/transformers, docs/source/en/training.md ("Train in native PyTorch"
loop, AdamW(lr=5e-5), linear schedule: tests/zoo/hf_bert.py) with GPT2LMHeadModel, whose forward shifts the labels inside. GPT2Config tiny
(2 layers, width 32), dropouts at their default 0.1; no download.
"""

import torch
from transformers import GPT2Config, GPT2LMHeadModel

from zoo import Case
from zoo.hf_bert import STEPS, hand, schedule  # the same docs loop (AdamW, linear schedule)


def make():
    return GPT2LMHeadModel(GPT2Config(vocab_size=64, n_positions=16, n_embd=32, n_layer=2, n_head=2))


def batches():
    g = torch.Generator().manual_seed(14)
    out = []
    for _ in range(STEPS):
        ids = torch.randint(0, 64, (4, 12), generator=g)
        out.append({"input_ids": ids, "labels": ids.clone()})
    return out


CASE = Case("Hugging Face GPT-2 (tiny config)", make, batches, hand,
            lambda model: {"optimizer": torch.optim.AdamW(model.parameters(), lr=5e-5), "scheduler": schedule})
