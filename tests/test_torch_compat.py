"""Torch's private corners (gputrain/torch_compat.py), and what every supported torch must run.

- every entry resolves on the installed torch: one test per entry, so that a rename in a torch
  release names the entry that broke (`make test-torch TORCH=X.Y.Z` runs them on another torch);
- no module reaches a private torch name except through torch_compat (a scan of the source);
- each fallback does what its entry says (forced by marking the entry missing);
- the package imports whole, and `gputrain fit` trains each built-in workload for a few steps.
"""

from __future__ import annotations

import ast
import importlib
import json
import math
import pkgutil
from pathlib import Path

import pytest
import torch
from torch import nn

import gputrain
from gputrain.checkpoint.sharded import single_process_quiet
from gputrain import torch_compat

ROOT = Path(gputrain.__file__).parent

# Files another change is switching to torch_compat: their private names are allowed until then
# (each must still have one: a file that no longer needs its place here is named).
PENDING: set[str] = set()


@pytest.fixture
def without(monkeypatch):
    """Mark torch_compat entries as missing on this torch (as a torch without them would resolve)."""

    def mark(*paths: str) -> None:
        for path in paths:
            assert path in torch_compat.ENTRIES, path
            monkeypatch.setitem(torch_compat._resolved, path, None)

    return mark


# ---------------------------------------------------------------- every entry resolves


@pytest.mark.parametrize("path", list(torch_compat.ENTRIES))
def test_the_private_name_resolves_on_this_torch(path):
    entry = torch_compat.ENTRIES[path]
    try:
        found = entry.locate()
    except Exception as exc:  # noqa: BLE001 - the message names what broke and what gputrain does now
        pytest.fail(f"torch {torch.__version__} has no {path} ({type(exc).__name__}: {exc}); torch "
                    f"{entry.versions} had it. {entry.users} now falls back: {entry.fallback}. Point the entry "
                    "at the new name, or make the fallback the rule", pytrace=False)
    assert found is not None and torch_compat.resolve(path) is not None


def test_every_entry_says_where_it_is_used_and_what_happens_without_it():
    for path, entry in torch_compat.ENTRIES.items():
        assert entry.users and entry.versions and entry.fallback, path
        for user in entry.users.replace(" (to switch)", "").split(", "):
            assert (ROOT / user).is_file(), f"{path}: no module {user}"


# ---------------------------------------------------------------- nothing else reaches them


def _private(segment: str) -> bool:
    return segment.startswith("_") and not segment.startswith("__")


def _instance_names() -> set[str]:
    """Private attributes torch sets on instances or modules, as the entries spell them."""
    names = set()
    for path in torch_compat.ENTRIES:
        last = path.rsplit(".", 1)[-1]
        names.update(n for n in last.split("/") if _private(n))
    return names


def private_torch_uses(source: str) -> list[tuple[int, str]]:
    """(line, name) of each private torch name the source reaches: an import of a private torch module
    or name, an attribute chain from a torch module with a private part, or a private attribute
    torch keeps on its objects (read as `x._name` or named in a string for getattr)."""
    tree = ast.parse(source)
    torch_aliases = {}  # local name -> torch module it stands for
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name.split(".")[0] == "torch":
                    torch_aliases[a.asname or a.name.split(".")[0]] = a.name if a.asname else "torch"
                    if any(_private(s) for s in a.name.split(".")):
                        found.append((node.lineno, a.name))
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "torch":
            for a in node.names:
                torch_aliases[a.asname or a.name] = f"{node.module}.{a.name}"
                if any(_private(s) for s in [*node.module.split("."), a.name]):
                    found.append((node.lineno, f"{node.module}.{a.name}"))
    instance = _instance_names()
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute):
            chain, base = [node.attr], node.value
            while isinstance(base, ast.Attribute):
                chain.append(base.attr)
                base = base.value
            if isinstance(base, ast.Name) and base.id in torch_aliases and any(_private(s) for s in chain):
                found.append((node.lineno, ".".join([torch_aliases[base.id], *reversed(chain)])))
            elif node.attr in instance:
                found.append((node.lineno, f"._{node.attr.lstrip('_')}"))
        elif isinstance(node, ast.Constant) and node.value in instance:
            found.append((node.lineno, repr(node.value)))
    return sorted(set(found))


def test_the_scan_finds_each_kind_of_private_use():
    source = "\n".join([
        "import torch", "import torch.autograd.profiler as prof", "from torch import nn",
        "from torch.utils import _pytree", "from torch._dynamo.utils import counters",
        "a = torch._foreach_norm", "b = prof._is_profiler_enabled", "c = nn.modules.batchnorm._BatchNorm",
        "d = sched._last_lr", "e = getattr(m, '_forward_hooks')", "f = torch.nn.Linear",
    ])
    lines = {line for line, _ in private_torch_uses(source)}
    assert lines == {4, 5, 6, 7, 8, 9, 10}


def test_no_module_reaches_a_private_torch_name_but_torch_compat():
    offenders, pending_seen = [], set()
    for path in sorted(ROOT.rglob("*.py")):
        rel = path.relative_to(ROOT).as_posix()
        if rel == "torch_compat.py":
            continue
        uses = private_torch_uses(path.read_text())
        if rel in PENDING:
            pending_seen.add(rel) if uses else None
            continue
        offenders += [f"{rel}:{line}: {name}" for line, name in uses]
    assert not offenders, "private torch names outside torch_compat.py (add an entry there and " \
                          "use it):\n" + "\n".join(offenders)
    assert pending_seen == PENDING, f"no private torch name left in {sorted(PENDING - pending_seen)}: " \
                                    "remove it from PENDING"


# ---------------------------------------------------------------- the fallbacks


def _lists(seed: int, n: int = 3) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(4, 3, generator=g) for _ in range(n)]


def test_the_loop_fallbacks_compute_what_the_foreach_ops_do():
    tc = torch_compat
    in_place = [(tc.foreach_lerp_, tc._loop_lerp_, (_lists(1), 0.3)), (tc.foreach_mul_, tc._loop_mul_, (0.5,)),
                (tc.foreach_add_, tc._loop_add_, (_lists(1),)), (tc.foreach_copy_, tc._loop_copy_, (_lists(1),))]
    for op, loop, args in in_place:
        by_op, by_loop = _lists(0), _lists(0)
        op(by_op, *args)
        loop(by_loop, *args)
        torch.testing.assert_close(by_op, by_loop)
        assert not torch.equal(by_op[0], _lists(0)[0])  # the op did change them
    torch.testing.assert_close(tc.foreach_sub(_lists(0), _lists(1)), tc._loop_sub(_lists(0), _lists(1)))
    torch.testing.assert_close(tc.foreach_norm(_lists(0)), tc._loop_norm(_lists(0)))
    for poison in (None, float("inf"), float("nan")):
        a, a2 = _lists(0), _lists(0)
        if poison is not None:
            a[1][2, 0] = a2[1][2, 0] = poison
        flags = [torch.zeros(1), torch.zeros(1)]
        tc.non_finite_check_and_unscale_(a, flags[0], torch.full((1,), 0.5))
        tc._loop_non_finite_check_and_unscale_(a2, flags[1], torch.full((1,), 0.5))
        assert flags[0].item() == flags[1].item() == (0.0 if poison is None else 1.0)
        torch.testing.assert_close(a, a2, equal_nan=True)


def test_a_dcp_checkpoint_reads_whole_by_either_route(tmp_path, without):
    import torch.distributed.checkpoint as dcp

    state = {"model": {"w": torch.arange(6.0).reshape(2, 3)},
             "optimizer": {"state": {"w": {"step": torch.tensor(3.0)}}}}
    with single_process_quiet(True):
        dcp.save(state, storage_writer=dcp.FileSystemWriter(str(tmp_path / "ck")), no_dist=True)
        private = torch_compat.read_whole_dcp(tmp_path / "ck")
        without("torch.distributed.checkpoint.state_dict_loader._load_state_dict")
        public = torch_compat.read_whole_dcp(tmp_path / "ck")
    for got in (private, public):
        torch.testing.assert_close(got["model"]["w"], state["model"]["w"])
        assert got["optimizer"]["state"]["w"]["step"].item() == 3.0


def test_the_profiler_flag_is_read_live_and_taken_as_on_without_it(without):
    assert torch_compat.profiler_enabled() is False
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]):
        assert torch_compat.profiler_enabled() is True
    assert torch_compat.profiler_enabled() is False
    without("torch.autograd.profiler._is_profiler_enabled")
    assert torch_compat._profiler_flag()() is True


def test_without_the_hook_dicts_every_step_goes_through_torchs_wrapper(monkeypatch):
    from gputrain.train.optim import calls as optimizer_calls

    opt = torch.optim.AdamW([nn.Parameter(torch.ones(2))], lr=0.1)
    assert optimizer_calls._unwrapped_step(opt) is not None  # the shortcut on this torch
    monkeypatch.setattr(optimizer_calls, "_OWN_HOOKS", None)
    assert optimizer_calls._unwrapped_step(opt) is None
    monkeypatch.undo()
    monkeypatch.setattr(optimizer_calls, "_GLOBAL_HOOKS", None)
    assert optimizer_calls._unwrapped_step(opt) is None


def test_a_scaled_learning_rate_is_what_get_last_lr_reports(without):
    from gputrain.train.loop.callbacks import scale_schedule

    opt = torch.optim.SGD([nn.Parameter(torch.ones(1))], lr=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda _: 1.0)
    scale_schedule(sched, opt, 0.5)
    assert sched.get_last_lr() == pytest.approx([0.05])
    without("torch.optim.lr_scheduler.LRScheduler()._last_lr")
    scale_schedule(sched, opt, 0.5)  # the fallback: the scheduler's own report is left as it was
    assert sched.get_last_lr() == pytest.approx([0.05]) and opt.param_groups[0]["lr"] == pytest.approx(0.025)


def test_nvml_index_follows_cuda_visible_devices_or_falls_back_to_the_cuda_index(monkeypatch, without):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3,1")
    assert torch_compat.nvml_device_index(torch.device("cuda", 0)) == 3
    without("torch.cuda._get_nvml_device_index")
    assert torch_compat.nvml_device_index(torch.device("cuda", 0)) == 0


def test_module_hooks_are_seen_and_taken_as_present_without_the_dicts(without):
    m = nn.Linear(2, 2)
    assert not torch_compat.module_has_hooks(m) and not torch_compat.global_module_hooks()
    handle = m.register_forward_pre_hook(lambda *a: None)
    assert torch_compat.module_has_hooks(m)
    handle.remove()
    handle = nn.modules.module.register_module_forward_hook(lambda *a: None)
    try:
        assert torch_compat.global_module_hooks()
    finally:
        handle.remove()
    without("torch.nn.Module()._forward_hooks/_forward_pre_hooks/_backward_hooks/_backward_pre_hooks",
            "torch.nn.modules.module._global_forward_hooks")
    assert torch_compat.module_has_hooks(m) and torch_compat.global_module_hooks()


def test_the_batchnorm_fallback_lists_every_batchnorm_layer_of_torch_nn(without):
    base = torch_compat.resolve("torch.nn.modules.batchnorm._BatchNorm")
    every = {c for c in vars(nn).values() if isinstance(c, type) and issubclass(c, base)}
    without("torch.nn.modules.batchnorm._BatchNorm")
    assert every and every <= set(torch_compat._batchnorm_types())


def test_a_recompiled_module_is_named_and_counted_without_dynamos_deque(without):
    from helpers import mlp

    from gputrain.runtime.recompiles import RecompileWatcher

    for missing in (False, True):
        if missing:
            without("torch._dynamo.utils._compilation_metrics")
        torch._dynamo.reset()
        compiled = torch.compile(mlp(4, 2, hidden=8), dynamic=False, backend="eager")
        with RecompileWatcher() as watcher:
            compiled(torch.randn(8, 4))
            compiled(torch.randn(3, 4))  # dim 0 changes: one recompilation
            compiled(torch.randn(3, 4))
        report = watcher.report()
        assert (report["compilations"], report["recompilations"]) == (2, 1), missing
        assert report["events"][0]["function"] == "a compiled module's forward"


def test_a_user_dataloaders_plain_shuffle_is_told_from_a_custom_sampler():
    from torch.utils.data import DataLoader, RandomSampler, TensorDataset

    from gputrain.data.user_loader import _plain_shuffle

    ds = TensorDataset(torch.arange(10.0))
    assert _plain_shuffle(DataLoader(ds, batch_size=2, shuffle=True)) is True
    assert _plain_shuffle(DataLoader(ds, batch_size=2, shuffle=False)) is False
    assert _plain_shuffle(DataLoader(ds, batch_size=2, sampler=RandomSampler(ds, num_samples=4))) is None


# ---------------------------------------------------------------- the package on this torch


def test_every_module_of_the_package_imports():
    failed = []
    for info in pkgutil.walk_packages([str(ROOT)], prefix="gputrain."):
        if info.name == "gputrain.__main__":
            continue
        try:
            importlib.import_module(info.name)
        except Exception as exc:  # noqa: BLE001 - collect them all
            failed.append(f"{info.name}: {type(exc).__name__}: {exc}")
    assert not failed, "\n".join(failed)


def _data_options(name: str, tmp_path: Path) -> list[str]:
    """What a workload needs to train a few steps offline: its files, or a small generated set."""
    from test_workloads import write_cifar, write_mnist

    if name in ("cifar10-cnn", "resnet18-cifar"):
        return ["--data-dir", str(write_cifar(tmp_path / "cifar-10-batches-py", n=8, n_test=8))]
    if name == "mnist-cnn":
        write_mnist(tmp_path / "mnist", n=32, n_test=16)
        return ["--data-dir", str(tmp_path / "mnist")]
    if name == "synthetic-cifar":
        return ["--option", "n=64", "--option", "n_test=32"]
    if name == "gpt-mini":
        return [f"--option={kv}" for kv in ("n_tokens=4096", "n_layer=1", "n_embd=32", "n_head=2", "block_size=16")]
    return []


def _built_in() -> list[str]:
    from gputrain.workloads.registry import WORKLOADS

    return sorted(WORKLOADS)


@pytest.mark.parametrize("name", _built_in())
def test_fit_trains_each_built_in_workload_a_few_steps(name, tmp_path, cache_dir, capsys):
    from gputrain.cli import main

    code = main(["fit", name, "--device", "cpu", "--steps", "3", "--batch-size", "8", "--log-every", "1",
                 "--eval-every", "3", "--run-dir", str(tmp_path / "run"), "--no-tensorboard", "--progress", "off",
                 "--json", *_data_options(name, tmp_path)])
    out = capsys.readouterr().out
    assert code == 0, out
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2, 3]
    assert all(math.isfinite(r["loss"]) for r in records) and math.isfinite(records[-1]["eval_loss"])


def test_looking_names_up_draws_no_random_numbers(monkeypatch):
    """Some finders build a small module to look at (its weights drawn at random): the first lookup in a
    process, which a seeded run's setup makes, must leave the random stream as it was, or the first
    run in a process trains differently from the next."""
    monkeypatch.setattr(torch_compat, "_resolved", {})
    torch.manual_seed(0)
    before = torch.get_rng_state()
    for path in torch_compat.ENTRIES:
        torch_compat.resolve(path)
    assert torch.equal(torch.get_rng_state(), before)
