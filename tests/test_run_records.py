"""Records that say what ran: the optimizer decision of a run with your own optimizers, and counts
in words that agree with their number, in the summary, its table and report.html."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import torch
from torch import nn

from gputrain import TrainConfig, fit
from gputrain.report.summary import counted, summary_rows

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "docs" / "examples"))
import own_step as examples  # noqa: E402

from helpers import data, mlp  # noqa: E402

CFG = dict(device="cpu", batch_size=64, log_every=2, steps=2, seed=5)


def test_the_decisions_of_a_run_with_your_optimizers_say_yours_not_the_default(tmp_path):
    model = examples.GAN()
    run_dir = tmp_path / "gan"
    h = fit(model, examples.digits(), step_fn=examples.gan_step, optimizer=examples.gan_optimizers(model),
            config=TrainConfig(**CFG, run_dir=str(run_dir)))
    row = next(d for d in h.summary["decisions"] if d["name"] == "optimizer")
    assert row["value"] == "generator: Adam, discriminator: Adam (yours, stepped by step_fn)"
    assert row["reason"] == "yours (optimizer={name: ...}), each stepped by your step_fn with step.step(name)"
    page = (run_dir / "report.html").read_text()
    assert "the default: AdamW" not in page and "each stepped by your step_fn with step.step(name)" in page
    # The built-in step's optimizers: the default, and one given.
    x, y = data(64)
    h = fit(mlp(), (x, y), loss_fn=nn.CrossEntropyLoss(), config=TrainConfig(**CFG))
    assert next(d["reason"] for d in h.summary["decisions"] if d["name"] == "optimizer") == "the default: AdamW"
    net = mlp()
    h = fit(net, (x, y), loss_fn=nn.CrossEntropyLoss(), optimizer=torch.optim.SGD(net.parameters(), 0.1),
            config=TrainConfig(**CFG))
    assert next(d["reason"] for d in h.summary["decisions"] if d["name"] == "optimizer") == "given"


def _numbers_with_plural_nouns(text: str) -> list[str]:
    """"1 saves", "1 steps", "1 records" and the like: the number 1 before a plural noun."""
    return re.findall(r"(?<![\d.,])1 (?:saves|steps|records|ops|training steps|evaluations|processes)\b", text)


def test_counts_agree_with_their_number_in_the_summary_and_the_report(tmp_path):
    x, y = data(64)
    run_dir = tmp_path / "one"
    h = fit(mlp(), (x, y), loss_fn=nn.CrossEntropyLoss(),
            config=TrainConfig(**{**CFG, "steps": 1, "log_every": 1}, run_dir=str(run_dir)))
    assert h.summary["checkpoint_saves"] == 1
    rows = dict(summary_rows(h.summary))
    assert rows["checkpoints"].startswith("1 save (file): training blocked ")
    page = (run_dir / "report.html").read_text()
    assert "1 save (file)" in page and "1 record (metrics.jsonl)" in page
    assert not _numbers_with_plural_nouns(page + str(rows)), _numbers_with_plural_nouns(page + str(rows))
    two = dict(summary_rows({**h.summary, "checkpoint_saves": 2}))
    assert two["checkpoints"].startswith("2 saves (file)") and two["checkpoints"].endswith("per save (median)")


def test_counted_says_one_thing_and_many_things():
    assert [counted(n, "save") for n in (0, 1, 2, 1234)] == ["0 saves", "1 save", "2 saves", "1,234 saves"]
    assert counted(1, "process", "processes") == "1 process" and counted(3, "process", "processes") == "3 processes"
    from gputrain.train.loop.run_summary import optimizer_reason

    assert optimizer_reason("AdamW (fused), stepped by step_fn") == "the default: AdamW, stepped by your step_fn"
    assert optimizer_reason("Adam (given), stepped by step_fn") == "given, stepped by your step_fn"
