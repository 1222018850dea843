"""Fault injection, the short version (issue 13): real `gputrain fit` processes on the CPU are killed,
stopped, fed a non-finite step, denied disk, and resumed; each must end bit-equal to an uninterrupted
run (or stop / skip as configured). The harness is benchmarks/faults/harness.py; benchmarks/fault_injection.py
runs the same trials in full counts (>= 30 SIGKILLs) and prints the table in benchmarks/LOG.md.

Faulted runs are processes; the runs that are not faulted (the uninterrupted references and the
resumes) run in this process, which saves an interpreter start and torch's imports each.
"""

from __future__ import annotations

import random

import pytest

from benchmarks.faults import harness as fi

pytestmark = pytest.mark.processes  # every test here starts processes: make test-fast leaves them out


@pytest.fixture(scope="module")
def h(tmp_path_factory):
    # 100 steps of a tiny MLP, a checkpoint every 5, 4 ms per forward (the random moments fall in
    # 0.4 s of training), 512 KiB checkpoints (writes long enough to be hit).
    return fi.Harness(tmp_path_factory.mktemp("faults"), steps=100, every=5, sleep_ms=4, pad_kb=512, timeout=240,
                      in_process=True)


@pytest.mark.parametrize("aim,seed", [("training", 1), ("write", 2)])
def test_sigkill_mid_training_or_mid_write_then_resume_ends_exact(h, aim, seed):
    # (a kill after a checkpoint's rename and before `latest` names it resumes from the one before,
    # by design: exact all the same)
    trial = fi.trial_sigkill(h, random.Random(seed), aim=aim)
    assert trial.ok, trial.detail


def test_sigterm_checkpoints_exits_143_and_resume_ends_exact(h):
    trial = fi.trial_sigterm(h, random.Random(3))
    assert trial.ok, trial.detail
    assert trial.lost_steps == 0


def test_a_damaged_newest_checkpoint_falls_back_with_a_warning_and_ends_exact(h):
    # (the benchmark also truncates and empties it)
    trial = fi.trial_corrupt(h, random.Random(4), how="flip")
    assert trial.ok, trial.detail


@pytest.mark.parametrize("kind,on_nan", [("lr", "stop"), ("inf", "stop"), ("inf", "skip")])
def test_a_non_finite_step_stops_or_skips_as_configured_and_checkpoints_stay_finite(h, kind, on_nan):
    trial = fi.trial_nonfinite(h, random.Random(5), kind, on_nan, resume_check=False)
    assert trial.ok, trial.detail


def test_a_nan_gradient_under_a_finite_loss_stops_without_a_non_finite_checkpoint(h):
    # An inf input into a tanh: the forward saturates (finite loss), the backward gives 0 * inf =
    # NaN in the first layer's gradient; --on-nan's help promises "a non-finite loss or gradient".
    # Checkpoints every step, so the step is a checkpoint's. (The benchmark runs --on-nan skip too.)
    trial = fi.trial_nonfinite(h, random.Random(6), "inf-grad", "stop")
    assert trial.ok, trial.detail


def test_enospc_in_a_checkpoint_write_keeps_the_previous_one_and_resume_ends_exact(h):
    trial = fi.trial_enospc(h, random.Random(7))
    assert trial.ok, trial.detail


@pytest.fixture(scope="module")
def tmpfs(h):
    if not fi.tmpfs_available(h.base):
        pytest.skip("cannot mount a tmpfs here (needs root and mount): the full disk is injected instead")


def test_a_tmpfs_filled_mid_run_keeps_the_previous_checkpoint_and_resume_ends_exact(h, tmpfs):
    trial = fi.trial_tmpfs(h, random.Random(8))
    assert trial.ok, trial.detail


def test_preflight_on_a_too_small_tmpfs_is_one_line_and_exit_2(h, tmpfs):
    trial = fi.trial_preflight_full(h, random.Random(9))
    assert trial.ok, trial.detail


@pytest.mark.slow
def test_torchrun_sigterm_to_one_rank_both_stop_at_one_step_one_checkpoint_resume_exact(h):
    """Slow: 195 s on this machine (the serial suite, 2026-11-28, load 5-14): a 2-rank torchrun stopped by
    SIGTERM, resumed, and its uninterrupted 2-rank reference, each three interpreters."""
    trial = fi.trial_torchrun(h, random.Random(10))
    assert trial.ok, trial.detail


@pytest.mark.slow
def test_a_damaged_shard_of_a_dcp_checkpoint_falls_back_naming_the_file_and_ends_exact(h):
    """Slow: 157 s on this machine (the serial suite, 2026-11-28, load 5-14): 2-rank torchrun runs writing DCP
    checkpoints (the damaged one, its resume and the reference)."""
    from benchmarks.faults import dcp as fault_harness_dcp

    trial = fault_harness_dcp.trial_dcp_damaged(h, random.Random(11))
    assert trial.ok, trial.detail
