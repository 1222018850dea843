"""Profile's per-step figures count training steps only; the loop's other work in the profiled
window (a log point's loss read, evaluation) is shown apart."""

import pytest
import torch
from torch import nn

from gputrain import TrainConfig
from gputrain.diagnostics.profile import profile_workload
from gputrain.diagnostics.trace import STEP_LABEL, trace_summary
from gputrain.workloads.base import DataSplits, Workload


def _two_convs() -> Workload:
    """A model with two convolutions, and a test split of 64 (one eval batch)."""

    def make_data():
        g = torch.Generator().manual_seed(0)
        x = torch.randint(0, 256, (192, 1, 8, 8), dtype=torch.uint8, generator=g)
        y = torch.randint(0, 4, (192,), generator=g)
        return DataSplits(train=(x[:128], y[:128]), test=(x[128:], y[128:]), mean=(127.5,), std=(64.0,))

    def make_model():
        return nn.Sequential(nn.Conv2d(1, 4, 3, padding=1), nn.ReLU(), nn.Conv2d(4, 4, 3, padding=1), nn.ReLU(),
                             nn.Flatten(), nn.Linear(4 * 8 * 8, 4))

    return Workload(name="two-convs", description="test", make_data=make_data, make_model=make_model,
                    loss_fn=nn.CrossEntropyLoss(), defaults={"batch_size": 32})


def test_the_op_table_counts_a_models_two_convolutions_per_step_with_evaluations_in_the_window(tmp_path):
    """Every step is a log point with an evaluation (log_every=1, eval_every=1): the profiled window
    holds 2 steps and 2 evaluations. Per step, the model's 2 convolutions, not (4 + 4) / 2 = 4."""
    config = TrainConfig(device="cpu", precision="fp32", batch_size=32, log_every=1, eval_every=1)
    s = profile_workload(_two_convs(), config, steps=2, wait=0, warmup=1, active=2, out_dir=tmp_path, top=500)
    per_step = {r["name"]: r["calls_per_step"] for r in s["top_ops"]}
    other = {r["name"]: r["calls"] for r in s["other_ops"]}
    assert s["top_ops_steps"] == 2
    assert per_step["aten::convolution"] == 2 and per_step["aten::convolution_backward"] == 2
    assert other["aten::convolution"] == 4 and "aten::convolution_backward" not in other  # 2 evaluations x 2
    assert s["trace"]["steps"] == 2 and s["trace"]["other_work"]["ms"] > 0
    from gputrain.report.html import render_report  # report.html shows both tables, each for what it counts

    page = render_report([], {"workload": "two-convs"}, profile=s, run_dir=str(tmp_path))
    assert "(per training step, 2 training steps)" in page
    assert "other work (log points: the loss read, evaluation): top" in page and "not per step" in page


def _x(name, cat, ts, dur, **args):
    return {"ph": "X", "name": name, "cat": cat, "ts": ts, "dur": dur, "args": args}


def test_the_trace_counts_kernels_launched_in_the_steps_and_shows_the_rest_apart():
    """Two ProfilerStep windows, each a training step (marked) then an evaluation: kernels belong to
    what launched them (the runtime call with the same correlation), wherever they run."""
    events = [
        _x("ProfilerStep#1", "user_annotation", 1000, 100), _x("ProfilerStep#2", "user_annotation", 1100, 100),
        _x(STEP_LABEL, "user_annotation", 1000, 40), _x(STEP_LABEL, "user_annotation", 1100, 40),
        _x(STEP_LABEL, "gpu_user_annotation", 1000, 60),  # the GPU-timeline copy: not a step
        _x("cudaLaunchKernel", "cuda_runtime", 1010, 2, correlation=1),
        _x("cudaLaunchKernel", "cuda_runtime", 1110, 2, correlation=2),
        _x("cudaLaunchKernel", "cuda_runtime", 1060, 2, correlation=3),  # the evaluation's
        _x("cudaLaunchKernel", "cuda_runtime", 1160, 2, correlation=4),
        _x("cudaStreamSynchronize", "cuda_runtime", 1070, 10),  # the log point's loss read
        _x("step-kernel", "kernel", 1045, 10, correlation=1),  # runs after its step's CPU span: still the step's
        _x("step-kernel", "kernel", 1115, 10, correlation=2),
        _x("eval-kernel", "kernel", 1065, 4, correlation=3), _x("eval-kernel", "kernel", 1165, 4, correlation=4),
    ]
    t = trace_summary({"traceEvents": events})
    assert t["steps"] == 2 and t["step_ms"] == pytest.approx(0.040)
    assert t["kernels_per_step"] == 1 and t["kernel_ms_per_step"] == pytest.approx(0.010)
    assert t["syncs_per_step"] == 0 and t["other_work"] == {"ms": pytest.approx(0.120), "kernels": 2, "syncs": 1}
    assert t["gpu_busy"] == pytest.approx(28 / 200)  # a share of the whole window
