"""RecompileWatcher: planted recompilations and graph breaks are reported with reason and hint.

The compiled models use backend="eager": dynamo's guards, recompilations and graph breaks are the
same whatever backend turns the graph into code, and Inductor's C++ build would take tens of
seconds on the CPU. One test runs the default backend (Inductor) with backward to check the
records look the same there.
"""

from __future__ import annotations

import pytest
import torch
from helpers import mlp

from gputrain.runtime.recompiles import RecompileWatcher, explain_guard_failure


def test_partial_last_batch_is_reported_with_reason_and_hint():
    torch._dynamo.reset()
    compiled = torch.compile(mlp(4, 2, hidden=8), dynamic=False, backend="eager")
    with RecompileWatcher() as watcher:
        compiled(torch.randn(8, 4))
        first = watcher.report()
        compiled(torch.randn(3, 4))  # a last batch of 3: dim 0 changes, dynamic=False recompiles
        compiled(torch.randn(3, 4))  # cached now: no more compiles
    report = watcher.report()
    assert first["recompilations"] == 0 and first["compilations"] == 1
    assert report["recompilations"] == 1
    assert report["compilations"] == 2
    assert report["graph_breaks"] == 0
    (event,) = report["events"]
    assert event["kind"] == "recompile"
    assert "size mismatch at index 0" in event["reason"]
    assert event["short"] == "input 0 dim 0 8 -> 3 (last partial batch)"
    assert "drop_last" in event["hint"] and "dynamic" in event["hint"]
    assert watcher.summary().startswith("recompiled 1 time: input 0 dim 0 8 -> 3 (last partial batch): set drop_last")
    assert report["summary"] == watcher.summary()


def test_nothing_before_start_or_after_stop_counts():
    torch._dynamo.reset()
    compiled = torch.compile(mlp(4, 2, hidden=8), dynamic=False, backend="eager")
    compiled(torch.randn(8, 4))
    compiled(torch.randn(5, 4))  # a recompile before the watcher starts
    watcher = RecompileWatcher().start()
    compiled(torch.randn(8, 4))  # both shapes are cached: nothing compiles
    final = watcher.stop()
    compiled(torch.randn(2, 4))  # after stop: not seen
    assert final["recompilations"] == 0 and final["compilations"] == 0
    assert final["summary"] == "no recompilations, no graph breaks"
    assert watcher.report()["recompilations"] == 0
    assert watcher._seen == []  # no references to dynamo's records kept after stop


def test_graph_break_is_reported():
    torch._dynamo.reset()

    def fn(x):
        y = x * 2
        print("graph break here", end="\r")  # dynamo cannot trace print: the graph breaks
        return y.sum()

    with RecompileWatcher() as watcher:
        torch.compile(fn, backend="eager")(torch.randn(3))
    report = watcher.report()
    assert report["graph_breaks"] == 1
    (event,) = [e for e in report["events"] if e["kind"] == "graph_break"]
    assert "print" in event["reason"] + event["explanation"]
    assert "1 graph break:" in report["summary"]


@pytest.mark.processes
def test_inductor_with_backward_reports_the_same():
    from torch._dynamo.utils import get_compilation_metrics

    torch._dynamo.reset()
    compiled = torch.compile(mlp(4, 2, hidden=8), dynamic=False)
    # Caches off: a backward graph loaded from the caches leaves no record of its own.
    with torch._inductor.config.patch(fx_graph_cache=False), torch._functorch.config.patch(enable_autograd_cache=False):
        with RecompileWatcher() as watcher:
            compiled(torch.randn(8, 4)).sum().backward()
            compiled(torch.randn(3, 4)).sum().backward()
            records = get_compilation_metrics()[-4:]
    assert [m.is_forward for m in records] == [True, False, True, False]
    report = watcher.report()
    assert report["recompilations"] == 1
    assert report["compilations"] == 2  # backward graphs belong to their forward's compilation
    # Compile time counts the backward graphs too (their own records' durations).
    forward_only = sum(m.entire_frame_compile_time_s for m in records if m.is_forward)
    assert report["compile_time_s"] > forward_only > 0
    assert report["events"][0]["short"] == "input 0 dim 0 8 -> 3 (last partial batch)"


def test_explanations_of_other_guards():
    short, hint = explain_guard_failure("0/0: tensor 'args[0]' size mismatch at index 1. expected 256, actual 100")
    assert short == "input 0 dim 1 256 -> 100 (a non-batch dimension changed)" and "pad" in hint
    short, _ = explain_guard_failure("0/1: tensor 'args[0]' size mismatch at index 0. expected 8, actual 16")
    assert short.endswith("(batch size changed)")
    short, _ = explain_guard_failure("0/1: GLOBAL_STATE changed: grad_mode ")
    assert short == "grad mode changed (torch.no_grad)"
    short, hint = explain_guard_failure("0/3: something new")
    assert short == "something new" and "TORCH_LOGS=recompiles" in hint
