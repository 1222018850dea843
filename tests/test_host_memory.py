"""Host page faults a step: the training steps' own (evaluations, checkpoint saves and tracker writes
left out), given per step in the summary, and the allocator setting advised only where the steps'
faults take a noticeable share of a step, in words that give this run's figures."""

import platform

import pytest
from helpers import data, mlp
from torch import nn

from gputrain import TrainConfig, fit
from gputrain.runtime import host_memory
from gputrain.runtime.host_memory import (ADVISE_FROM_SHARE, MEASURE_FROM_STEPS, TERMINAL_FROM_SHARE, TUNABLES,
                                          allocator_advice, faults_per_step, steps_measured)


def _records(counts, every=5):
    return [{"step": every * (i + 1), "step_page_faults": c} for i, c in enumerate(counts)]


def test_faults_a_step_are_the_steps_own_the_first_interval_left_out_when_there_are_more():
    assert faults_per_step(_records([9_000, 100, 300])) == 40.0  # (100 + 300) / 10 steps
    assert faults_per_step(_records([500])) == 100.0  # one interval: it counts
    assert faults_per_step([]) is None
    assert faults_per_step([{"step": 5, "step_page_faults": None}, {"step": 10}]) is None
    # Intervals of different lengths (an epoch end between log points): faults over steps.
    recs = [{"step": 4, "step_page_faults": 1}, {"step": 6, "step_page_faults": 20}, {"step": 10, "step_page_faults": 40}]
    assert faults_per_step(recs) == 10.0  # (20 + 40) / (2 + 4)
    # A resumed run: only the log points after its start, the first interval from the resume step.
    assert faults_per_step(recs, start_step=4) == 10.0 and faults_per_step(recs, start_step=6) == 10.0
    # The steps that measured it: those after the first interval; none when there was one interval.
    assert steps_measured(recs) == 6 and steps_measured(recs, start_step=6) == 0
    assert steps_measured(_records([500])) == 0 and steps_measured(_records([9_000, 100, 300])) == 10


@pytest.fixture
def glibc(monkeypatch):
    """This process as if on glibc's malloc with its default thresholds."""
    monkeypatch.setattr(platform, "system", lambda: "Linux")
    monkeypatch.setattr(platform, "libc_ver", lambda *a, **k: ("glibc", "2.36"))
    monkeypatch.delenv("GLIBC_TUNABLES", raising=False)
    monkeypatch.delenv("LD_PRELOAD", raising=False)


def test_the_advice_needs_faults_that_matter_for_the_step_and_says_this_runs_figures(glibc, monkeypatch):
    # 1,000 faults a step at 1 us each: 1 ms of a 10 ms step (10%): said, with the figures.
    advice = allocator_advice(1000.0, 0.010, 40, 1e-6)
    assert advice is not None and not advice.in_terminal  # 10% of a step: report.html only
    advice = advice.text
    assert advice.startswith("the training steps took 1,000 minor page faults each")
    assert "1.00 us" in advice and "1.00 ms of each 10.00 ms step (10%)" in advice and TUNABLES in advice
    assert "1.08x" not in advice and "text model" not in advice  # another run's measurement is not quoted
    assert "trims its heap" not in advice and "can give a step's freed memory back" in advice  # not stated as fact
    # The same faults in a 1 s step (0.1%), or too few to measure: nothing to say.
    assert allocator_advice(1000.0, 1.0, 40, 1e-6) is None
    share_just_below = ADVISE_FROM_SHARE * 0.99
    assert allocator_advice(1000.0, 1000.0 * 1e-6 / share_just_below, 40, 1e-6) is None
    assert allocator_advice(1000.0, 1000.0 * 1e-6 / (ADVISE_FROM_SHARE * 1.01), 40, 1e-6) is not None
    assert allocator_advice(8.0, 1e-6, 40, 1e-6) is None and allocator_advice(None, 0.01, 40) is None
    assert allocator_advice(1000.0, None, 40, 1e-6) is None
    # Counted over too few steps (the first log interval alone, or a short run): no measurement.
    assert allocator_advice(1000.0, 0.010, MEASURE_FROM_STEPS - 1, 1e-6) is None
    assert allocator_advice(1000.0, 0.010, MEASURE_FROM_STEPS, 1e-6) is not None
    # Faulting a quarter of each step or more: the terminal as well.
    assert allocator_advice(1000.0, 1000 * 1e-6 / TERMINAL_FROM_SHARE, 40, 1e-6).in_terminal
    assert not allocator_advice(1000.0, 1000 * 1e-6 / (TERMINAL_FROM_SHARE * 0.99), 40, 1e-6).in_terminal
    # The allocator set already: another libc, the thresholds fixed, a preloaded allocator.
    monkeypatch.setenv("GLIBC_TUNABLES", TUNABLES)
    assert allocator_advice(1000.0, 0.010, 40, 1e-6) is None
    monkeypatch.delenv("GLIBC_TUNABLES")
    monkeypatch.setenv("LD_PRELOAD", "/usr/lib/x86_64-linux-gnu/libjemalloc.so.2")
    assert allocator_advice(1000.0, 0.010, 40, 1e-6) is None
    monkeypatch.delenv("LD_PRELOAD")
    monkeypatch.setattr(platform, "libc_ver", lambda *a, **k: ("", ""))  # musl, or not Linux
    assert allocator_advice(1000.0, 0.010, 40, 1e-6) is None


def test_a_fault_is_measured_on_this_machine():
    seconds = host_memory.fault_seconds(pages=512, repeats=1)
    if host_memory.minor_faults() is None:
        assert seconds is None
    else:
        assert seconds is not None and 0 < seconds < 1e-3  # a minor fault is microseconds, not milliseconds


class _Faults:
    """A stand-in for the process's fault counter: each training forward adds `per_step`, each
    evaluation forward `per_eval`, and whatever else a test adds."""

    def __init__(self, per_step: int, per_eval: int):
        self.n, self.per_step, self.per_eval = 0, per_step, per_eval

    def __call__(self) -> int:
        return self.n

    def model(self) -> nn.Module:
        faults, inner = self, mlp()

        class Counted(nn.Module):
            def __init__(self):
                super().__init__()
                self.inner = inner

            def forward(self, x):
                faults.n += faults.per_step if self.training else faults.per_eval
                return self.inner(x)

        return Counted()


def _fit_counted(monkeypatch, faults: _Faults, **cfg):
    monkeypatch.setattr("gputrain.runtime.host_memory.minor_faults", faults)
    x, y = data(64)
    config = TrainConfig(**{"device": "cpu", "batch_size": 8, "steps": 24, "log_every": 4, **cfg})
    return fit(faults.model(), (x, y), loss_fn=nn.CrossEntropyLoss(), eval_data=(x, y), config=config)


def test_evaluations_checkpoints_and_tracker_writes_stay_out_of_the_steps_faults(monkeypatch, tmp_path, glibc):
    """The steps fault 7 each; evaluations (every epoch: 8 steps), checkpoint saves and tracker writes
    fault a million each: the summary says 7 a step."""
    faults = _Faults(per_step=7, per_eval=1_000_000)
    from gputrain.report.run_outputs import RunOutputs
    from gputrain.train.loop.trainer import Trainer

    save, append = Trainer.save_checkpoint, RunOutputs.append

    def faulting_save(self, *a, **k):
        faults.n += 1_000_000
        return save(self, *a, **k)

    def faulting_append(self, record):
        faults.n += 1_000_000
        return append(self, record)

    monkeypatch.setattr(Trainer, "save_checkpoint", faulting_save)
    monkeypatch.setattr(RunOutputs, "append", faulting_append)
    h = _fit_counted(monkeypatch, faults, run_dir=str(tmp_path / "run"), checkpoint_every=6)
    assert [r["step"] for r in h.records if "eval_loss" in r] == [8, 16, 24]
    assert all(r["step_page_faults"] == 7 * (r["step"] - prev)
               for prev, r in zip([0] + [r["step"] for r in h.records], h.records))
    assert h.summary["host_page_faults_per_step"] == 7.0
    assert not [w for w in h.summary["warnings"] + h.summary["advice"] if "page faults" in w]


def test_steps_that_do_not_fault_get_no_advice_however_much_the_evaluations_fault(monkeypatch, glibc):
    monkeypatch.setattr(host_memory, "fault_seconds", lambda *a, **k: 1e-3)  # a slow fault: any count would matter
    h = _fit_counted(monkeypatch, _Faults(per_step=0, per_eval=5_000_000))
    assert h.summary["host_page_faults_per_step"] == 0.0
    assert not [w for w in h.summary["warnings"] + h.summary["advice"] if "page faults" in w]


def test_steps_that_fault_enough_for_their_length_get_the_advice_once_with_this_runs_figures(monkeypatch, glibc,
                                                                                               caplog):
    monkeypatch.setattr(host_memory, "fault_seconds", lambda *a, **k: 1e-3)  # 1 ms a fault: 2 s of faulting a step
    h = _fit_counted(monkeypatch, _Faults(per_step=2_000, per_eval=0))
    s = h.summary
    assert s["host_page_faults_per_step"] == 2000.0
    step_s = s["samples"] / s["steps"] / s["samples_per_s"]
    advice = allocator_advice(2000.0, step_s, 20, 1e-3)
    assert advice is not None and advice.in_terminal  # 2 s of faulting a step
    advice = advice.text
    assert s["advice"] == [advice] and not [w for w in s["warnings"] if "page faults" in w]
    assert "2,000 minor page faults each" in advice and "1000.00 us" in advice and "20 steps counted" in advice
    assert [r.getMessage() for r in caplog.records if "page faults" in r.getMessage()] == [advice]
    # The same run with a fault as cheap as 1 ps: faulting is no share of the step, nothing said.
    monkeypatch.setattr(host_memory, "fault_seconds", lambda *a, **k: 1e-12)
    h = _fit_counted(monkeypatch, _Faults(per_step=2_000, per_eval=0))
    assert not [w for w in h.summary["warnings"] + h.summary["advice"] if "page faults" in w]


def test_a_run_counts_real_faults_at_log_points():
    x, y = data(64)
    h = fit(mlp(), (x, y), loss_fn=nn.CrossEntropyLoss(),
            config=TrainConfig(device="cpu", batch_size=8, steps=20, log_every=5))
    if host_memory.minor_faults() is None:
        pytest.skip("no getrusage on this platform")
    counts = [r["step_page_faults"] for r in h.records]
    assert len(counts) == 4 and all(isinstance(c, int) and c >= 0 for c in counts)
    assert h.summary["host_page_faults_per_step"] == sum(counts[1:]) / 15


def test_a_resumed_run_counts_only_its_own_log_points(tmp_path, monkeypatch):
    """The resumed History holds the stopped run's records, counted by another process: the faults a
    step come from this run's log points alone."""
    x, y = data(64)
    cfg = dict(device="cpu", batch_size=8, steps=30, log_every=5, run_dir=str(tmp_path / "run"))
    monkeypatch.setattr("gputrain.runtime.host_memory.minor_faults", iter(range(0, 10**6, 1000)).__next__)
    fit(mlp(), (x, y), loss_fn=nn.CrossEntropyLoss(), config=TrainConfig(**cfg, stop_at_step=15))
    monkeypatch.setattr("gputrain.runtime.host_memory.minor_faults", iter(range(10**7, 2 * 10**7, 100)).__next__)
    h = fit(mlp(), (x, y), loss_fn=nn.CrossEntropyLoss(), config=TrainConfig(**cfg, resume=True))
    assert [r["step"] for r in h.records] == [5, 10, 15, 20, 25, 30]
    # Each read 100 apart; a log point reads twice (its count, then the mark after its work): the
    # steps of each interval after the first saw 100 faults, over 5 steps.
    assert h.summary["host_page_faults_per_step"] == 20.0
    assert not [w for w in h.summary["warnings"] + h.summary["advice"] if "page faults" in w]


def test_a_run_too_short_to_measure_gets_no_advice_however_it_faults(monkeypatch, glibc, caplog):
    """A one-step toy fit, and a run of one log interval: the faults counted hold the run's first
    allocations, a measurement that cannot carry advice; nothing in the summary, report or terminal."""
    monkeypatch.setattr(host_memory, "fault_seconds", lambda *a, **k: 1e-3)
    for steps, every in ((1, 1), (24, 24)):
        h = _fit_counted(monkeypatch, _Faults(per_step=50_000, per_eval=0), steps=steps, log_every=every)
        assert h.summary["host_page_faults_per_step"] == 50_000.0
        assert h.summary["advice"] == [] and not [w for w in h.summary["warnings"] if "page faults" in w]
    assert not [r for r in caplog.records if "page faults" in r.getMessage()]


def test_advice_not_measured_to_pay_goes_to_the_report_only(monkeypatch, glibc, caplog, tmp_path):
    """Faulting at 5% of a step: the advice is in the summary's "advice" and report.html, and not
    printed; at 50% it is printed as well."""
    from gputrain.report.html import write_report
    from gputrain.runtime.host_memory import AllocatorAdvice
    from gputrain.train.loop import run_summary

    for share, printed in ((0.05, False), (0.5, True)):
        caplog.clear()
        text = f"the training steps took many minor page faults each ({share:.0%})"
        monkeypatch.setattr(run_summary, "allocator_advice", lambda *a, **k: AllocatorAdvice(text, share))
        run_dir = tmp_path / f"run{share}"
        h = _fit_counted(monkeypatch, _Faults(per_step=0, per_eval=0), run_dir=str(run_dir))
        assert h.summary["advice"] == [text] and text not in h.summary["warnings"]
        assert ("advice: " + text) in write_report(run_dir).read_text()
        assert [r.getMessage() for r in caplog.records if text in r.getMessage()] == ([text] if printed else [])
