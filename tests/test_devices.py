"""pick_device: every way a device request can fail says what was asked, what exists and the fix."""

import pytest
import torch

from gputrain import DeviceError, pick_device
from gputrain.runtime import devices


def _fake_cuda(monkeypatch, names, built=True, available=True):
    monkeypatch.setattr(devices, "_cuda_built", lambda: built)
    monkeypatch.setattr(devices, "_cuda_available", lambda: available)
    monkeypatch.setattr(devices, "_cuda_count", lambda: len(names) if available else 0)
    monkeypatch.setattr(devices, "_cuda_name", lambda i: names[i])
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(devices, "_probe", lambda device: None)


def test_auto_and_cpu_on_this_machine():
    assert pick_device() == torch.device("cpu") or torch.cuda.is_available()
    assert pick_device("cpu") == torch.device("cpu")
    assert pick_device(torch.device("cpu")) == torch.device("cpu")
    assert pick_device(" CPU ") == torch.device("cpu")


@pytest.mark.parametrize("spec,needle", [
    ("cuda:abc", "unknown device 'cuda:abc': use 'auto', 'cpu', 'cuda', 'cuda:N' or 'mps'"),
    ("tpu", "unknown device 'tpu'"),
    ("gpu", "an NVIDIA GPU is 'cuda'"),
    ("meta", "device type 'meta' is not supported"),
])
def test_unknown_devices(spec, needle):
    with pytest.raises(DeviceError, match=needle.replace("(", r"\(").replace(")", r"\)")):
        pick_device(spec)


def test_wrong_type():
    with pytest.raises(DeviceError, match="not int"):
        pick_device(3)


def test_cuda_on_a_cpu_only_build(monkeypatch):
    _fake_cuda(monkeypatch, [], built=False, available=False)
    with pytest.raises(DeviceError) as e:
        pick_device("cuda")
    msg = str(e.value)
    assert f"this PyTorch build has no CUDA support (torch {torch.__version__})" in msg
    assert "install a CUDA build of PyTorch" in msg


@pytest.mark.skipif(torch.version.cuda is not None, reason="needs a CPU-only PyTorch build")
def test_cuda_on_this_cpu_only_build_unpatched():
    with pytest.raises(DeviceError, match=r"cuda:0 requested, but this PyTorch build has no CUDA support"):
        pick_device("cuda:0")


def test_cuda_index_out_of_range_names_the_devices(monkeypatch):
    _fake_cuda(monkeypatch, ["NVIDIA H100 80GB HBM3"])
    with pytest.raises(DeviceError) as e:
        pick_device("cuda:3")
    assert str(e.value) == ("cuda:3 requested, but this machine has 1 CUDA device (cuda:0 NVIDIA H100 80GB HBM3): "
                            "use one of cuda:0..cuda:0")
    _fake_cuda(monkeypatch, ["A100", "A100"])
    assert pick_device("cuda:1") == torch.device("cuda", 1)
    assert pick_device("cuda") == torch.device("cuda", 0)  # "cuda" means the current device, made explicit


def test_cuda_built_but_not_available(monkeypatch):
    _fake_cuda(monkeypatch, [], built=True, available=False)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    with pytest.raises(DeviceError, match=r"CUDA is not available \(CUDA_VISIBLE_DEVICES='' hides every GPU\)"):
        pick_device("cuda")


def test_cuda_built_but_no_driver(monkeypatch):
    _fake_cuda(monkeypatch, [], built=True, available=False)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    with pytest.raises(DeviceError) as e:
        pick_device("cuda")
    assert str(e.value) == ("cuda requested, but CUDA is not available (no usable NVIDIA GPU or driver was found): "
                            "run `gputrain doctor` to see why, or use device 'cpu'")


def test_probe_failure_is_a_device_error(monkeypatch):
    _fake_cuda(monkeypatch, ["Tesla T4", "Tesla T4"])

    def boom(device):
        raise RuntimeError("CUDA error: all CUDA-capable devices are busy or unavailable\nmore text")

    monkeypatch.setattr(devices, "_probe", boom)
    with pytest.raises(DeviceError, match=r"cuda:1 \(Tesla T4\) exists but a test allocation failed: "
                                          r"CUDA error: all CUDA-capable devices are busy"):
        pick_device("cuda:1")


def test_auto_prefers_cuda_then_mps(monkeypatch):
    _fake_cuda(monkeypatch, ["A100"])
    assert pick_device("auto") == torch.device("cuda", 0)
    _fake_cuda(monkeypatch, [], available=False)
    monkeypatch.setattr(devices, "_mps_built", lambda: True)
    monkeypatch.setattr(devices, "_mps_available", lambda: True)
    monkeypatch.setattr(devices, "_probe", lambda d: None)
    assert pick_device("auto") == torch.device("mps")


def test_mps_absent(monkeypatch):
    monkeypatch.setattr(devices, "_mps_built", lambda: False)
    with pytest.raises(DeviceError, match="MPS requested, but this PyTorch build has no MPS support"):
        pick_device("mps")
    monkeypatch.setattr(devices, "_mps_built", lambda: True)
    monkeypatch.setattr(devices, "_mps_available", lambda: False)
    with pytest.raises(DeviceError, match="no usable MPS device"):
        pick_device("mps")


def test_describe_devices_cpu():
    d = devices.describe_devices()
    assert d["cpu"]["logical_cores"] >= 1 and d["cpu"]["total_memory_bytes"] > 0
    assert isinstance(d["cuda"], list)


@pytest.mark.gpu
def test_describe_real_gpu():
    d = devices.describe_cuda(0)
    assert d["total_memory_bytes"] > 0 and d["multiprocessors"] > 0
    assert pick_device("cuda") == torch.device("cuda", 0)
