"""Character-level token data for language models: a local text file, or a seeded synthetic chain.

A corpus is one stream of token ids. It is cut into non-overlapping windows of `block_size + 1`
tokens' span: inputs are tokens [i*T, i*T + T) and targets the same window shifted by one, both
int64 (N, T), so every token of the training part is a target once per epoch. The last tenth of the
stream (by tokens) is the test split, as in nanoGPT, when it holds at least one window.

Nothing is downloaded: a text file is the user's (`text=PATH` / `--data-dir PATH`); otherwise the
tokens come from a small random Markov chain whose entropy rate (the best loss any model can
reach, in nats per token) is known, so a falling loss can be checked against a floor.
"""

from __future__ import annotations

import bisect
import os
from dataclasses import dataclass
from pathlib import Path

import torch

from gputrain.errors import DataError
from gputrain.workloads.base import DataSplits

TEST_FRACTION = 0.1
SYNTHETIC_VOCAB = 65  # tiny Shakespeare's character count: the same model size on synthetic and real text
SYNTHETIC_BRANCHING = 4  # possible successors per token: learnable, with a loss floor near 1 nat/token


@dataclass
class CharCorpus:
    """A token stream (int64 (n,)) and its vocabulary (the characters, in id order)."""

    tokens: torch.Tensor
    chars: list[str]
    source: str  # where it came from, for summaries and errors

    @property
    def vocab_size(self) -> int:
        return len(self.chars)

    def encode(self, text: str) -> torch.Tensor:
        index = {c: i for i, c in enumerate(self.chars)}
        return torch.tensor([index[c] for c in text], dtype=torch.int64)

    def decode(self, ids) -> str:
        return "".join(self.chars[int(i)] for i in ids)


def resolve_text_path(path: str | os.PathLike) -> Path:
    """A text file, or a folder holding `input.txt` (nanoGPT's name for tiny Shakespeare)."""
    p = Path(path).expanduser()
    if p.is_dir():
        candidate = p / "input.txt"
        if not candidate.is_file():
            raise DataError(f"text folder {p} has no input.txt: pass the text file itself "
                            "(--option text=PATH or --data-dir PATH)")
        return candidate
    if not p.is_file():
        raise DataError(f"text file {p} does not exist: pass a UTF-8 text file (--option text=PATH or "
                        "--data-dir PATH); gputrain never downloads one")
    return p


def load_char_corpus(path: str | os.PathLike, block_size: int) -> CharCorpus:
    """Read a UTF-8 text file; the vocabulary is its distinct characters, sorted.

    Raises DataError naming the path when it is missing, not UTF-8, empty, or shorter than one
    context (block_size + 1 characters: T inputs and the target after the last).
    """
    p = resolve_text_path(path)
    try:
        text = p.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise DataError(f"text file {p} is not UTF-8 text ({exc})") from None
    except OSError as exc:
        raise DataError(f"text file {p} could not be read ({exc})") from None
    if not text:
        raise DataError(f"text file {p} is empty")
    if len(text) < block_size + 1:
        raise DataError(f"text file {p} has {len(text)} characters, fewer than one context needs "
                        f"(block_size + 1 = {block_size + 1}); use a longer text or a smaller block_size")
    chars = sorted(set(text))
    corpus = CharCorpus(torch.empty(0, dtype=torch.int64), chars, str(p))
    corpus.tokens = corpus.encode(text)
    return corpus


def markov_chain(vocab_size: int, branching: int, seed: int) -> torch.Tensor:
    """A random first-order chain: (V, V) transition probabilities, `branching` successors per token.

    Each token has `branching` possible next tokens with Dirichlet(1) weights, so the chain is far
    from uniform (a model can learn it) but not deterministic (the loss has a floor above zero).
    """
    g = torch.Generator().manual_seed(seed)
    probs = torch.zeros(vocab_size, vocab_size, dtype=torch.float64)
    for a in range(vocab_size):
        nxt = torch.randperm(vocab_size, generator=g)[:branching]
        w = -torch.log(torch.rand(branching, generator=g, dtype=torch.float64))  # Dirichlet(1) via Exp(1)
        probs[a, nxt] = w / w.sum()
    return probs


def entropy_rate(probs: torch.Tensor) -> float:
    """Nats per token of a stationary chain: sum_a pi(a) H(P[a]); the lowest mean loss possible."""
    # Stationary distribution by power iteration (the chain is random and dense enough to mix).
    pi = torch.full((probs.shape[0],), 1.0 / probs.shape[0], dtype=torch.float64)
    for _ in range(1000):
        pi = pi @ probs
    logs = torch.where(probs > 0, probs.log(), torch.zeros_like(probs))
    return float(-(pi * (probs * logs).sum(1)).sum())


def synthetic_corpus(n_tokens: int = 2**20, vocab_size: int = SYNTHETIC_VOCAB, branching: int = SYNTHETIC_BRANCHING,
                     seed: int = 0
                     ) -> tuple[CharCorpus, float]:
    """`n_tokens` ids drawn from `markov_chain(vocab_size, branching, seed)`; also its entropy rate.

    Returns (corpus, entropy rate in nats per token).
    """
    probs = markov_chain(vocab_size, branching, seed)
    g = torch.Generator().manual_seed(seed + 1)
    # Sampling step by step in Python would take seconds for 1M tokens; instead draw every step's
    # uniform at once and walk the chain through cumulative rows (a searchsorted per token).
    cum = probs.cumsum(1).to(torch.float32)
    cum[:, -1] = 1.0
    u = torch.rand(n_tokens, generator=g)
    cum_rows = cum.tolist()
    out = [0] * n_tokens
    state = 0
    u_list = u.tolist()
    for i in range(n_tokens):
        state = min(bisect.bisect_right(cum_rows[state], u_list[i]), vocab_size - 1)
        out[i] = state
    chars = [chr(ord("!") + i) for i in range(vocab_size)]  # printable stand-ins, for decode()
    corpus = CharCorpus(torch.tensor(out, dtype=torch.int64), chars, f"synthetic Markov chain (seed {seed})")
    return corpus, entropy_rate(probs)


def windows(tokens: torch.Tensor, block_size: int) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Non-overlapping (inputs, targets), each int64 (N, block_size); None when not one fits."""
    n = (tokens.numel() - 1) // block_size
    if n < 1:
        return None
    span = tokens[: n * block_size + 1]
    x = span[:-1].reshape(n, block_size).clone()
    y = span[1:].reshape(n, block_size).clone()
    return x, y


def corpus_splits(corpus: CharCorpus, block_size: int, test_fraction: float = TEST_FRACTION) -> DataSplits:
    """Train on the first 90% of the stream, test on the rest (no test when it holds no window)."""
    n = corpus.tokens.numel()
    n_test = int(n * test_fraction)
    test = windows(corpus.tokens[n - n_test:], block_size) if n_test else None
    train_tokens = corpus.tokens[: n - n_test] if test is not None else corpus.tokens
    train = windows(train_tokens, block_size)
    if train is None:  # load_char_corpus already refuses texts shorter than one window
        raise DataError(f"{corpus.source}: {n} tokens do not fill one context of {block_size} (+1)")
    return DataSplits(train=train, test=test)


def tokens_summary(n_tokens: int, block_size: int) -> str:
    n_windows = max(0, (n_tokens - int(n_tokens * TEST_FRACTION) - 1) // block_size)
    return f"{n_windows:,} windows of {block_size} tokens (int64)"
