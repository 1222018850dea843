"""`gputrain doctor` on faked machines: each check's verdict and fix; exit codes; JSON; measurements."""

import dataclasses
import json
import sys

import pytest
import torch

from gputrain.runtime import devices
from gputrain.diagnostics import doctor as doc
from gputrain.cli import main
from test_info import fake_pynvml

GIB = 2**30
H100 = {"index": 0, "device": "cuda:0", "name": "NVIDIA H100 80GB HBM3", "total_memory_bytes": 80 * GIB,
        "free_memory_bytes": 79 * GIB, "compute_capability": "9.0", "multiprocessors": 132, "bf16": True, "tf32": True}
T4 = {**H100, "name": "Tesla T4", "compute_capability": "7.5", "bf16": False, "tf32": False}


def probe(**changes):
    """A healthy H100 machine; each test changes one fact."""
    base = doc.Probe(torch_version="2.13.0", torch_cuda="12.6", cuda_available=True, cuda_error=None,
                     nvidia_driver=True, driver_version="560.35", driver_cuda="12.6", gpus=[H100], tf32_matmul=True)
    return dataclasses.replace(base, **changes)


def by_name(checks):
    return {c.name: c for c in checks}


def test_healthy_gpu_machine_passes():
    checks = doc.run_checks(probe())
    assert [c.name for c in checks] == ["pytorch build", "cuda", "driver", "memory cuda:0"]
    assert all(c.status == "pass" for c in checks), checks


def test_gpu_present_but_cpu_only_torch_fails():
    checks = by_name(doc.run_checks(probe(torch_cuda=None, cuda_available=False, gpus=[])))
    c = checks["pytorch build"]
    assert c.status == "fail" and "PyTorch 2.13.0 is a CPU-only build" in c.message and "driver 560.35" in c.message
    assert "install a CUDA build of PyTorch" in c.fix
    assert checks["accelerator"].fix == "fix the failure above"


def test_gather_probe_nvml_sees_a_gpu_torch_has_no_cuda(monkeypatch):
    """The real gather on this CPU-only build, with NVML faked to report an H100."""
    monkeypatch.setitem(sys.modules, "pynvml", fake_pynvml())
    monkeypatch.setattr(devices, "_cuda_built", lambda: False)
    p = doc.gather_probe()
    assert p.nvidia_driver and p.driver_version == "560.35.03" and p.driver_cuda == "12.6"
    assert p.gpus == [] and p.gpu_processes == {}  # PyTorch sees no GPU to attach processes to
    checks = by_name(doc.run_checks(dataclasses.replace(p, torch_cuda=None)))
    assert checks["pytorch build"].status == "fail"


def test_gather_probe_memory_held_by_another_process(monkeypatch):
    """Faked CUDA device and NVML: the other process's pid and memory reach the memory check."""
    monkeypatch.setitem(sys.modules, "pynvml", fake_pynvml())
    monkeypatch.setattr(devices, "_cuda_built", lambda: True)
    monkeypatch.setattr(devices, "_cuda_available", lambda: True)
    monkeypatch.setattr(devices, "_cuda_count", lambda: 1)
    monkeypatch.setattr(devices, "describe_cuda", lambda i: {**H100, "free_memory_bytes": 10 * GIB})
    monkeypatch.setattr(doc, "_cuda_uuid", lambda i: "0")  # the fake NVML GPU's UUID is "GPU-0"
    p = doc.gather_probe()
    assert p.cuda_available and [x["pid"] for x in p.gpu_processes[0]] == [4242]  # this process is not "other"
    c = by_name(doc.run_checks(dataclasses.replace(p, torch_cuda="12.6")))["memory cuda:0"]
    assert c.status == "warn" and c.message == "only 10.0 of 80.0 GiB free: 1 other process holds 69.0 GiB (pids 4242)"


def test_nvml_gpus_are_matched_to_pytorch_by_uuid(monkeypatch):
    """NVML numbers all GPUs by PCI bus; PyTorch only the visible ones: cuda:0 may be NVML's GPU 2."""
    nvml = [{"index": i, "uuid": f"GPU-{i}AAA", "processes": [{"pid": 100 + i, "memory_bytes": GIB,
                                                                "this_process": False}]} for i in range(3)]
    gpus = [{**H100, "index": 0}]
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2")
    assert doc.processes_by_cuda_index(gpus, nvml, {0: "2aaa"}) == {0: nvml[2]["processes"]}
    assert doc.processes_by_cuda_index(gpus, nvml, {0: None}) == {}  # unknown, never a wrong GPU's list
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    three = [{**H100, "index": i} for i in range(3)]
    assert doc.processes_by_cuda_index(three, nvml, {})[1] == nvml[1]["processes"]  # all visible: by index


def test_gather_probe_without_nvml_keeps_the_reason(monkeypatch):
    monkeypatch.setitem(sys.modules, "pynvml", fake_pynvml(init_error=RuntimeError("NVML Shared Library Not Found")))
    monkeypatch.setattr(doc.os.path, "exists", lambda path: False)  # and no /proc/driver/nvidia
    p = doc.gather_probe()
    assert not p.nvidia_driver and p.driver_version is None
    assert p.nvml_reason.endswith("NVML Shared Library Not Found")


def test_cuda_not_initializable_fails():
    c = by_name(doc.run_checks(probe(cuda_available=False, gpus=[], cuda_error="CUDA driver initialization failed")))["cuda"]
    assert c.status == "fail" and c.message.endswith("CUDA is not available: CUDA driver initialization failed")
    assert "nvidia-smi" in c.fix
    c = by_name(doc.run_checks(probe(cuda_available=False, gpus=[], nvidia_driver=False, driver_cuda=None)))["cuda"]
    assert c.status == "fail" and "no NVIDIA driver found" in c.message


def test_old_driver():
    checks = by_name(doc.run_checks(probe(driver_cuda="11.8")))
    assert checks["driver"].status == "fail"
    assert "supports CUDA up to 11.8, but PyTorch was built with CUDA 12.6" in checks["driver"].message
    assert "CUDA 11.x" in checks["driver"].fix
    # Same major version: minor-version compatibility usually works, so a warning.
    assert by_name(doc.run_checks(probe(driver_cuda="12.2")))["driver"].status == "warn"
    assert by_name(doc.run_checks(probe(driver_cuda="12.8")))["driver"].status == "pass"


def test_memory_held_by_others_warns():
    gpu = {**H100, "free_memory_bytes": 10 * GIB}
    c = by_name(doc.run_checks(probe(gpus=[gpu], gpu_processes={0: [{"pid": 7, "memory_bytes": 70 * GIB}]})))
    c = c["memory cuda:0"]
    assert c.status == "warn" and c.message == "only 10.0 of 80.0 GiB free: 1 other process holds 70.0 GiB (pids 7)"
    assert "--device cuda:N" in c.fix
    c = by_name(doc.run_checks(probe(gpus=[gpu], gpu_processes={0: []})))["memory cuda:0"]
    assert c.status == "warn" and "NVML lists no other process" in c.message
    c = by_name(doc.run_checks(probe(gpus=[gpu])))["memory cuda:0"]
    assert c.status == "warn" and "who holds it is unknown" in c.message
    assert by_name(doc.run_checks(probe()))["memory cuda:0"].message == "79.0 of 80.0 GiB free"


def test_rocm_build():
    checks = by_name(doc.run_checks(probe(torch_cuda=None, torch_hip="6.2", nvidia_driver=False, driver_cuda=None,
                                          gpus=[{**H100, "name": "AMD Instinct MI300X"}])))
    assert checks["pytorch build"].status == "pass" and "ROCm 6.2" in checks["pytorch build"].message
    assert "driver" not in checks  # NVIDIA's driver/CUDA comparison does not apply
    c = by_name(doc.run_checks(probe(torch_cuda=None, torch_hip="6.2", nvidia_driver=False, cuda_available=False,
                                     gpus=[])))["cuda"]
    assert c.status == "fail" and "rocm-smi" in c.fix
    c = by_name(doc.run_checks(probe(torch_cuda=None, torch_hip="6.2", cuda_available=False, gpus=[])))
    assert c["pytorch build"].status == "fail" and "is a ROCm 6.2 (AMD) build" in c["pytorch build"].message


def test_tf32_off_on_a_hopper_gpu_warns():
    c = by_name(doc.run_checks(probe(tf32_matmul=False)))["tf32 cuda:0"]
    assert c.status == "warn" and "capability 9.0" in c.message
    assert "gputrain fit turns TF32 on" in c.fix and "set_float32_matmul_precision('high')" in c.fix
    assert "tf32 cuda:0" not in by_name(doc.run_checks(probe(tf32_matmul=False, gpus=[T4])))  # no TF32 hardware


def test_no_bf16_warns():
    c = by_name(doc.run_checks(probe(gpus=[T4])))["bf16 cuda:0"]
    assert c.status == "warn" and "Tesla T4 (capability 7.5) has no bf16" in c.message and "fp16" in c.fix


def test_cpu_only_and_mps_fallback_warn():
    checks = by_name(doc.run_checks(probe(torch_cuda=None, cuda_available=False, gpus=[], nvidia_driver=False,
                                          driver_cuda=None, mps_fallback=True)))
    assert checks["pytorch build"].status == "pass"
    assert checks["accelerator"].status == "warn" and "training runs on the CPU" in checks["accelerator"].message
    assert checks["mps fallback"].status == "warn" and "PYTORCH_ENABLE_MPS_FALLBACK=1" in checks["mps fallback"].message


def test_tf32_reading_survives_both_pytorch_apis():
    matmul = torch.backends.cuda.matmul
    saved = torch.get_float32_matmul_precision()
    try:
        torch.set_float32_matmul_precision("highest")
        assert doc.tf32_matmul_enabled() is False
        torch.set_float32_matmul_precision("high")
        assert doc.tf32_matmul_enabled() is True
        if hasattr(matmul, "fp32_precision"):  # the newer API: reading allow_tf32 after it raises
            matmul.fp32_precision = "tf32"
            assert doc.tf32_matmul_enabled() is True
            matmul.fp32_precision = "ieee"
            assert doc.tf32_matmul_enabled() is False
    finally:
        torch.set_float32_matmul_precision(saved)


def test_matmul_verdict_against_the_peak_table():
    c = doc.matmul_check("NVIDIA H100 80GB HBM3", {"bf16": 700.0, "tf32": 400.0, "fp32": 50.0}, 4096)
    assert c.status == "pass" and "bf16 700 (71% of 989)" in c.message
    c = doc.matmul_check("NVIDIA H100 80GB HBM3", {"bf16": 200.0}, 4096)
    assert c.status == "warn" and "power limit" in c.fix
    c = doc.matmul_check("Mystery GPU 9000", {"bf16": 123.0, "fp32": 20.0}, 4096)
    assert c.status == "pass" and "%" not in c.message and "no published peak known" in c.message


def test_transfer_verdict():
    assert doc.transfer_check({"pinned": 24.0, "pageable": 9.0}).status == "pass"
    c = doc.transfer_check({"pinned": 3.0, "pageable": 3.0})
    assert c.status == "warn" and "PCIe" in c.fix


def test_doctor_exit_code_and_json(monkeypatch, capsys):
    monkeypatch.setattr(doc, "gather_probe", lambda: probe(torch_cuda=None, cuda_available=False, gpus=[]))
    assert main(["doctor", "--no-measure", "--json"]) == 1
    report = json.loads(capsys.readouterr().out)
    assert set(report) == {"ok", "checks", "measurements", "probe"}
    assert report["ok"] is False and report["measurements"] is None
    assert {"name", "status", "message", "fix"} == set(report["checks"][0])
    assert report["checks"][0]["status"] == "fail"

    assert main(["doctor", "--no-measure"]) == 1
    out = capsys.readouterr().out
    assert "FAIL" in out and "fix: install a CUDA build of PyTorch" in out and "1 check(s) failed" in out

    monkeypatch.setattr(doc, "gather_probe", lambda: probe(torch_cuda=None, cuda_available=False, gpus=[],
                                                           nvidia_driver=False, driver_cuda=None))
    assert main(["doctor", "--no-measure"]) == 0
    assert "no failures, 1 warning(s)" in capsys.readouterr().out


def test_measurement_error_becomes_a_warning(monkeypatch):
    def broken(device, budget_s=0.5):
        raise RuntimeError("CUDA error: an illegal memory access was encountered\nmore")

    monkeypatch.setattr(doc, "measure", broken)
    report = doc.doctor(probe=probe(torch_cuda=None, cuda_available=False, gpus=[], nvidia_driver=False))
    c = report["checks"][-1]
    assert c["name"] == "measurements" and c["status"] == "warn"
    assert c["message"] == "could not measure on cpu: CUDA error: an illegal memory access was encountered"


def test_doctor_measures_this_machine(capsys):
    assert main(["doctor", "--json"]) in (0, 1)
    report = json.loads(capsys.readouterr().out)
    names = [c["name"] for c in report["checks"]]
    assert "matmul" in names and "host-to-device" in names
    if not torch.cuda.is_available():
        assert report["measurements"]["matmul_gflops_fp32"] > 0.1
        assert report["measurements"]["h2d_gb_per_s"] is None
        assert "skipped" in next(c for c in report["checks"] if c["name"] == "host-to-device")["message"]


@pytest.mark.gpu
def test_doctor_measures_the_gpu():
    report = doc.doctor()
    m = report["measurements"]
    assert m["h2d_gb_per_s"]["pinned"] > m["h2d_gb_per_s"]["pageable"]
    assert set(m["matmul_tflops"]) == {"bf16", "tf32", "fp32"}
    name = torch.cuda.get_device_name(0)
    if "H100" in name or "H200" in name:
        assert m["matmul_tflops"]["bf16"] > 100
        assert m["peak_tflops"]["bf16"] is not None
    assert torch.get_float32_matmul_precision() == "highest"  # the measurement restored the setting


def test_private_torch_names_this_torch_lacks_are_a_warning_naming_them(monkeypatch):
    """The real gather reads runtime/torch_compat: on this torch every name resolves (a pass); a torch
    without one (marked missing, as a torch without it would resolve) is a warning naming it."""
    from gputrain import torch_compat

    assert doc.gather_probe().torch_fallbacks == []
    assert by_name(doc.run_checks(doc.gather_probe()))["torch internals"].status == "pass"
    monkeypatch.setitem(torch_compat._resolved, "torch.Tensor._version", None)
    p = doc.gather_probe()
    assert p.torch_fallbacks == ["torch.Tensor._version"]
    c = by_name(doc.run_checks(p))["torch internals"]
    assert c.status == "warn" and "lacks 1 of the private names" in c.message and "torch.Tensor._version" in c.message
    assert torch_compat.CHECKED in c.fix
    assert "torch internals" not in by_name(doc.run_checks(probe()))  # a Probe built by hand did not look
