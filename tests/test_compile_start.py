"""Time to the first step: regional compilation, compile caches across processes, the startup parts.

One regional inductor run (3 identical blocks) with a run directory is shared by several tests: it
trains as eager does, compiles one block frame for its three blocks, saves its compiled artifacts,
and names its startup parts; a second run loads those artifacts. The other tests build a Trainer
without stepping (torch.compile compiles nothing before the first call) or use the cache's files
directly.
"""

from __future__ import annotations

import json
import logging

import pytest
import torch
from torch import nn
from helpers import sgd

from gputrain import ConfigError, TrainConfig, fit
from gputrain.report.html import render_report
from gputrain.runtime import torch_compat
from gputrain.runtime.compile_cache import CompileCache, cache_folder, key_parts
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


def test_regional_run_trains_as_eager_does(regional):
    eager, _ = _fit(False)
    for (name, a), (_, b) in zip(eager.named_parameters(), regional["model"].named_parameters()):
        torch.testing.assert_close(b, a, rtol=0, atol=1e-5, msg=lambda m: f"{name}: {m}")  # 3 SGD steps


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
    assert isinstance(t.model, torch._dynamo.eval_frame.OptimizedModule)  # compiled whole
    assert t.speed.reasons["compile"].startswith("requested (mode default); whole model: regional compilation "
                                                 "asked, but the largest run "
                                                 "of identical blocks (2 x BasicBlock in layers) holds")
    gpt = GPTMini(65, block_size=8, n_layer=4, n_embd=16, n_head=2)
    t = Trainer(gpt, (torch.randint(0, 65, (8, 8)),), compute_loss=lambda m, b: m(b[0]).mean(),
                config=cfg.replace(compile=True))
    assert isinstance(t.model, torch._dynamo.eval_frame.OptimizedModule)
    reason = t.speed.reasons["compile"]  # compile=True keeps its meaning
    assert reason.startswith("requested (mode default); whole model") and "regional" not in reason
    found = find_repeated_blocks(gpt)
    assert found is not None and (found.container, found.block_class, found.count) == ("blocks", "Block", 4)
    with pytest.raises(ConfigError, match="compile must be True, False or 'regional'"):
        TrainConfig(compile="regions")
    with pytest.raises(ConfigError, match="compile_cache must be a folder"):
        TrainConfig(compile_cache=3)  # type: ignore[arg-type]


def test_the_second_run_loads_the_first_runs_compile_cache(regional, tmp_path, caplog):
    folder = regional["run_dir"] / "compile_cache"
    assert len(list(folder.glob("*.bin"))) == 1 and len(list(folder.glob("*.json"))) == 1
    with caplog.at_level(logging.INFO, logger="gputrain"):
        _, history = _fit("regional", str(tmp_path / "second"), compile_cache=str(folder))
    assert any(r.getMessage().startswith("compile cache: loaded ") for r in caplog.records)
    reason = next(d["reason"] for d in history.summary["decisions"] if d["name"] == "compile")
    assert reason.endswith(f"compile cache loaded ({folder})")


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


def _check_parts(startup: dict, *expected: str) -> None:
    names = [p["name"] for p in startup["parts"]]
    for name in expected:
        assert name in names, f"{name!r} not among {names}"
    assert all(p["s"] >= 0 for p in startup["parts"])
    assert 0 < sum(p["s"] for p in startup["parts"]) <= startup["wall_s"]
    assert startup["import_s"] > 0


def test_the_time_before_the_first_step_is_named_by_part(regional, tmp_path):
    startup = regional["history"].summary["startup"]
    _check_parts(startup, "device and precision", "model moves, wrapping and compile setup", "compile cache load",
                 "data preparation", "optimizer, step and run directory", "announce, outputs and loggers",
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
