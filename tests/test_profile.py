"""Profiling: the instrumented run and its files, trace figures, the verdict on recorded metrics,
host reads and the sync detector (CPU), plus the GPU-only checks."""

import inspect
import json

import pytest
import torch
from helpers import tiny_workload
from torch import nn

from gputrain.config import TrainConfig
from gputrain.diagnostics.profile import PHASES, profile_workload
from gputrain.diagnostics.syncs import count_host_reads, detect_syncs
from gputrain.diagnostics.trace import trace_summary
from gputrain.diagnostics.verdict import VERDICTS, diagnose


# ---------------------------------------------------------------- profile_workload


def test_profile_workload_writes_a_trace_and_a_summary(tmp_path):
    config = TrainConfig(device="cpu", precision="fp32", batch_size=32, log_every=1000)
    s = profile_workload(tiny_workload(), config, steps=4, wait=1, warmup=1, active=2, out_dir=tmp_path)

    trace = json.loads((tmp_path / "trace.json").read_text())
    names = {e.get("name") for e in trace["traceEvents"]}
    assert "aten::convolution" in names or "aten::mkldnn_convolution" in names
    saved = json.loads((tmp_path / "profile_summary.json").read_text())
    assert saved["workload"] == "tiny" and saved["files"]["trace"] == str(tmp_path / "trace.json")

    assert s["top_ops"] and all(r["self_cpu_ms_per_step"] > 0 for r in s["top_ops"])
    assert not any(r["name"].startswith("ProfilerStep") for r in s["top_ops"])
    assert [r["phase"] for r in s["breakdown"]] == list(PHASES)
    assert sum(r["share"] for r in s["breakdown"]) == pytest.approx(1.0)
    assert s["step_ms"] > 0 and s["samples_per_s"] > 0
    # conv 1->8 (3x3 on 8x8) and linear 512->4, batch 32: forward + weight grads + the linear's input grad
    conv, lin = 2 * 32 * 8 * 8 * 8 * 9, 2 * 32 * 512 * 4
    assert s["flops_per_step"] == 2 * (conv + lin) + lin
    assert s["mfu"] is None and s["peak_tflops"] is None  # no made-up peak for a CPU
    assert s["trace"]["steps"] == 2 and s["trace"]["kernels_per_step"] is None
    assert s["syncs"]["supported"] is False and "CUDA GPU" in s["syncs"]["reason"]
    assert s["host_reads"]["sites"] == []  # log_every=1000: no loss read in the profiled steps
    assert s["verdict"]["verdict"] in VERDICTS


def test_profile_finds_the_per_step_loss_read(tmp_path):
    config = TrainConfig(device="cpu", precision="fp32", batch_size=32, log_every=1)  # seed 003's habit
    s = profile_workload(tiny_workload(), config, steps=2, wait=0, warmup=1, active=1, out_dir=tmp_path)
    (site,) = s["host_reads"]["sites"]
    assert site["what"] == ".tolist()" and site["per_step"] == 1
    assert site["file"].endswith("step.py") and ".tolist()" in site["code"]


# ---------------------------------------------------------------- host reads and syncs


def test_count_host_reads_points_at_the_users_line():
    model = nn.Linear(4, 1)
    x = torch.randn(8, 4)
    lines = {}

    def step():
        loss = model(x).pow(2).mean()
        lines["item"] = inspect.currentframe().f_lineno + 1
        value = loss.item()
        lines["if"] = inspect.currentframe().f_lineno + 1
        if loss > 100:
            pass
        lines["fmt"] = inspect.currentframe().f_lineno + 1
        text = f"{loss:.3f}"
        loss.backward()
        return value, text

    r = count_host_reads(step, steps=3)
    sites = {(s["line"], s["what"]): s for s in r["sites"]}
    assert all(s["file"] == __file__ for s in r["sites"])
    assert sites[(lines["item"], ".item()")]["count"] == 3
    assert sites[(lines["if"], "__bool__")]["per_step"] == 1
    assert sites[(lines["fmt"], "__format__")]["per_step"] == 1  # the user's line, not torch's internals
    assert r["per_step"] == 3 and r["kind"] == "host-reads"

    def clean():
        model(x).pow(2).mean().backward()

    assert count_host_reads(clean, steps=2)["total"] == 0


def test_count_host_reads_sees_a_read_inside_a_cpp_op():
    """A 0-dim tensor given where an op takes a Scalar is read on the host by the op's argument
    parsing (aten._local_scalar_dense), below anything Python sees: the dispatcher's view counts it,
    on the user's line. (EMA's warm-up weight read the host every step this way.)"""
    a, b = [torch.zeros(3)], [torch.ones(3)]
    weight = torch.tensor(0.5)
    lines = {}

    def step():
        lines["lerp"] = inspect.currentframe().f_lineno + 1
        torch._foreach_lerp_(a, b, weight)  # pyright: ignore[reportPrivateImportUsage]

    r = count_host_reads(step, steps=4)
    assert r["total"] == 4 and r["sites"][0]["line"] == lines["lerp"] and r["sites"][0]["file"] == __file__
    assert ".item()" in r["sites"][0]["what"]
    assert count_host_reads(lambda: torch._foreach_lerp_(a, b, 0.5), steps=4)["total"] == 0  # a Python number


def test_host_read_rule_names_each_kind():
    from gputrain.diagnostics.syncs import host_read

    aten = torch.ops.aten
    t, mask, idx = torch.randn(4), torch.tensor([True, False, True, False]), torch.tensor([0, 2])
    reads = {
        "item": host_read(aten._local_scalar_dense.default, (t[0],)),
        "nonzero": host_read(aten.nonzero.default, (t,)),
        "mask": host_read(aten.index.Tensor, (t, [mask])),
        "equal": host_read(aten.equal.default, (t, t)),
        "tensor": host_read(aten.lift_fresh.default, (t,)),
        "repeat": host_read(aten.repeat_interleave.Tensor, (idx,)),
    }
    assert all(reads.values()), reads
    assert "output size depends on the data" in reads["mask"] and ".item()" in reads["item"]
    assert host_read(aten.index.Tensor, (t, [idx])) is None  # integer indices: a fixed size
    assert host_read(aten.add.Tensor, (t, t)) is None
    assert host_read(aten.repeat_interleave.Tensor, (idx,), {"output_size": 2}) is None


def test_the_verdict_names_host_reads_that_would_sync_on_a_gpu():
    cpu = diagnose({"device_type": "cpu", "breakdown_ms": {"data": 0.1, "forward": 5.0, "backward": 9.0},
                    "host_reads_per_step": 1.0, "host_read_site": "ema.py:134 (.item())"})
    assert any("1 host read(s) of device values per step, most at ema.py:134" in a and "a sync on a GPU" in a
               for a in cpu["also"])
    clean = diagnose({"device_type": "cpu", "breakdown_ms": {"forward": 5.0}, "host_reads_per_step": 0.0})
    assert not any("host read" in a for a in clean["also"])


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU answer")
def test_detect_syncs_on_the_cpu_says_it_needs_a_gpu():
    calls = []
    r = detect_syncs(lambda: calls.append(1), steps=3)
    assert r["supported"] is False
    assert "needs a CUDA GPU" in r["reason"] and "count_host_reads" in r["reason"]
    assert r["sites"] == [] and calls == []  # nothing was run


# ---------------------------------------------------------------- traces and verdicts


def _x(name, cat, ts, dur, **kw):
    return {"ph": "X", "name": name, "cat": cat, "ts": ts, "dur": dur, **kw}


def test_trace_summary_on_a_recorded_gpu_trace():
    events = [
        _x("ProfilerStep#3", "user_annotation", 1000, 100),
        _x("ProfilerStep#4", "user_annotation", 1100, 100),
        _x("ProfilerStep#3", "gpu_user_annotation", 1000, 100),  # the GPU-timeline copy: not a step
        _x("ProfilerStep#4", "gpu_user_annotation", 1100, 100),
        _x("k1", "kernel", 1010, 4), _x("k2", "kernel", 1012, 6),  # overlapping: 8 us busy
        _x("k3", "kernel", 1050, 10), _x("k4", "kernel", 1150, 20),
        _x("Memcpy DtoH", "gpu_memcpy", 1190, 2),
        _x("cudaLaunchKernel", "cuda_runtime", 1005, 3),
        _x("cudaStreamSynchronize", "cuda_runtime", 1150, 40),
        _x("k-outside", "kernel", 5000, 999),  # not in the profiled steps
        {"ph": "i", "name": "instant", "ts": 1001},
    ]
    t = trace_summary({"traceEvents": events})
    assert t["steps"] == 2 and t["step_ms"] == pytest.approx(0.1)
    assert t["kernels_per_step"] == 2 and t["median_kernel_us"] == 8
    assert t["kernel_ms_per_step"] == pytest.approx(0.020)
    assert t["syncs_per_step"] == 0.5 and t["sync_wait_share"] == pytest.approx(40 / 200)
    assert t["gpu_busy"] == pytest.approx((8 + 10 + 20 + 2) / 200)


def test_trace_summary_reads_a_file(tmp_path):
    path = tmp_path / "t.json"
    path.write_text(json.dumps({"traceEvents": [_x("ProfilerStep#0", "user_annotation", 0, 50),
                                                _x("aten::mm", "cpu_op", 5, 20)]}))
    t = trace_summary(path)
    assert t["steps"] == 1 and t["gpu_busy"] is None and t["kernels_per_step"] is None


RECORDED = {
    # A DataLoader without workers feeding a ResNet: the GPU waits for batches.
    "input-bound": {"device_type": "cuda", "step_ms": 40.0, "gpu_busy": 0.35, "median_kernel_us": 80.0,
                    "breakdown_ms": {"data": 22.0, "h2d": 4.0, "forward": 4.0, "backward": 8.0, "optimizer": 1.5,
                                     "logging": 0.5}, "syncs_per_step": 0, "mfu": 0.05},
    # Seed 003: iris MLP, full batch, loss.item() every epoch.
    "launch-bound": {"device_type": "cuda", "step_ms": 0.45, "gpu_busy": 0.12, "kernels_per_step": 38,
                     "median_kernel_us": 2.9, "syncs_per_step": 1, "sync_wait_share": 0.04,
                     "breakdown_ms": {"data": 0.01, "h2d": 0.0, "forward": 0.12, "backward": 0.18, "optimizer": 0.1,
                                      "logging": 0.04}, "mfu": 0.00001},
    # Medium kernels, but .item() and .cpu() three times a step drain the queue each time.
    "sync-bound": {"device_type": "cuda", "step_ms": 6.0, "gpu_busy": 0.45, "kernels_per_step": 60,
                   "median_kernel_us": 45.0, "syncs_per_step": 3, "sync_wait_share": 0.4,
                   "breakdown_ms": {"data": 0.1, "h2d": 0.0, "forward": 2.0, "backward": 3.0, "optimizer": 0.4,
                                    "logging": 0.5}},
    # A big model in bf16 with device-resident data.
    "compute-bound": {"device_type": "cuda", "step_ms": 120.0, "gpu_busy": 0.97, "kernels_per_step": 900,
                      "median_kernel_us": 90.0, "syncs_per_step": 0.02, "sync_wait_share": 0.01,
                      "breakdown_ms": {"data": 0.2, "h2d": 0.0, "forward": 38.0, "backward": 76.0, "optimizer": 5.0,
                                       "logging": 0.8}, "mfu": 0.42},
}


@pytest.mark.parametrize("expected", list(RECORDED))
def test_diagnose_recorded_metrics(expected):
    v = diagnose(RECORDED[expected])
    assert v["verdict"] == expected
    assert v["evidence"] and v["suggestions"]


def test_diagnose_evidence_and_side_findings():
    launch = diagnose(RECORDED["launch-bound"])
    assert any("2.9 us" in e for e in launch["evidence"])
    assert any(".item()" in a for a in launch["also"])  # the per-step sync is reported too
    assert any("CUDA graphs" in s for s in launch["suggestions"])
    assert any("MFU 42.0%" in e for e in diagnose(RECORDED["compute-bound"])["evidence"])
    assert any("65%" in e for e in diagnose(RECORDED["input-bound"])["evidence"])
    sync = diagnose(RECORDED["sync-bound"])
    assert any(".item()" in s for s in sync["suggestions"])
    # NVML utilization stands in for the trace's busy figure.
    nvml = dict(RECORDED["launch-bound"], gpu_busy=None, gpu_util_pct=15)
    assert diagnose(nvml)["verdict"] == "launch-bound"
    cpu = diagnose({"device_type": "cpu", "breakdown_ms": {"data": 0.1, "forward": 5.0, "backward": 9.0}})
    assert cpu["verdict"] == "compute-bound" and any("CUDA GPU" in a for a in cpu["also"])


# ---------------------------------------------------------------- the command


def test_profile_command_on_the_cpu(tmp_path, capsys):
    from gputrain.cli import main

    assert main(["profile", "iris-mlp", "--device", "cpu", "--steps", "3", "--active", "1",
                 "--out", str(tmp_path / "p")]) == 0
    out = capsys.readouterr().out
    assert "where an eager step's time goes" in out and "per step as fit runs it" in out and "top ops" in out
    assert "needs a CUDA GPU" in out and "verdict:" in out
    assert (tmp_path / "p" / "trace.json").is_file()

    assert main(["profile", "iris-mlp", "--device", "cpu", "--steps", "2", "--active", "1", "--log-every", "1",
                 "--out", str(tmp_path / "q"), "--json"]) == 0
    s = json.loads(capsys.readouterr().out)
    assert s["batch_size"] == 120 and s["config"]["log_every"] == 1
    # The trainer's own loop: with log_every=1 every step is a log point, which reads the loss and
    # evaluates on the test split (eval_every unset), one host read each, as fit would.
    assert s["host_reads"]["per_step"] == 2
    # the loss read (read_totals) and the evaluation's one read (Evaluator._reduce)
    assert {site["function"] for site in s["host_reads"]["sites"]} == {"read_totals", "_reduce"}


def test_profile_takes_a_runs_config_under_its_flags(tmp_path, capsys):
    """`gputrain profile --config FILE` profiles the run a file describes (workload, options,
    [train]: its learning rate and batch), the flags given over it; the file's [fit] settings and
    run directory belong to a run that trains: nothing is written there."""
    from gputrain.cli import main

    (tmp_path / "run.toml").write_text(f'workload = "iris-mlp"\n[train]\nbatch_size = 30\nlr = 0.05\nlog_every = 2\n'
                                       f'run_dir = "{tmp_path / "r"}"\n[fit]\nema = 0.9\n')
    assert main(["profile", "--config", str(tmp_path / "run.toml"), "--device", "cpu", "--steps", "2", "--active", "1",
                 "--log-every", "1", "--out", str(tmp_path / "p"), "--json"]) == 0
    s = json.loads(capsys.readouterr().out)
    assert s["workload"] == "iris-mlp" and s["batch_size"] == 30 and s["config"]["lr"] == 0.05
    assert s["config"]["log_every"] == 1 and s["config"]["run_dir"] is None  # the flag over the file
    assert not (tmp_path / "r").exists()


# ---------------------------------------------------------------- GPU


@pytest.mark.gpu
def test_detect_syncs_finds_a_planted_item_with_its_line():
    device = torch.device("cuda")
    model = nn.Linear(64, 1).to(device)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randn(256, 64, device=device)
    planted = {}

    def step():
        loss = model(x).pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        planted["line"] = inspect.currentframe().f_lineno + 1
        return loss.item()

    r = detect_syncs(step, steps=4)
    assert r["supported"]
    site = next(s for s in r["sites"] if s["line"] == planted["line"])
    assert site["file"] == __file__ and "loss.item()" in site["code"]
    assert site["count"] == 4 and site["per_step"] == 1

    def clean():
        model(x).pow(2).mean().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    assert detect_syncs(clean, steps=3)["total"] == 0


@pytest.mark.gpu
def test_seed_003_iris_loop_is_launch_or_sync_bound(tmp_path):
    from gputrain.workloads import get_workload

    w = get_workload("iris-mlp")
    config = TrainConfig(device="cuda", precision="fp32", batch_size=120, log_every=1, lr=0.01)
    s = profile_workload(w, config, steps=50, out_dir=tmp_path)
    assert s["verdict"]["verdict"] in ("launch-bound", "sync-bound"), s["verdict"]
    assert s["trace"]["kernels_per_step"] > 5 and s["trace"]["gpu_busy"] < 0.6
    assert s["syncs"]["supported"] and s["syncs"]["per_step"] >= 1  # the loss.item() every step
    assert all(r["device_ms"] is not None for r in s["breakdown"])


@pytest.mark.gpu
def test_profile_on_cuda_reports_kernels_utilization_and_mfu(tmp_path):
    from gputrain.workloads import get_workload

    w = get_workload("synthetic-cifar", n=4096)
    config = TrainConfig(device="cuda", precision="bf16", batch_size=512, log_every=10**9)
    s = profile_workload(w, config, steps=20, out_dir=tmp_path)
    assert s["top_ops"][0]["self_device_ms_per_step"] > 0
    assert s["syncs"]["supported"] and s["syncs"]["per_step"] == 0  # log_every=100: the loss is never read
    assert s["gpu_utilization"] is None or 0 <= s["gpu_utilization"]["mean_pct"] <= 100
    if s["peak_tflops"] is not None:
        assert 0 < s["mfu"] < 1


@pytest.mark.gpu
def test_profile_reports_the_step_time_fit_reaches_on_synthetic_cifar():
    """profile times the step fit runs (graphed, channels_last, bf16): within 10% of fit's steady rate."""
    from gputrain import fit
    from gputrain.workloads import get_workload

    wl = get_workload("synthetic-cifar", n=20000)
    cfg = TrainConfig(device="cuda", batch_size=64, steps=1500, log_every=250)
    torch.manual_seed(0)
    h = fit(wl.make_model(), wl.make_data(), loss_fn=wl.loss_fn, config=cfg)
    fit_ms = 1000 * 64 / h.summary["samples_per_s"]
    s = profile_workload(wl, cfg.replace(log_every=250), steps=300, active=2)
    assert s["cuda_graphs"] == h.summary["cuda_graphs"] == "on"
    assert s["step_ms"] == pytest.approx(fit_ms, rel=0.10), (s["step_ms"], fit_ms)
