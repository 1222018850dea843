"""`gputrain info`: JSON schema, fast, NVML telemetry (faked), and absent frameworks never imported."""

import json
import os
import subprocess
import sys
import time
import types
from pathlib import Path

import pytest
import torch

from gputrain.diagnostics import info, telemetry
from gputrain.cli import main

GIB = 2**30


def fake_pynvml(init_error=None, processes=None):
    """A stand-in for nvidia-ml-py: one H100, 70 GiB used, power limit not supported."""
    nv = types.ModuleType("pynvml")
    nv.NVML_TEMPERATURE_GPU = 0

    def init():
        if init_error:
            raise init_error

    def unsupported(h):
        raise RuntimeError("Not Supported")

    nv.nvmlInit = init
    nv.nvmlShutdown = lambda: None
    nv.nvmlSystemGetDriverVersion = lambda: b"560.35.03"
    nv.nvmlSystemGetCudaDriverVersion = lambda: 12060
    nv.nvmlDeviceGetCount = lambda: 1
    nv.nvmlDeviceGetHandleByIndex = lambda i: i
    nv.nvmlDeviceGetName = lambda h: b"NVIDIA H100 80GB HBM3"
    nv.nvmlDeviceGetUUID = lambda h: "GPU-0"
    nv.nvmlDeviceGetMemoryInfo = lambda h: types.SimpleNamespace(used=70 * GIB, total=80 * GIB)
    nv.nvmlDeviceGetUtilizationRates = lambda h: types.SimpleNamespace(gpu=97, memory=40)
    nv.nvmlDeviceGetTemperature = lambda h, kind: 61
    nv.nvmlDeviceGetPowerUsage = lambda h: 650_000  # mW
    nv.nvmlDeviceGetEnforcedPowerLimit = unsupported
    procs = processes if processes is not None else [
        types.SimpleNamespace(pid=4242, usedGpuMemory=69 * GIB),
        types.SimpleNamespace(pid=os.getpid(), usedGpuMemory=1 * GIB),
    ]
    nv.nvmlDeviceGetComputeRunningProcesses = lambda h: procs
    nv.nvmlDeviceGetGraphicsRunningProcesses = lambda h: procs[:1]  # the same pid again: counted once
    return nv


def test_nvml_telemetry_reads_every_field(monkeypatch):
    monkeypatch.setitem(sys.modules, "pynvml", fake_pynvml())
    data, reason = telemetry.nvml_telemetry()
    assert reason is None
    assert data["driver"] == "560.35.03" and data["cuda_driver"] == "12.6"
    gpu = data["gpus"][0]
    assert gpu["name"] == "NVIDIA H100 80GB HBM3" and gpu["utilization_pct"] == 97 and gpu["temperature_c"] == 61
    assert gpu["power_w"] == 650 and gpu["power_limit_w"] is None  # one unsupported query, the rest still read
    assert gpu["memory_used_bytes"] == 70 * GIB and gpu["memory_total_bytes"] == 80 * GIB
    assert [p["pid"] for p in gpu["processes"]] == [4242, os.getpid()]
    assert gpu["other_processes_memory_bytes"] == 69 * GIB  # this process's own memory is not "other"
    json.dumps(data)


def test_nvml_absent_or_failing_gives_none_and_a_reason(monkeypatch):
    monkeypatch.setitem(sys.modules, "pynvml", fake_pynvml(init_error=RuntimeError("Driver Not Loaded")))
    assert telemetry.nvml_telemetry() == (None, "NVML did not initialize (no NVIDIA driver?): Driver Not Loaded")
    assert telemetry.nvml_snapshot() == {"available": False,
                                         "reason": "NVML did not initialize (no NVIDIA driver?): Driver Not Loaded"}
    monkeypatch.setitem(sys.modules, "pynvml", None)  # not installed: `import pynvml` raises ImportError
    data, reason = telemetry.nvml_telemetry()
    assert data is None and "nvidia-ml-py is not importable" in reason


def test_host_memory():
    mem = telemetry.host_memory()
    assert 0 < mem["available_bytes"] <= mem["total_bytes"]


def test_info_json_schema(capsys):
    assert main(["info", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert tuple(data) == info.SCHEMA_KEYS == ("gputrain", "python", "torch", "devices", "nvml", "frameworks")
    assert data["python"]["version"].count(".") == 2
    assert data["torch"]["torch"] == torch.__version__
    assert data["torch"]["build"] == ("CPU-only" if torch.version.cuda is None else "CUDA")
    cpu = data["devices"]["cpu"]
    assert cpu["logical_cores"] >= 1 and cpu["total_memory_bytes"] > 0
    assert isinstance(data["devices"]["cuda"], list)
    assert data["nvml"]["available"] or data["nvml"]["reason"]
    assert isinstance(data["frameworks"], dict)


def test_info_shows_nvml_telemetry(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "pynvml", fake_pynvml())
    assert main(["info", "--json"]) == 0
    nvml = json.loads(capsys.readouterr().out)["nvml"]
    assert nvml["available"] is True and nvml["gpus"][0]["other_processes_memory_bytes"] == 69 * GIB
    assert main(["info"]) == 0
    out = capsys.readouterr().out
    assert "driver 560.35.03" in out and "97%" in out and "69.0 GiB" in out


def test_info_tables_render(capsys):
    assert main(["info"]) == 0
    out = capsys.readouterr().out
    assert f"PyTorch {torch.__version__}" in out and "cpu" in out


@pytest.mark.processes
def test_info_command_is_fast():
    exe = Path(sys.executable).with_name("gputrain")  # the installed console script, as a user runs it
    t0 = time.perf_counter()
    proc = subprocess.run([str(exe), "info", "--json"], capture_output=True, text=True, timeout=60)
    elapsed = time.perf_counter() - t0
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["gputrain"]
    assert elapsed < 10, f"gputrain info took {elapsed:.1f} s"


def test_absent_frameworks_are_not_imported(monkeypatch):
    monkeypatch.setattr(info.importlib.util, "find_spec", lambda name: None)
    monkeypatch.delitem(sys.modules, "tensorflow", raising=False)
    assert info.other_frameworks() == {}
    assert "tensorflow" not in sys.modules and "jax" not in sys.modules


def test_broken_framework_is_reported_not_fatal(monkeypatch):
    monkeypatch.setattr(info.importlib.util, "find_spec", lambda name: object() if name == "tensorflow" else None)

    def broken():
        raise ImportError("libcudart.so.11.0: cannot open shared object file\nsecond line")

    monkeypatch.setattr(info, "_tensorflow", broken)
    out = info.other_frameworks()
    assert out == {"tensorflow": {"installed": True,
                                  "error": "ImportError: libcudart.so.11.0: cannot open shared object file"}}


def test_framework_whose_lookup_fails_is_reported(monkeypatch):
    def find_spec(name):
        if name == "jax":
            raise ValueError("jax.__spec__ is None")
        return None

    monkeypatch.setattr(info.importlib.util, "find_spec", find_spec)
    assert info.other_frameworks() == {"jax": {"installed": True, "error": "ValueError: jax.__spec__ is None"}}


def test_installed_framework_reports_version_and_gpus(monkeypatch):
    fake_jax = types.ModuleType("jax")
    fake_jax.__version__ = "0.4.30"
    dev = type("Dev", (), {"platform": "gpu", "__str__": lambda self: "cuda:0"})()
    fake_jax.devices = lambda: [dev]
    monkeypatch.setitem(sys.modules, "jax", fake_jax)
    monkeypatch.setattr(info.importlib.util, "find_spec", lambda name: object() if name == "jax" else None)
    assert info.other_frameworks() == {"jax": {"installed": True, "version": "0.4.30", "devices": ["cuda:0"],
                                               "gpus": ["cuda:0"]}}


def test_installed_tensorflow_reports_version_and_the_gpus_it_sees(monkeypatch):
    fake_tf = types.ModuleType("tensorflow")
    fake_tf.__version__ = "2.16.1"
    asked = []
    gpu = types.SimpleNamespace(name="/physical_device:GPU:0")
    fake_tf.config = types.SimpleNamespace(list_physical_devices=lambda kind: asked.append(kind) or [gpu])
    monkeypatch.setitem(sys.modules, "tensorflow", fake_tf)
    monkeypatch.setattr(info.importlib.util, "find_spec", lambda name: object() if name == "tensorflow" else None)
    assert info.other_frameworks() == {"tensorflow": {"installed": True, "version": "2.16.1",
                                                      "gpus": ["/physical_device:GPU:0"]}}
    assert asked == ["GPU"]


@pytest.mark.gpu
def test_info_shows_the_gpu(capsys):
    data = info.collect_info()
    gpu = data["devices"]["cuda"][0]
    assert gpu["total_memory_bytes"] > 0 and gpu["multiprocessors"] > 0
    major = int(gpu["compute_capability"].split(".")[0])
    assert gpu["bf16"] == (major >= 8) and gpu["tf32"] == (major >= 8)
    assert main(["info"]) == 0
    out = capsys.readouterr().out
    assert gpu["compute_capability"] in out and gpu["name"][:10] in out
