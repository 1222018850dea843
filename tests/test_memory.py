"""Memory: estimate arithmetic, activation measurement, the max-batch search, OOM handling,
recommendations and recompute (CPU), plus the real search on a GPU."""

import copy
import json

import pytest
import torch
from torch import nn

from gputrain.errors import ConfigError, GputrainError
from gputrain.diagnostics.advice import recommendations
from gputrain.diagnostics.batch_search import batch_trial, find_max_batch
from gputrain.diagnostics.estimate import estimate_memory, max_batch_from_estimate
from gputrain.diagnostics.probe import StepProbe, as_loss_rule, measure_step_memory
from gputrain.diagnostics.memory_stats import memory_stats
from gputrain.runtime.oom import free_after_oom, is_oom
from gputrain.train.step.recompute import apply_recompute, recompute_units


def mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(10, 20), nn.ReLU(), nn.Linear(20, 5))  # 325 parameters


class Block(nn.Module):
    def __init__(self, width: int = 16):
        super().__init__()
        self.fc = nn.Linear(width, width)
        self.bn = nn.BatchNorm1d(width)
        self.drop = nn.Dropout(0.2)

    def forward(self, x):
        return x + self.drop(torch.relu(self.bn(self.fc(x))))


class BlockNet(nn.Module):
    def __init__(self, depth: int = 4, width: int = 16):
        super().__init__()
        self.stem = nn.Linear(4, width)
        self.blocks = nn.Sequential(*[Block(width) for _ in range(depth)])
        self.head = nn.Linear(width, 3)

    def forward(self, x):
        return self.head(self.blocks(self.stem(x)))


# ---------------------------------------------------------------- estimate


def test_estimate_counts_parameters_gradients_and_optimizer_state_exactly():
    model = mlp()
    x = torch.randn(8, 10)
    est = estimate_memory(model, x, "adamw", batch_size=64)
    assert est["parameters"] == 10 * 20 + 20 + 20 * 5 + 5 == 325
    assert est["parameter_bytes"] == 325 * 4
    assert est["gradient_bytes"] == 325 * 4
    assert est["optimizer_state_bytes"] == 2 * 325 * 4  # AdamW: exp_avg + exp_avg_sq in fp32
    # Saved for backward per sample: Linear1's input (10 floats) and ReLU's output (20 floats), which
    # Linear2 saves again (the same storage, counted once). Weights are parameters, not activations.
    assert est["activation_bytes_per_sample"] == (10 + 20) * 4
    assert est["activation_bytes_fixed"] == 0
    assert est["activation_bytes"] == 120 * 64
    assert est["total_bytes"] == 1300 + 1300 + 2600 + 7680
    assert any("2 x 1,300 B" in line for line in est["arithmetic"])

    assert estimate_memory(model, x, "sgd")["optimizer_state_bytes"] == 325 * 4  # momentum: one buffer
    assert estimate_memory(model, x, "none")["optimizer_state_bytes"] == 0


def test_estimate_counts_only_trainable_gradients_and_tied_weights_once():
    model = mlp()
    model[0].requires_grad_(False)
    est = estimate_memory(model, torch.randn(4, 10), "adamw")
    assert est["parameter_bytes"] == 325 * 4
    assert est["gradient_bytes"] == (20 * 5 + 5) * 4
    assert est["optimizer_state_bytes"] == 2 * (20 * 5 + 5) * 4

    tied = nn.Sequential(nn.Linear(8, 8, bias=False), nn.Linear(8, 8, bias=False))
    tied[1].weight = tied[0].weight
    assert estimate_memory(tied, torch.randn(4, 8))["parameters"] == 64


def test_activation_bytes_scale_with_the_batch():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2), nn.Flatten(), nn.Linear(8 * 8 * 8, 10))
    small = estimate_memory(model, torch.randn(4, 3, 16, 16), batch_size=4)
    large = estimate_memory(model, torch.randn(16, 3, 16, 16), batch_size=16)
    assert large["measured_activation_bytes"][0] == 4 * small["measured_activation_bytes"][0]
    assert small["activation_bytes_per_sample"] == large["activation_bytes_per_sample"] > 0
    # The fit predicts other batch sizes linearly.
    at_1000 = estimate_memory(model, torch.randn(8, 3, 16, 16), batch_size=1000)
    assert at_1000["activation_bytes"] == pytest.approx(1000 * large["activation_bytes_per_sample"], abs=1)


def test_estimate_with_loss_and_bf16_and_leaves_the_model_unchanged():
    model = BlockNet()
    before = copy.deepcopy(model.state_dict())
    model.eval()
    x, y = torch.randn(8, 4), torch.randint(0, 3, (8,))
    fp32 = estimate_memory(model, (x, y), loss_fn=nn.functional.cross_entropy)
    bf16 = estimate_memory(model, (x, y), precision="bf16", loss_fn=nn.functional.cross_entropy)
    assert bf16["activation_bytes_per_sample"] < fp32["activation_bytes_per_sample"]
    assert fp32["bf16_activation_bytes_per_sample"] == bf16["activation_bytes_per_sample"]
    assert not model.training  # mode restored
    after = model.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)  # BatchNorm running stats untouched
    assert [b["name"] for b in fp32["blocks"]] == [f"blocks.{i}" for i in range(4)]
    with pytest.raises(ConfigError, match="unknown optimizer 'lamb'"):
        estimate_memory(model, x, "lamb")


# ---------------------------------------------------------------- max batch, OOM


def fake_device(limit: int, message: str | None = None):
    """A try_batch for a device that fits batches up to `limit`."""
    calls = []

    def try_batch(b: int) -> None:
        calls.append(b)
        if b > limit:
            if message:
                raise RuntimeError(message)
            raise torch.OutOfMemoryError(f"fake: {b} > {limit}")

    return try_batch, calls


@pytest.mark.parametrize("start", [1, 8, 37, 64, 1000])
def test_find_max_batch_finds_the_exact_limit(start):
    try_batch, calls = fake_device(37)
    assert find_max_batch(try_batch, start=start, limit=None, device="cpu") == 37
    assert len(calls) <= 16  # doubling + bisection, not a scan


def test_find_max_batch_respects_limit_and_catches_runtime_oom_messages():
    try_batch, _ = fake_device(1000)
    assert find_max_batch(try_batch, start=3, limit=20) == 20
    try_batch, _ = fake_device(5, message="CUDA out of memory. Tried to allocate 2.00 GiB")
    assert find_max_batch(try_batch, start=1, limit=64) == 5


def test_find_max_batch_when_nothing_fits_or_another_error():
    try_batch, _ = fake_device(0)
    with pytest.raises(GputrainError, match="even with a batch of 1"):
        find_max_batch(try_batch, start=1)
    with pytest.raises(GputrainError, match="even with a batch of 1"):
        find_max_batch(try_batch, start=16)

    def broken(b: int) -> None:
        raise ValueError("shapes do not match")

    with pytest.raises(ValueError, match="shapes"):
        find_max_batch(broken, start=4)
    with pytest.raises(ConfigError):
        find_max_batch(broken, start=0)


def test_is_oom():
    assert is_oom(torch.OutOfMemoryError("CUDA out of memory"))
    assert is_oom(torch.cuda.OutOfMemoryError("x"))
    assert is_oom(RuntimeError("CUDA out of memory. Tried to allocate 20.00 MiB"))
    assert is_oom(RuntimeError("MPS backend out of memory (MPS allocated: 1.2 GB)"))
    assert is_oom(RuntimeError("[enforce fail] DefaultCPUAllocator: can't allocate memory: you tried to allocate"))
    assert is_oom(RuntimeError("cuDNN error: CUDNN_STATUS_ALLOC_FAILED"))
    assert is_oom(MemoryError())
    assert not is_oom(RuntimeError("mat1 and mat2 shapes cannot be multiplied"))
    assert not is_oom(ValueError("out of memory"))  # not an error torch raises for memory
    free_after_oom("cpu")  # a no-op here, but must not fail


def test_batch_trial_with_a_limit_matches_the_estimate():
    model = mlp()
    est = estimate_memory(model, torch.randn(8, 10), "adamw")
    limit = 200_000
    with StepProbe(model, as_loss_rule(), precision="fp32") as probe:
        found = find_max_batch(batch_trial(probe, lambda b: torch.randn(b, 10), limit_bytes=limit), start=8,
                               device="cpu")
    assert found == max_batch_from_estimate(est, limit) == (limit - 5200) // 120
    step = measure_step_memory(model, torch.randn(found, 10))
    assert not step["measured"] and "estimate" in step["method"]
    assert step["peak_bytes"] <= limit < measure_step_memory(model, torch.randn(found + 1, 10))["peak_bytes"]


def test_memory_stats_on_the_cpu():
    s = memory_stats("cpu")
    assert s["kind"] == "host"
    assert 0 < s["free_bytes"] <= s["total_bytes"]
    assert s["allocated_bytes"] > 0 and s["peak_bytes"] >= s["allocated_bytes"]


# ---------------------------------------------------------------- recommendations


def test_recommendations_each_save_bytes():
    model = BlockNet()
    est = estimate_memory(model, torch.randn(8, 4), batch_size=4096)
    recs = recommendations(est, device_total_bytes=None, precision="fp32")
    actions = [r["action"] for r in recs]
    assert set(actions) == {"bf16", "accumulate", "recompute", "smaller-batch"}
    assert all(r["saves_bytes"] > 0 and r["total_bytes_after"] == est["total_bytes"] - r["saves_bytes"] for r in recs)
    assert [r["saves_bytes"] for r in recs] == sorted((r["saves_bytes"] for r in recs), reverse=True)
    acc = next(r for r in recs if r["action"] == "accumulate")
    assert acc["saves_bytes"] == int(est["activation_bytes_per_sample"] * 2048)

    # Over budget: the smaller batch proposed is one that fits; bf16 is not proposed under bf16.
    budget = est["total_bytes"] // 3
    recs = recommendations(est, device_total_bytes=budget, precision="bf16")
    assert "bf16" not in [r["action"] for r in recs]
    smaller = next(r for r in recs if r["action"] == "smaller-batch")
    assert smaller["fits_after"] and smaller["total_bytes_after"] <= budget
    acc = next(r for r in recs if r["action"] == "accumulate")
    assert acc["fits_after"]


# ---------------------------------------------------------------- recompute


def grads_and_buffers(model, x, y):
    torch.manual_seed(123)  # the same dropout masks on both sides
    model.zero_grad()
    nn.functional.cross_entropy(model(x), y).backward()
    return [p.grad.clone() for p in model.parameters()], [b.clone() for b in model.buffers()]


def test_recompute_of_repeated_blocks_gives_identical_gradients():
    model = BlockNet()
    wrapped = copy.deepcopy(model)
    names = apply_recompute(wrapped)
    assert names == ["blocks.0", "blocks.1", "blocks.2", "blocks.3"]
    assert [repr(u) for u in recompute_units(model)] == [f"RecomputeUnit('blocks.{i}')" for i in range(4)]
    assert list(wrapped.state_dict()) == list(model.state_dict())  # parameter names unchanged
    x, y = torch.randn(32, 4), torch.randint(0, 3, (32,))
    g1, b1 = grads_and_buffers(model, x, y)
    g2, b2 = grads_and_buffers(wrapped, x, y)
    assert all(torch.equal(a, b) for a, b in zip(g1, g2))
    assert all(torch.equal(a, b) for a, b in zip(b1, b2))  # BatchNorm stats updated once, not twice
    # It saves memory: fewer bytes are kept for backward.
    assert (estimate_memory(wrapped, (x, y), loss_fn=nn.functional.cross_entropy)["activation_bytes_per_sample"]
            < estimate_memory(model, (x, y), loss_fn=nn.functional.cross_entropy)["activation_bytes_per_sample"])
    # Idempotent, and a deep copy recomputes with its own weights.
    assert apply_recompute(wrapped) == names
    twin = copy.deepcopy(wrapped)
    nn.functional.cross_entropy(twin(x), y).backward()
    assert twin.blocks[0].fc.weight.grad is not None


def test_recompute_of_a_plain_sequential_and_named_targets():
    torch.manual_seed(0)

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.net = nn.Sequential(*(m for _ in range(3) for m in (nn.Linear(16, 16), nn.Tanh(), nn.Dropout(0.1))))
            self.out = nn.Linear(16, 3)

        def forward(self, x):
            return self.out(self.net(x))

    model = Net()
    auto = copy.deepcopy(model)
    assert apply_recompute(auto) == ["net[0:3]", "net[3:6]"]
    named = copy.deepcopy(model)
    assert apply_recompute(named, ["net[0:4]", "out"]) == ["net[0:4]", "out"]
    x, y = torch.randn(8, 16), torch.randint(0, 3, (8,))
    ref, _ = grads_and_buffers(model, x, y)
    for m in (auto, named):
        got, _ = grads_and_buffers(m, x, y)
        assert all(torch.equal(a, b) for a, b in zip(ref, got))
    # No gradients, no recompute: eval output is unchanged.
    with torch.no_grad():
        assert torch.equal(model.eval()(x), named.eval()(x))


def test_recompute_errors_name_the_bad_target():
    model = BlockNet()
    with pytest.raises(ConfigError, match=r"'blocks\.9'.*did you mean"):
        apply_recompute(model, ["blocks.9"])
    with pytest.raises(ConfigError, match="'blockz'"):
        apply_recompute(model, ["blockz"])
    with pytest.raises(ConfigError, match="has 4 layers"):
        apply_recompute(model, ["blocks[2:9]"])
    with pytest.raises(ConfigError, match="no repeated blocks"):
        apply_recompute(nn.Linear(3, 3))


# ---------------------------------------------------------------- the command


def run_cli(argv, capsys):
    from gputrain.cli import main

    code = main(argv)
    out = capsys.readouterr().out
    return code, out


def test_memory_command_json_with_a_dry_run_search(capsys):
    code, out = run_cli(["memory", "iris-mlp", "--device", "cpu", "--find-max", "--limit", "1MiB", "--json"], capsys)
    assert code == 0
    report = json.loads(out)
    est = report["estimate"]
    assert est["parameters"] == 4 * 10 + 10 + 10 * 3 + 3
    assert report["batch_size"] == 120  # iris trains full-batch
    assert report["max_batch"]["result"] == report["max_batch"]["predicted_from_estimate"] > 120
    assert report["recommendations"] and all(r["saves_bytes"] > 0 for r in report["recommendations"])


def test_memory_command_text_on_the_cpu_says_the_search_needs_bounded_memory(capsys):
    code, out = run_cli(["memory", "iris-mlp", "--device", "cpu", "--find-max"], capsys)
    assert code == 0
    assert "optimizer state" in out and "activations" in out
    assert "bounded memory" in out and "--limit" in out


def test_memory_measures_the_run_a_config_describes_under_its_flags(tmp_path, capsys):
    """`gputrain memory --config FILE` takes the run a file describes (--print-config's output, as
    RUN_DIR/config.toml holds it: its workload, options and [train]), the flags over it, with fit's
    declarations of --batch-size, --precision and --device; the file's run directory is a trained
    run's: nothing is written there."""
    code, printed = run_cli(["fit", "digits-cnn", "--batch-size", "24", "--precision", "fp32", "--run-dir",
                             str(tmp_path / "r"), "--print-config"], capsys)
    assert code == 0
    (tmp_path / "run.toml").write_text(printed)
    code, out = run_cli(["memory", "--config", str(tmp_path / "run.toml"), "--device", "cpu", "--json"], capsys)
    report = json.loads(out)
    assert code == 0 and (report["workload"], report["batch_size"], report["precision"]) == ("digits-cnn", 24, "fp32")
    code, out = run_cli(["memory", "--config", str(tmp_path / "run.toml"), "--device", "cpu", "--batch-size", "8",
                         "--json"], capsys)
    assert code == 0 and json.loads(out)["batch_size"] == 8  # the flag over the file
    code, out = run_cli(["memory", "iris-mlp", "--config", str(tmp_path / "run.toml"), "--device", "cpu", "--json"],
                        capsys)
    assert code == 0 and (json.loads(out)["workload"], json.loads(out)["batch_size"]) == ("iris-mlp", 24)
    assert not (tmp_path / "r").exists()


# ---------------------------------------------------------------- GPU


@pytest.mark.gpu
def test_find_max_batch_is_within_10_percent_of_the_real_limit_on_synthetic_cifar():
    from gputrain.data import BatchTransform
    from gputrain.workloads import get_workload

    device = torch.device("cuda", torch.cuda.current_device())  # the memory-fraction API needs an index
    w = get_workload("synthetic-cifar", n=2048)
    data = w.make_data()
    x_all, y_all = data.train[0].to(device), data.train[1].to(device)
    transform = BatchTransform(data.mean, data.std)

    def make_batch(b):
        idx = torch.arange(b, device=device) % x_all.shape[0]
        return transform(x_all[idx], train=True), y_all[idx]

    model = w.make_model().to(device)
    total = torch.cuda.get_device_properties(device).total_memory
    budget = 2 * 2**30  # a 2 GiB GPU, so that the search is quick
    torch.cuda.empty_cache()
    # The cap counts every tensor of the process: what earlier tests left alive is not room for the
    # search (the model's parameters are in the estimate's own fixed part).
    held = torch.cuda.memory_allocated(device) - sum(p.numel() * p.element_size() for p in model.parameters())
    probe = StepProbe(model, as_loss_rule(loss_fn=w.loss_fn), precision="fp32")  # the step fit runs, at lr 0
    torch.cuda.set_per_process_memory_fraction(budget / total, device)
    try:
        trial = batch_trial(probe, make_batch)
        found = find_max_batch(trial, start=64, limit=2**20, device=device)
        trial(found)  # it really runs
        over = int(found * 1.1) + 1
        with pytest.raises(torch.OutOfMemoryError):
            trial(over)  # and 10% more does not
    finally:
        probe.close()
        free_after_oom(device)
        torch.cuda.set_per_process_memory_fraction(1.0, device)
    est = estimate_memory(model, make_batch(16), "adamw", "fp32", loss_fn=w.loss_fn)
    predicted = max_batch_from_estimate(est, budget - held)
    assert 0.5 * found <= predicted <= 2 * found, (found, predicted, held)


@pytest.mark.gpu
def test_measured_peak_on_cuda_is_close_to_the_estimate():
    device = torch.device("cuda")
    model = BlockNet(depth=8, width=1024).to(device)
    x, y = torch.randn(4096, 4, device=device), torch.randint(0, 3, (4096,), device=device)
    est = estimate_memory(model, (x[:16], y[:16]), "adamw", batch_size=4096, loss_fn=nn.functional.cross_entropy)
    step = measure_step_memory(model, (x, y), nn.functional.cross_entropy)
    assert step["measured"]
    assert 0.7 * step["peak_bytes"] <= est["total_bytes"] <= 1.3 * step["peak_bytes"]


def test_the_saved_tensor_meter_counts_each_storage_once_and_leaves_backward_unchanged():
    """The meter's docstring example: a Linear layer's forward saves its input (the weight is
    skipped); the same input saved twice counts once; a backward taken under the hooks gives the
    gradients it gives without them (the unpack hook hands back the saved tensor)."""
    from gputrain.diagnostics.saved_tensors import SavedTensorMeter, parameter_storages

    torch.manual_seed(0)
    model, x = nn.Linear(16, 4, bias=False), torch.randn(8, 16)
    reference = torch.autograd.grad((model(x) * model(x)).sum(), model.weight)[0]
    meter = SavedTensorMeter(parameter_storages(model.parameters()))
    with meter.hooks():
        out = model(x) * model(x)  # x saved by both matmuls, each output by the product
        grad = torch.autograd.grad(out.sum(), model.weight)[0]
    assert meter.total_bytes == 8 * 16 * 4 + 2 * 8 * 4 * 4
    assert torch.equal(grad, reference)
