"""The CPU suite's CUDA graph (tests/graph_capture.py) has CUDA's capture semantics: these tests
hold it to them, so that the graph tests built on it can be believed."""

from __future__ import annotations

import pytest
import torch

from graph_capture import CaptureError, CaptureGraphs
from helpers import data


def _capture(fn):
    backend = CaptureGraphs()
    return backend, backend.capture(fn)


@pytest.mark.parametrize("read", [
    lambda t: t.sum().item(),
    lambda t: bool(t.sum() > 0),
    lambda t: t.nonzero(),
    lambda t: t[t > 0],
    lambda t: torch.tensor([1.0, 2.0]) + t[:2],
    lambda t: torch._foreach_lerp_([t], [t * 2], torch.tensor(0.5)),  # a 0-dim tensor as a Scalar: .item() in C++
    lambda t: torch.equal(t, t),
])
def test_capture_raises_where_cuda_capture_raises(read):
    t = torch.randn(8)
    with pytest.raises(CaptureError, match="operation not permitted when stream is capturing"):
        _capture(lambda: read(t))


def test_capture_launches_nothing_and_replay_runs_the_recorded_ops():
    """Capture leaves every tensor as it was (CUDA records kernels without running them); each
    replay applies the step once, to the same tensors."""
    w = torch.ones(4)
    lr = torch.tensor(0.5)
    grad = torch.full((4,), 2.0)
    _, graph = _capture(lambda: w.sub_(grad * lr))
    assert torch.equal(w, torch.ones(4))
    graph.replay()
    assert torch.equal(w, torch.zeros(4))
    lr.fill_(0.25)  # written in place: the graph reads the new value
    grad.copy_(torch.full((4,), 4.0))
    graph.replay()
    assert torch.equal(w, torch.full((4,), -1.0))


def test_capture_leaves_the_tensors_it_only_reads_untouched_version_counters_included():
    """A tensor the step only reads keeps its version counter through capture, as on CUDA:
    train/step/graphs.py compares the batch buffers' counters to see whether the step writes its own
    inputs (then it copies every batch in); one the step writes gets its contents back."""
    from graph_capture import _version

    w, x = torch.ones(4), torch.full((4,), 2.0)
    read_before, written_before = _version(x), _version(w)
    _capture(lambda: w.mul_(x))
    assert _version(x) == read_before and torch.equal(x, torch.full((4,), 2.0))
    assert _version(w) != written_before and torch.equal(w, torch.ones(4))


def test_python_numbers_and_python_branches_are_frozen_at_capture():
    w = torch.zeros(3)
    state = {"lr": 1.0, "steps": 0}

    def step():
        state["steps"] += 1
        if state["lr"] > 0.5:  # a Python branch: taken once, at capture
            w.add_(state["lr"])
        else:
            w.sub_(100.0)

    _, graph = _capture(step)
    state["lr"] = 0.1  # as a scheduler writing a float would
    graph.replay()
    graph.replay()
    assert torch.equal(w, torch.full((3,), 2.0))  # +1.0 twice: the captured value and branch
    assert state["steps"] == 1  # the Python ran once


def test_fresh_outputs_are_the_graphs_static_memory():
    """A value the step computes lives in the tensor the capture made; replays write it there."""
    x = torch.tensor([1.0, 2.0])
    out = {}
    _, graph = _capture(lambda: out.setdefault("y", x * 3))
    y = out["y"]
    x.copy_(torch.tensor([5.0, 6.0]))
    graph.replay()
    assert torch.equal(y, torch.tensor([15.0, 18.0]))


def test_random_ops_draw_anew_on_each_replay_in_the_eager_order():
    """Capture consumes no random numbers; replays draw in sequence, so N replays equal N eager steps."""
    out = torch.zeros(5)
    torch.manual_seed(0)
    _, graph = _capture(lambda: out.copy_(torch.nn.functional.dropout(torch.ones(5), 0.5)))
    replayed = []
    for _ in range(3):
        graph.replay()
        replayed.append(out.clone())
    torch.manual_seed(0)
    eager = [torch.nn.functional.dropout(torch.ones(5), 0.5) for _ in range(3)]
    assert all(torch.equal(a, b) for a, b in zip(replayed, eager))
    assert not torch.equal(replayed[0], replayed[1])


def test_batch_norm_statistics_are_given_back_after_capture():
    """native_batch_norm writes the running statistics without saying so in its schema: every tensor
    from before the capture is restored, not only those an op declares it writes."""
    bn = torch.nn.BatchNorm1d(3)
    x, _ = data(16, d=3)
    _, graph = _capture(lambda: bn(x))
    assert torch.equal(bn.running_mean, torch.zeros(3)) and bn.num_batches_tracked.item() == 0
    graph.replay()
    expected = torch.nn.BatchNorm1d(3)
    expected(x)
    assert torch.allclose(bn.running_mean, expected.running_mean) and bn.num_batches_tracked.item() == 1


def test_replay_fails_when_python_of_gputrain_or_the_tests_runs():
    """The promise that no Python runs on replay is checked, not assumed: an op whose replay calls
    into test code fails the replay."""
    import helpers

    _, graph = _capture(lambda: torch.ones(2).add_(1))

    class CallsPython:
        def replay(self):
            helpers.data(4)

    graph.ops.append(CallsPython())  # pyright: ignore[reportArgumentType]
    with pytest.raises(AssertionError, match="Python ran during a graph replay: .*helpers.py"):
        graph.replay()
