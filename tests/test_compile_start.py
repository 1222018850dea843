"""Time to the first step: regional compilation, compile caches across processes, the startup parts.

One regional inductor run (3 identical blocks) with a run directory is shared by several tests: it
trains as eager does, compiles one block frame for its three blocks, saves its compiled artifacts,
and names its startup parts; a second run, with nothing compiled in memory, loads those artifacts
from a named folder that then keeps inductor's kernels. A whole-model run trains as eager does. The
other tests build a Trainer without stepping (torch.compile compiles nothing before the first call),
use the cache's files directly, or parse the command line and a sweep's space (--compile-scope).
`import gputrain` and `gputrain --help`, each in a fresh process, leave the optional extras, the
compiler stack and tomllib unimported.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

import pytest
import torch
from torch import nn
from helpers import sgd

from gputrain import ConfigError, TrainConfig, fit
from gputrain.report.html import render_report
from gputrain import torch_compat
from gputrain.runtime import compile_cache
from gputrain.runtime.compile_cache import CompileCache, cache_folder, key_parts, named_folder
from gputrain.runtime.compile_regions import find_repeated_blocks
from gputrain.train import Trainer
from gputrain.workloads.real_models import GPTMini, ResNet18Cifar


class Block(nn.Module):
    def __init__(self, d: int):
        super().__init__()
        self.ln, self.fc = nn.LayerNorm(d), nn.Linear(d, d)

    def forward(self, x):
        return x + torch.tanh(self.fc(self.ln(x)))


class Stack(nn.Module):
    def __init__(self, n: int = 3):
        super().__init__()
        self.inp, self.out = nn.Linear(8, 16), nn.Linear(16, 2)
        self.blocks = nn.ModuleList(Block(16) for _ in range(n))

    def forward(self, x):
        x = self.inp(x)
        for block in self.blocks:
            x = block(x)
        return self.out(x)


def _data():
    g = torch.Generator().manual_seed(0)
    return torch.randn(64, 8, generator=g), torch.randint(0, 2, (64,), generator=g)


def _fit(compile_, run_dir=None, **kw):
    torch.manual_seed(1)
    model = Stack()
    cfg = TrainConfig(device="cpu", precision="fp32", compile=compile_, steps=3, batch_size=16, log_every=1,
                      loggers=(), run_dir=run_dir, **kw)
    # SGD: the parameters' difference follows the gradients' (AdamW's normalized step can flip a sign
    # on a gradient near zero and move an element by 2 x lr).
    history = fit(model, _data(), loss_fn=nn.functional.cross_entropy, config=cfg,
                  optimizer=sgd())
    return model, history


@pytest.fixture(scope="module")
def regional(tmp_path_factory):
    """The regional run: its model, history, the dynamo graphs and frames it compiled, its run dir."""
    run_dir = tmp_path_factory.mktemp("regional") / "run"
    graphs_before = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    seen = {id(m) for m in torch_compat.compilation_metrics()}
    model, history = _fit("regional", str(run_dir))
    frames = [m for m in torch_compat.compilation_metrics() if id(m) not in seen and m.is_forward is not False]
    return {"model": model, "history": history, "run_dir": run_dir, "frames": frames,
            "graphs": torch._dynamo.utils.counters["stats"]["unique_graphs"] - graphs_before}


@pytest.mark.slow
@pytest.mark.processes
def test_regional_run_trains_as_eager_does(regional):
    """Slow: 93 s on this machine (the serial suite, 2026-11-28, load 5-14), as the first of its file to use
    `regional`: that fixture's cold inductor build (C++ kernels) is counted here."""
    eager, _ = _fit(False)
    for (name, a), (_, b) in zip(eager.named_parameters(), regional["model"].named_parameters()):
        torch.testing.assert_close(b, a, rtol=0, atol=1e-5, msg=lambda m: f"{name}: {m}")  # 3 SGD steps


@pytest.mark.processes
def test_a_whole_model_compiled_run_trains_as_eager_does():
    eager, _ = _fit(False)
    whole, history = _fit(True)  # the OptimizedModule is put in train mode as the model is
    for (name, a), (_, b) in zip(eager.named_parameters(), whole.named_parameters()):
        torch.testing.assert_close(b, a, rtol=0, atol=1e-5, msg=lambda m: f"{name}: {m}")
    reason = next(d["reason"] for d in history.summary["decisions"] if d["name"] == "compile")
    assert reason == "requested (mode default); whole model"


@pytest.mark.processes
def test_regional_compiles_one_block_frame_for_three_blocks(regional):
    assert all(b._compiled_call_impl is not None for b in regional["model"].blocks)  # each block compiled in place
    assert regional["graphs"] == 1  # one graph, shared by the three blocks
    assert [(m.co_name, m.co_firstlineno) for m in regional["frames"]] == \
        [("forward", Block.forward.__code__.co_firstlineno)]  # the block's forward, not the model's
    reason = next(d["reason"] for d in regional["history"].summary["decisions"] if d["name"] == "compile")
    assert reason.startswith("requested (mode default); regional: 3 x Block in blocks compiled once and shared")


def test_whole_and_fallback_decisions():
    resnet = ResNet18Cifar(num_classes=10, width=4)
    found = find_repeated_blocks(resnet)
    assert found is not None and found.count == 2 and found.share < 0.5  # one identical pair of BasicBlocks
    x, y = torch.randn(8, 3, 32, 32), torch.randint(0, 10, (8,))
    cfg = TrainConfig(device="cpu", compile="regional", steps=1, batch_size=4, loggers=())
    t = Trainer(resnet, (x, y), loss_fn=nn.functional.cross_entropy, config=cfg)
    assert isinstance(t.parts.model.model, torch._dynamo.eval_frame.OptimizedModule)  # compiled whole
    assert t.parts.speed.reasons["compile"].startswith("requested (mode default); whole model: regional compilation "
                                                 "asked, but the largest run "
                                                 "of identical blocks (2 x BasicBlock in layers) holds")
    gpt = GPTMini(65, block_size=8, n_layer=4, n_embd=16, n_head=2)
    t = Trainer(gpt, (torch.randint(0, 65, (8, 8)),), compute_loss=lambda m, b: m(b[0]).mean(),
                config=cfg.replace(compile=True))
    assert isinstance(t.parts.model.model, torch._dynamo.eval_frame.OptimizedModule)
    reason = t.parts.speed.reasons["compile"]  # compile=True keeps its meaning
    assert reason.startswith("requested (mode default); whole model") and "regional" not in reason
    found = find_repeated_blocks(gpt)
    assert found is not None and (found.container, found.block_class, found.count) == ("blocks", "Block", 4)
    with pytest.raises(ConfigError, match="compile must be True, False or 'regional'"):
        TrainConfig(compile="regions")
    with pytest.raises(ConfigError, match="compile_cache must be a folder"):
        TrainConfig(compile_cache=3)  # type: ignore[arg-type]


@pytest.fixture
def inductor_env(monkeypatch):
    """TORCHINDUCTOR_CACHE_DIR unset for the test and as it was afterwards (a named compile cache
    folder points it into the folder for the rest of the process)."""
    monkeypatch.setenv(compile_cache.INDUCTOR_ENV, "restored afterwards")
    monkeypatch.delenv(compile_cache.INDUCTOR_ENV)
    monkeypatch.setattr(compile_cache, "_set_here", None)


@pytest.mark.processes
def test_the_second_run_loads_the_first_runs_compile_cache(regional, tmp_path, caplog, inductor_env):
    folder = regional["run_dir"] / "compile_cache"
    assert len(list(folder.glob("*.bin"))) == 1 and len(list(folder.glob("*.json"))) == 1
    # the first run's folder was its RUN_DIR's own: inductor's kernels stayed in inductor's folder
    assert not (folder / compile_cache.INDUCTOR_FOLDER).exists()
    # as a new process would: nothing compiled in memory (dynamo's frames, inductor's loaded modules
    # and built libraries); only the folder can make this start warm
    torch._dynamo.reset()
    torch._inductor.utils.clear_inductor_caches()
    with caplog.at_level(logging.INFO, logger="gputrain"):
        _, history = _fit("regional", str(tmp_path / "second"), compile_cache=str(folder))
    assert any(r.getMessage().startswith("compile cache: loaded ") for r in caplog.records)
    reason = next(d["reason"] for d in history.summary["decisions"] if d["name"] == "compile")
    assert reason.endswith(f"compile cache loaded ({folder}; kernels kept)")
    # a named folder keeps inductor's cache: the C++ kernels this start built from the loaded code
    # (the mega-cache holds their source, not the libraries) are there for the next start
    kept = folder / compile_cache.INDUCTOR_FOLDER
    assert os.environ[compile_cache.INDUCTOR_ENV] == str(kept.resolve())
    assert list(kept.rglob("*.so")) and (kept / "fxgraph").is_dir()


def test_a_named_folder_keeps_inductors_cache_unless_the_environment_names_one(tmp_path, monkeypatch,
                                                                              inductor_env):
    parts = key_parts(Stack(), torch.device("cpu"), "regional default")
    monkeypatch.delenv("GPUTRAIN_COMPILE_CACHE", raising=False)
    assert named_folder(str(tmp_path)) and not named_folder(None) and not named_folder(False)
    monkeypatch.setenv("GPUTRAIN_COMPILE_CACHE", str(tmp_path / "env"))
    assert named_folder(None) and not named_folder(False)
    # the run's own folder: inductor's folder untouched
    CompileCache(tmp_path / "run", parts).load()
    assert compile_cache.INDUCTOR_ENV not in os.environ
    # a named one: inductor's cache in it; a later named one moves it (it was set here, not by the user)
    first = CompileCache(tmp_path / "a", parts, keep_kernels=True)
    first.load()
    assert first.inductor == (tmp_path / "a" / "inductor").resolve() == Path(os.environ[compile_cache.INDUCTOR_ENV])
    CompileCache(tmp_path / "b", parts, keep_kernels=True).load()
    assert os.environ[compile_cache.INDUCTOR_ENV] == str((tmp_path / "b" / "inductor").resolve())
    # inductor's own default, written into the variable by its first use, is not the user's choice
    monkeypatch.setenv(compile_cache.INDUCTOR_ENV, torch_compat.inductor_default_cache_dir() or "")
    monkeypatch.setattr(compile_cache, "_set_here", None)
    CompileCache(tmp_path / "d", parts, keep_kernels=True).load()
    assert os.environ[compile_cache.INDUCTOR_ENV] == str((tmp_path / "d" / "inductor").resolve())
    # the user's TORCHINDUCTOR_CACHE_DIR stands, with a line
    monkeypatch.setenv(compile_cache.INDUCTOR_ENV, str(tmp_path / "mine"))
    ours = CompileCache(tmp_path / "c", parts, keep_kernels=True)
    ours.load()
    assert ours.inductor is None and os.environ[compile_cache.INDUCTOR_ENV] == str(tmp_path / "mine")
    assert ours.describe() == f"empty ({tmp_path / 'c'})"


def test_compile_scope_flag_sets_the_compile_field_in_either_order():
    from gputrain.cli import build_parser
    from gputrain.runs.flags import stated

    parser = build_parser()

    def compile_of(*argv: str):
        return stated(parser.parse_args(["fit", "iris-mlp", *argv])).train.get("compile", "absent")

    assert compile_of() == "absent"
    assert compile_of("--compile") is True  # unchanged
    assert compile_of("--compile-scope", "regional") == "regional"
    assert compile_of("--compile-scope", "whole") is True
    assert compile_of("--compile", "--compile-scope", "regional") == "regional"
    assert compile_of("--compile-scope", "regional", "--compile") == "regional"  # the scope wins in either order
    args = parser.parse_args(["fit", "--compile-scope", "regional", "iris-mlp"])  # the workload is not swallowed
    assert args.workload == "iris-mlp" and args.compile == "regional"


def test_a_sweep_may_search_compile_off_whole_and_regional(tmp_path):
    from gputrain.runs.stated import load_run_config
    from gputrain.sweeps.settings import check_sweep

    def space(line: str):
        (tmp_path / "s.toml").write_text(f'workload = "iris-mlp"\n[sweep]\ntrials = 3\n[sweep.space]\n{line}\n')
        return check_sweep(load_run_config(tmp_path / "s.toml")).space[0]

    assert space('compile = {choices = [false, true, "regional"]}').choices == (False, True, "regional")
    with pytest.raises(ConfigError, match=r"compile: choices mix a string and true/false values"):
        space('compile = {choices = [false, "regions"]}')  # a value the field refuses: the mix is refused


def test_a_cache_made_for_another_torch_or_model_is_ignored_with_a_line(tmp_path, caplog):
    parts = key_parts(Stack(), torch.device("cpu"), "regional default")
    other = CompileCache(tmp_path, dict(parts, torch="1.0.0"))
    (tmp_path / f"{other.key}.bin").write_bytes(b"not artifacts")
    (tmp_path / f"{other.key}.json").write_text(json.dumps(other.parts))
    ours = CompileCache(tmp_path, parts)
    with caplog.at_level(logging.INFO, logger="gputrain"):
        assert ours.load() is False  # never handed to torch (these bytes would fail to load)
    assert ours.ignored == [f"compile cache {other.key}.bin in {tmp_path} ignored: made for another torch "
                            f"'1.0.0' here {torch.__version__!r}"]
    assert ours.ignored[0] in caplog.text
    # a description that does not match the file it names (edited or copied over): not trusted either
    (tmp_path / f"{ours.key}.bin").write_bytes(b"not artifacts")
    (tmp_path / f"{ours.key}.json").write_text(json.dumps(dict(parts, model="Other 0")))
    again = CompileCache(tmp_path, parts)
    assert again.load() is False and "made for another model 'Other 0'" in again.ignored[0]
    assert key_parts(Stack(2), torch.device("cpu"), "regional default")["model"] != parts["model"]


def test_a_cache_that_cannot_be_written_is_a_warning(tmp_path, caplog, monkeypatch):
    monkeypatch.setattr(torch.compiler, "save_cache_artifacts", lambda: (b"artifacts", None))
    blocked = tmp_path / "file"
    blocked.write_text("a file where the folder would go")
    cache = CompileCache(blocked / "cache", key_parts(Stack(), torch.device("cpu"), "whole default"))
    with caplog.at_level(logging.WARNING, logger="gputrain"):
        assert cache.save() is False
    assert "compile cache: could not write to" in caplog.text and not cache.saved


def test_cache_folder_rule(tmp_path, monkeypatch):
    monkeypatch.delenv("GPUTRAIN_COMPILE_CACHE", raising=False)
    assert cache_folder(None, str(tmp_path)) == tmp_path / "compile_cache"
    assert cache_folder(None, None) is None and cache_folder(False, str(tmp_path)) is None
    monkeypatch.setenv("GPUTRAIN_COMPILE_CACHE", str(tmp_path / "env"))
    assert cache_folder(None, str(tmp_path)) == tmp_path / "env"
    assert cache_folder(str(tmp_path / "mine"), str(tmp_path)) == tmp_path / "mine"
    monkeypatch.setenv("GPUTRAIN_COMPILE_CACHE", " ")  # blank: as unset (it names no folder)
    assert cache_folder(None, str(tmp_path)) == tmp_path / "compile_cache" and not named_folder(None)


@pytest.mark.processes
def test_a_named_folder_with_a_space_keeps_the_runs_cache_and_inductors_kernels_stay_out(tmp_path, caplog,
                                                                                         inductor_env):
    """GPUTRAIN_COMPILE_CACHE='my cache' is a legal folder: the run compiles and keeps its artifacts there;
    inductor's C++ build splits its compiler's command line at spaces, so its kernels stay in its own folder."""
    folder = tmp_path / "my cache"
    with caplog.at_level(logging.INFO, logger="gputrain"):
        _, history = _fit(True, compile_cache=str(folder))
    assert history.summary["steps"] == 3
    assert len(list(folder.glob("*.bin"))) == 1 and not (folder / compile_cache.INDUCTOR_FOLDER).exists()
    assert str(folder) not in os.environ.get(compile_cache.INDUCTOR_ENV, "")  # inductor's own (it writes it there)
    assert f"compile cache: inductor's kernels stay in its default folder, not in {folder} (a path with a space, " \
           "which its C++ build cannot take)" in caplog.messages


def _check_parts(startup: dict, *expected: str) -> None:
    names = [p["name"] for p in startup["parts"]]
    for name in expected:
        assert name in names, f"{name!r} not among {names}"
    assert all(p["s"] >= 0 for p in startup["parts"])
    assert 0 < sum(p["s"] for p in startup["parts"]) <= startup["wall_s"]
    assert startup["import_s"] > 0
    from gputrain.import_clock import import_seconds

    # the import's own duration, stopped when gputrain's import ended: not the time since
    assert startup["import_s"] == import_seconds() == import_seconds()


@pytest.mark.processes
def test_the_time_before_the_first_step_is_named_by_part(regional, tmp_path):
    startup = regional["history"].summary["startup"]
    _check_parts(startup, "device and precision", "model moves, wrapping and compile setup", "compile cache load",
                 "data preparation", "optimizer, step and run directory", "callbacks' start, progress and stop signals",
                 "compile (first step: dynamo and inductor)", "first step (besides compiling)")
    compiling = next(p["s"] for p in startup["parts"] if p["name"].startswith("compile (first step"))
    assert compiling > 0  # dynamo's own record of the first step's compile
    page = render_report(regional["history"].records, regional["history"].summary)
    assert "Time to the first step" in page and "compile (first step: dynamo and inductor)" in page
    # an eager run stopped and resumed: the resumed one names its checkpoint load
    _fit(False, str(tmp_path / "eager"), stop_at_step=2)
    _, resumed = _fit(False, str(tmp_path / "eager"), resume=True)
    _check_parts(resumed.summary["startup"], "checkpoint load", "first step (besides compiling)")
    assert not any(p["name"].startswith("compile") for p in resumed.summary["startup"]["parts"])


# What `import gputrain` and `gputrain --help` must not import (issue 45: both within 10% of
# `import torch`): the optional extras, plotting, the terminal renderer, the compiler stack (dynamo
# and inductor come with the first compile), and tomllib (its regular expressions cost ~80 ms).
NOT_AT_IMPORT = ("tomllib", "matplotlib", "rich", "torch.utils.tensorboard", "tensorboard", "ray", "lightning",
                 "accelerate", "datasets", "mlflow", "wandb", "optuna", "torchmetrics", "onnx", "sklearn", "scipy",
                 "pandas", "transformers", "peft", "mnist1d", "torch._dynamo", "torch._inductor")


@pytest.mark.processes
@pytest.mark.parametrize("what", ["import gputrain", "gputrain --help"])
def test_import_and_help_leave_the_optional_and_slow_modules_unimported(what):
    import subprocess
    import sys

    run = ("import contextlib, io\nfrom gputrain.cli import main\n"
           "with contextlib.redirect_stdout(io.StringIO()):\n    try:\n        main(['--help'])\n"
           "    except SystemExit:\n        pass\n") if what == "gputrain --help" else "import gputrain\n"
    # what the interpreter had before the import is not the import's (under `make coverage` every
    # Python starts by measuring itself, and coverage reads its settings with tomllib)
    code = ("import sys\nbefore = set(sys.modules)\n" + run +
            f"print(sorted(m for m in {NOT_AT_IMPORT!r} if m in sys.modules and m not in before))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == "[]", f"{what} imported {out.stdout.strip()}"
