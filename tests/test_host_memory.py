"""Host page faults a step: counted at every log point, given per step in the summary, and the
allocator setting said once the steps fault in memory every step on glibc."""

import platform

import pytest
from helpers import data, mlp
from torch import nn

from gputrain import TrainConfig, fit
from gputrain.runtime import host_memory
from gputrain.runtime.host_memory import ADVISE_FROM, TUNABLES, allocator_advice, faults_per_step


def _records(counts, every=5):
    return [{"step": every * (i + 1), "host_page_faults": c} for i, c in enumerate(counts)]


def test_faults_a_step_leave_out_the_first_interval_when_there_are_more():
    assert faults_per_step(_records([10_000, 10_100, 10_600])) == 100.0  # (10600 - 10100) / 5
    assert faults_per_step(_records([10_000, 10_500])) == 100.0  # two log points: both count
    assert faults_per_step(_records([10_000])) is None
    assert faults_per_step([{"step": 5, "host_page_faults": None}, {"step": 10}]) is None


def test_the_advice_comes_past_the_threshold_on_glibc_unless_the_allocator_was_set(monkeypatch):
    monkeypatch.setattr(platform, "system", lambda: "Linux")
    monkeypatch.setattr(platform, "libc_ver", lambda *a, **k: ("glibc", "2.36"))
    monkeypatch.delenv("GLIBC_TUNABLES", raising=False)
    monkeypatch.delenv("LD_PRELOAD", raising=False)
    assert allocator_advice(ADVISE_FROM - 1) is None and allocator_advice(None) is None
    advice = allocator_advice(1536.0)
    assert advice is not None and advice.startswith("1,536 page faults a step") and TUNABLES in advice
    monkeypatch.setenv("GLIBC_TUNABLES", TUNABLES)
    assert allocator_advice(1536.0) is None
    monkeypatch.delenv("GLIBC_TUNABLES")
    monkeypatch.setenv("LD_PRELOAD", "/usr/lib/x86_64-linux-gnu/libjemalloc.so.2")
    assert allocator_advice(1536.0) is None
    monkeypatch.delenv("LD_PRELOAD")
    monkeypatch.setattr(platform, "libc_ver", lambda *a, **k: ("", ""))  # musl, or not Linux: another allocator
    assert allocator_advice(1536.0) is None


def test_a_run_counts_its_faults_at_log_points_and_the_summary_says_them(monkeypatch, caplog):
    x, y = data(64)
    cfg = TrainConfig(device="cpu", batch_size=8, steps=20, log_every=5)
    h = fit(mlp(), (x, y), loss_fn=nn.CrossEntropyLoss(), config=cfg)  # the real count
    if host_memory.minor_faults() is None:
        pytest.skip("no getrusage on this platform")
    counts = [r["host_page_faults"] for r in h.records]
    assert len(counts) == 4 and all(isinstance(c, int) for c in counts) and counts == sorted(counts)
    assert h.summary["host_page_faults_per_step"] == (counts[-1] - counts[1]) / 10
    # Many faults a step (a counter that grows 5,000 a log point: 1,000 a step) on glibc: said once.
    monkeypatch.setattr(platform, "system", lambda: "Linux")
    monkeypatch.setattr(platform, "libc_ver", lambda *a, **k: ("glibc", "2.36"))
    monkeypatch.delenv("GLIBC_TUNABLES", raising=False)
    monkeypatch.delenv("LD_PRELOAD", raising=False)
    calls = iter(range(0, 10**6, 5_000))
    monkeypatch.setattr("gputrain.train.trainer.minor_faults", lambda: next(calls))
    h = fit(mlp(), (x, y), loss_fn=nn.CrossEntropyLoss(), config=cfg)
    assert h.summary["host_page_faults_per_step"] == 1000.0
    assert [w for w in h.summary["warnings"] if "page faults a step" in w] == [allocator_advice(1000.0)]
    assert [r.getMessage() for r in caplog.records if "page faults a step" in r.getMessage()] == [allocator_advice(1000.0)]


def test_a_resumed_run_counts_only_its_own_log_points(tmp_path, monkeypatch):
    """The resumed History holds the stopped run's records, counted by another process (or before
    this one's setup): the faults a step come from this run's log points alone."""
    x, y = data(64)
    cfg = dict(device="cpu", batch_size=8, steps=30, log_every=5, run_dir=str(tmp_path / "run"))
    monkeypatch.setattr("gputrain.train.trainer.minor_faults", iter(range(0, 10**6, 100)).__next__)
    fit(mlp(), (x, y), loss_fn=nn.CrossEntropyLoss(), config=TrainConfig(**cfg, stop_at_step=15))
    monkeypatch.setattr("gputrain.train.trainer.minor_faults", iter(range(10**7, 2 * 10**7, 100)).__next__)
    h = fit(mlp(), (x, y), loss_fn=nn.CrossEntropyLoss(), config=TrainConfig(**cfg, resume=True))
    assert [r["step"] for r in h.records] == [5, 10, 15, 20, 25, 30]
    assert h.summary["host_page_faults_per_step"] == 20.0  # (steps 25 -> 30) 100 faults / 5 steps
    assert not [w for w in h.summary["warnings"] if "page faults a step" in w]
