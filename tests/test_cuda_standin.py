"""CUDA-only decisions and reports, run on a CPU machine under the `fake_cuda` stand-in (conftest.py).

torch.cuda REPORTS a GPU (an H100 by default, a V100, an A100, one or four of them); no kernel, tensor,
stream or graph is faked, so whatever would make a real CUDA tensor still fails and stays in `gpu`
tests. Each test goes through gputrain's own calls to torch.cuda: device choice, precision, data
placement, speed switches, the run summary / report.html / TensorBoard of a CUDA run, `gputrain info`,
`doctor`, `memory`, NVML telemetry and the per-process device of the launcher.
"""

import json
import logging
import sys
import types

import pytest
import torch
from torch import nn

from gputrain import DeviceError, TrainConfig, pick_device
from gputrain.errors import ConfigError
from gputrain.runtime import devices

GiB = 2**30
H100 = "NVIDIA H100 80GB HBM3"
V100 = "Tesla V100-SXM2-32GB"
CUDA0 = torch.device("cuda", 0)
# This torch's own answers, read at import, before any stand-in: a CPU build says (False, None); PyPI's
# CUDA build on a machine without a GPU (False, "13.0"); on the GPU machine (True, "13.0").
REAL_CUDA = (torch.cuda.is_available(), torch.version.cuda)


@pytest.fixture
def no_nvml(monkeypatch):
    """nvidia-ml-py not importable, as on a machine without it (the real one may be installed here)."""
    monkeypatch.setitem(sys.modules, "pynvml", None)


@pytest.fixture
def wide(monkeypatch):
    """rich renders to a 200-column terminal, so a table cell is never cut."""
    monkeypatch.setenv("COLUMNS", "200")


def _conv_net() -> nn.Module:
    return nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.Flatten(), nn.Linear(8 * 8 * 8, 10))


# ---------------------------------------------------------------- the stand-in itself


def test_stand_in_reports_a_gpu_but_never_makes_a_cuda_tensor(fake_cuda):
    gpu = fake_cuda()
    assert torch.cuda.is_available() and torch.cuda.device_count() == 1
    props = torch.cuda.get_device_properties(0)
    assert (props.name, props.major, props.minor, props.total_memory, props.multi_processor_count) == (
        H100, 9, 0, 80 * GiB, 132)
    assert torch.cuda.mem_get_info(CUDA0) == (79 * GiB, 80 * GiB)
    # gputrain's own probes read the patched torch: a CUDA build with one H100.
    assert devices._cuda_built() and devices._cuda_available() and devices._cuda_count() == 1
    assert devices._cuda_name(0) == H100
    gpu.allocate(3 * GiB)
    gpu.release(2 * GiB)
    assert (torch.cuda.memory_allocated(CUDA0), torch.cuda.max_memory_allocated(CUDA0)) == (1 * GiB, 3 * GiB)
    assert torch.cuda.mem_get_info(CUDA0)[0] == 76 * GiB  # the cache still holds the 3 GiB
    torch.cuda.reset_peak_memory_stats(CUDA0)
    assert torch.cuda.memory_stats(CUDA0)["allocated_bytes.all.peak"] == 1 * GiB
    with pytest.raises(ValueError, match="Expected a cuda device"):
        torch.cuda.memory_allocated(torch.device("cpu"))
    with pytest.raises(AssertionError, match="Invalid device id"):
        torch.cuda.get_device_properties(1)
    # Honest: kernels and tensors are not faked.
    with pytest.raises((AssertionError, RuntimeError)):
        torch.empty(1, device="cuda")
    with pytest.raises((AssertionError, RuntimeError)):
        torch.ones(2).to(CUDA0)


def test_stand_in_is_undone():
    """Unpatched here; run after the test above (file order), it shows the fixture undid everything."""
    assert torch.cuda.get_device_properties.__module__ == "torch.cuda"
    assert (torch.cuda.is_available(), torch.version.cuda) == REAL_CUDA


# ---------------------------------------------------------------- choosing a device


@pytest.mark.parametrize("count", [1, 4])
def test_pick_device_on_one_and_four_gpus(fake_cuda, count):
    gpu = fake_cuda(count=count)
    assert pick_device("auto") == CUDA0 and pick_device("cuda") == CUDA0
    if count == 4:
        assert pick_device("cuda:3") == torch.device("cuda", 3)
        torch.cuda.set_device(2)  # "cuda" means the current device, made explicit
        assert pick_device("cuda") == torch.device("cuda", 2) and pick_device("auto") == torch.device("cuda", 2)
        names = ", ".join(f"cuda:{i} {H100}" for i in range(4))
        with pytest.raises(DeviceError) as e:
            pick_device("cuda:4")
        assert str(e.value) == f"cuda:4 requested, but this machine has 4 CUDA devices ({names}): use one of cuda:0..cuda:3"
    else:
        with pytest.raises(DeviceError) as e:
            pick_device("cuda:3")
        assert str(e.value) == (f"cuda:3 requested, but this machine has 1 CUDA device (cuda:0 {H100}): "
                                "use one of cuda:0..cuda:0")
    assert gpu.calls["probe"] >= 2  # every accepted CUDA device had its test allocation


def test_a_busy_gpu_and_a_cpu_only_torch_say_why(fake_cuda, monkeypatch):
    fake_cuda(count=2, capability=(7, 0), probe_error="CUDA error: out of memory\nCUDA kernel errors ...")
    with pytest.raises(DeviceError, match=rf"cuda:1 \({V100}\) exists but a test allocation failed: "
                                          "CUDA error: out of memory. Check `nvidia-smi`"):
        pick_device("cuda:1")
    monkeypatch.setattr(torch.version, "cuda", None)  # the GPU is there, the build is CPU-only
    with pytest.raises(DeviceError, match="this PyTorch build has no CUDA support"):
        pick_device("cuda")


def test_single_process_setup_takes_the_gpu(fake_cuda):
    from gputrain.runtime import distributed

    fake_cuda()
    info, device = distributed.init_distributed("auto")
    assert info is distributed.SINGLE and device == CUDA0


# ---------------------------------------------------------------- precision by compute capability


@pytest.mark.parametrize("capability,name,auto,scaler,tf32", [
    ((9, 0), H100, "bf16", False, True),
    ((8, 0), "NVIDIA A100-SXM4-80GB", "bf16", False, True),
    ((7, 0), V100, "fp16", True, False),
])
def test_auto_precision_follows_the_capability(fake_cuda, capability, name, auto, scaler, tf32):
    from gputrain.runtime.precision import RunPrecision, resolve_precision

    fake_cuda(capability=capability)
    device = pick_device("auto")
    p = resolve_precision("auto", device)
    cap = f"{capability[0]}.{capability[1]}"
    if auto == "bf16":
        assert p.reason == f"auto: bf16 autocast, since {name} (capability {cap}) has bf16 tensor cores"
    else:
        assert p.reason == f"auto: fp16 autocast with loss scaling, since {name} (capability {cap}) has no bf16"
    assert (p.name, p.use_scaler, p.tf32) == (auto, scaler, tf32)
    assert p.autocast_dtype == (torch.bfloat16 if auto == "bf16" else torch.float16)
    run = RunPrecision(p, device)
    assert run.scaler.is_enabled() is scaler  # a GradScaler only for fp16
    before = torch.get_float32_matmul_precision()
    run.apply()
    try:
        assert torch.get_float32_matmul_precision() == ("high" if tf32 else "highest")
    finally:
        run.restore()
    assert torch.get_float32_matmul_precision() == before


def test_bf16_and_tf32_on_a_v100_are_refused_with_the_fix(fake_cuda):
    from gputrain.runtime.precision import resolve_precision

    fake_cuda(capability=(7, 0))
    with pytest.raises(ConfigError) as e:
        resolve_precision("bf16", CUDA0)
    assert str(e.value) == (f"precision bf16 needs compute capability 8.0+, but {V100} has 7.0: "
                            "use fp16 (with loss scaling) or fp32")
    with pytest.raises(ConfigError) as e:
        resolve_precision("tf32", CUDA0)
    assert str(e.value) == f"precision tf32 needs compute capability 8.0+, but {V100} has 7.0: use fp16 or fp32"
    assert resolve_precision("fp16", CUDA0).use_scaler


def test_bf16_support_is_read_from_the_capability_not_torch_emulation(fake_cuda):
    """torch.cuda.is_bf16_supported() answers True on a V100 (bf16 is emulated there); gputrain's
    choices must follow the capability, as resolve_precision does."""
    from gputrain.diagnostics import autotune
    from gputrain.diagnostics.estimate import _bf16_autocast_works

    fake_cuda(capability=(7, 0), count=2)
    assert torch.cuda.is_bf16_supported() and not torch.cuda.is_bf16_supported(including_emulation=False)
    low = {c["precision"] for c in autotune.candidates(TrainConfig(), CUDA0, _conv_net())} - {"fp32"}
    assert low == {"fp16"}
    assert not _bf16_autocast_works(CUDA0)
    fake_cuda(capability=(9, 0))
    low = {c["precision"] for c in autotune.candidates(TrainConfig(), CUDA0, _conv_net())} - {"fp32"}
    assert low == {"bf16"} and _bf16_autocast_works(CUDA0)


# ---------------------------------------------------------------- data placement: the memory rule


def _columns(gib: float, device: str = "meta"):
    """Tensor columns of about `gib` GiB, without allocating them (meta tensors have sizes only)."""
    rows = int(gib * GiB) // (3 * 64 * 64 * 4)
    return torch.empty(rows, 3, 64, 64, device=device), torch.empty(rows, dtype=torch.int64, device=device)


def test_data_that_fits_in_free_memory_stays_on_the_gpu_else_it_streams(fake_cuda):
    from gputrain.data.placement import column_placement, nbytes_of

    gpu = fake_cuda(count=4)  # 79 GiB free of 80 on each
    small, big = _columns(30), _columns(45)
    p = column_placement(small, CUDA0)
    mib = nbytes_of(small) / 2**20
    assert p.kind == "device"
    assert p.reason == f"data kept on the device: {mib:.1f} MiB of data fits in 50% of 79.0 GiB free on cuda:0"
    p = column_placement(big, CUDA0)
    assert p.kind == "dataloader"
    assert p.reason == (f"data streamed from the host (pinned, prefetched): {nbytes_of(big) / 2**20:.1f} MiB "
                        "of data exceeds 50% of 79.0 GiB free on cuda:0")
    # Free memory is the device's own, now: what this process holds, or another GPU's, does not count.
    gpu.allocate(40 * GiB)
    assert column_placement(small, CUDA0).kind == "dataloader"
    gpu.gpus[2].free_memory = 10 * GiB
    p = column_placement(_columns(6), torch.device("cuda", 2))
    assert p.kind == "dataloader" and p.reason.endswith("exceeds 50% of 10.0 GiB free on cuda:2")
    assert column_placement(_columns(6), torch.device("cuda", 3)).kind == "device"
    # Forced either way, whatever fits.
    assert column_placement(big, CUDA0, on_device=True).reason == "data kept on the device: data_on_device=True was requested"
    assert column_placement(small, CUDA0, memory_fraction=0.9).kind == "device"  # 30 GiB < 90% of the 39 GiB left


def test_make_loader_puts_resident_data_on_the_gpu(fake_cuda):
    """Keeping data resident copies it to the GPU: a real CUDA tensor, which the stand-in never makes."""
    from gputrain.data.feed import make_loader

    fake_cuda()
    with pytest.raises((AssertionError, RuntimeError)):
        make_loader((torch.randn(8, 3), torch.arange(8)), 4, device=CUDA0, train=True)


# ---------------------------------------------------------------- speed switches: graphs and channels_last


def test_speed_switches_on_an_h100_and_a_v100(fake_cuda):
    from gputrain.runtime.precision import resolve_precision
    from gputrain.runtime.speed import decide_speed

    fake_cuda()
    device = pick_device("cuda")
    prec = resolve_precision("auto", device)
    s = decide_speed(TrainConfig(), _conv_net(), device, use_scaler=prec.use_scaler)
    assert (s.cuda_graphs, s.channels_last, s.cudnn_benchmark) == (True, True, True)
    # Without a first step to probe (probe_layout=False: the memory tools), the CUDA rule; fit's own
    # first step checks NHWC first (tests/test_channels_last.py).
    assert s.reasons == {"channels_last": "2D convolutions on CUDA: cuDNN's NHWC kernels (the CUDA rule)",
                         "cudnn_benchmark": "fixed input shapes: cuDNN picks the fastest algorithm once",
                         "compile": "not requested",
                         "cuda_graphs": "one graph launch per step instead of one launch per kernel"}
    before = torch.backends.cudnn.benchmark
    s.apply(device)
    assert torch.backends.cudnn.benchmark is True
    s.restore()
    assert torch.backends.cudnn.benchmark is before
    dense = decide_speed(TrainConfig(), nn.Linear(4, 2), device)
    assert (dense.channels_last, dense.reasons["channels_last"]) == (False, "no 2D convolutions")
    assert dense.reasons["cudnn_benchmark"] == "not a CUDA conv net"

    fake_cuda(capability=(7, 0))  # auto precision is fp16 there: its loss scaler keeps the step out of a graph
    prec = resolve_precision("auto", device)
    s = decide_speed(TrainConfig(), _conv_net(), device, use_scaler=prec.use_scaler)
    assert s.cuda_graphs is False and s.channels_last is True
    assert s.reasons["cuda_graphs"] == "fp16 loss scaling checks for inf on the host every step"
    forced = decide_speed(TrainConfig(cuda_graphs=True, channels_last=False), _conv_net(), device,
                          use_scaler=prec.use_scaler)
    assert forced.cuda_graphs is False and forced.reasons["channels_last"] == "requested"


# ---------------------------------------------------------------- a CUDA run's summary, report.html, TensorBoard


def _cuda_run(config: TrainConfig):
    """A stand-in for a CUDA run with the parts the run summary reads (train/loop/parts.py's `RunParts`),
    every part decided under the stand-in by gputrain's own functions (device, precision, placement,
    speed); the loop's figures are given (2 log points)."""
    from gputrain.data.placement import column_placement
    from gputrain.io.history import History
    from gputrain.metric_direction import metric_direction
    from gputrain.runtime.distributed import SINGLE
    from gputrain.runtime.precision import RunPrecision, resolve_precision
    from gputrain.runtime.speed import decide_speed
    from gputrain.train.loop.callbacks import CallbackList
    from gputrain.train.evaluation.points import EvalPoints
    from gputrain.train.loop.guards import SpikeDetector
    from gputrain.train.step.loss import LossRule
    from gputrain.train.loop.startup_costs import StartupClock
    from gputrain.train.loop.state import RunState
    from gputrain.train.modes import UserModes

    device = pick_device(config.device)
    precision = RunPrecision(resolve_precision(config.precision, device), device)
    speed = decide_speed(config, _conv_net(), device, use_scaler=precision.precision.use_scaler)
    ns = types.SimpleNamespace
    return ns(
        config=config, device=device, is_main=True, precision=precision, speed=speed, dist=SINGLE,
        run_dir=config.run_dir, history=History(records=[], config=config.to_dict(), summary={}),
        state=RunState(step=200, samples_seen=200 * config.batch_size), warnings=[],
        data=ns(placement=column_placement(_columns(2), device, config.data_on_device, config.device_memory_fraction),
                eval_points=EvalPoints(None, 100, 1, 200, config.log_every, has_eval=False), eval=None,
                batch_size=config.batch_size, total_steps=200, train=None),
        optim=ns(optimizer_desc="AdamW (fused, graph-capturable)", schedule_desc=f"{config.schedule} (built-in)"),
        # The graph wrapper as graph_status reads it (no capture failed); its CUDA side needs a real GPU.
        step=ns(loss=LossRule(nn.CrossEntropyLoss()), body=ns(micro=ns(splits=1)), own=False,
                graphed=ns(failed=None) if speed.cuda_graphs else None),
        model=ns(recomputed=[], compile=None, modes=UserModes(_conv_net())), callbacks=CallbackList(None),
        checkpoints=ns(model_part=ns(frozen=None), writer=ns(timings=[])),
        guards=ns(spikes=SpikeDetector(None, 10, 3, "warn")),
        startup=StartupClock(),  # the time before the first step (no step in a stand-in: "no step yet")
        task="classification", control=ns(metric_direction=lambda key: metric_direction(key, config.metric_modes)))


def test_cuda_run_summary_report_and_tensorboard(fake_cuda, tmp_path, caplog):
    pytest.importorskip("tensorboard", reason="tensorboard is not installed")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from gputrain.report.run_outputs import RunOutputs
    from gputrain.report.summary import summary_rows
    from gputrain.train.loop import run_summary
    from gputrain.runtime.devices import take_peak_memory

    gpu = fake_cuda()
    run_dir = tmp_path / "run"
    config = TrainConfig(name="cifar10-cnn", device="cuda", steps=200, batch_size=512, run_dir=str(run_dir))
    t = _cuda_run(config)
    with caplog.at_level(logging.INFO, logger="gputrain"):
        run_summary.announce(t)
    assert f"device: cuda:0 ({H100})" in caplog.messages
    assert "cuda_graphs: on (one graph launch per step instead of one launch per kernel)" in caplog.messages

    outputs = RunOutputs(run_dir, config, enabled=True)
    peak = 0
    for step, loss, held in ((100, 1.5, 60 * GiB), (200, 0.9, 20 * GiB)):
        gpu.allocate(held)  # the steps since the last log point held `held` at most, then freed it
        gpu.release(held)
        record = {"step": step, "epoch": step / 100, "loss": loss, "lr": 1e-3, "samples_per_s": 50_000.0,
                  "peak_memory_bytes": take_peak_memory(t.device), "wall_time_s": step / 10}
        peak = max(peak, record["peak_memory_bytes"])
        t.history.add(record)
        outputs.append(record)
    assert [r["peak_memory_bytes"] for r in t.history.records] == [60 * GiB, 20 * GiB]  # reset at each log point
    run_summary.summarize(t, elapsed=20.0, peak=peak, stopped=False)
    s = t.history.summary
    assert s["device"] == f"cuda:0 ({H100})"
    assert (s["device_memory_bytes"], s["peak_memory_bytes"]) == (80 * GiB, 60 * GiB)
    assert (s["precision"], s["data"], s["cuda_graphs"], s["channels_last"]) == ("bf16", "device", "on", True)
    assert ("peak device memory", "60.0 GiB") in summary_rows(s) and ("CUDA graphs", "on") in summary_rows(s)
    outputs.close(s)
    outputs.finish(t.history)

    page = (run_dir / "report.html").read_text()
    assert f"cuda:0 ({H100})" in page
    assert "Peak device memory: <b>60.0 GiB</b> of 80.0 GiB (<b>75.0%</b>)" in page
    assert "auto: bf16 autocast, since NVIDIA H100 80GB HBM3 (capability 9.0) has bf16 tensor cores" in page
    assert "one graph launch per step instead of one launch per kernel" in page
    assert json.loads((run_dir / "history.json").read_text())["summary"]["device"] == f"cuda:0 ({H100})"
    ea = EventAccumulator(str(run_dir), size_guidance={"scalars": 0, "tensors": 0})
    ea.Reload()
    assert [e.value for e in ea.Scalars("memory/peak_memory_bytes")] == [60 * GiB, 20 * GiB]
    text = ea.Tensors("summary/text_summary")[0].tensor_proto.string_val[0].decode()
    assert f"| device | `\"cuda:0 ({H100})\"` |" in text and f"| device_memory_bytes | `{80 * GiB}` |" in text


def test_cuda_run_on_a_v100_reports_fp16_and_graphs_off(fake_cuda):
    from gputrain.report.html import render_report
    from gputrain.train.loop import run_summary

    fake_cuda(capability=(7, 0), count=4)
    t = _cuda_run(TrainConfig(device="cuda:3", steps=200, data_on_device=False))
    run_summary.summarize(t, elapsed=10.0, peak=30 * GiB, stopped=False)
    s = t.history.summary
    assert s["device"] == f"cuda:3 ({V100})" and s["device_memory_bytes"] == 32 * GiB
    assert s["precision"] == "fp16" and s["cuda_graphs"] == "off: fp16 loss scaling checks for inf on the host every step"
    assert s["data_reason"] == "data streamed from the host (pinned, prefetched): data_on_device=False was requested"
    page = render_report([], s)
    assert "Peak device memory: <b>30.0 GiB</b> of 32.0 GiB (<b>93.8%</b>)" in page
    assert "Above 90% of the device" in page


# ---------------------------------------------------------------- gputrain info and doctor


def test_info_shows_the_gpus(fake_cuda, no_nvml, wide, capsys):
    from gputrain.cli import main

    fake_cuda(capability=(7, 0), count=4, free_memory=30 * GiB)
    assert main(["info", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["torch"]["cuda"] == "12.6" and data["torch"]["build"] == "CUDA" and data["torch"]["cudnn"] == 90100
    assert [g["device"] for g in data["devices"]["cuda"]] == ["cuda:0", "cuda:1", "cuda:2", "cuda:3"]
    assert data["devices"]["cuda"][3] == {
        "index": 3, "device": "cuda:3", "name": V100, "total_memory_bytes": 32 * GiB, "free_memory_bytes": 30 * GiB,
        "compute_capability": "7.0", "multiprocessors": 80, "bf16": False, "tf32": False}
    assert data["devices"]["cuda_error"] is None
    assert data["nvml"]["available"] is False and "nvidia-ml-py is not importable" in data["nvml"]["reason"]

    fake_cuda()
    assert main(["info"]) == 0
    out = capsys.readouterr().out
    assert f"PyTorch {torch.__version__} (CUDA 12.6, cuDNN 90100)" in out
    row = next(line for line in out.splitlines() if "cuda:0" in line)
    for cell in (H100, "79.0 GiB / 80.0 GiB", "9.0", "132", "yes"):
        assert cell in row, (cell, row)
    assert "NVML: not available (nvidia-ml-py is not importable" in out
    assert "No GPU is usable" not in out


def test_doctor_on_a_healthy_h100(fake_cuda, no_nvml, wide, capsys, monkeypatch):
    from gputrain.cli import main
    from gputrain.diagnostics import doctor as doc

    fake_cuda()
    monkeypatch.setattr(doc, "tf32_matmul_enabled", lambda: False)  # this process's fp32 matmuls: full fp32
    assert main(["doctor", "--no-measure"]) == 0
    out = capsys.readouterr().out
    assert f"PyTorch {torch.__version__} · CUDA 12.6" in out
    lines = {line.split()[1]: line for line in out.splitlines() if line.split()[:1] in (["pass"], ["warn"], ["FAIL"])}
    assert lines["cuda"].startswith("pass") and f"1 CUDA device: cuda:0 {H100}" in lines["cuda"]
    assert lines["memory"].startswith("pass") and "79.0 of 80.0 GiB free" in lines["memory"]
    assert lines["tf32"].startswith("warn") and f"{H100} (capability 9.0) has TF32 tensor cores" in lines["tf32"]
    assert "no failures, 1 warning(s)." in out


def test_doctor_on_a_shared_v100_names_the_other_process(fake_cuda, wide, capsys, monkeypatch):
    from test_info import fake_pynvml

    from gputrain.cli import main

    fake_cuda(capability=(7, 0), free_memory=10 * GiB)
    monkeypatch.setitem(sys.modules, "pynvml", fake_pynvml())  # another process holds 69 GiB
    assert main(["doctor", "--no-measure", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    checks = {c["name"]: c for c in report["checks"]}
    assert checks["memory cuda:0"]["status"] == "warn"
    assert checks["memory cuda:0"]["message"] == ("only 10.0 of 32.0 GiB free: 1 other process holds 69.0 GiB "
                                                  "(pids 4242)")
    assert checks["bf16 cuda:0"]["message"].startswith(f"{V100} (capability 7.0) has no bf16 tensor cores")
    assert checks["driver"]["status"] == "pass" and "tf32 cuda:0" not in checks
    assert report["probe"]["gpus"][0]["compute_capability"] == "7.0"


# ---------------------------------------------------------------- gputrain memory: the verdict against the GPU


def test_memory_verdict_against_the_device_memory(fake_cuda, wide, capsys):
    from rich.console import Console

    from gputrain.commands.memory import device_capacity, render
    from gputrain.diagnostics.advice import recommendations
    from gputrain.diagnostics.estimate import estimate_memory, max_batch_from_estimate
    from gputrain.diagnostics.memory_stats import memory_stats
    from gputrain.runtime.speed import decide_speed

    gpu = fake_cuda(name="Tesla T4", capability=(7, 5), total_memory=15 * GiB, free_memory=14 * GiB)
    gpu.allocate(3 * GiB)
    gpu.release(1 * GiB)  # the cache keeps its blocks: 2 GiB allocated, 3 GiB reserved
    stats = memory_stats(pick_device("cuda"))
    assert stats == {"device": "cuda:0", "kind": "cuda", "allocated_bytes": 2 * GiB, "reserved_bytes": 3 * GiB,
                     "peak_bytes": 3 * GiB, "peak_reserved_bytes": 3 * GiB, "free_bytes": 11 * GiB,
                     "total_bytes": 15 * GiB, "note": "PyTorch caching allocator; free/total from the driver"}
    capacity, label = device_capacity(CUDA0, stats)
    assert (capacity, label) == (15 * GiB, "device memory")  # the whole device, not what is free now
    assert device_capacity(CUDA0, stats, 2 * GiB) == (2 * GiB, "--limit")

    # The estimate itself runs on the CPU (the measuring needs real tensors); the verdict is the GPU's.
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(1024, 4096), nn.ReLU(), nn.Linear(4096, 10))
    batch = 2**20  # a million samples: far more than a T4 holds
    sample = (torch.randn(16, 1024), torch.randint(0, 10, (16,)))
    estimate = estimate_memory(model, sample, "adamw", "fp32", batch_size=batch, loss_fn=nn.CrossEntropyLoss())
    fits = max_batch_from_estimate(estimate, capacity)
    assert 0 < fits < batch and estimate["total_bytes"] > capacity
    recs = recommendations(estimate, capacity, "fp32", CUDA0)
    # A T4 (7.5) has no bf16, and fit refuses it there: the 16-bit advice is fp16 with loss scaling.
    assert [r["how"] for r in recs if r["action"] in ("bf16", "fp16")] == ["--precision fp16 (TrainConfig(precision='fp16'))"]
    gpu.gpus[0].capability = (9, 0)
    assert "bf16" in [r["action"] for r in recommendations(estimate, capacity, "fp32", CUDA0)]
    gpu.gpus[0].capability = (7, 5)
    smaller = next(r for r in recs if r["action"] == "smaller-batch")
    assert smaller["how"] == f"--batch-size {fits}" and smaller["fits_after"] is True
    report = {"workload": "mlp", "device": "cuda:0", "device_stats": stats, "precision": "fp32", "batch_size": batch,
              "capacity_bytes": capacity, "capacity_label": label, "estimate": estimate,
              "measured": {"peak_bytes": None, "measured": False, "batch_size": batch,
                           "method": "not measured: a real step needs CUDA tensors"},
              "step": {"optimizer": "AdamW (fused)", "recompute": [],
                       "switches": decide_speed(TrainConfig(), model, CUDA0).decisions()},
              "max_batch": {"requested": False, "predicted_from_estimate": fits}, "recommendations": recs}
    console = Console(record=True, width=200)
    render(report, console)
    out = console.export_text()
    assert "of device memory" in out and "device memory: 15.0 GiB" in out
    assert f"largest batch by the estimate: {fits:,} (fits 15.0 GiB device memory)" in out
    assert f"--batch-size {fits}" in out
    assert "cuda_graphs on" in out  # the step's switches as decided for this GPU


# ---------------------------------------------------------------- telemetry: NVML present, absent or failing


def test_gpu_utilization_without_nvml_is_none_with_a_reason(fake_cuda, no_nvml):
    from gputrain.diagnostics.gpu_util import GpuUtilSampler

    fake_cuda()
    with GpuUtilSampler(CUDA0) as sampler:
        pass
    assert sampler.result() is None and sampler.error is not None and sampler.error.startswith("NVML unavailable: ")


def test_gpu_utilization_with_a_failing_and_a_working_nvml(fake_cuda, monkeypatch):
    import time

    from test_info import fake_pynvml

    from gputrain.diagnostics.gpu_util import GpuUtilSampler
    from gputrain.diagnostics.telemetry import nvml_snapshot

    fake_cuda()
    monkeypatch.setitem(sys.modules, "pynvml", fake_pynvml(init_error=RuntimeError("Driver Not Loaded")))
    with GpuUtilSampler(CUDA0) as sampler:
        pass
    assert sampler.result() is None and sampler.error == "NVML unavailable: Driver Not Loaded"
    assert nvml_snapshot() == {"available": False,
                               "reason": "NVML did not initialize (no NVIDIA driver?): Driver Not Loaded"}
    monkeypatch.setitem(sys.modules, "pynvml", fake_pynvml())
    with GpuUtilSampler(CUDA0, interval_s=0.005) as sampler:
        deadline = time.monotonic() + 5
        while len(sampler.samples) < 3 and time.monotonic() < deadline:
            time.sleep(0.005)
    result = sampler.result()
    assert sampler.error is None and result is not None and result["samples"] >= 3
    assert (result["mean_pct"], result["max_pct"]) == (97, 97)


# ---------------------------------------------------------------- the launcher: one process per GPU


@pytest.mark.parametrize("count", [1, 4])
def test_each_local_rank_gets_its_gpu(fake_cuda, count, monkeypatch):
    from gputrain.runtime import distributed

    gpu = fake_cuda(count=count)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    for rank in range(count):
        assert distributed._rank_device("auto", rank) == torch.device("cuda", rank)
        assert torch.cuda.current_device() == rank  # set_device: the rank's kernels go to its GPU
    assert distributed._rank_device("cuda", count - 1) == torch.device("cuda", count - 1)
    assert gpu.calls["set_device"] == count + 1
    with pytest.raises(ConfigError) as e:
        distributed._rank_device("auto", count)
    assert str(e.value) == (f"local rank {count} has no GPU: this machine has {count} visible "
                            f"(CUDA_VISIBLE_DEVICES=None); start at most {count} processes per node "
                            "(--nproc-per-node / --nproc)")
    assert distributed._rank_device("cpu", count) == torch.device("cpu")  # gloo on the CPU: any count
    nccl = distributed.DistInfo(True, rank=1, local_rank=1, world_size=count, backend="nccl")
    assert distributed._collective_device(nccl) == torch.device("cuda", count - 1)  # the current device


# ---------------------------------------------------------------- the run's seed


def test_a_cuda_run_seeds_every_device_and_a_cpu_run_the_cpu_generator_only(fake_cuda, monkeypatch):
    """seed_run: torch.manual_seed (CPU and CUDA generators; CUDA's queued until initialized) for a
    CUDA run; the CPU generator alone for a CPU run, without torch.manual_seed's per-accelerator
    queueing."""
    fake_cuda()
    calls = []
    real = torch.manual_seed
    monkeypatch.setattr(torch, "manual_seed", lambda seed: calls.append(seed) or real(seed))
    devices.seed_run(7, CUDA0)
    assert calls == [7] and torch.initial_seed() == 7
    devices.seed_run(11, torch.device("cpu"))
    assert calls == [7] and torch.initial_seed() == 11
