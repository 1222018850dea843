"""`gputrain doctor` on faked machines: each check's verdict and fix; exit codes; JSON."""

import dataclasses
import json

import pytest
import torch

from gputrain import doctor as doc
from gputrain.cli import main

H100 = {"index": 0, "device": "cuda:0", "name": "NVIDIA H100 80GB HBM3", "total_memory_bytes": 80 * 2**30,
        "free_memory_bytes": 79 * 2**30, "compute_capability": "9.0", "multiprocessors": 132, "bf16": True, "tf32": True}
T4 = {**H100, "name": "Tesla T4", "compute_capability": "7.5", "bf16": False, "tf32": False}


def probe(**changes):
    base = doc.Probe(torch_version="2.13.0", torch_cuda="12.6", cuda_available=True, cuda_error=None,
                     nvidia_driver=True, driver_version="560.35", driver_cuda="12.6", gpus=[H100], tf32_matmul=True)
    return dataclasses.replace(base, **changes)


def by_name(checks):
    return {c.name: c for c in checks}


def test_healthy_gpu_machine_passes():
    checks = doc.run_checks(probe())
    assert all(c.status == "pass" for c in checks), checks


def test_gpu_present_but_cpu_only_torch_fails():
    c = by_name(doc.run_checks(probe(torch_cuda=None, cuda_available=False, gpus=[])))["pytorch build"]
    assert c.status == "fail" and "CPU-only build" in c.message and "CUDA build" in c.fix


def test_cuda_not_initializable_fails():
    c = by_name(doc.run_checks(probe(cuda_available=False, gpus=[], cuda_error="CUDA driver initialization failed")))["cuda"]
    assert c.status == "fail" and "driver initialization failed" in c.message


def test_old_driver():
    checks = by_name(doc.run_checks(probe(driver_cuda="11.8")))
    assert checks["driver"].status == "fail" and "CUDA up to 11.8" in checks["driver"].message
    assert by_name(doc.run_checks(probe(driver_cuda="12.2")))["driver"].status == "warn"


def test_memory_held_by_others_warns():
    gpu = {**H100, "free_memory_bytes": 10 * 2**30}
    c = by_name(doc.run_checks(probe(gpus=[gpu], gpu_processes={0: [{"pid": 7, "memory_bytes": 70 * 2**30}]})))["memory cuda:0"]
    assert c.status == "warn" and "1 other process(es) hold 70.0 GiB" in c.message


def test_tf32_off_on_ampere_warns_and_no_bf16_warns():
    assert by_name(doc.run_checks(probe(tf32_matmul=False)))["tf32 cuda:0"].status == "warn"
    c = by_name(doc.run_checks(probe(gpus=[T4])))["bf16 cuda:0"]
    assert c.status == "warn" and "fp16" in c.message


def test_cpu_only_and_mps_fallback_warn():
    checks = by_name(doc.run_checks(probe(torch_cuda=None, cuda_available=False, gpus=[], nvidia_driver=False,
                                          mps_fallback=True)))
    assert checks["pytorch build"].status == "pass"
    assert checks["accelerator"].status == "warn" and "CPU" in checks["accelerator"].message
    assert checks["mps fallback"].status == "warn"


def test_doctor_exit_code_follows_failures(monkeypatch, capsys):
    monkeypatch.setattr(doc, "gather_probe", lambda: probe(torch_cuda=None, cuda_available=False, gpus=[]))
    assert main(["doctor", "--no-measure", "--json"]) == 1
    report = json.loads(capsys.readouterr().out)
    assert report["ok"] is False and any(c["status"] == "fail" for c in report["checks"])
    monkeypatch.setattr(doc, "gather_probe", lambda: probe(cuda_available=False, gpus=[], torch_cuda=None,
                                                           nvidia_driver=False))
    assert main(["doctor", "--no-measure"]) == 0


def test_doctor_measures_this_machine():
    report = doc.doctor(run_measurements=True)
    names = [c["name"] for c in report["checks"]]
    assert "matmul" in names and "host-to-device" in names
    if not torch.cuda.is_available():
        assert report["measurements"]["matmul_gflops_fp32"] > 0.1
        assert report["measurements"]["h2d_gb_per_s"] is None


@pytest.mark.gpu
def test_doctor_measures_the_gpu():
    m = doc.doctor()["measurements"]
    assert m["h2d_gb_per_s"]["pinned"] > m["h2d_gb_per_s"]["pageable"]
    if "H100" in torch.cuda.get_device_name(0) or "H200" in torch.cuda.get_device_name(0):
        assert m["matmul_tflops"]["bf16"] > 300
