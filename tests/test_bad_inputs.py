"""Bad input, tried as a new user would, across every subcommand: each case is its own `python -m
gputrain` process and must exit 2 (argparse's and gputrain's status for a refused command) with
exactly one line on stderr that says what was wrong, no traceback, and, where a run directory is
involved, every file in it byte-identical before and after (a refused command writes nothing).

The run directories are trained once per module (digits-cnn for 4 steps, two tiny user workloads)
and shared; a case that would change one fails here, not in the cases after it, because each case
compares the directory it names with its own snapshot.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import torch

HAS_PROC = Path("/proc/self").is_dir()  # a tree no one can create files in, not even root (Linux)
HAS_ONNX = all(__import__("importlib.util").util.find_spec(m) is not None for m in ("onnx", "onnxruntime"))

USER_WORKLOADS = '''
import os

import torch
from torch import nn

from gputrain.workloads.base import DataSplits, Workload


def _data():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 4, generator=g)
    return DataSplits(train=(x, (x[:, 0] > 0).long()), test=(x[:16], (x[:16, 0] > 0).long()))


class Unexportable(nn.Module):
    """Trains and runs, but torch's ONNX exporters have no conversion for special_i0e."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 2)

    def forward(self, x):
        return self.fc(torch.special.i0e(x))


class FailsWhenAsked(nn.Module):
    """A model whose own forward raises (in eval mode, when GPUTRAIN_TEST_MODEL_FAILS is set)."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 2)

    def forward(self, x):
        if not self.training and os.environ.get("GPUTRAIN_TEST_MODEL_FAILS"):
            raise RuntimeError("the user's model failed on purpose")
        return self.fc(x)


def _columns():  # dict batches: {"x": (N, 4) float32, "labels": (N,) int64}
    x, y = _data().train
    return DataSplits(train={"x": x, "labels": y}, test={"x": x[:16], "labels": y[:16]})


def _loss(model, batch):
    logits = model(batch["x"])
    return nn.functional.cross_entropy(logits, batch["labels"]), logits


def unexportable():
    return Workload(name="unexportable", description="test", make_data=_data, make_model=Unexportable,
                    loss_fn=nn.CrossEntropyLoss(), defaults={"batch_size": 16})


def fails_when_asked():
    return Workload(name="fails-when-asked", description="test", make_data=_columns, make_model=FailsWhenAsked,
                    loss_fn=None, compute_loss=_loss, task=None, defaults={"batch_size": 16})
'''


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
           and not k.startswith(("TORCHELASTIC_", "SLURM_"))}
    env.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", COLUMNS="200", **extra)
    src = str(Path(__file__).resolve().parents[1] / "src")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [src, env.get("PYTHONPATH")]))
    return env


def gputrain(cwd: Path, *argv: str, timeout: float = 120, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "gputrain", *argv], cwd=cwd, env=_env(**env), capture_output=True,
                          text=True, timeout=timeout)


def snapshot(folder: Path) -> dict[str, str]:
    """Every file and folder below `folder`: its sha256, or "dir"."""
    out = {}
    for path in sorted(folder.rglob("*")):
        rel = str(path.relative_to(folder))
        out[rel] = "dir" if path.is_dir() else hashlib.sha256(path.read_bytes()).hexdigest()
    return out


@pytest.fixture(scope="module")
def work(tmp_path_factory) -> Path:
    """A working folder with run directories (digits: digits-cnn, 4 steps; its copies without
    workload.json and with a damaged checkpoint; unexportable), data files good and bad, a file
    and a folder in the way."""
    w = tmp_path_factory.mktemp("bad-inputs")
    (w / "userwl.py").write_text(USER_WORKLOADS)
    common = ("--steps", "4", "--log-every", "2", "--device", "cpu", "--precision", "fp32", "--no-tensorboard",
              "--progress", "off", "--quiet")
    for workload, run in (("digits-cnn", "digits"), ("userwl.py:unexportable", "unexportable"),
                          ("userwl.py:fails_when_asked", "fails")):
        proc = gputrain(w, "fit", workload, "--run-dir", run, *common, timeout=240)
        assert proc.returncode == 0, proc.stderr[-3000:]
    shutil.copytree(w / "digits", w / "nowl")  # as a run of the Python API: no workload.json
    (w / "nowl" / "workload.json").unlink()
    shutil.copytree(w / "digits", w / "damaged")
    checkpoint = w / "damaged" / "checkpoints" / "step-000004.pt"
    data = bytearray(checkpoint.read_bytes())
    data[len(data) // 2] ^= 0xFF
    checkpoint.write_bytes(bytes(data))
    for name, text in CONFIG_FILES.items():  # the config files of the value-check rows below
        (w / name).write_text(text)
    (w / "empty-run").mkdir()
    (w / "in-the-way").write_text("a file where a folder is expected\n")
    (w / "a-folder").mkdir()

    images = torch.randint(0, 256, (5, 1, 8, 8), dtype=torch.uint8)  # digits-cnn's data: (N, 1, 8, 8) uint8
    (w / "garbage.pt").write_bytes(b"this is not a torch file\n" * 10)
    (w / "garbage.npy").write_bytes(b"\x93NUMPY but not really")
    np.save(w / "objects.npy", np.array([{"a": 1}, None], dtype=object), allow_pickle=True)
    np.save(w / "strings.npy", np.array(["a", "b"]))
    np.save(w / "flat.npy", np.zeros((5, 40), dtype=np.float32))
    torch.save(images, w / "images.pt")
    torch.save(torch.zeros(5, 3, 8, 8), w / "three-channels.pt")
    torch.save(images.to(torch.complex64), w / "complex.pt")
    torch.save({"x": images}, w / "dict.pt")
    torch.save([1, 2, 3], w / "list.pt")
    torch.save((images, torch.zeros(4, dtype=torch.long)), w / "ragged.pt")
    torch.save((images, torch.full((5,), 12)), w / "labels-out-of-range.pt")
    return w


@dataclass(frozen=True)
class Case:
    id: str
    argv: tuple[str, ...]
    says: str  # a regular expression the one line must match (what was wrong, and what to do)
    run: str | None = None  # the run directory the command reads: byte-identical afterwards
    absent: str | None = None  # a path the command must not leave behind
    env: tuple[tuple[str, str], ...] = ()
    rc: int = 2
    needs: str | None = None  # "proc" | "onnx": skipped (with the reason) where missing


SRUN = (("SLURM_PROCID", "0"), ("SLURM_STEP_ID", "0"), ("SLURM_NTASKS", "2"), ("SLURM_JOB_NODELIST", "localhost"))
TORCHRUN = (("WORLD_SIZE", "2"), ("RANK", "0"), ("LOCAL_RANK", "0"), ("MASTER_ADDR", "127.0.0.1"))

CASES = [
    # ---------------------------------------------------------------- fit
    Case("fit-misspelt-workload", ("fit", "digits-cnnn"), r"unknown workload 'digits-cnnn': did you mean 'digits-cnn'"),
    Case("fit-negative-lr", ("fit", "digits-cnn", "--lr", "-1"), r"--lr: expected a positive number, got '-1'"),
    Case("fit-steps-and-epochs", ("fit", "digits-cnn", "--steps", "2", "--epochs", "1"), r"not allowed with"),
    Case("fit-missing-device", ("fit", "digits-cnn", "--device", "cuda:7", "--no-save"), r"cuda:7 requested"),
    Case("fit-unknown-logger", ("fit", "digits-cnn", "--logger", "nosuch", "--no-save"),
         r"unknown logger 'nosuch': choose from csv"),
    Case("fit-missing-module", ("fit", "nosuchmodule:make"), r"no module named 'nosuchmodule'"),
    Case("fit-unknown-option", ("fit", "digits-cnn", "--option", "n=5"), r"takes no options; got n"),
    Case("fit-option-without-value", ("fit", "digits-cnn", "--option", "n5"),
         r"--option 'n5': expected KEY=VALUE, e\.g\. --option n=2000$"),
    Case("fit-fp16-on-cpu", ("fit", "digits-cnn", "--precision", "fp16", "--device", "cpu", "--no-save"),
         r"fp16 is not supported on the CPU"),
    Case("fit-missing-data-dir", ("fit", "cifar10-cnn", "--data-dir", "no-such-folder", "--no-save"),
         r"no-such-folder.*does not exist"),
    Case("fit-ema-out-of-range", ("fit", "digits-cnn", "--ema", "2", "--no-save"), r"EMA decay must be in \(0, 1\)"),
    Case("fit-resume-nothing", ("fit", "digits-cnn", "--resume", "no-such-run"),
         r"--resume no-such-run: no such run directory or checkpoint file"),
    Case("fit-resume-garbage-file", ("fit", "digits-cnn", "--resume", "garbage.pt", "--run-dir", "new-run"),
         r"garbage.pt: corrupt or not a PyTorch file", absent="new-run"),
    Case("fit-run-dir-is-a-file", ("fit", "digits-cnn", "--run-dir", "in-the-way/run"),
         r"cannot create run directory in-the-way/run: a file .* is in the way"),
    Case("fit-resume-another-workloads-run", ("fit", "iris-mlp", "--resume", "digits", "--run-dir", "digits"),
         r"digits belongs to a run of digits-cnn .*resume it with `gputrain fit digits-cnn --resume digits`, or "
         r"start a new run of iris-mlp with another --run-dir", run="digits"),
    Case("fit-into-another-workloads-run", ("fit", "iris-mlp", "--run-dir", "digits", "--steps", "1"),
         r"digits belongs to a run of digits-cnn", run="digits"),
    Case("fit-resume-another-model-no-workload-json", ("fit", "iris-mlp", "--resume", "nowl"),
         r"the checkpoint belongs to another model", run="nowl"),
    Case("fit-resume-another-global-batch", ("fit", "digits-cnn", "--resume", "digits", "--batch-size", "7"),
         r"global batch of 64 .* but this run has 7", run="digits"),
    Case("fit-malformed-master-port", ("fit", "digits-cnn", "--resume", "digits"), r"MASTER_PORT='abc' is not an integer",
         run="digits", env=(*TORCHRUN, ("MASTER_PORT", "abc"))),
    Case("fit-malformed-world-size", ("fit", "digits-cnn", "--no-save"), r"WORLD_SIZE='two' is not an integer",
         env=(("WORLD_SIZE", "two"),)),
    Case("fit-rank-beyond-world", ("fit", "digits-cnn", "--no-save"), r"RANK='5' is not an integer from 0 to 1",
         env=(*TORCHRUN[:1], ("RANK", "5"), *TORCHRUN[2:], ("MASTER_PORT", "29999"))),
    Case("fit-malformed-slurm-restart-count", ("fit", "digits-cnn", "--no-save"),
         r"SLURM_RESTART_COUNT='x' is not an integer", env=(*SRUN, ("SLURM_RESTART_COUNT", "x"))),
    Case("fit-slurm-port-out-of-range", ("fit", "digits-cnn", "--no-save"),
         r"MASTER_PORT='99999' is not an integer from 1 to 65535", env=(*SRUN, ("MASTER_PORT", "99999"))),
    # ---------------------------------------------------------------- eval
    Case("eval-no-such-run", ("eval", "no-such-run"), r"no-such-run: no such run directory"),
    Case("eval-run-without-checkpoints", ("eval", "empty-run"), r"empty-run: the run has no checkpoint"),
    Case("eval-damaged-checkpoint", ("eval", "damaged"),
         r"damaged: no checkpoint verifies \(step-000004.pt: its content hash does not match", run="damaged"),
    Case("eval-another-workload", ("eval", "digits", "--workload", "iris-mlp"),
         r"--workload names iris-mlp, but the checkpoint was trained as digits-cnn: pass --workload digits-cnn$",
         run="digits"),
    Case("eval-garbage-pt", ("eval", "digits", "--data", "garbage.pt"),
         r"garbage.pt: not a PyTorch file, or a damaged one .*write the data with torch.save", run="digits"),
    Case("eval-garbage-npy", ("eval", "digits", "--data", "garbage.npy"),
         r"garbage.npy: not a readable .npy file .*numpy.save", run="digits"),
    Case("eval-pickled-objects-npy", ("eval", "digits", "--data", "objects.npy"),
         r"objects.npy: an array of Python objects \(dtype=object\).*can run any code", run="digits"),
    Case("eval-inputs-without-targets", ("eval", "digits", "--data", "images.pt"),
         r"holds inputs alone .*eval needs targets too .*torch.save\(\(inputs, targets\)", run="digits"),
    Case("eval-dict-for-a-pair-workload", ("eval", "digits", "--data", "dict.pt"),
         r"holds a dict \('x'\), but digits-cnn's data are inputs \(N, 1, 8, 8\) uint8", run="digits"),
    Case("eval-columns-of-different-lengths", ("eval", "digits", "--data", "ragged.pt"),
         r"different numbers of samples \(inputs 5, targets 4\)", run="digits"),
    Case("eval-labels-out-of-range", ("eval", "digits", "--data", "labels-out-of-range.pt"),
         r"the model failed on it .*targets in \[12, 12\] where digits-cnn's are in \[0, 9\]", run="digits"),
    Case("eval-tensor-for-a-dict-workload", ("eval", "fails", "--data", "images.pt"),
         r"holds inputs \(5, 1, 8, 8\) uint8, but fails-when-asked's data are a dict of tensors \(x \(N, 4\) float32, "
         r"labels \(N,\) int64\); save a dict of tensors with the same keys", run="fails"),
    Case("eval-dict-without-the-labels", ("eval", "fails", "--data", "dict.pt"),
         r"the dict has no 'labels' \(fails-when-asked's data: x \(N, 4\) float32, labels \(N,\) int64\)", run="fails"),
    Case("eval-missing-checkpoint-file", ("eval", "digits", "--checkpoint", "step-9.pt"),
         r"--checkpoint step-9.pt: no such file", run="digits"),
    Case("eval-checkpoint-folder", ("eval", "digits", "--checkpoint", "digits/checkpoints"),
         r"a folder, but not a sharded checkpoint \(step-N.dcp\)", run="digits"),
    Case("eval-no-ema", ("eval", "digits", "--weights", "ema"), r"kept no EMA of its weights", run="digits"),
    Case("eval-zero-batch", ("eval", "digits", "--batch-size", "0"), r"--batch-size: expected a positive integer"),
    Case("eval-option-without-value", ("eval", "digits", "--option", "=5"), r"--option '=5': expected KEY=VALUE$",
         run="digits"),
    # ---------------------------------------------------------------- predict
    Case("predict-wrong-channels", ("predict", "digits", "--data", "three-channels.pt"),
         r"the model failed on it \(RuntimeError: .*\): inputs \(5, 3, 8, 8\) float32 where digits-cnn's are "
         r"\(N, 1, 8, 8\) uint8", run="digits"),
    Case("predict-wrong-rank-npy", ("predict", "digits", "--data", "flat.npy"),
         r"inputs \(5, 40\) float32 where digits-cnn's are \(N, 1, 8, 8\) uint8", run="digits"),
    Case("predict-complex", ("predict", "digits", "--data", "complex.pt"), r"inputs are complex numbers", run="digits"),
    Case("predict-strings-npy", ("predict", "digits", "--data", "strings.npy"),
         r"an array of <U1 .*tensors hold numbers", run="digits"),
    Case("predict-list-of-numbers", ("predict", "digits", "--data", "list.pt"), r"holds a list holding int, not tensors",
         run="digits"),
    Case("predict-out-is-a-folder", ("predict", "digits", "--data", "test", "--out", "a-folder"),
         r"--out a-folder is a folder: give a file name", run="digits"),
    Case("predict-out-below-a-file", ("predict", "digits", "--data", "test", "--out", "in-the-way/p.pt"),
         r"in-the-way is a file, not a folder", run="digits"),
    Case("predict-out-unwritable", ("predict", "digits", "--data", "test", "--out", "/proc/p.pt"),
         r"--out /proc/p.pt: cannot write in /proc", run="digits", needs="proc"),
    Case("predict-no-data", ("predict", "digits"), r"the following arguments are required: --data"),
    # ---------------------------------------------------------------- export
    Case("export-onnx-to-a-folder", ("export", "digits", "--format", "onnx", "--out", "a-folder"),
         r"--out a-folder is a folder: give a file name, e.g. a-folder/model.onnx", run="digits"),
    Case("export-safetensors-below-a-file", ("export", "digits", "--out", "in-the-way/m.safetensors"),
         r"in-the-way is a file, not a folder", run="digits"),
    Case("export-hf-of-a-plain-model", ("export", "digits", "--format", "hf"),
         r"--format hf exports Hugging Face models .*use --format safetensors", run="digits"),
    Case("export-hf-into-a-file", ("export", "digits", "--format", "hf", "--out", "in-the-way"),
         r"--out in-the-way is a file, but a folder is needed", run="digits"),
    Case("export-unknown-format", ("export", "digits", "--format", "tflite"), r"invalid choice: 'tflite'"),
    Case("export-onnx-exporter-fails", ("export", "unexportable", "--format", "onnx"),
         r"--format onnx failed: torch.onnx.export cannot convert this model \(.*special_i0e.*\); nothing was "
         r"written, and the other formats still work \(--format safetensors\)", run="unexportable", needs="onnx"),
    # ---------------------------------------------------------------- report
    Case("report-no-such-run", ("report", "no-such-run"), r"no-such-run: no such run directory"),
    Case("report-not-a-run", ("report", "a-folder"), r"a-folder: not a run directory"),
    Case("report-out-is-a-folder", ("report", "digits", "--out", "a-folder"), r"--out a-folder is a folder",
         run="digits"),
    Case("report-out-unwritable", ("report", "digits", "--out", "/proc/report.html"), r"cannot write in /proc",
         run="digits", needs="proc"),
    # ---------------------------------------------------------------- memory, profile, bench
    Case("memory-unknown-workload", ("memory", "nosuch-workload"), r"unknown workload 'nosuch-workload'"),
    Case("memory-bad-limit", ("memory", "digits-cnn", "--limit", "lots"), r"--limit: expected a size in bytes"),
    Case("memory-zero-batch", ("memory", "digits-cnn", "--batch-size", "0"), r"expected a positive integer, got '0'"),
    Case("profile-misspelt-workload", ("profile", "digits-cnnn"), r"did you mean 'digits-cnn'"),
    Case("profile-out-is-a-file", ("profile", "digits-cnn", "--out", "in-the-way"),
         r"--out in-the-way is a file, but a folder is needed"),
    Case("bench-unknown-benchmark", ("bench", "nosuch"), r"invalid choice: 'nosuch'"),
    Case("bench-out-is-a-file", ("bench", "matmul", "--quick", "--out", "in-the-way"),
         r"--out in-the-way is a file, but a folder is needed"),
    # ---------------------------------------------------------------- slurm
    Case("slurm-misspelt-workload", ("slurm", "digits-cnnn", "--run-dir", "/shared/run"),
         r"did you mean 'digits-cnn'"),
    Case("slurm-bad-time", ("slurm", "digits-cnn", "--run-dir", "/shared/run", "--time", "soon"),
         r"--time 'soon': use sbatch's forms"),
    Case("slurm-fit-args-fit-refuses", ("slurm", "digits-cnn", "--run-dir", "/shared/run", "--fit-args=--bogus 1"),
         r"`gputrain fit` on the cluster would refuse them \(unrecognized arguments: --bogus 1\)"),
    Case("slurm-fit-args-as-two-flags", ("slurm", "digits-cnn", "--run-dir", "/shared/run", "--fit-args", "--shard"),
         r"--fit-args: expected one argument; a value that starts with '-' is written --flag=VALUE"),
    Case("slurm-output-is-a-folder", ("slurm", "digits-cnn", "--run-dir", "/shared/run", "--output", "a-folder"),
         r"--output a-folder is a folder"),
    # ---------------------------------------------------------------- sweep (more: tests/test_sweep.py)
    Case("sweep-nothing-to-run", ("sweep",), r"give a sweep's config \(--config FILE\), or --sweep-dir of a sweep"),
    # ---------------------------------------------------------------- values a field refuses, from a flag, a file
    # or a sweep's space: refused before anything runs (no run or sweep directory made)
    *[Case(f"fit-{name}", ("fit", workload, *flags, "--run-dir", "r-refused"), says, absent="r-refused")
      for name, workload, flags, says in (
          ("weight-decay-negative", "iris-mlp", ("--weight-decay", "-1"),
           r"--weight-decay: weight_decay must be a finite number >= 0, got -1\.0"),
          ("weight-decay-nan", "iris-mlp", ("--weight-decay", "nan"), r"weight_decay must be a finite number >= 0, got nan"),
          ("seed-beyond-64-bits", "iris-mlp", ("--seed", "99999999999999999999"),
           r"--seed: seed must be an integer from 0 to 9223372036854775807"),
          ("option-beyond-any-tensor", "linear-regression", ("--option", "n=99999999999999999999"),
           r"option n must be at most 2147483647"),
          ("unknown-compile-mode", "iris-mlp", ("--compile-mode", "warp"),
           r"unknown compile_mode 'warp': torch.compile's modes are default, .*max-autotune"),
          ("negative-max-restarts", "iris-mlp", ("--max-restarts", "-1"), r"max_restarts must be 0 or a positive integer"),
          ("infinite-lr", "iris-mlp", ("--lr", "inf"), r"--lr: expected a positive number, got 'inf'"),
          ("accumulate-beyond-any-step", "iris-mlp", ("--accumulate", "100000000000000000000"),
           r"accumulate must be an integer from 1 to 65536 .*raise batch_size"),
          ("print-config-unknown-device", "iris-mlp", ("--device", "tpu", "--print-config"),
           r"unknown device 'tpu': use 'auto', 'cpu', 'cuda', 'cuda:N' or 'mps'"),
          ("print-config-negative-weight-decay", "iris-mlp", ("--weight-decay=-1", "--print-config"),
           r"weight_decay must be a finite number >= 0"),
          ("print-config-more-processes-than-cores", "iris-mlp", ("--nproc", "100000", "--print-config"),
           r"nproc must be at most \d+ \(the CPU cores of this machine"),
      )],
    *[Case(f"fit-config-{name}", ("fit", "--config", f"{name}.toml", "--run-dir", "r-refused"), says, absent="r-refused")
      for name, says in (
          ("uncatchable-stop-signal", r"line 4: \[train\] stop_signals: SIGKILL in stop_signals: no process can catch it"),
          ("negative-max-grad-norm", r"line 4: \[train\] max_grad_norm: max_grad_norm must be a finite number > 0, got -1"),
          ("zero-max-grad-norm", r"\[train\] max_grad_norm: max_grad_norm must be a finite number > 0, got 0"),
          ("negative-warmup", r"\[train\] warmup_steps: warmup_steps must be 0 or a positive integer, got -5"),
          ("negative-num-workers", r"\[train\] num_workers: num_workers must be 0 or a positive integer, got -3"),
          ("best-metric-not-a-metric", r"best_metric 'accuracy' is no value a run reports: name loss or an evaluation"),
          ("best-metric-the-workload-lacks", r"best_metric 'eval_f1' is not reported by iris-mlp's runs: they report loss "
                                             r"and eval_accuracy, eval_loss"),
          ("lr-beyond-floats", r"\[train\] lr: lr must be > 0 and finite, got inf"),
          ("infinite-weight-decay", r"\[train\] weight_decay: weight_decay must be a finite number >= 0, got inf"),
      )],
    *[Case(f"sweep-{name}", ("sweep", "--config", f"sweep-{name}.toml", "--sweep-dir", "s-refused"), says,
           absent="s-refused")
      for name, says in (
          ("ema-beyond-one", r"\[sweep.space\] ema: can sample 1.0, which the run refuses: \[fit\] EMA decay must be in "
                             r"\(0, 1\)"),
          ("infinite-lr-choice", r"\[sweep.space\] lr: can sample inf, which the run refuses: .*lr must be > 0 and finite"),
          ("option-the-workload-lacks", r"\[sweep.space\] options.n: can sample 100, which the workload refuses: workload "
                                        r"'iris-mlp' takes no options"),
          ("mixed-choices", r"\[sweep.space\] batch_size: choices mix a number and a string values"),
          ("seed-beyond-the-samplers", r"\[sweep\] seed must be an integer from 0 to 4294967295 .*got 1180591620717411303424"),
          ("negative-seed", r"\[sweep\] seed must be an integer from 0 to 4294967295 .*got -1"),
          ("infinite-step", r"\[sweep.space\] weight_decay: step must be a positive number, got inf"),
          ("more-workers-than-cores", r"workers = 100000000000000000000, but this machine has \d+ CPU cores?"),
          ("accumulate-beyond-any-step", r"\[train\] accumulate: accumulate must be an integer from 1 to 65536"),
      )],
    # ---------------------------------------------------------------- info, doctor
    Case("info-unknown-flag", ("info", "--gpus"), r"unrecognized arguments: --gpus"),
    Case("doctor-unknown-flag", ("doctor", "--fast"), r"unrecognized arguments: --fast"),
    Case("unknown-command", ("train", "digits-cnn"), r"invalid choice: 'train'"),
]


_RUN46 = 'workload = "iris-mlp"\n[train]\nsteps = 2\n'  # a run of iris-mlp; line 4 is the case's own
_SWEEP46 = ('workload = "iris-mlp"\n[train]\nsteps = 2\ndevice = "cpu"\n[sweep]\ntrials = 1\n{sweep}[sweep.space]\n'
            '{space}\n')
CONFIG_FILES = {
    "uncatchable-stop-signal.toml": _RUN46 + 'stop_signals = ["SIGTERM", "SIGKILL"]\n',
    "negative-max-grad-norm.toml": _RUN46 + "max_grad_norm = -1\n",
    "zero-max-grad-norm.toml": _RUN46 + "max_grad_norm = 0\n",
    "negative-warmup.toml": _RUN46 + "warmup_steps = -5\n",
    "negative-num-workers.toml": _RUN46 + "num_workers = -3\n",
    "best-metric-not-a-metric.toml": _RUN46 + 'best_metric = "accuracy"\n',
    "best-metric-the-workload-lacks.toml": _RUN46 + 'best_metric = "eval_f1"\n',
    "lr-beyond-floats.toml": _RUN46 + "lr = 1e400\n",
    "infinite-weight-decay.toml": _RUN46 + "weight_decay = inf\n",
    **{f"sweep-{name}.toml": _SWEEP46.format(sweep=sweep, space=space) for name, sweep, space in (
        ("ema-beyond-one", "", "ema = {uniform = [0.5, 1.5]}"),
        ("infinite-lr-choice", "", "lr = {choices = [0.1, inf]}"),
        ("option-the-workload-lacks", "", "options.n = {choices = [100, 200]}"),
        ("mixed-choices", "", 'batch_size = {choices = [16, "32"]}'),
        ("seed-beyond-the-samplers", "seed = 1180591620717411303424\n", "lr = {loguniform = [1e-4, 1e-1]}"),
        ("negative-seed", "seed = -1\n", "lr = {loguniform = [1e-4, 1e-1]}"),
        ("infinite-step", "", "weight_decay = {uniform = [0.0, 0.1], step = inf}"),
        ("more-workers-than-cores", "workers = 100000000000000000000\n", "lr = {loguniform = [1e-4, 1e-1]}"),
        ("accumulate-beyond-any-step", "", "lr = {loguniform = [1e-4, 1e-1]}"),
    )},
}
CONFIG_FILES["sweep-accumulate-beyond-any-step.toml"] = CONFIG_FILES["sweep-accumulate-beyond-any-step.toml"].replace(
    "steps = 2\n", "steps = 2\naccumulate = 100000000000000000000\n")


def test_the_table_covers_every_subcommand():
    from gputrain.cli import COMMANDS

    covered = {c.argv[0] for c in CASES}
    assert set(COMMANDS) <= covered, f"no bad-input case for {sorted(set(COMMANDS) - covered)}"
    assert len(CASES) >= 40 and len({c.id for c in CASES}) == len(CASES)


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_bad_input_gets_one_line_and_changes_nothing(case: Case, work: Path):
    if case.needs == "proc" and not HAS_PROC:
        pytest.skip("needs /proc (Linux) for a folder no one can write to")
    if case.needs == "onnx" and not HAS_ONNX:
        pytest.skip("needs onnx and onnxruntime (pip install 'gputrain[export]')")
    before = snapshot(work / case.run) if case.run else None
    proc = gputrain(work, *case.argv, **dict(case.env))
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert proc.returncode == case.rc, proc.stderr[-3000:]
    assert len(lines) == 1, f"expected one line on stderr, got {len(lines)}:\n{proc.stderr[-3000:]}"
    assert proc.stdout == "", f"a refused command printed on stdout:\n{proc.stdout[-3000:]}"
    command = case.argv[0] if case.argv[0] != "train" else ""
    assert lines[0].startswith((f"gputrain {command}: error: ", "gputrain: error: ")), lines[0]
    import re

    assert re.search(case.says, lines[0]), f"{case.says!r} not in:\n{lines[0]}"
    if before is not None:
        assert snapshot(work / case.run) == before, f"{case.run} changed"
    if case.absent:
        assert not (work / case.absent).exists(), f"{case.absent} was left behind"


# ---------------------------------------------------------------- beyond the table


def test_a_refused_resume_leaves_the_run_usable(work: Path):
    """The issue's case: a wrong-workload resume, then eval / predict / export of the run still work."""
    before = snapshot(work / "digits")
    refused = gputrain(work, "fit", "iris-mlp", "--resume", "digits", "--run-dir", "digits")
    assert refused.returncode == 2 and "belongs to a run of digits-cnn" in refused.stderr
    assert snapshot(work / "digits") == before
    for argv in (("eval", "digits"), ("predict", "digits", "--data", "test", "--out", "p.pt"),
                 ("export", "digits", "--out", "m.safetensors")):
        proc = gputrain(work, *argv)
        assert proc.returncode == 0, proc.stderr[-3000:]
    assert (work / "p.pt").is_file() and (work / "m.safetensors").is_file()


def test_resume_without_a_workload_continues_the_runs_own(work: Path, tmp_path: Path):
    """`gputrain fit --resume RUN/checkpoints/step-N.pt` trains the run's workload (from its
    workload.json), not the default, and goes on in RUN (not in RUN/checkpoints)."""
    run = tmp_path / "digits"
    shutil.copytree(work / "digits", run)
    proc = gputrain(work, "fit", "--resume", str(run / "checkpoints" / "step-000004.pt"), "--steps", "6", "--device",
                    "cpu", "--precision", "fp32", "--no-tensorboard", "--progress", "off", "--quiet", "--json",
                    timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert '"workload": "digits-cnn"' in proc.stdout and (run / "checkpoints" / "step-000006.pt").is_file()
    assert not (run / "checkpoints" / "checkpoints").exists()


def test_the_users_model_failing_keeps_its_traceback_with_a_note(work: Path):
    """An error raised by the user's own model is not turned into one line: its traceback stays,
    with gputrain's note of what it was doing (and on what data)."""
    for argv in (("eval", "fails"), ("predict", "fails", "--data", "test", "--out", "fails.pt")):
        proc = gputrain(work, *argv, GPUTRAIN_TEST_MODEL_FAILS="1")
        assert proc.returncode == 1, proc.stderr[-3000:]
        assert "Traceback" in proc.stderr and "RuntimeError: the user's model failed on purpose" in proc.stderr
        assert (f"gputrain {argv[0]}: the model raised while running on --data test (x (16, 4) float32, "
                "labels (16,) int64, like fails-when-asked's data)") in proc.stderr
    assert not (work / "fails.pt").exists()
