"""Stopping and resuming, through fit and the CLI: a stop signal finishes the step and checkpoints,
an error in user code checkpoints the last finished step, retention keeps the last and the best, a
damaged newest checkpoint falls back to the one before, preflight refuses a run directory early
(the fault runs in subprocesses are in test_faults.py)."""

import json
import signal

import pytest
import torch
from helpers import SignalAt, data, mlp, params
from torch import nn

from gputrain import TrainConfig, fit
from gputrain.cli import main
from gputrain.errors import ConfigError, StopRequested
from gputrain.checkpoint.store import CheckpointStore


CFG = dict(device="cpu", batch_size=8, steps=30, log_every=5, seed=3)


@pytest.mark.parametrize("sig,code", [(signal.SIGTERM, 143), (signal.SIGUSR1, 138), (signal.SIGINT, 130)])
def test_a_stop_signal_finishes_the_step_checkpoints_and_resumes_exactly(tmp_path, sig, code):
    x, y = data(80)
    full = mlp()
    h_full = fit(full, (x, y), loss_fn=nn.CrossEntropyLoss(), config=TrainConfig(**CFG))
    before = signal.getsignal(sig)
    run_dir = str(tmp_path / "run")
    with pytest.raises(StopRequested) as info:
        fit(SignalAt(mlp(), at=12, sig=sig), (x, y), loss_fn=nn.CrossEntropyLoss(),
            config=TrainConfig(**CFG, run_dir=run_dir))
    assert info.value.exit_code == code and info.value.step == 12  # step 12 was finished, then the stop
    assert "--resume" in str(info.value) and signal.getsignal(sig) is before  # handler given back
    assert CheckpointStore(run_dir).latest_path().name == "step-000012.pt"
    resumed = SignalAt(mlp(seed=5), at=-1)
    h = fit(resumed, (x, y), loss_fn=nn.CrossEntropyLoss(), config=TrainConfig(**CFG, run_dir=run_dir, resume=True))
    assert torch.equal(params(resumed.inner), params(full))
    assert [r["loss"] for r in h.records] == pytest.approx([r["loss"] for r in h_full.records], rel=1e-6)


def test_a_handler_installed_before_fit_is_chained_and_restored(tmp_path):
    seen = []
    previous = signal.signal(signal.SIGUSR1, lambda s, f: seen.append(s))
    try:
        with pytest.raises(StopRequested):
            fit(SignalAt(mlp(), at=3, sig=signal.SIGUSR1), data(80), loss_fn=nn.CrossEntropyLoss(),
                config=TrainConfig(**CFG, run_dir=str(tmp_path / "r")))
        assert seen == [signal.SIGUSR1]
        handler = signal.getsignal(signal.SIGUSR1)
        handler(signal.SIGUSR1, None)
        assert seen == [signal.SIGUSR1, signal.SIGUSR1]  # the user's own handler is back
    finally:
        signal.signal(signal.SIGUSR1, previous)


def test_the_cli_exits_143_with_how_to_resume_as_its_last_line(tmp_path, capsys, monkeypatch):
    (tmp_path / "sigwl.py").write_text(
        "import os, signal, torch\nfrom torch import nn\nimport gputrain\nfrom gputrain.workloads import DataSplits\n"
        "class M(nn.Module):\n"
        "    def __init__(self):\n        super().__init__(); self.l = nn.Linear(4, 2); self.n = 0\n"
        "    def forward(self, x):\n"
        "        self.n += self.training\n"
        "        if self.training and self.n == 7: os.kill(os.getpid(), signal.SIGTERM)\n"
        "        return self.l(x)\n"
        "def make():\n"
        "    g = torch.Generator().manual_seed(0); x = torch.randn(64, 4, generator=g); y = (x[:, 0] > 0).long()\n"
        "    return gputrain.Workload(name='sig', description='t', make_data=lambda: DataSplits(train=(x, y)),\n"
        "        make_model=M, loss_fn=nn.CrossEntropyLoss(), defaults={'batch_size': 8, 'steps': 40})\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    run_dir = tmp_path / "run"
    code = main(["fit", "sigwl:make", "--device", "cpu", "--run-dir", str(run_dir), "--quiet"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 143 and "stopped by SIGTERM after step 7" in err[-1] and f"--resume {run_dir}" in err[-1]


def test_an_error_in_user_code_checkpoints_the_last_step_and_says_where(tmp_path):
    class Breaks(nn.Module):
        def __init__(self):
            super().__init__()
            self.inner, self.n = mlp(), 0

        def forward(self, x):
            self.n += self.training
            if self.n == 9:
                raise ValueError("bad sample")  # the user's bug, on this line
            return self.inner(x)

    run_dir = tmp_path / "run"
    with pytest.raises(ValueError) as info:
        fit(Breaks(), data(80), loss_fn=nn.CrossEntropyLoss(), config=TrainConfig(**CFG, run_dir=str(run_dir)))
    note = info.value.__notes__[-1]
    assert "failed in step 9" in note and "test_stop_and_resume.py" in note and "--resume" in note
    assert CheckpointStore(run_dir).latest_path().name == "step-000008.pt"


def test_retention_keeps_the_last_two_and_the_best(tmp_path):
    x, y = data(160)
    run_dir = tmp_path / "run"
    fit(mlp(), (x, y), loss_fn=nn.CrossEntropyLoss(), eval_data=(x, y),
        config=TrainConfig(**{**CFG, "steps": 40}, run_dir=str(run_dir), checkpoint_every=5, eval_every=5,
                           best_metric="eval_loss", best_mode="min", lr=0.05))
    store = CheckpointStore(run_dir, best_metric="eval_loss", best_mode="min")
    names = [p.name for p in store.list()]
    assert names[-2:] == ["step-000035.pt", "step-000040.pt"] and len(names) <= 3
    assert store.best_path() is not None and store.best_path().name in names
    assert all(store.verify(p) for p in store.list())


def test_resume_falls_back_when_the_newest_checkpoint_is_damaged(tmp_path):
    x, y = data(80)
    full = mlp()
    fit(full, (x, y), loss_fn=nn.CrossEntropyLoss(), config=TrainConfig(**CFG))
    run_dir = tmp_path / "run"
    fit(mlp(), (x, y), loss_fn=nn.CrossEntropyLoss(),
        config=TrainConfig(**CFG, run_dir=str(run_dir), checkpoint_every=5, stop_at_step=20))
    newest = CheckpointStore(run_dir).latest_path()
    raw = bytearray(newest.read_bytes())
    raw[len(raw) // 2] ^= 0xFF  # one flipped byte
    newest.write_bytes(bytes(raw))
    resumed = mlp(seed=9)
    with pytest.warns(Warning, match="step-000020"):
        fit(resumed, (x, y), loss_fn=nn.CrossEntropyLoss(), config=TrainConfig(**CFG, run_dir=str(run_dir), resume=True))
    assert torch.equal(params(resumed), params(full))  # from step 15, and still exact


def test_preflight_refuses_a_run_dir_that_cannot_be_created(tmp_path, capsys):
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    with pytest.raises(ConfigError, match="run directory"):
        fit(mlp(), data(80), loss_fn=nn.CrossEntropyLoss(),
            config=TrainConfig(**CFG, run_dir=str(blocker / "run")))
    code = main(["fit", "iris-mlp", "--device", "cpu", "--run-dir", str(blocker / "run"), "--steps", "2"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1 and "run directory" in err


def test_no_run_dir_stop_says_nothing_was_saved():
    with pytest.raises(StopRequested, match="nothing was saved"):
        fit(SignalAt(mlp(), at=2), data(80), loss_fn=nn.CrossEntropyLoss(), config=TrainConfig(**CFG))


def test_json_summary_still_reports_after_a_normal_run(tmp_path, capsys):
    code = main(["fit", "iris-mlp", "--device", "cpu", "--steps", "3", "--run-dir", str(tmp_path / "r"), "--json"])
    assert code == 0 and json.loads(capsys.readouterr().out)["summary"]["steps"] == 3
