"""Fine-tune with frozen parts: LoRA adapters (PEFT, `pip install 'gputrain[adapters]'`) on a GPT-2 base
that stays frozen. The checkpoints hold the adapter, its optimizer state and a fingerprint of the base;
the adapter is saved as PEFT saves it. (A small base from a config stands in for a pretrained one:
GPT2LMHeadModel.from_pretrained("gpt2") trains the same way.)"""

from pathlib import Path

import torch
from peft import LoraConfig, PeftModel, get_peft_model
from transformers import GPT2Config, GPT2LMHeadModel

import gputrain


def base_model():
    torch.manual_seed(0)  # the same base weights every time, as a pretrained checkpoint gives
    return GPT2LMHeadModel(GPT2Config(vocab_size=64, n_positions=16, n_embd=64, n_layer=2, n_head=2,
                                      bos_token_id=0, eos_token_id=0))


def counting(n, seed):
    """Token sequences that count up by one (mod 64) from a random start: each next token is predictable."""
    start = torch.randint(0, 64, (n, 1), generator=torch.Generator().manual_seed(seed))
    ids = (start + torch.arange(16)) % 64
    return {"input_ids": ids, "labels": ids}


model = get_peft_model(base_model(), LoraConfig(r=8, lora_alpha=16, target_modules=["c_attn", "c_fc"],
                                                fan_in_fan_out=True))  # GPT-2's Conv1D layers
before = gputrain.evaluate(model, counting(256, 2))["eval_loss"]
history = gputrain.fit(model, counting(2048, 1), eval_data=counting(256, 2),  # the model's own loss, from labels
                       config=gputrain.TrainConfig(steps=200, batch_size=32, lr=1e-2, weight_decay=0.01,
                                                   run_dir="runs/lora"))
checkpoint = max(Path("runs/lora/checkpoints").glob("step-*.pt"))
print(f"eval loss {before:.3f} -> {history.summary['final_eval_loss']:.3f}; {checkpoint.name}: "
      f"{checkpoint.stat().st_size / 1e3:.0f} kB, {history.summary['checkpoint_contents']}")

model.save_pretrained("runs/lora/adapter")  # PEFT's adapter_config.json + adapter_model.safetensors
reloaded = PeftModel.from_pretrained(base_model(), "runs/lora/adapter")
same = gputrain.evaluate(reloaded, counting(256, 2))["eval_loss"] == history.summary["final_eval_loss"]
print(f"the adapter reloads onto the base with the same eval loss: {same}")
