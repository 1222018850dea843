"""Bad input, tried as a new user would, across every subcommand: each case must exit 2 (argparse's and
gputrain's status for a refused command) with exactly one line on stderr that says what was wrong, no
traceback, nothing on stdout, and every file of its working folder byte-identical before and after (a
refused command writes nothing).

Each case runs in a fresh copy of the working folder. Most run `gputrain.cli.main(ARGV)` in this process,
as `python -m gputrain ARGV` would (`run_in_process`: the child's environment and folder, what a fresh
interpreter would print for a warning or a log record, its torch settings, signal handlers, sys.path and
imported user modules put back afterwards). The rows with `process=True` run as a real `python -m
gputrain` process, at least one per subcommand and one per failure class (`failure_class`; held by
`test_each_command_and_failure_class_has_a_process_row`), so that a refusal is still shown to hold as a
process: its exit status, its stderr, its files.

The run directories are trained once per module (digits-cnn for 4 steps, two tiny user workloads)
and copied for each case; a case that would change one fails here, as each case compares its copy
with a snapshot taken before it.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import random
import re
import shutil
import subprocess
import sys
import threading
import warnings
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers import launcher_variable, process_state, put_back, subprocess_env, unmeasured_env

HAS_PROC = Path("/proc/self").is_dir()  # a tree no one can create files in, not even root (Linux)
HAS_OPTUNA = __import__("importlib.util").util.find_spec("optuna") is not None
HAS_PSYCOPG = __import__("importlib.util").util.find_spec("psycopg") is not None
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


class ListedLayers(nn.Module):
    """Its layers in a plain Python list (as pytorch/examples' mnist_forward_forward keeps them): unregistered."""

    def __init__(self):
        super().__init__()
        self.layers = [nn.Linear(4, 8), nn.Linear(8, 2)]

    def forward(self, x):
        return self.layers[1](self.layers[0](x).relu())


def _listed_step(step, batch):
    x, y = batch
    loss = nn.functional.cross_entropy(step.model(x), y)
    step.backward(loss)
    step.step("first")
    step.step("second")
    return loss


def listed_layers():
    return Workload(name="listed-layers", description="test", make_data=_data, make_model=ListedLayers, loss_fn=None,
                    task=None, step_fn=_listed_step, defaults={"batch_size": 16},
                    optimizers=lambda m: {"first": torch.optim.SGD(m.layers[0].parameters(), lr=0.1),
                                          "second": torch.optim.SGD(m.layers[1].parameters(), lr=0.1)})


class Pair(nn.Module):
    """A GAN's two parts and no forward of its own: the step calls them."""

    def __init__(self):
        super().__init__()
        self.generator = nn.Linear(8, 4)
        self.discriminator = nn.Linear(4, 2)


def _train_only():  # no test split: a model without a forward of its own is not evaluated by a loss rule
    return DataSplits(train=_data().train, test=None)


def _pair_losses(step, batch):
    x, y = batch
    d = nn.functional.cross_entropy(step.model.discriminator(x), y)
    step.backward(d)
    step.step("discriminator")
    g = nn.functional.cross_entropy(step.model.discriminator(step.model.generator(torch.randn(len(x), 8))), y)
    step.backward(g)
    step.step("generator")
    return d, g


# A step of your own that misuses the API, by name: what it does after its two losses d and g (the
# --option misuse=NAME of the pair workload), or, for those that misuse it before (ONE_LOSS), with one.
MISUSES = {
    "returns-loss-beside-others": lambda step, d, g: {"loss": d, "g_loss": g},
    "returns-a-learning-rates-name": lambda step, d, g: {"lr_generator": d},
    "returns-an-evaluations-name": lambda step, d, g: {"eval_loss": g},
    "returns-a-blank-name": lambda step, d, g: {"": d},
    "returns-a-number-as-name": lambda step, d, g: {1: d},
    "returns-a-1d-tensor": lambda step, d, g: d.reshape(1),
    "returns-a-1d-named-loss": lambda step, d, g: {"d_loss": d.reshape(1)},
    "returns-an-empty-dict": lambda step, d, g: {},
    "returns-none": lambda step, d, g: None,
    "returns-a-string": lambda step, d, g: "loss",
    "returns-a-list": lambda step, d, g: [d, g],
    "assigns-state": lambda step, d, g: setattr(step, "state", {"hidden": d.detach()}),
    "assigns-micro-index": lambda step, d, g: setattr(step, "micro_index", 3),
    "assigns-index": lambda step, d, g: setattr(step, "index", 7),
    "state-named-by-a-number": lambda step, d, g: step.state.__setitem__(1, d.detach()),
    "state-on-the-meta-device": lambda step, d, g: step.state.__setitem__("bank", torch.empty(3, device="meta")),
    "state-a-function": lambda step, d, g: step.state.__setitem__("hook", print),
    "steps-twice": lambda step, d, g: step.step("generator"),
}
ONE_LOSS = {
    "no-backward": lambda step, d: step.step("discriminator"),
    "no-step": lambda step, d: step.backward(d),
    "backward-of-none": lambda step, d: step.backward(None),
    "unknown-optimizer": lambda step, d: (step.backward(d), step.step("critic")),
    "optimizer-unnamed": lambda step, d: (step.backward(d), step.step()),
}


def pair(misuse="", eval_part=None):
    def step_fn(step, batch):
        if misuse in ONE_LOSS:
            d = nn.functional.cross_entropy(step.model.discriminator(batch[0]), batch[1])
            ONE_LOSS[misuse](step, d)
            return d
        d, g = _pair_losses(step, batch)
        if misuse in MISUSES:
            out = MISUSES[misuse](step, d, g)
            return d if misuse.startswith(("assigns", "state", "steps")) else out
        return {"d_loss": d, "g_loss": g}

    return Workload(name="pair", description="test", make_data=_train_only, make_model=Pair, loss_fn=None, task=None,
                    step_fn=step_fn, eval_part=eval_part, defaults={"batch_size": 16},
                    optimizers={"discriminator": lambda m: torch.optim.SGD(m.discriminator.parameters(), lr=0.1),
                                "generator": lambda m: torch.optim.Adam(m.generator.parameters(), lr=1e-3)})
'''


def gputrain(cwd: Path, *argv: str, timeout: float = 120, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "gputrain", *argv], cwd=cwd, env=subprocess_env(COLUMNS="200", **env),
                          capture_output=True,                          text=True, timeout=timeout)


def snapshot(folder: Path) -> dict[str, str]:
    """Every file and folder below `folder`: its sha256, or "dir" (Python's __pycache__ left out: importing a
    user workload writes there)."""
    out = {}
    for path in sorted(folder.rglob("*")):
        rel = path.relative_to(folder)
        if "__pycache__" in rel.parts:
            continue
        out[str(rel)] = "dir" if path.is_dir() else hashlib.sha256(path.read_bytes()).hexdigest()
    return out


@pytest.fixture(scope="module")
def work(tmp_path_factory) -> Path:
    """A working folder with run directories (digits: digits-cnn, 4 steps; its copies without
    workload.json and with a damaged checkpoint; unexportable), data files good and bad, a file
    and a folder in the way. The runs are trained through main() here (their files are what
    `gputrain fit` writes either way; the process rows and the tests below read them as processes)."""
    w = tmp_path_factory.mktemp("bad-inputs")
    (w / "userwl.py").write_text(USER_WORKLOADS)
    common = ("--steps", "4", "--log-every", "2", "--device", "cpu", "--precision", "fp32", "--no-tensorboard",
              "--progress", "off", "--quiet")
    from gputrain.cli import main

    for workload, run in (("digits-cnn", "digits"), ("userwl.py:unexportable", "unexportable"),
                          ("userwl.py:fails_when_asked", "fails"), ("userwl.py:pair", "pair")):
        with as_a_process_would(w):  # `gputrain fit`, in this process: no interpreter to start
            assert main(["fit", workload, "--run-dir", run, *common]) == 0
    shutil.copytree(w / "digits", w / "nowl")  # as a run of the Python API: no workload.json
    (w / "nowl" / "workload.json").unlink()
    shutil.copytree(w / "digits", w / "damaged")
    checkpoint = w / "damaged" / "checkpoints" / "step-000004.pt"
    data = bytearray(checkpoint.read_bytes())
    data[len(data) // 2] ^= 0xFF
    checkpoint.write_bytes(bytes(data))
    for name, text in CONFIG_FILES.items():  # the config files of the value-check rows below
        (w / name).write_text(text)
    (w / "utf16.toml").write_text('workload = "iris-mlp"\n', encoding="utf-16")  # a Windows editor's "Unicode"
    (w / "cache dir").mkdir()
    (w / "empty-run").mkdir()
    (w / "in-the-way").write_text("a file where a folder is expected\n")
    (w / "no-ray" / "ray").mkdir(parents=True)  # on PYTHONPATH: a Python where Ray is not installed
    (w / "no-ray" / "ray" / "__init__.py").write_text("raise ModuleNotFoundError(\"No module named 'ray'\", name='ray')\n")
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
    needs: str | None = None  # "proc" | "onnx" | "optuna" | "psycopg": skipped (with the reason) where missing
    process: bool = False  # a real `python -m gputrain` process, not main() in this one (see the docstring)


SRUN = (("SLURM_PROCID", "0"), ("SLURM_STEP_ID", "0"), ("SLURM_NTASKS", "2"), ("SLURM_JOB_NODELIST", "localhost"))
NPROC_55 = ("--nproc", "2", "--steps", "6")  # torchrun's processes, refused before they start
TORCHRUN = (("WORLD_SIZE", "2"), ("RANK", "0"), ("LOCAL_RANK", "0"), ("MASTER_ADDR", "127.0.0.1"))

CASES = [
    # ---------------------------------------------------------------- fit
    Case("fit-misspelt-workload", ("fit", "digits-cnnn"), r"unknown workload 'digits-cnnn': did you mean 'digits-cnn'",
         process=True),
    Case("fit-negative-lr", ("fit", "digits-cnn", "--lr", "-1"), r"--lr: expected a positive number, got '-1'"),
    Case("fit-steps-and-epochs", ("fit", "digits-cnn", "--steps", "2", "--epochs", "1"), r"not allowed with",
         process=True),
    Case("fit-missing-device", ("fit", "digits-cnn", "--device", "cuda:7", "--no-save"), r"cuda:7 requested"),
    # --launcher ray: refused before a Ray cluster starts (RAY_ADDRESS unset unless the case sets it)
    Case("fit-ray-not-installed", ("fit", "iris-mlp", "--launcher", "ray", "--run-dir", "r-ray"),
         r"Ray is not installed \(No module named 'ray'\): install the extra with pip install 'gputrain\[ray\]'",
         env=(("PYTHONPATH", "no-ray"), ("RAY_ADDRESS", "")), absent="r-ray", process=True),
    Case("fit-ray-cluster-unreachable", ("fit", "iris-mlp", "--launcher", "ray", "--run-dir", "r-ray"),
         r"cannot reach the Ray cluster at RAY_ADDRESS='127.0.0.1:1' \(.+\): start it \(`ray start --head`\) or unset "
         r"RAY_ADDRESS", env=(("RAY_ADDRESS", "127.0.0.1:1"),), absent="r-ray", process=True),
    Case("fit-ray-more-workers-than-cores", ("fit", "iris-mlp", "--launcher", "ray", "--nproc", "100000"),
         r"--nproc 100000: 100000 Ray workers need 100000 CPUs \(one each\) but this machine \(a local Ray cluster\) "
         r"has \d+: use --nproc \d+ or fewer", env=(("RAY_ADDRESS", ""),)),
    Case("fit-ray-no-save", ("fit", "iris-mlp", "--launcher", "ray", "--no-save"),
         r"--launcher ray keeps the run's checkpoints .*: drop --no-save"),
    Case("fit-ray-storage-without-ray", ("fit", "iris-mlp", "--ray-storage", "store", "--run-dir", "r-ray"),
         r"--ray-storage says where Ray Train keeps its checkpoints: it needs --launcher ray", absent="r-ray"),
    Case("fit-ray-storage-empty", ("fit", "iris-mlp", "--launcher", "ray", "--ray-storage", " ", "--run-dir", "r-ray"),
         r"--ray-storage is empty: give a folder or a URI \(s3://bucket/path\), or leave it out", absent="r-ray"),
    Case("fit-ray-storage-a-file", ("fit", "iris-mlp", "--launcher", "ray", "--ray-storage", "in-the-way",
                                    "--run-dir", "r-ray"),
         r"--ray-storage in-the-way: a file, not a folder: give a folder \(made if missing\) or a URI",
         env=(("RAY_ADDRESS", ""),), absent="r-ray"),
    Case("fit-unknown-launcher", ("fit", "iris-mlp", "--launcher", "mpirun"),
         r"argument --launcher: launcher must be one of 'torchrun', 'ray', got 'mpirun'"),
    Case("fit-unknown-logger", ("fit", "digits-cnn", "--logger", "nosuch", "--no-save"),
         r"unknown logger 'nosuch': choose from csv"),
    Case("fit-missing-module", ("fit", "nosuchmodule:make"), r"no module named 'nosuchmodule'"),
    Case("fit-unknown-option", ("fit", "digits-cnn", "--option", "n=5"), r"takes no options; got n"),
    Case("fit-option-without-value", ("fit", "digits-cnn", "--option", "n5"),
         r"--option 'n5': expected KEY=VALUE, e\.g\. --option n=2000$"),
    Case("fit-parameters-in-a-python-list", ("fit", "userwl.py:listed_layers", "--run-dir", "r-listed"),
         r"optimizer 'first' and optimizer 'second' update 4 parameter tensors that the model does not register \(it "
         r"registers none\), of shapes \[8, 4\], \[8\], \[2, 8\], \[2\]: .*Register them on the model: .*nn\.ModuleList",
         absent="r-listed"),
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
         r"start a new run of iris-mlp with another --run-dir", run="digits", process=True),
    Case("fit-into-another-workloads-run", ("fit", "iris-mlp", "--run-dir", "digits", "--steps", "1"),
         r"digits belongs to a run of digits-cnn", run="digits"),
    Case("fit-resume-another-model-no-workload-json", ("fit", "iris-mlp", "--resume", "nowl"),
         r"the checkpoint belongs to another model", run="nowl"),
    Case("fit-resume-another-global-batch", ("fit", "digits-cnn", "--resume", "digits", "--batch-size", "7"),
         r"global batch of 64 .* but this run has 7", run="digits"),
    Case("fit-malformed-master-port", ("fit", "digits-cnn", "--resume", "digits"), r"MASTER_PORT='abc' is not an integer",
         run="digits", env=(*TORCHRUN, ("MASTER_PORT", "abc"))),
    Case("fit-malformed-world-size", ("fit", "digits-cnn", "--no-save"), r"WORLD_SIZE='two' is not an integer",
         env=(("WORLD_SIZE", "two"),), process=True),
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
         r"damaged: no checkpoint verifies \(step-000004.pt: its content hash does not match", run="damaged",
         process=True),
    Case("eval-another-workload", ("eval", "digits", "--workload", "iris-mlp"),
         r"--workload names iris-mlp, but the checkpoint was trained as digits-cnn: pass --workload digits-cnn$",
         run="digits"),
    Case("eval-garbage-pt", ("eval", "digits", "--data", "garbage.pt"),
         r"garbage.pt: not a PyTorch file, or a damaged one .*write the data with torch.save", run="digits",
         process=True),
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
         r"\(N, 1, 8, 8\) uint8", run="digits", process=True),
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
         r"--out /proc/p.pt: cannot write in /proc", run="digits", needs="proc", process=True),
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
         r"written, and the other formats still work \(--format safetensors\)", run="unexportable", needs="onnx",
         process=True),
    # ---------------------------------------------------------------- report
    Case("report-no-such-run", ("report", "no-such-run"), r"no-such-run: no such run directory"),
    Case("report-not-a-run", ("report", "a-folder"), r"a-folder: not a run directory", process=True),
    Case("report-sweep-not-a-sweep", ("report", "--sweep", "a-folder"),
         r"a-folder: not a sweep's folder \(no sweep.toml\): give the --sweep-dir of a sweep", needs="optuna"),
    Case("report-out-is-a-folder", ("report", "digits", "--out", "a-folder"), r"--out a-folder is a folder",
         run="digits"),
    Case("report-out-unwritable", ("report", "digits", "--out", "/proc/report.html"), r"cannot write in /proc",
         run="digits", needs="proc"),
    # ---------------------------------------------------------------- memory, profile, bench
    Case("memory-unknown-workload", ("memory", "nosuch-workload"), r"unknown workload 'nosuch-workload'"),
    Case("memory-bad-limit", ("memory", "digits-cnn", "--limit", "lots"), r"--limit: expected a size in bytes",
         process=True),
    Case("memory-zero-batch", ("memory", "digits-cnn", "--batch-size", "0"), r"expected a positive integer, got '0'"),
    Case("memory-unknown-optimizer", ("memory", "digits-cnn", "--optimizer", "lion"),
         r"argument --optimizer: invalid choice: 'lion' \(choose from 'adamw', 'adam', 'sgd'"),
    Case("memory-no-workload", ("memory",), r"give a workload \(a built-in one, .*\) or a run's --config FILE"),
    Case("memory-config-lr-beyond-floats", ("memory", "--config", "lr-beyond-floats.toml"),
         r"line 4: \[train\] lr: lr must be > 0 and finite, got inf"),
    Case("profile-misspelt-workload", ("profile", "digits-cnnn"), r"did you mean 'digits-cnn'"),
    Case("profile-config-negative-warmup", ("profile", "--config", "negative-warmup.toml", "--out", "p-refused"),
         r"line 4: \[train\] warmup_steps: warmup_steps must be 0 or a positive integer, got -5", absent="p-refused"),
    Case("profile-batch-size-in-words", ("profile", "digits-cnn", "--batch-size", "many"),
         r"argument --batch-size: expected a positive integer, got 'many'"),
    Case("profile-out-is-a-file", ("profile", "digits-cnn", "--out", "in-the-way"),
         r"--out in-the-way is a file, but a folder is needed", process=True),
    Case("bench-unknown-benchmark", ("bench", "nosuch"), r"invalid choice: 'nosuch'"),
    Case("bench-out-is-a-file", ("bench", "matmul", "--quick", "--out", "in-the-way"),
         r"--out in-the-way is a file, but a folder is needed", process=True),
    # ---------------------------------------------------------------- slurm
    Case("slurm-misspelt-workload", ("slurm", "digits-cnnn", "--run-dir", "/shared/run"),
         r"did you mean 'digits-cnn'"),
    Case("slurm-bad-time", ("slurm", "digits-cnn", "--run-dir", "/shared/run", "--time", "soon"),
         r"--time 'soon': use sbatch's forms", process=True),
    Case("slurm-fit-args-fit-refuses", ("slurm", "digits-cnn", "--run-dir", "/shared/run", "--fit-args=--bogus 1"),
         r"`gputrain fit` on the cluster would refuse them \(unrecognized arguments: --bogus 1\)"),
    Case("slurm-fit-args-as-two-flags", ("slurm", "digits-cnn", "--run-dir", "/shared/run", "--fit-args", "--shard"),
         r"--fit-args: expected one argument; a value that starts with '-' is written --flag=VALUE"),
    Case("slurm-output-is-a-folder", ("slurm", "digits-cnn", "--run-dir", "/shared/run", "--output", "a-folder"),
         r"--output a-folder is a folder"),
    # slurm --sweep: the sweep checked as `gputrain sweep` checks it, before the job array waits in the queue
    Case("slurm-sweep-password-in-storage", ("slurm", "--sweep", "sweep-storage.toml", "--sweep-dir", "/shared/lr",
                                             "--storage", "postgresql://u:hunter2@db/sweeps", "--output", "array.sbatch"),
         r"--storage postgresql://u@db/sweeps: a password in the URL would be written into the script; give the URL "
         r"without it", absent="array.sbatch", needs="optuna"),
    Case("slurm-sweep-with-a-flag-of-fit", ("slurm", "--sweep", "sweep-storage.toml", "--sweep-dir", "/shared/lr",
                                            "--run-dir", "/shared/run"),
         r"--run-dir: belongs to a sweep's array \(--sweep\): its trials go under --sweep-dir", needs="optuna"),
    Case("slurm-sweep-journal-not-absolute", ("slurm", "--sweep", "sweep-storage.toml", "--sweep-dir", "/shared/lr",
                                              "--storage", "lr.journal"),
         r"--storage 'lr.journal': give the journal file's absolute path on storage every node sees", needs="optuna"),
    Case("slurm-sweep-sampling-what-the-run-refuses", ("slurm", "--sweep", "sweep-ema-beyond-one.toml", "--sweep-dir",
                                                       "/shared/lr", "--output", "array.sbatch"),
         r"line 8: \[sweep.space\] ema: can sample 1.0, which the run refuses: \[fit\] EMA decay must be in \(0, 1\)",
         absent="array.sbatch", needs="optuna",
         process=True),
    Case("slurm-sweep-without-its-folder", ("slurm", "--sweep", "sweep-storage.toml"),
         r"--sweep needs --sweep-dir DIR: on storage every node sees", needs="optuna"),
    # ---------------------------------------------------------------- sweep (more: tests/test_sweep.py)
    Case("sweep-nothing-to-run", ("sweep",), r"give a sweep's config \(--config FILE\), or --sweep-dir of a sweep",
         process=True),
    Case("sweep-direction-up", ("sweep", "--config", "sweep-negative-seed.toml", "--direction", "up"),
         r"argument --direction: invalid choice: 'up' \(choose from 'min', 'max'\)"),
    # where the study lives (--storage): refused before anything is written, the password never shown
    *[Case(f"sweep-storage-{name}", ("sweep", "--config", "sweep-storage.toml", "--sweep-dir", "s-refused", *flags), says,
           absent="s-refused", needs=needs)
      for name, flags, says, needs in (
          ("unknown-scheme", ("--storage", "redis://u:secret@localhost/0"),
           r"argument --storage: storage 'redis://u:\*\*\*@localhost/0': unknown scheme 'redis': give "
           r"postgresql://USER@HOST/DB", None),
          ("sqlite", ("--storage", "sqlite:///study.db"), r"SQLite is the default already \(SWEEP_DIR/study.db", None),
          ("journal-below-a-file", ("--storage", "in-the-way/study.journal"),
           r"--storage .*in-the-way/study.journal: .*in-the-way is a file, not a folder", None),
          ("journal-in-a-missing-folder", ("--storage", "no-such-folder/study.journal"),
           r"its folder .*no-such-folder does not exist: create it on the shared filesystem first", None),
          ("server-unreachable", ("--storage", "postgresql://u:secret@127.0.0.1:1/sweeps"),
           r"--storage postgresql\+psycopg://u:\*\*\*@127.0.0.1:1/sweeps: cannot connect \(.*\): check that the server "
           r"runs", "psycopg"),
          ("empty-study-name", ("--study", ""), r"argument --study: study must be a name of 1 to 512 printable characters", None),
          # neither MySQL driver is among the test extras: what a user without one sees
          ("mysql-without-its-driver", ("--storage", "mysql+mysqldb://u:secret@127.0.0.1:1/sweeps"),
           r"--storage mysql\+mysqldb://u:\*\*\*@127.0.0.1:1/sweeps needs its database driver \(MySQLdb\): install the "
           r"driver the URL names \(mysql\+mysqldb://: pip install mysqlclient\), or write mysql:// for PyMySQL", None),
      )],
    Case("sweep-storage-password-in-the-config", ("sweep", "--config", "sweep-storage-password.toml", "--sweep-dir",
                                                  "s-refused"),
         r"line 7: \[sweep\] storage holds a password: a config file is no place for it; .*PGPASSWORD", absent="s-refused"),
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
          ("unknown-compile-scope", "iris-mlp", ("--compile-scope", "regions"),
           r"argument --compile-scope: expected whole or regional, got 'regions'"),
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
    *[Case(f"fit-config-{name}", ("fit", "--config", f"{name}.toml", "--run-dir", "r-refused"), says,
           absent="r-refused", process=name == "uncatchable-stop-signal")
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
    # ---------------------------------------------------------------- a step of your own that misuses the API: said at its
    # first step, before anything is written (the run directory it would have made is not left behind)
    *[Case(f"fit-own-step-{name}", ("fit", "userwl.py:pair", "--option", f"misuse={name}", "--run-dir", "r-misuse"),
           says, absent="r-misuse", process=name == "steps-twice")
      for name, says in (
          ("returns-loss-beside-others", r"step_fn returned 'loss' beside 'g_loss': the run's loss is the sum of the "
                                         r"losses returned, so name each loss for what it is"),
          ("returns-a-learning-rates-name", r"step_fn returned a loss named 'lr_generator', a name the run's records "
                                            r"give to a value of their own \(a learning rate\): name it otherwise"),
          ("returns-an-evaluations-name", r"a loss named 'eval_loss', a name the run's records give to a value of "
                                          r"their own \(an evaluation\)"),
          ("returns-a-blank-name", r"step_fn returned a loss named '': name each loss \(it is logged under its name\)"),
          ("returns-a-number-as-name", r"step_fn returned a dict with the key\(s\) \[1\]: name each loss with a string"),
          ("returns-a-1d-tensor", r"step_fn returned a tensor of shape \(1,\): return the loss as a scalar tensor"),
          ("returns-a-1d-named-loss", r"step_fn returned \{'d_loss': a tensor of shape \(1,\)\}: each loss must be a "
                                      r"scalar tensor"),
          ("returns-an-empty-dict", r"step_fn returned an empty dict: return the loss \(a scalar tensor\) or a dict of "
                                    r"at least one named scalar loss"),
          ("returns-none", r"step_fn returned None: return the loss \(a scalar tensor\) or a dict of named scalar "
                           r"losses"),
          ("returns-a-string", r"step_fn returned a str: return the loss"),
          ("returns-a-list", r"step_fn returned a list: return the loss \(a scalar tensor\) or a dict"),
          ("assigns-state", r"step.state = ... in your step_fn: the step's attributes are gputrain's and read-only; "
                            r"assign its entries instead, step.state\['hidden'\] = h"),
          ("assigns-micro-index", r"step.micro_index = ... in your step_fn: the step's attributes are gputrain's and "
                                  r"read-only"),
          ("assigns-index", r"step.index = ... in your step_fn: the step's attributes are gputrain's and read-only"),
          ("state-named-by-a-number", r"step.state names must be non-empty strings \(they name checkpoint entries\), "
                                      r"got 1"),
          ("state-on-the-meta-device", r"step.state\['bank'\] is a tensor on the meta device \(a shape without data\), "
                                       r"which a checkpoint cannot save"),
          ("state-a-function", r"cannot checkpoint step.state\['hook'\]: it is a builtins.builtin_function_or_method; "
                               r".*or objects with state_dict\(\) and load_state_dict\(\)"),
          ("steps-twice", r"step.step\('generator'\) was called twice in one call of step_fn"),
          ("no-backward", r"step_fn returned without calling step.backward\(loss\): nothing would train"),
          ("no-step", r"step_fn never called step.step\(name\): no optimizer of \['discriminator', 'generator'\] "
                      r"would update"),
          ("backward-of-none", r"step.backward\(loss\) takes the loss tensor your step_fn computed \(a scalar\), "
                               r"got NoneType"),
          ("unknown-optimizer", r"no optimizer named 'critic': this run has \['discriminator', 'generator'\]"),
          ("optimizer-unnamed", r"this run has optimizers \['discriminator', 'generator'\]: say which, "
                                r"step.step\(name\)"),
      )],
    Case("fit-eval-part-the-model-lacks", ("fit", "userwl.py:pair", "--option", "eval_part=critic", "--run-dir",
                                           "r-refused"),
         r"pair's eval_part 'critic': the model of pair has no such part; its parts are generator, discriminator",
         absent="r-refused"),
    # ---------------------------------------------------------------- a part of the model (--part)
    Case("export-onnx-of-a-part-its-inputs-do-not-fit", ("export", "pair", "--part", "generator", "--format", "onnx",
                                                         "--out", "g.onnx"),
         r"--format onnx --part generator: the part does not run on its workload's inputs \(\(4, 4\) float32: "
         r"RuntimeError: mat1 and mat2 shapes cannot be multiplied.*\), and an ONNX export needs inputs it takes; "
         r"export its weights with --format safetensors", run="pair", absent="g.onnx", needs="onnx"),
    *[Case(f"{command}-blank-part", (command, "pair", "--part", part, *extra),
           rf"--part '{part}' is blank: name a part of the model \(its parts are generator, discriminator\), or leave "
           r"it out for the whole model", run="pair")
      for command, part, extra in (("export", "", ("--out", "m55.safetensors")), ("eval", " ", ()),
                                   ("predict", "", ("--data", "test", "--out", "p55.pt")))],
    # ---------------------------------------------------------------- settings found wrong only at a run's end, or never
    Case("fit-config-early-stop-not-reported", ("fit", "--config", "early-stop-not-reported.toml", "--run-dir",
                                                "r-refused"),
         r"early_stop 'nosuch_metric' is not reported by iris-mlp's runs: they report loss and eval_accuracy, "
         r"eval_loss", absent="r-refused"),
    Case("fit-early-stop-not-reported", ("fit", "iris-mlp", "--early-stop", "eval_f1", "--run-dir", "r-refused"),
         r"early_stop 'eval_f1' is not reported by iris-mlp's runs", absent="r-refused"),
    Case("fit-config-batch-size-beyond-torch", ("fit", "--config", "batch-size-beyond-torch.toml", "--run-dir",
                                                "r-refused"),
         r"line 4: \[train\] batch_size: batch_size must be at most 9223372036854775807 \(torch's sizes are 64-bit "
         r"integers", absent="r-refused"),
    Case("fit-print-config-batch-size-beyond-torch", ("fit", "--config", "batch-size-beyond-torch.toml",
                                                      "--print-config"), r"batch_size must be at most 9223372036854775807"),
    Case("fit-batch-size-beyond-torch", ("fit", "iris-mlp", "--batch-size", "99999999999999999999", "--run-dir",
                                         "r-refused"),
         r"argument --batch-size: batch_size must be at most 9223372036854775807", absent="r-refused"),
    Case("fit-config-utf16", ("fit", "--config", "utf16.toml", "--run-dir", "r-refused"),
         r"--config utf16.toml: not a UTF-8 text file; a config is a TOML file", absent="r-refused"),
    # ---------------------------------------------------------------- compile caches: before anything is compiled or written
    *[Case(f"fit-compile-cache-{name}", ("fit", "iris-mlp", "--compile", "--device", "cpu", "--run-dir", "r-refused"),
           says, env=env, absent="r-refused", needs="proc" if "/proc" in str(env) else None,
           process=name == "env-with-a-space")
      for name, env, says in (
          ("env-a-file", (("GPUTRAIN_COMPILE_CACHE", "in-the-way"),),
           r"GPUTRAIN_COMPILE_CACHE in-the-way is a file, but a folder is needed there"),
          ("env-below-a-file", (("GPUTRAIN_COMPILE_CACHE", "in-the-way/cache"),),
           r"GPUTRAIN_COMPILE_CACHE in-the-way/cache: in-the-way is a file, not a folder"),
          ("env-unwritable", (("GPUTRAIN_COMPILE_CACHE", "/proc/gputrain-cache"),),
           r"GPUTRAIN_COMPILE_CACHE /proc/gputrain-cache: cannot write in /proc"),
          ("inductor-env-a-file", (("TORCHINDUCTOR_CACHE_DIR", "in-the-way"),),
           r"TORCHINDUCTOR_CACHE_DIR \S*in-the-way is a file, but a folder is needed there"),
          ("inductor-env-below-a-file", (("TORCHINDUCTOR_CACHE_DIR", "in-the-way/inductor"),),
           r"TORCHINDUCTOR_CACHE_DIR \S*in-the-way/inductor: \S*in-the-way is a file, not a folder"),
          # a folder that exists (torch's own import makes the folder TORCHINDUCTOR_CACHE_DIR names)
          ("env-with-a-space", (("TORCHINDUCTOR_CACHE_DIR", "cache dir"),),
           r"TORCHINDUCTOR_CACHE_DIR='\S*cache dir' holds a space, which inductor's C\+\+ build on the CPU cannot "
           r"take"),
      )],
    *[Case(f"fit-config-compile-cache-{name}", ("fit", "--config", f"compile-cache-{name}.toml", "--run-dir",
                                                 "r-refused"), says, absent="r-refused")
      for name, says in (
          ("a-file", r"\[train\] compile_cache in-the-way is a file, but a folder is needed there"),
          ("blank", r"line 5: \[train\] compile_cache: compile_cache is blank: give a folder \(made if missing\), or "
                    r"False"),
      )],
    # ---------------------------------------------------------------- the Ray launcher: what its workers refused after Ray
    # started is refused before (in this process: Ray is never imported)
    *[Case(f"fit-ray-{name}", ("fit", workload, "--launcher", "ray", *flags), says, run=run,
           absent=None if run else "r-ray", needs="proc" if "/proc" in str(flags) else None)
      for name, workload, flags, run, says in (
          ("storage-below-a-file", "iris-mlp", ("--ray-storage", "in-the-way/store", "--run-dir", "r-ray"), None,
           r"--ray-storage in-the-way/store: in-the-way is a file, not a folder"),
          ("storage-unwritable", "iris-mlp", ("--ray-storage", "/proc/store", "--run-dir", "r-ray"), None,
           r"--ray-storage /proc/store: cannot write in /proc"),
          ("storage-file-uri-unwritable", "iris-mlp", ("--ray-storage", "file:///proc/store", "--run-dir", "r-ray"),
           None, r"--ray-storage /proc/store: cannot write in /proc"),
          ("storage-unknown-scheme", "iris-mlp", ("--ray-storage", "bogus://x/y", "--run-dir", "r-ray"), None,
           r"--ray-storage bogus://x/y: Ray Train stores through pyarrow's file systems, which know no bogus://: give "
           r"s3://, gs://"),
          ("storage-s3-without-a-bucket", "iris-mlp", ("--ray-storage", "s3://", "--run-dir", "r-ray"), None,
           r"--ray-storage s3:// names no bucket: give s3://BUCKET/PATH"),
          ("storage-gs-without-a-bucket", "iris-mlp", ("--ray-storage", "gs:///runs", "--run-dir", "r-ray"), None,
           r"--ray-storage gs:///runs names no bucket: give gs://BUCKET/PATH"),
          ("run-dir-a-file", "iris-mlp", ("--run-dir", "in-the-way"), None,
           r"cannot create run directory in-the-way: a file of that name \(or of a parent's name\) is in the way"),
          ("resume-a-one-process-run", "digits-cnn", ("--nproc", "2", "--resume", "digits", "--steps", "6"), "digits",
           r"digits/checkpoints/step-000004.pt: the checkpoint was trained with a global batch of 64 \(batch_size x "
           r"accumulate x processes\) but this run has 128"),
          ("resume-another-workloads-run", "iris-mlp", ("--resume", "digits", "--run-dir", "digits"), "digits",
           r"digits belongs to a run of digits-cnn"),
          ("optimizer-the-workload-lacks", "userwl.py:pair", ("--optimizer", "gen.lr=0.1", "--run-dir", "r-ray"), None,
           r"\[optimizers\] names gen, which this workload has not: its optimizers are discriminator, generator"),
          ("optimizer-setting-its-optimizer-lacks", "userwl.py:pair",
           ("--optimizer", "generator.momentum=0.9", "--run-dir", "r-ray"), None,
           r"\[optimizers.generator\] momentum: Adam takes no momentum"),
      )],
    # ---------------------------------------------------------------- torchrun's processes: the same, before they start
    *[Case(f"fit-nproc-{name}", ("fit", workload, *NPROC_55, *flags), says, run=run, absent=None if run else "r-refused")
      for name, workload, flags, run, says in (
          ("resume-a-one-process-run", "digits-cnn", ("--resume", "digits"), "digits",
           r"the checkpoint was trained with a global batch of 64 .* but this run has 128"),
          ("run-dir-below-a-file", "iris-mlp", ("--run-dir", "in-the-way/run"), None,
           r"cannot create run directory in-the-way/run: a file of that name"),
          ("optimizer-the-workload-lacks", "userwl.py:pair", ("--optimizer", "gen.lr=0.1", "--run-dir", "r-refused"),
           None, r"\[optimizers\] names gen, which this workload has not"),
      )],
    # ---------------------------------------------------------------- the environment, seen before a library's warnings
    Case("fit-home-a-file", ("fit", "mnist1d-cnn", "--no-save", "--steps", "1"),
         r"cannot write gputrain's cache file in-the-way/.cache/gputrain/mnist1d-\S+ \(in-the-way is a file, not a "
         r"folder\): set GPUTRAIN_CACHE", env=(("HOME", "in-the-way"), ("XDG_CACHE_HOME", ""), ("GPUTRAIN_CACHE", ""),
                                              ("MPLCONFIGDIR", "")), process=True),
    # ---------------------------------------------------------------- a sweep every trial of which would fail: refused before
    # the first trial
    *[Case(f"sweep-{name}", ("sweep", "--config", f"sweep-{name}.toml", "--sweep-dir", "s-refused"), says,
           absent="s-refused", needs="optuna")
      for name, says in (
          ("optimizer-the-workload-lacks", r"\[sweep.space\] optimizers.gen.lr: can sample 0.0001, which the run "
                                           r"refuses: \[optimizers\] names gen, which this workload has not"),
          ("optimizer-setting-its-optimizer-lacks", r"\[sweep.space\] optimizers.generator.momentum: can sample 0.1, "
                                                    r"which the run refuses: .*Adam takes no momentum"),
          ("compile-with-own-step", r"\[sweep.space\] compile: can sample 'regional', which the run refuses: "
                                    r"compile='regional' compiles the model gputrain calls, but your step_fn calls it"),
          ("skip-nonfinite-with-own-step", r"\[sweep.space\] on_nan: can sample 'skip', which the run refuses: "
                                           r"on_nan='skip' .* a step of your own does not support yet"),
          ("early-stop-not-reported", r"\[sweep.space\] early_stop: can sample 'eval_f1', which the run refuses: "
                                      r"early_stop 'eval_f1' is not reported by iris-mlp's runs"),
      )],
    # ---------------------------------------------------------------- info, doctor
    Case("info-unknown-flag", ("info", "--gpus"), r"unrecognized arguments: --gpus", process=True),
    Case("doctor-unknown-flag", ("doctor", "--fast"), r"unrecognized arguments: --fast", process=True),
    Case("unknown-command", ("train", "digits-cnn"), r"invalid choice: 'train'", process=True),
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
        ("storage", "", "lr = {loguniform = [1e-4, 1e-1]}"),
        ("storage-password", 'storage = "postgresql://u:secret@127.0.0.1:1/sweeps"\n', "lr = {loguniform = [1e-4, 1e-1]}"),
    )},
}
_PAIR55 = ('workload = "userwl.py:pair"\n[train]\nsteps = 2\ndevice = "cpu"\n[sweep]\ntrials = 1\n[sweep.space]\n'
           '{space}\n')
CONFIG_FILES.update({
    "early-stop-not-reported.toml": _RUN46 + '[fit]\nearly_stop = "nosuch_metric"\n',
    "batch-size-beyond-torch.toml": _RUN46 + "batch_size = 99999999999999999999\n",
    "compile-cache-a-file.toml": _RUN46 + 'compile = true\ncompile_cache = "in-the-way"\ndevice = "cpu"\n',
    "compile-cache-blank.toml": _RUN46 + 'compile = true\ncompile_cache = " "\n',
    **{f"sweep-{name}.toml": _PAIR55.format(space=space) for name, space in (
        ("optimizer-the-workload-lacks", "optimizers.gen.lr = {loguniform = [1e-4, 1e-1]}"),
        ("optimizer-setting-its-optimizer-lacks", "optimizers.generator.momentum = {uniform = [0.1, 0.9]}"),
        ("compile-with-own-step", 'compile = {choices = [false, "regional"]}'),
        ("skip-nonfinite-with-own-step", 'on_nan = {choices = ["stop", "skip"]}'),
    )},
    "sweep-early-stop-not-reported.toml": _SWEEP46.format(sweep="", space='early_stop = {choices = ["eval_loss", '
                                                                           '"eval_f1"]}'),
})
CONFIG_FILES["sweep-accumulate-beyond-any-step.toml"] = CONFIG_FILES["sweep-accumulate-beyond-any-step.toml"].replace(
    "steps = 2\n", "steps = 2\naccumulate = 100000000000000000000\n")


def test_the_table_covers_every_subcommand():
    from gputrain.cli import COMMANDS

    covered = {c.argv[0] for c in CASES}
    assert set(COMMANDS) <= covered, f"no bad-input case for {sorted(set(COMMANDS) - covered)}"
    assert len(CASES) >= 40 and len({c.id for c in CASES}) == len(CASES)


def rows(cases: list[Case]) -> list:
    """The cases as pytest parameters: a process row carries the `processes` mark (make test-fast leaves
    it out)."""
    return [pytest.param(c, id=c.id, marks=[pytest.mark.processes] if c.process else []) for c in cases]


@pytest.mark.parametrize("case", rows(CASES))
def test_bad_input_gets_one_line_and_changes_nothing(case: Case, work: Path, tmp_path: Path, monkeypatch, capfd,
                                                     caplog):
    check_case(case, work, tmp_path, monkeypatch, capfd, caplog)


def check_case(case: Case, work: Path, tmp_path: Path, monkeypatch, capfd, caplog) -> None:
    """Run `case` in a fresh copy of `work` (as a process where case.process, else through main() here):
    one line on stderr, its exit status, nothing on stdout, and every file of the copy (every run
    directory, sweep and data file of the table) byte-identical afterwards, none added."""
    if case.needs == "proc" and not HAS_PROC:
        pytest.skip("needs /proc (Linux) for a folder no one can write to")
    if case.needs == "onnx" and not HAS_ONNX:
        pytest.skip("needs onnx and onnxruntime (pip install 'gputrain[export]')")
    if case.needs in ("optuna", "psycopg") and not HAS_OPTUNA:
        pytest.skip("needs Optuna (pip install 'gputrain[sweep]')")
    if case.needs == "psycopg" and not HAS_PSYCOPG:
        pytest.skip("needs psycopg (pip install 'gputrain[postgres]')")
    folder = tmp_path / "w"
    shutil.copytree(work, folder, symlinks=True, ignore=shutil.ignore_patterns("__pycache__"))
    before = snapshot(folder)
    if case.process:
        proc = gputrain(folder, *case.argv, **dict(case.env))
        code, out, err = proc.returncode, proc.stdout, proc.stderr
    else:
        code, out, err = run_in_process(case, folder, monkeypatch, capfd, caplog)
    lines = [line for line in err.splitlines() if line.strip()]
    assert "Traceback" not in err, err[-3000:]
    assert code == case.rc, err[-3000:]
    assert len(lines) == 1, f"expected one line on stderr, got {len(lines)}:\n{err[-3000:]}"
    assert out == "", f"a refused command printed on stdout:\n{out[-3000:]}"
    command = case.argv[0] if case.argv[0] != "train" else ""
    assert lines[0].startswith((f"gputrain {command}: error: ", "gputrain: error: ")), lines[0]
    assert re.search(case.says, lines[0]), f"{case.says!r} not in:\n{lines[0]}"
    after = snapshot(folder)
    changed = sorted(k for k in before.keys() | after.keys() if before.get(k) != after.get(k))
    assert not changed, f"{case.id} changed {changed[:8]}"
    if case.absent:
        assert not (folder / case.absent).exists(), f"{case.absent} was left behind"


# What `python -m gputrain` prints of a warning in a fresh interpreter: every category but these, which
# Python's default filters hide (DeprecationWarning outside __main__ included).
_HIDDEN_WARNINGS = (DeprecationWarning, PendingDeprecationWarning, ImportWarning, ResourceWarning)


@contextlib.contextmanager
def as_a_process_would(cwd: Path):
    """Run the block in `cwd`, then put back what a process of its own would have taken with it: the
    folder, sys.path, the user's workload modules imported from files, torch's settings and the signal
    handlers (helpers.process_state), the random states of torch, random and numpy."""
    saved_path, saved_modules, saved_state = list(sys.path), set(sys.modules), process_state()
    saved_random = (torch.get_rng_state(), random.getstate(), np.random.get_state())
    os.chdir(cwd)
    try:
        yield
    finally:
        sys.path[:] = saved_path
        for name in set(sys.modules) - saved_modules:
            if name.startswith("_gputrain_user_") or str(cwd) in str(getattr(sys.modules[name], "__file__", "")):
                del sys.modules[name]
        put_back(saved_state)
        torch.set_rng_state(saved_random[0])
        random.setstate(saved_random[1])
        np.random.set_state(saved_random[2])


def run_in_process(case: Case, cwd: Path, monkeypatch, capfd, caplog) -> tuple[int, str, str]:
    """`python -m gputrain ARGV` with `case.env`, in `cwd`, as `gputrain.cli.main(ARGV)` in this process:
    (exit status, stdout, stderr). What the child would print and this process would not is added to
    stderr: a warning Python's default filters show, a log record of WARNING or above that reaches the
    root logger (logging.lastResort prints it where no handler is set). Put back afterwards: the
    environment and sys.argv (monkeypatch), and what `as_a_process_would` puts back; a thread left
    running, or Ray imported here, fails the case."""
    from gputrain.cli import main

    for key in [k for k in os.environ if launcher_variable(k)]:
        monkeypatch.delenv(key)  # as helpers.subprocess_env leaves them out of a child's environment
    for key, value in (("COLUMNS", "200"), ("OMP_NUM_THREADS", "1"), ("GLOO_SOCKET_IFNAME", "lo"), *case.env):
        monkeypatch.setenv(key, value)
    monkeypatch.setattr(sys, "argv", [str(Path(main.__code__.co_filename).with_name("__main__.py")), *case.argv])
    saved_modules = set(sys.modules)
    threads = set(threading.enumerate())
    capfd.readouterr()
    caplog.clear()
    with as_a_process_would(cwd), warnings.catch_warnings(record=True) as shown:
        warnings.simplefilter("default")
        try:
            code = main(list(case.argv))
        except SystemExit as exc:
            code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
            if not isinstance(exc.code, (int, type(None))):
                print(exc.code, file=sys.stderr)  # as the interpreter prints SystemExit("text")
        out, err = capfd.readouterr()
    extra = [f"{w.category.__name__}: {w.message}" for w in shown if not issubclass(w.category, _HIDDEN_WARNINGS)]
    extra += [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert "ray" in saved_modules or "ray" not in sys.modules, f"{case.id} imported Ray here: make it a process row"
    left = [t for t in set(threading.enumerate()) - threads if t.is_alive()]
    assert not left, f"{case.id} left threads running: {left}"
    return int(code), out, err + "".join(f"{line}\n" for line in extra)


# ---------------------------------------------------------------- beyond the table


@pytest.mark.processes
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


@pytest.mark.processes
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


@pytest.mark.processes
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


# ---------------------------------------------------------------- what a run holds: damaged runs and sweeps

FROZEN_WORKLOAD = '''
import torch
from torch import nn

from gputrain.workloads.base import DataSplits, Workload


def _data():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 4, generator=g)
    return DataSplits(train=(x, (x[:, 0] > 0).long()), test=(x[:16], (x[:16, 0] > 0).long()))


def frozen(layers="1"):
    """Three Linear layers, the first `layers` frozen: a trainable-only checkpoint of the rest."""
    def model():
        net = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 2))
        for layer in [m for m in net if isinstance(m, nn.Linear)][:int(layers)]:
            layer.requires_grad_(False)
        return net
    return Workload(name="frozen", description="test", make_data=_data, make_model=model,
                    loss_fn=nn.CrossEntropyLoss(), defaults={"batch_size": 16})
'''

BROKEN_WORKLOADS = {  # a user's workload module that cannot be loaded: as it would be named in workload.json
    "brk_syntax": "def make(:\n    pass\n",
    "brk_import": "import nosuch_package_of_the_user\n\n\ndef make():\n    pass\n",
}



@pytest.fixture(scope="module")
def held(work: Path) -> Path:
    """`work` with damaged copies of its digits run (no checkpoints, an empty checkpoints folder, a file
    in its place, a folder as `latest`), a run of a frozen base, runs whose workload module cannot be
    loaded, and a finished one-trial sweep with copies whose study.db is missing, empty, renamed,
    damaged or not SQLite, or whose lock is a folder."""
    common = ("--device", "cpu", "--precision", "fp32", "--no-tensorboard", "--progress", "off", "--quiet")
    for name, damage in (("nockpt", "rm"), ("emptyckpt", "empty"), ("ckptfile", "file"), ("latestdir", "latest")):
        run = work / name
        shutil.copytree(work / "digits", run)
        if damage in ("rm", "empty", "file"):
            shutil.rmtree(run / "checkpoints")
        if damage == "empty":
            (run / "checkpoints").mkdir()
        if damage == "file":
            (run / "checkpoints").write_text("a file where the checkpoints folder is expected\n")
        if damage == "latest":
            (run / "checkpoints" / "latest").unlink()
            (run / "checkpoints" / "latest").mkdir()
    (work / "resume-new.toml").write_text('workload = "digits-cnn"\n\n[train]\nresume = true\nrun_dir = "brand-new"\n'
                                          'steps = 2\ndevice = "cpu"\n')
    proc = gputrain(work, "fit", "digits-cnn", "--run-dir", "dcp-missing-shard", "--steps", "2", "--log-every", "2",
                    "--checkpoint-format", "dcp", *common, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    next((work / "dcp-missing-shard" / "checkpoints").glob("step-*.dcp/*.distcp")).unlink()
    (work / "frozenwl.py").write_text(FROZEN_WORKLOAD)
    proc = gputrain(work, "fit", "frozenwl.py:frozen", "--run-dir", "frozen1", "--steps", "4", *common, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    for module, text in BROKEN_WORKLOADS.items():
        (work / f"{module}.py").write_text(text)
        shutil.copytree(work / "digits", work / module)
        (work / module / "workload.json").write_text(f'{{"workload": "{module}.py:make", "name": "digits-cnn", '
                                                     '"options": {}}\n')
        (work / f"{module}.toml").write_text(f'workload = "{module}.py:make"\n\n[train]\nsteps = 2\n')
    if HAS_OPTUNA:
        from test_sweep import SWEEP  # iris-mlp, 20 steps a trial: one trial here

        (work / "sweep46.toml").write_text(SWEEP.replace("trials = 8", "trials = 1").replace("workers = 2", "workers = 1"))
        proc = gputrain(work, "sweep", "--config", "sweep46.toml", "--sweep-dir", "sweep", timeout=300)
        assert proc.returncode == 0, proc.stderr[-3000:]
        db = (work / "sweep" / "study.db").read_bytes()
        for name in ("nodb", "emptydb", "renamed", "dropped", "truncated", "notsqlite", "lockdir", "accessdir"):
            shutil.copytree(work / "sweep", work / f"sweep-{name}")
        (work / "sweep-nodb" / "study.db").unlink()
        (work / "sweep-emptydb" / "study.db").write_bytes(b"")
        (work / "sweep-renamed" / "study.db").rename(work / "sweep-renamed" / "study.db.old")
        import sqlite3

        con = sqlite3.connect(work / "sweep-dropped" / "study.db")
        con.execute("DROP TABLE trial_values")
        con.commit()
        con.close()
        (work / "sweep-truncated" / "study.db").write_bytes(db[: len(db) // 2])
        (work / "sweep-notsqlite" / "study.db").write_text("not a database\n" * 20)
        for name, lock in (("lockdir", "sweep.lock"), ("accessdir", "study.lock")):
            (work / f"sweep-{name}" / lock).unlink(missing_ok=True)
            (work / f"sweep-{name}" / lock).mkdir()
    return work


_NO_CKPT = r"resume from {run}: no checkpoint to resume from \({run}/checkpoints {why}\)"
_HELD = r"writing there would destroy what the run holds; give another path"

CASES_HELD = [
    # ---------------------------------------------------------------- an output path is never what the run holds
    Case("export-out-onto-its-checkpoint", ("export", "digits", "--out", "digits/checkpoints/step-000004.pt"),
         r"--out digits/checkpoints/step-000004.pt is in the checkpoints of the run digits: " + _HELD, process=True),
    Case("predict-out-onto-its-checkpoint",
         ("predict", "digits", "--data", "test", "--out", "digits/checkpoints/step-000004.pt"),
         r"is in the checkpoints of the run digits: " + _HELD + r", e.g. digits/predictions.pt"),
    Case("report-out-onto-its-history", ("report", "digits", "--out", "digits/history.json"),
         r"--out digits/history.json is the record history.json of the run digits: " + _HELD),
    Case("export-onnx-onto-its-workload-json", ("export", "digits", "--format", "onnx", "--out", "digits/workload.json"),
         r"is the record workload.json of the run digits: " + _HELD + r", e.g. digits/model.onnx"),
    Case("export-hf-onto-its-checkpoints", ("export", "digits", "--format", "hf", "--out", "digits/checkpoints"),
         r"--out digits/checkpoints is in the checkpoints of the run digits"),
    # ---------------------------------------------------------------- a resume finds a checkpoint or refuses
    Case("fit-resume-run-without-checkpoints", ("fit", "digits-cnn", "--resume", "nockpt", "--steps", "6"),
         _NO_CKPT.format(run="nockpt", why="is missing") + r", and the run directory holds an earlier run "
         r"\(config.toml, curves.png, .*\) that a new start would overwrite"),
    Case("fit-resume-empty-checkpoints", ("fit", "digits-cnn", "--resume", "emptyckpt", "--steps", "6"),
         _NO_CKPT.format(run="emptyckpt", why="holds no checkpoint")),
    Case("fit-resume-checkpoints-a-file", ("fit", "digits-cnn", "--resume", "ckptfile", "--steps", "6"),
         _NO_CKPT.format(run="ckptfile", why="is a file, not a folder")),
    Case("fit-config-resume-into-a-new-run-dir", ("fit", "--config", "resume-new.toml"),
         _NO_CKPT.format(run="brand-new", why="is missing") + r": drop --resume \(resume=True\) to start a new run",
         absent="brand-new"),
    # ---------------------------------------------------------------- a checkpoint that cannot be written
    Case("fit-resume-latest-a-folder", ("fit", "digits-cnn", "--resume", "latestdir", "--steps", "6"),
         r"latestdir/checkpoints/latest is a folder where the store writes a file .*: remove it"),
    Case("fit-checkpoints-a-file", ("fit", "digits-cnn", "--run-dir", "ckptfile", "--steps", "6"),
         r"ckptfile/checkpoints is a file where the run keeps its checkpoints \(a folder\)"),
    # ---------------------------------------------------------------- a frozen base's fingerprint
    Case("eval-one-more-frozen-layer", ("eval", "frozen1", "--option", "layers=2"),
         r"trained on another frozen base: 2 tensor\(s\) frozen in the model \S*frozenwl.py:frozen builds were not "
         r"frozen in the run that wrote it \(2.weight, 2.bias\)"),
    Case("export-one-more-frozen-layer", ("export", "frozen1", "--option", "layers=2", "--out", "f.safetensors"),
         r"trained on another frozen base: 2 tensor\(s\) frozen", absent="f.safetensors"),
    Case("fit-resume-one-more-frozen-layer", ("fit", "frozenwl.py:frozen", "--resume", "frozen1", "--option", "layers=2",
                                              "--steps", "6", "--device", "cpu"),
         r"trained on another frozen base: 2 tensor\(s\) frozen in this run's model"),
    # ---------------------------------------------------------------- a sweep's study
    *[Case(f"sweep-resume-study-db-{name}", ("sweep", "--sweep-dir", f"sweep-{name}"), says, needs="optuna",
           process=name == "truncated")
      for name, says in (
          ("nodb", r"sweep-nodb/study.db is missing; sweep-nodb/trials holds 1 trial\(s\) \(trial-0000\) that a new "
                   r"study would train over: put the sweep's study.db back"),
          ("renamed", r"sweep-renamed/study.db is missing; .*\(was it renamed or moved\?\)"),
          ("emptydb", r"sweep-emptydb/study.db is empty \(0 bytes\); .* restore it from a copy"),
          ("dropped", r"sweep-dropped/study.db is missing the study's table\(s\) trial_values"),
          ("truncated", r"sweep-truncated/study.db is damaged"),
          ("notsqlite", r"sweep-notsqlite/study.db is not an SQLite database"),
          ("lockdir", r"cannot open the sweep's lock file sweep-lockdir/sweep.lock \(a folder is in its place\)"),
          ("accessdir", r"cannot open the sweep's lock file sweep-accessdir/study.lock \(a folder is in its place\)"))],
    Case("sweep-dir-below-a-file", ("sweep", "--config", "sweep46.toml", "--sweep-dir", "in-the-way/s"),
         r"--sweep-dir in-the-way/s: in-the-way is a file, not a folder", needs="optuna"),
    Case("sweep-dir-in-proc", ("sweep", "--config", "sweep46.toml", "--sweep-dir", "/proc/gputrain-sweep"),
         r"--sweep-dir /proc/gputrain-sweep: cannot write in /proc", needs="optuna"),
]


NPROC = ("--nproc", "2", "--steps", "6")
ONE_PROCESS = (("OMP_NUM_THREADS", "1"),)

CASES_HELD += [
    # ---------------------------------------------------------------- refusals in --nproc 2 workers: once, no torchrun traceback
    Case("fit-nproc-missing-device", ("fit", "digits-cnn", *NPROC, "--device", "cuda:7", "--no-save"),
         r"^gputrain fit: error: cuda requested"),
    Case("fit-nproc-resume-another-workloads-run", ("fit", "iris-mlp", *NPROC, "--resume", "digits", "--run-dir", "digits"),
         r"digits belongs to a run of digits-cnn", process=True),
    Case("fit-nproc-resume-a-dcp-with-a-missing-shard",
         ("fit", "digits-cnn", *NPROC, "--device", "cpu", "--resume", "dcp-missing-shard"),
         r"dcp-missing-shard.*step-000002.dcp.*__0_0.distcp"),
    # the global batch kept (16): the launcher's check passes, and the workers refuse what only the model shows
    Case("fit-nproc-fsdp-on-a-trainable-only-checkpoint",
         ("fit", "frozenwl.py:frozen", *NPROC, "--device", "cpu", "--shard", "--resume", "frozen1", "--batch-size", "8"),
         r"holds only the trainable parameters .*which a sharded \(FSDP\) run cannot take: resume it without --shard"),
    # ---------------------------------------------------------------- a user's workload module that cannot be loaded
    *[Case(f"{surface}-{module.replace('_', '-')}", argv, says, process=(surface, module) == ("fit-module-function",
                                                                                          "brk_syntax"))
      for module, says in (("brk_syntax", r"the workload module \S*brk_syntax.py does not compile: invalid syntax "
                                          r"\(\S*brk_syntax.py, line 1\); fix it"),
                           ("brk_import", r"importing '\S*brk_import.py' failed: it needs the module "
                                          r"'nosuch_package_of_the_user', which is not installed"))
      for surface, argv in (("fit-module-function", ("fit", f"{module}.py:make", "--steps", "2")),
                            ("fit-config", ("fit", "--config", f"{module}.toml")),
                            ("fit-resume", ("fit", "--resume", module, "--steps", "6")), ("eval", ("eval", module)),
                            ("predict", ("predict", module, "--data", "test", "--out", "p46.pt")),
                            ("export", ("export", module, "--out", "m46.onnx")))],
    # ---------------------------------------------------------------- the environment
    Case("fit-master-port-with-spaces", ("fit", "digits-cnn", "--no-save"),
         r"MASTER_PORT=' 29511 ' is not an integer from 1 to 65535", env=(*TORCHRUN, ("MASTER_PORT", " 29511 "))),
    Case("fit-master-port-full-width-digits", ("fit", "digits-cnn", "--no-save"),
         r"MASTER_PORT='２９５１１' is not an integer from 1 to 65535", env=(*TORCHRUN, ("MASTER_PORT", "２９５１１"))),
    Case("fit-local-world-size-not-a-number", ("fit", "digits-cnn", "--no-save"),
         r"LOCAL_WORLD_SIZE='x' is not an integer from 1 to 2",
         env=(*TORCHRUN, ("MASTER_PORT", "29511"), ("LOCAL_WORLD_SIZE", "x"))),
    Case("fit-slurm-ntasks-per-node-in-another-form", ("fit", "digits-cnn", "--no-save"),
         r"SLURM_NTASKS_PER_NODE='2\(x3\)' is not an integer >= 1", env=(*SRUN, ("SLURM_NTASKS_PER_NODE", "2(x3)"))),
    Case("fit-master-addr-no-such-host", ("fit", "digits-cnn", "--no-save"),
         r"MASTER_ADDR='no such host!' does not resolve \(.*\): set it to the host name or address of rank 0's",
         env=(*TORCHRUN[:3], ("MASTER_ADDR", "no such host!"), ("MASTER_PORT", "29511"))),
    Case("fit-gputrain-cache-a-file", ("fit", "mnist1d-cnn", "--no-save", "--steps", "1"),
         r"cannot write gputrain's cache file in-the-way/mnist1d-\S+ \(in-the-way is a file, not a folder\): set "
         r"GPUTRAIN_CACHE to a folder you can write", env=(("GPUTRAIN_CACHE", "in-the-way"),)),
    Case("fit-home-unwritable", ("fit", "mnist1d-cnn", "--no-save", "--steps", "1"),
         r"cannot write gputrain's cache file /proc/gputrain-home/.cache/gputrain/\S+ \(.*\): set GPUTRAIN_CACHE",
         env=(("HOME", "/proc/gputrain-home"), ("XDG_CACHE_HOME", ""), ("GPUTRAIN_CACHE", ""),
              ("MPLCONFIGDIR", "/tmp/gputrain-test-matplotlib")), needs="proc"),
    # ---------------------------------------------------------------- messages
    *[Case(f"{command}-checkpoints-a-file", (command, "ckptfile", *extra),
           r"ckptfile/checkpoints is a file, not the run's checkpoints folder")
      for command, extra in (("eval", ()), ("predict", ("--data", "test", "--out", "p46.pt")),
                             ("export", ("--out", "m46.safetensors")))],
]


def failure_class(case: Case) -> str:
    """Where a row's refusal comes from, as far as the row says: each class, and each subcommand, has at
    least one row that runs as a real process."""
    argv = case.argv
    if argv[:1] == ("fit",) and "ray" in argv and "--launcher" in argv:
        return "the Ray launcher"
    if "--nproc" in argv and "--print-config" not in argv:
        return "a refusal in the workers of fit --nproc"
    if re.search(r"argument|invalid choice|unrecognized arguments|are required|not allowed with", case.says):
        return "argparse's usage"
    if any(a.startswith("brk_") for a in argv):
        return "a user's workload module that cannot be loaded"
    if case.env:
        return "the environment"
    if "--config" in argv:
        return "a config file"
    if "--data" in argv and not {"--out", "--output"} & set(argv):
        return "a data file"
    if {"--out", "--output"} & set(argv):
        return "an output path"
    if case.run or case.needs == "optuna" or "--resume" in argv or case in CASES_HELD:
        return "a run or sweep directory"
    return "a setting or name on the command line"


def test_each_command_and_failure_class_has_a_process_row():
    """The rows run through main() in this process stand for processes: a refusal of each subcommand, and
    of each failure class, is still run as a `python -m gputrain` process."""
    from gputrain.cli import COMMANDS

    rows = CASES + CASES_HELD
    as_process = [c for c in rows if c.process]
    commands = {c.argv[0] for c in as_process}
    assert set(COMMANDS) | {"train"} <= commands, f"no process row for {sorted(set(COMMANDS) - commands)}"
    classes = {failure_class(c) for c in rows}
    missing = classes - {failure_class(c) for c in as_process}
    assert not missing and len(classes) >= 10, f"classes {sorted(classes)}: no process row for {sorted(missing)}"


@pytest.mark.processes  # `held` trains with --checkpoint-format dcp and sweeps (a trial process)
@pytest.mark.parametrize("case", rows(CASES_HELD))
def test_what_a_run_holds_is_never_lost(case: Case, held: Path, tmp_path: Path, monkeypatch, capfd, caplog):
    check_case(case, held, tmp_path, monkeypatch, capfd, caplog)


def _fails_with_its_fix(step_fn, optimizer=None) -> BaseException:
    """What `fit` raises for a step of your own that misuses the API (2 steps of a tiny model)."""
    from torch import nn

    from gputrain import TrainConfig, fit

    x = torch.randn(32, 4, generator=torch.Generator().manual_seed(0))
    with pytest.raises(Exception) as exc_info:
        fit(nn.Linear(4, 2), (x, (x[:, 0] > 0).long()), step_fn=step_fn, config=TrainConfig(device="cpu", steps=2, batch_size=16),
            optimizer=optimizer or {"a": lambda m: torch.optim.SGD(m.parameters(), lr=0.1)})
    return exc_info.value


def _loss(step, batch):
    return torch.nn.functional.cross_entropy(step.model(batch[0]), batch[1])


def _dict_with_an_int_key(step, batch):
    loss = _loss(step, batch)
    step.backward(loss)
    step.step()
    return {1: loss}


def _backward_of_none(step, batch):
    step.backward(None)
    step.step()


def _step_twice(step, batch):
    step.backward(_loss(step, batch))
    step.step("a")
    step.step("a")


@pytest.mark.parametrize("step_fn, error, says", [
    (_dict_with_an_int_key, "DataError", r"step_fn returned a dict with the key\(s\) \[1\]: name each loss with a string"),
    (_backward_of_none, "DataError", r"step.backward\(loss\) takes the loss tensor your step_fn computed \(a scalar\), "
                                     r"got NoneType"),
    (3, "DataError", r"step_fn must be a function fn\(step, batch\) .*, got int 3: pass the function itself"),
    (_step_twice, "ConfigError", r"step.step\('a'\) was called twice in one call of step_fn: each optimizer steps once"),
], ids=["dict-key-not-a-name", "backward-of-none", "step-fn-not-callable", "step-twice-in-one-step"])
def test_a_step_of_your_own_that_misuses_the_api_says_the_fix(step_fn, error, says):
    exc = _fails_with_its_fix(step_fn)
    assert type(exc).__name__ == error and re.search(says, str(exc)), f"{type(exc).__name__}: {exc}"


@pytest.mark.parametrize("state, says", [
    ({"bank": object()}, r"cannot checkpoint state=\{'bank': \.\.\.\}: it is a builtins.object; .*or objects with "
                         r"state_dict\(\) and load_state_dict\(\)"),
    ({"bank": torch.empty(3, device="meta")}, r"state=\{'bank': \.\.\.\} is a tensor on the meta device"),
    ({"": torch.zeros(1)}, r"state= names must be non-empty strings \(they name checkpoint entries\), got ''"),
], ids=["an-object-without-state-dict", "a-meta-tensor", "a-blank-name"])
def test_carried_state_a_checkpoint_cannot_hold_is_refused_before_the_first_step(state, says, tmp_path):
    """fit(state=...) is known at the start: what its first checkpoint could not save is refused then,
    before a step (the step_fn never runs) and before the run directory is made."""
    from torch import nn

    from gputrain import TrainConfig, fit
    from gputrain.errors import ConfigError

    called = []
    x = torch.randn(32, 4, generator=torch.Generator().manual_seed(0))
    with pytest.raises(ConfigError, match=says):
        fit(nn.Linear(4, 2), (x, (x[:, 0] > 0).long()), step_fn=lambda step, batch: called.append(1), state=state,
            config=TrainConfig(device="cpu", steps=2, batch_size=16, run_dir=str(tmp_path / "run")))
    assert called == [] and list(tmp_path.iterdir()) == []


def test_what_a_user_means_is_honoured(work: Path, tmp_path: Path, monkeypatch, capfd, caplog):
    """Accepted, not refused: a config with a UTF-8 byte-order mark (Windows editors write one) reads as
    the same file without it."""
    folder = tmp_path / "w"
    folder.mkdir()
    text = 'workload = "iris-mlp"\n[train]\nsteps = 2\nlr = 0.01\n'
    (folder / "plain.toml").write_text(text)
    (folder / "bom.toml").write_bytes(b"\xef\xbb\xbf" + text.encode())
    printed = {}
    for name in ("plain", "bom"):
        code, out, err = run_in_process(Case(name, ("fit", "--config", f"{name}.toml", "--print-config"), ""), folder,
                                        monkeypatch, capfd, caplog)
        assert code == 0 and err == "", err
        printed[name] = out
    assert printed["bom"] == printed["plain"] and "lr = 0.01" in printed["bom"]


def test_ray_is_given_its_address_once_a_blank_one_as_unset(monkeypatch):
    """RAY_ADDRESS=' ' starts a local cluster (as unset: Ray itself refuses a blank address), and
    RAY_ADDRESS=auto is passed to ray.init as its address: in neither does ray.init find the
    variable (it would print a line of its own for "auto"); the variable is put back afterwards."""
    import types

    from gputrain.runtime import ray_train

    calls = []

    def init(**kwargs):
        calls.append((kwargs.get("address"), kwargs.get("num_cpus"), os.environ.get("RAY_ADDRESS")))

    fake = types.SimpleNamespace(init=init, shutdown=lambda: None, cluster_resources=lambda: {"CPU": 64.0})
    monkeypatch.setattr(ray_train, "import_ray", lambda: fake)
    for address in (" ", "auto"):
        monkeypatch.setenv("RAY_ADDRESS", address)
        where, gpus = ray_train.connect(1, "cpu")
        assert os.environ["RAY_ADDRESS"] == address and not gpus
        assert where == ("a local Ray cluster" if address == " " else "the Ray cluster at auto")
    assert calls == [(None, os.cpu_count() or 1, None), ("auto", None, None)]


@pytest.mark.processes
def test_a_sweep_whose_every_trial_fails_exits_1(tmp_path: Path):
    """Trials that each fail (here: a learning rate that makes every loss non-finite, which no check can
    know before training) leave a sweep that found nothing: its table, then one line and exit 1."""
    if not HAS_OPTUNA:
        pytest.skip("needs Optuna (pip install 'gputrain[sweep]')")
    (tmp_path / "diverges.toml").write_text('workload = "linear-regression"\n[train]\nsteps = 3\ndevice = "cpu"\n'
                                            '[sweep]\ntrials = 2\n[sweep.space]\nlr = {loguniform = [1e30, 1e35]}\n')
    proc = gputrain(tmp_path, "sweep", "--config", "diverges.toml", "--sweep-dir", "s", timeout=300)
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert re.search(r"^gputrain sweep: error: every trial failed \(2 of 2; trial 0: \S+: .*\); the report says more: "
                     r"s/report.html$", lines[-1]), lines[-1]


@pytest.mark.processes
def test_a_workload_builder_that_raises_keeps_its_traceback_with_a_note(held: Path, tmp_path: Path):
    """An exception in the user's own builder is their code's: its traceback stays, with gputrain's note,
    on every surface that builds the workload; and the run it was named by is left as it was."""
    (held / "brk_raise.py").write_text("def make():\n    raise ValueError('the builder failed on purpose')\n")
    run = held / "brk_raise"
    if not run.exists():
        shutil.copytree(held / "digits", run)
        (run / "workload.json").write_text('{"workload": "brk_raise.py:make", "name": "digits-cnn", "options": {}}\n')
    before = snapshot(run)
    for argv in (("fit", "brk_raise.py:make", "--steps", "2", "--run-dir", str(tmp_path / "r")),
                 ("fit", "--resume", "brk_raise", "--steps", "6"), ("eval", "brk_raise"),
                 ("predict", "brk_raise", "--data", "test", "--out", str(tmp_path / "p.pt")),
                 ("export", "brk_raise", "--out", str(tmp_path / "m.safetensors"))):
        proc = gputrain(held, *argv)
        assert proc.returncode == 1, proc.stderr[-3000:]
        assert "Traceback" in proc.stderr and "ValueError: the builder failed on purpose" in proc.stderr
        assert "gputrain: the workload function brk_raise.py:make raised while building the workload" in proc.stderr
    assert snapshot(run) == before and list(tmp_path.iterdir()) == []


@pytest.mark.processes
def test_a_file_workloads_run_is_found_from_another_folder(held: Path):
    """workload.json keeps a file workload with its absolute path: eval from another folder finds it."""
    assert json.loads((held / "frozen1" / "workload.json").read_text())["workload"] == \
        f"{(held / 'frozenwl.py').resolve()}:frozen"
    proc = gputrain(held / "a-folder", "eval", "../frozen1", "--json")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert json.loads(proc.stdout)["step"] == 4


@pytest.mark.processes
def test_predict_onto_a_full_disk_is_one_line_and_writes_nothing(work: Path, tmp_path: Path):
    """torch.save's failed write (a RuntimeError, not an OSError) on a full disk: here a file-size limit."""
    import resource

    def limit():
        resource.setrlimit(resource.RLIMIT_FSIZE, (1024, 1024))  # in torch.save's writer: its RuntimeError

    proc = subprocess.run([sys.executable, "-m", "gputrain", "predict", "digits", "--data", "test", "--out",
                           str(tmp_path / "p.pt")], cwd=work, env=unmeasured_env(COLUMNS="200"), capture_output=True,
                          text=True, timeout=120, preexec_fn=limit)
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert proc.returncode == 2 and len(lines) == 1, proc.stderr[-3000:]
    assert re.search(r"--out \S+p.pt: cannot write the predictions \(torch.save's write failed: the disk is full, or "
                     r"a file-size limit was reached\); nothing was written", lines[0]), lines[0]
    assert list(tmp_path.iterdir()) == []


@pytest.mark.processes
def test_a_sweep_on_a_full_disk_is_one_line_and_runs_once_there_is_room(held: Path, tmp_path: Path):
    """The study cannot be written (a file-size limit stands for the full disk): one line, exit 2, and
    the sweep's folder it made taken away again (its sweep.toml, study.db and locks: no trial had run);
    the same command with room runs."""
    if not HAS_OPTUNA:
        pytest.skip("needs Optuna (pip install 'gputrain[sweep]')")
    import resource

    def limit():
        resource.setrlimit(resource.RLIMIT_FSIZE, (16 << 10, 16 << 10))

    argv = [sys.executable, "-m", "gputrain", "sweep", "--config", str(held / "sweep46.toml"), "--sweep-dir",
            str(tmp_path / "s")]
    proc = subprocess.run(argv, cwd=held, env=unmeasured_env(COLUMNS="200"), capture_output=True, text=True,
                          timeout=240, preexec_fn=limit)
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert proc.returncode == 2 and len(lines) == 1, proc.stderr[-3000:]
    assert re.search(r"cannot write the sweep's study \S+/study.db \(.*\): free disk space \(or raise the file-size "
                     r"limit\) and run the sweep again", lines[0]), lines[0]
    assert list(tmp_path.iterdir()) == []
    again = subprocess.run(argv, cwd=held, env=subprocess_env(COLUMNS="200"), capture_output=True, text=True,
                           timeout=240)
    assert again.returncode == 0, again.stderr[-3000:]
