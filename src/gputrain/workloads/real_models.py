"""Two real models for speed work: ResNet-18 for 32x32 images and a small GPT for characters.

Both are the usual reference versions (so figures can be compared with published ones):
- `ResNet18Cifar`: He et al.'s ResNet-18 (BasicBlock x [2, 2, 2, 2], widths 64-128-256-512) with
  the CIFAR stem of kuangliu/pytorch-cifar: one 3x3 stride-1 conv and no max-pool, so the 32x32
  input keeps its resolution in the first stage. 11,173,962 parameters at width 64, 10 classes.
- `GPTMini`: a decoder-only transformer as in nanoGPT's shakespeare-char config (6 layers, width
  384, 6 heads, context 256): pre-LayerNorm blocks, causal `scaled_dot_product_attention`, GELU MLP
  of 4x width, learned position embeddings, tied input/output embeddings.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

# ---------------------------------------------------------------- ResNet-18 (CIFAR stem)


class BasicBlock(nn.Module):
    """Two 3x3 conv-BN layers and a residual; a 1x1 stride-s conv-BN shortcut when the shape changes."""

    expansion = 1

    def __init__(self, in_ch: int, out_ch: int, stride: int = 1):
        super().__init__()
        # Convolutions without bias: the BatchNorm right after adds its own shift.
        self.conv1 = nn.Conv2d(in_ch, out_ch, 3, stride=stride, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(out_ch)
        self.conv2 = nn.Conv2d(out_ch, out_ch, 3, stride=1, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(out_ch)
        self.shortcut = nn.Sequential()
        if stride != 1 or in_ch != out_ch:
            self.shortcut = nn.Sequential(nn.Conv2d(in_ch, out_ch, 1, stride=stride, bias=False),
                                          nn.BatchNorm2d(out_ch))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return F.relu(out + self.shortcut(x))


class ResNet18Cifar(nn.Module):
    """ResNet-18 for (B, 3, 32, 32) float inputs -> (B, num_classes) logits.

    width: channels of the first stage (64 in the paper); the stages have width x (1, 2, 4, 8).
    Tests use a small width to run the same architecture quickly on the CPU.
    """

    def __init__(self, num_classes: int = 10, width: int = 64, blocks: tuple[int, ...] = (2, 2, 2, 2)):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, width, 3, stride=1, padding=1, bias=False),
                                  nn.BatchNorm2d(width), nn.ReLU(inplace=True))
        layers = []
        in_ch = width
        for i, n in enumerate(blocks):
            out_ch = width * 2**i
            stride = 1 if i == 0 else 2  # 32x32 -> 32, 16, 8, 4
            for j in range(n):
                layers.append(BasicBlock(in_ch, out_ch, stride if j == 0 else 1))
                in_ch = out_ch
        self.layers = nn.Sequential(*layers)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(in_ch, num_classes)
        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.layers(self.stem(x))
        return self.fc(torch.flatten(self.pool(x), 1))


# ---------------------------------------------------------------- GPT (nanoGPT-style)


class CausalSelfAttention(nn.Module):
    def __init__(self, n_embd: int, n_head: int, dropout: float):
        super().__init__()
        if n_embd % n_head:
            raise ValueError(f"n_embd ({n_embd}) must be a multiple of n_head ({n_head})")
        self.n_head = n_head
        self.qkv = nn.Linear(n_embd, 3 * n_embd)
        self.proj = nn.Linear(n_embd, n_embd)
        self.dropout = dropout
        self.resid_drop = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        q, k, v = self.qkv(x).split(C, dim=2)
        # (B, T, C) -> (B, heads, T, C / heads): SDPA attends over T per head.
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=self.dropout if self.training else 0.0,
                                           is_causal=True)
        y = y.transpose(1, 2).contiguous().view(B, T, C)
        return self.resid_drop(self.proj(y))


class MLP(nn.Module):
    def __init__(self, n_embd: int, dropout: float):
        super().__init__()
        self.fc = nn.Linear(n_embd, 4 * n_embd)
        self.proj = nn.Linear(4 * n_embd, n_embd)
        self.drop = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.drop(self.proj(F.gelu(self.fc(x))))


class Block(nn.Module):
    """Pre-LayerNorm transformer block: x + attn(ln(x)), then x + mlp(ln(x))."""

    def __init__(self, n_embd: int, n_head: int, dropout: float):
        super().__init__()
        self.ln1 = nn.LayerNorm(n_embd)
        self.attn = CausalSelfAttention(n_embd, n_head, dropout)
        self.ln2 = nn.LayerNorm(n_embd)
        self.mlp = MLP(n_embd, dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPTMini(nn.Module):
    """Decoder-only transformer: token ids (B, T) -> next-token logits (B, T, vocab_size).

    Tied embeddings: the output layer reuses the token embedding matrix (GPT-2 and nanoGPT do the
    same). With a character vocabulary this saves only vocab x n_embd parameters (25k of 10.8M), but
    it keeps the model identical to nanoGPT's shakespeare-char reference so that losses and speeds
    can be set side by side, and one matrix of 65 rows is learned from both ends.
    """

    positions: torch.Tensor  # (block_size,) int64, a buffer: 0, 1, ..., block_size - 1

    def __init__(self, vocab_size: int, block_size: int = 256, n_layer: int = 6, n_embd: int = 384,
                 n_head: int = 6, dropout: float = 0.1):
        super().__init__()
        self.block_size = block_size
        self.tok_emb = nn.Embedding(vocab_size, n_embd)
        self.pos_emb = nn.Embedding(block_size, n_embd)
        self.drop = nn.Dropout(dropout)
        self.blocks = nn.ModuleList(Block(n_embd, n_head, dropout) for _ in range(n_layer))
        self.ln_f = nn.LayerNorm(n_embd)
        self.head = nn.Linear(n_embd, vocab_size, bias=False)
        self.head.weight = self.tok_emb.weight  # tied
        # GPT-2's init: N(0, 0.02), and the residual projections scaled by 1/sqrt(2 * n_layer) so
        # the residual stream's variance does not grow with depth.
        self.apply(self._init)
        for name, p in self.named_parameters():
            if name.endswith("proj.weight"):
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * n_layer))
        # Positions 0..block_size-1, a buffer so it follows the model to its device (not saved).
        self.register_buffer("positions", torch.arange(block_size), persistent=False)

    @staticmethod
    def _init(m: nn.Module) -> None:
        if isinstance(m, nn.Linear):
            nn.init.normal_(m.weight, mean=0.0, std=0.02)
            if m.bias is not None:
                nn.init.zeros_(m.bias)
        elif isinstance(m, nn.Embedding):
            nn.init.normal_(m.weight, mean=0.0, std=0.02)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        # gputrain's batch transform turns integer inputs without a mean/std into float32; token
        # ids (< 2**24) survive that exactly, and one cast of B*T values back is negligible.
        if idx.dtype != torch.long:
            idx = idx.long()
        T = idx.shape[1]
        if T > self.block_size:
            raise ValueError(f"sequence of {T} tokens is longer than the context ({self.block_size})")
        x = self.drop(self.tok_emb(idx) + self.pos_emb(self.positions[:T]))  # (B, T, C)
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))  # (B, T, V)


def next_token_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy of (B, T, V) logits against (B, T) int64 targets, over all B*T tokens.

    Named so that gputrain's task inference reads it as a loss-only ("regression") task: accuracy
    with argmax over dim 1 would be meaningless for (B, T, V) outputs.
    """
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1).long())
