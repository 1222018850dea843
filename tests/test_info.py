"""`gputrain info`: JSON schema, fast, and never imports frameworks that are absent."""

import json
import subprocess
import sys
import time

import pytest
import torch

from gputrain import info
from gputrain.cli import main


def test_info_json_schema(capsys):
    assert main(["info", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert tuple(data) == info.SCHEMA_KEYS
    assert data["torch"]["torch"] == torch.__version__
    assert data["torch"]["build"] == ("CPU-only" if torch.version.cuda is None else "CUDA")
    cpu = data["devices"]["cpu"]
    assert cpu["logical_cores"] >= 1 and cpu["total_memory_bytes"] > 0
    assert isinstance(data["devices"]["cuda"], list)
    assert "available" in data["nvml"] and (data["nvml"]["available"] or data["nvml"]["reason"])


def test_info_tables_render(capsys):
    assert main(["info"]) == 0
    out = capsys.readouterr().out
    assert "PyTorch" in out and "cpu" in out


def test_info_command_is_fast():
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "gputrain", "info", "--json"], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert time.perf_counter() - t0 < 10
    assert json.loads(proc.stdout)["gputrain"]


def test_absent_frameworks_are_not_imported(monkeypatch):
    monkeypatch.setattr(info.importlib.util, "find_spec", lambda name: None)
    assert info.other_frameworks() == {}


def test_broken_framework_is_reported_not_fatal(monkeypatch):
    monkeypatch.setattr(info.importlib.util, "find_spec", lambda name: object() if name == "tensorflow" else None)

    def broken():
        raise ImportError("libcudart.so.11.0: cannot open shared object file")

    monkeypatch.setattr(info, "_tensorflow", broken)
    out = info.other_frameworks()
    assert out["tensorflow"]["error"].startswith("ImportError: libcudart")


@pytest.mark.gpu
def test_info_shows_the_gpu():
    data = info.collect_info()
    gpu = data["devices"]["cuda"][0]
    assert gpu["total_memory_bytes"] > 0 and gpu["compute_capability"]
    major = int(gpu["compute_capability"].split(".")[0])
    assert gpu["bf16"] == (major >= 8)
