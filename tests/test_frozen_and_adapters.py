"""Fine-tuning with frozen parts: the optimizer holds only what trains, weight decay spares biases and
normalization weights, checkpoints of a frozen base hold the trainable weights and a fingerprint of
the base (and resume exactly, on that base only), PEFT's LoRA trains and exports as PEFT does, and
`memory` and the summary count trainable and frozen parameters (checkpoint/frozen.py, train/optim/build.py)."""

from __future__ import annotations

import importlib.util
import json
import logging
import re
import runpy
import textwrap
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import gputrain
from gputrain import TrainConfig, fit
from gputrain.errors import CheckpointError, ConfigError
from gputrain.checkpoint.format import load_checkpoint
from gputrain.checkpoint.frozen import CHUNK, FrozenBase, tensor_digests

from helpers import DIST_SCRIPTS, data, docs_page, mlp, params, torchrun

ROOT = Path(__file__).resolve().parents[1]


class NormNet(nn.Module):
    """A frozen first layer, a LayerNorm and a head; `unused` and the head's weight get a zero gradient
    (they enter the loss times 0), so only weight decay can move them."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.first, self.norm, self.head = nn.Linear(6, 16), nn.LayerNorm(16), nn.Linear(16, 3)
        self.unused = nn.Linear(3, 3)
        self.first.requires_grad_(False)

    def forward(self, x):
        return self.head(self.norm(self.first(x)).relu())


def _zero_grad_terms(model, batch):
    x, y = batch
    dead = sum(p.sum() for p in model.unused.parameters())
    return F.cross_entropy(model(x), y) + 0.0 * dead


def _cfg(**kw):
    return TrainConfig(**{"device": "cpu", "batch_size": 16, "steps": 6, "log_every": 3, "loggers": ("csv",),
                          **kw})


# ---------------------------------------------------------------- the optimizer


def test_the_optimizer_holds_only_trainable_parameters_and_decays_no_bias_or_norm_weight():
    model = NormNet()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    history = fit(model, data(), compute_loss=_zero_grad_terms, config=_cfg(weight_decay=0.5, lr=0.1))
    after = dict(model.named_parameters())
    # frozen: bit-equal; a zero-gradient weight decays, a zero-gradient bias does not
    assert torch.equal(after["first.weight"], before["first.weight"])
    assert torch.equal(after["first.bias"], before["first.bias"])
    assert torch.allclose(after["unused.weight"], before["unused.weight"] * (1 - 0.1 * 0.5) ** 6)
    assert torch.equal(after["unused.bias"], before["unused.bias"])
    desc = history.summary["optimizer"]
    assert "weight decay 0.5 on 2 weight tensors, none on 4 biases and normalization weights" in desc, desc
    assert "the 6 trainable of 8 parameter tensors" in desc, desc


def test_weight_decay_groups_false_decays_every_trainable_parameter():
    model = NormNet()
    before = model.unused.bias.detach().clone()
    history = fit(model, data(), compute_loss=_zero_grad_terms,
                  config=_cfg(weight_decay=0.5, lr=0.1, weight_decay_groups=False))
    assert torch.allclose(model.unused.bias, before * (1 - 0.1 * 0.5) ** 6)
    assert "weight decay 0.5 on all 6 tensors (weight_decay_groups=False)" in history.summary["optimizer"]


def test_optimizer_groups_of_the_default_adamw():
    from gputrain.train.optim.build import make_optimizer

    model = NormNet()
    kw = {"lr": 0.01, "device": torch.device("cpu")}
    opt, _ = make_optimizer(None, model.parameters(), weight_decay=0.1, **kw)
    trainable = [p for p in model.parameters() if p.requires_grad]
    assert [[id(p) for p in g["params"]] for g in opt.param_groups] == \
        [[id(p) for p in trainable if p.dim() >= 2], [id(p) for p in trainable if p.dim() < 2]]
    assert [g["weight_decay"] for g in opt.param_groups] == [0.1, 0.0] and opt.defaults["fused"]
    # without weight decay: one group, the layout of earlier checkpoints
    opt, _ = make_optimizer(None, model.parameters(), weight_decay=0.0, **kw)
    assert len(opt.param_groups) == 1 and [id(p) for p in opt.param_groups[0]["params"]] == [id(p) for p in trainable]
    # a factory gets only the trainable parameters
    got = []
    make_optimizer(lambda ps: got.extend(ps) or torch.optim.SGD(ps, lr=0.1), model.parameters(), weight_decay=0, **kw)
    assert [id(p) for p in got] == [id(p) for p in trainable]


def test_an_optimizer_that_owns_no_trainable_parameter_is_one_line():
    model = NormNet()
    frozen_only = torch.optim.SGD(model.first.parameters(), lr=0.1)
    with pytest.raises(ConfigError, match=r"^the optimizer owns no trainable parameter: its 2 parameter tensors all "
                                          r"have requires_grad=False"):
        fit(model, data(), compute_loss=_zero_grad_terms, optimizer=frozen_only, config=_cfg())
    other = torch.optim.SGD(NormNet().parameters(), lr=0.1)
    with pytest.raises(ConfigError, match="owns none of the model's trainable parameters: it was built over another"):
        fit(model, data(), compute_loss=_zero_grad_terms, optimizer=other, config=_cfg())
    everything_frozen = mlp().requires_grad_(False)
    with pytest.raises(ConfigError, match=r"the model has no trainable parameter: all 4 parameter tensors have "
                                          r"requires_grad=False"):
        fit(everything_frozen, data(), loss_fn=nn.CrossEntropyLoss(), config=_cfg())


class ListedHead(nn.Module):
    """A registered body and a head kept in a plain Python list (not registered: no state_dict holds it)."""

    def __init__(self, register_body: bool = True):
        super().__init__()
        torch.manual_seed(0)
        body = nn.Linear(6, 16)
        if register_body:
            self.body = body
        else:
            self.listed_body = [body]
        self.heads = [nn.Linear(16, 3)]

    def forward(self, x):
        body = self.body if hasattr(self, "body") else self.listed_body[0]
        return self.heads[0](body(x).relu())


def test_an_optimizer_over_tensors_the_model_does_not_register_is_refused_before_anything_is_written(tmp_path):
    """They would train but never be checkpointed (a resume would start them again from their initial
    values): refused in one line with their count, shapes and nn.ModuleList, the run directory not made."""
    run_dir = tmp_path / "run"
    some_listed = ListedHead()
    given = torch.optim.SGD([*some_listed.parameters(), *some_listed.heads[0].parameters()], lr=0.1)
    with pytest.raises(ConfigError, match=r"^the optimizer updates 2 parameter tensors that the model does not "
                                          r"register, of shapes \[3, 16\], \[3\]: they would train but never be saved, "
                                          r"and a resumed run would start them again from their initial values\. "
                                          r"Register them on the model: .*nn\.ModuleList") as refused:
        fit(some_listed, data(), loss_fn=nn.CrossEntropyLoss(), optimizer=given, config=_cfg(run_dir=str(run_dir)))
    assert "\n" not in str(refused.value) and not run_dir.exists()
    all_listed = ListedHead(register_body=False)  # the model registers no parameter at all
    listed = [p for m in (*all_listed.listed_body, *all_listed.heads) for p in m.parameters()]
    with pytest.raises(ConfigError, match=r"^the optimizer updates 4 parameter tensors that the model does not "
                                          r"register \(it registers none\), of shapes \[16, 6\], \[16\], \[3, 16\], "
                                          r"\[3\]"):
        fit(all_listed, data(), loss_fn=nn.CrossEntropyLoss(), optimizer=torch.optim.SGD(listed, lr=0.1),
            config=_cfg(run_dir=str(run_dir)))
    factory_adds = ListedHead()  # a factory that adds the listed head to what it is given
    with pytest.raises(ConfigError, match=r"^the optimizer the factory built updates 2 parameter tensors that the "
                                          r"model does not register, of shapes \[3, 16\], \[3\]"):
        fit(factory_adds, data(), loss_fn=nn.CrossEntropyLoss(), config=_cfg(run_dir=str(run_dir)),
            optimizer=lambda ps: torch.optim.SGD([*ps, *factory_adds.heads[0].parameters()], lr=0.1))
    with pytest.raises(ConfigError, match=r"^the model registers no parameter \(model\.parameters\(\) is empty\), so "
                                          r"nothing would train: layers kept in a Python list or dict are not "
                                          r"registered: hold them in nn\.ModuleList"):
        fit(all_listed, data(), loss_fn=nn.CrossEntropyLoss(), config=_cfg(run_dir=str(run_dir)))
    assert not run_dir.exists()
    registered = nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.ModuleList([nn.Linear(16, 3)])[0])
    fit(registered, data(), loss_fn=nn.CrossEntropyLoss(), optimizer=torch.optim.SGD(registered.parameters(), lr=0.1),
        config=_cfg())  # the same layers registered: trains


def test_decay_groups_keep_the_graph_path_exact(capture_graphs):
    """Two parameter groups, a frozen layer and a tensor lr: the step replayed from its (stand-in) CUDA
    graph ends bit-equal to the eager one, and reads nothing on the host in the steady state."""
    from graph_capture import CaptureGraphs, EagerGraphs

    from gputrain.diagnostics.syncs import watch_host_reads
    from gputrain.train.loop.trainer import Trainer

    config = _cfg(weight_decay=0.1, steps=24, log_every=8, schedule="cosine", warmup_steps=4, cuda_graphs="auto")
    trainer = Trainer(NormNet(), data(), compute_loss=_zero_grad_terms,
                      config=config.replace(steps=100, log_every=100))
    try:
        trainer.run_steps(6)
        with watch_host_reads() as reads:
            for _ in range(4):
                trainer.train_one_step()
        assert reads.total == 0 and len(trainer.parts.optim.optimizer.param_groups) == 2
    finally:
        trainer.close()
    CaptureGraphs.instances.clear()
    graphed_model = NormNet()
    graphed = fit(graphed_model, data(), compute_loss=_zero_grad_terms, config=config)
    assert graphed.summary["cuda_graphs"] == "on"
    assert sum(g.replays for b in CaptureGraphs.instances for g in b.graphs) >= 3
    capture_graphs(EagerGraphs)
    eager_model = NormNet()
    eager = fit(eager_model, data(), compute_loss=_zero_grad_terms, config=config)
    assert torch.equal(params(graphed_model), params(eager_model))
    assert [r["loss"] for r in graphed.records] == [r["loss"] for r in eager.records]


# ---------------------------------------------------------------- the fingerprint


def test_the_fingerprint_sees_every_change_and_nothing_else():
    w = torch.randn(3, CHUNK + 5)  # more than one chunk
    base = tensor_digests({"w": w})["w"]
    assert tensor_digests({"w": w.clone()})["w"] == base
    assert tensor_digests({"w": w.t().contiguous().t()})["w"] == base  # another layout, the same values
    one = w.clone()
    one.view(-1)[CHUNK + 2] = torch.nextafter(one.view(-1)[CHUNK + 2], torch.tensor(9.0))  # one ulp
    swapped = w.clone().view(-1)
    swapped[[3, 70]] = swapped[[70, 3]]  # the same values, two places exchanged
    far = w.clone().view(-1)
    far[[0, CHUNK]] = far[[CHUNK, 0]]  # across chunks
    for other in (one, swapped.view(3, -1), far.view(3, -1), w.double(), w.reshape(-1)):
        assert tensor_digests({"w": other})["w"] != base
    assert len(tensor_digests({"b": torch.ones(2, dtype=torch.bool), "d": torch.tensor(2.0, dtype=torch.float64),
                               "e": torch.zeros(0)})) == 3


# ---------------------------------------------------------------- LoRA through PEFT

needs_peft = pytest.mark.skipif(importlib.util.find_spec("peft") is None or importlib.util.find_spec("transformers")
                                is None, reason="PEFT is not installed (pip install 'gputrain[adapters]')")


def _base(seed=0):
    import transformers

    torch.manual_seed(seed)
    config = transformers.GPT2Config(vocab_size=32, n_positions=8, n_embd=32, n_layer=2, n_head=2,
                                     bos_token_id=0, eos_token_id=0)
    return transformers.GPT2LMHeadModel(config)


def _lora(seed=0):
    import peft

    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["c_attn"], fan_in_fan_out=True, lora_dropout=0.1)
    return peft.get_peft_model(_base(seed), config)


def _tokens(n=256, seed=1):
    start = torch.randint(0, 32, (n, 1), generator=torch.Generator().manual_seed(seed))
    ids = (start + torch.arange(8)) % 32
    return {"input_ids": ids, "labels": ids}


def _lora_cfg(run_dir, **kw):
    return _cfg(steps=8, log_every=4, batch_size=32, lr=1e-2, weight_decay=0.01, run_dir=str(run_dir), **kw)


def _checkpoint(run_dir) -> Path:
    return max(Path(run_dir, "checkpoints").glob("step-*.pt"))


@needs_peft
def test_a_lora_checkpoint_holds_the_adapter_and_resumes_exactly_on_its_base(tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="gputrain")
    whole = _lora()
    base_before = {k: v.clone() for k, v in whole.state_dict().items() if "lora_" not in k}
    straight = fit(whole, _tokens(), eval_data=_tokens(64, 2), config=_lora_cfg(tmp_path / "a"))
    assert all(torch.equal(whole.state_dict()[k], v) for k, v in base_before.items())  # the base stays bit-equal
    # stopped at step 4, resumed on a model built the same way: the same weights and losses as straight through
    first = _lora()
    fit(first, _tokens(), eval_data=_tokens(64, 2), config=_lora_cfg(tmp_path / "b", stop_at_step=4))
    state = load_checkpoint(_checkpoint(tmp_path / "b"))
    trainable = {k for k, p in first.state_dict(keep_vars=True).items() if p.requires_grad}
    assert set(state["model"]) == trainable and len(trainable) == 4  # lora_A, lora_B of two layers
    assert state["frozen"]["parameters"] == straight.summary["frozen_parameters"] > 0
    assert len(state["frozen"]["tensors"]) == len(first.state_dict()) - 4  # tied lm_head and wte: both names
    resumed_model = _lora()
    resumed = fit(resumed_model, _tokens(), eval_data=_tokens(64, 2), config=_lora_cfg(tmp_path / "b", resume=True))
    assert torch.equal(params(resumed_model), params(whole))
    assert [r["loss"] for r in resumed.records] == [r["loss"] for r in straight.records]
    assert resumed.summary["final_eval_loss"] == straight.summary["final_eval_loss"]
    # the summary, its table and the log say what trains and what the checkpoints hold
    s = straight.summary
    assert s["trainable_parameters"] == sum(p.numel() for p in whole.parameters() if p.requires_grad) == 1024
    assert s["checkpoint_contents"].startswith("trainable only: 1,024 of ")
    from gputrain.report.summary import summary_rows

    rows = dict(summary_rows(s))
    assert re.fullmatch(r"1,024 trainable of [\d,]+ \(\d\.\d\d%\); [\d,]+ frozen", rows["parameters"])
    assert rows["checkpoint contents"] == s["checkpoint_contents"]
    assert any(r.getMessage().startswith("checkpoints: trainable only") for r in caplog.records)
    html = (tmp_path / "a" / "report.html").read_text()
    assert "Parameters: <b>1,024 trainable of" in html
    # full checkpoints when asked: every weight, no fingerprint, and the sizes
    full = _lora()
    fit(full, _tokens(), eval_data=_tokens(64, 2), config=_lora_cfg(tmp_path / "c", full_checkpoints=True))
    full_state = load_checkpoint(_checkpoint(tmp_path / "c"))
    assert set(full_state["model"]) == set(full.state_dict()) and "frozen" not in full_state
    small, big = _checkpoint(tmp_path / "a").stat().st_size, _checkpoint(tmp_path / "c").stat().st_size
    print(f"tiny GPT-2 + LoRA checkpoint: {small} B trainable only, {big} B full")
    assert small < big


@needs_peft
def test_a_resume_on_another_base_is_refused_with_the_reason(tmp_path):
    fit(_lora(), _tokens(), config=_lora_cfg(tmp_path, stop_at_step=4))
    with pytest.raises(CheckpointError, match=r"the checkpoint was trained on another frozen base: \d+ of \d+ "
                                              r"frozen tensors differ from this run's model \(base_model\.model\."
                                              r"transformer\.wte\.weight, .* and \d+ more\); it holds only the "
                                              r"trainable parameters, so it fits only the base weights it was "
                                              r"trained on: load those, or start a new run"):
        fit(_lora(seed=1), _tokens(), config=_lora_cfg(tmp_path, resume=True))
    one_changed = _lora()
    with torch.no_grad():
        one_changed.base_model.model.transformer.ln_f.bias[0] += 1
    with pytest.raises(CheckpointError, match=r"1 of \d+ frozen tensors differ .*\(base_model\.model\.transformer\."
                                              r"ln_f\.bias\)"):
        fit(one_changed, _tokens(), config=_lora_cfg(tmp_path, resume=True))
    unfrozen = _lora()
    unfrozen.base_model.model.transformer.ln_f.requires_grad_(True)
    with pytest.raises(CheckpointError, match=r"2 tensor\(s\) it left out as frozen are not frozen in this run's "
                                              r"model \(base_model\.model\.transformer\.ln_f\.weight, "):
        fit(unfrozen, _tokens(), config=_lora_cfg(tmp_path, resume=True))
    one_more_frozen = _lora()  # the same seed, one more layer frozen: its adapter weights would be the base's
    one_more_frozen.base_model.model.transformer.h[1].attn.c_attn.lora_A.default.requires_grad_(False)
    with pytest.raises(CheckpointError, match=r"another frozen base: 1 tensor\(s\) frozen in this run's model were "
                                              r"not frozen in the run that wrote it \(base_model\.model\.transformer"
                                              r"\.h\.1\.attn\.c_attn\.lora_A\.default\.weight\)"):
        fit(one_more_frozen, _tokens(), config=_lora_cfg(tmp_path, resume=True))
    # the same base resumes
    fit(_lora(), _tokens(), config=_lora_cfg(tmp_path, resume=True))


def test_a_checkpoint_of_one_weight_decay_layout_resumes_only_with_it(tmp_path):
    fit(NormNet(), data(), compute_loss=_zero_grad_terms,
        config=_cfg(weight_decay=0.1, weight_decay_groups=False, stop_at_step=3, run_dir=str(tmp_path)))
    with pytest.raises(CheckpointError, match=r"the checkpoint's optimizer has 1 parameter group\(s\) and this run's "
                                              r"2: .*resume with weight_decay_groups=False"):
        fit(NormNet(), data(), compute_loss=_zero_grad_terms,
            config=_cfg(weight_decay=0.1, run_dir=str(tmp_path), resume=True))
    fit(NormNet(), data(), compute_loss=_zero_grad_terms,
        config=_cfg(weight_decay=0.1, weight_decay_groups=False, run_dir=str(tmp_path), resume=True))


@needs_peft
def test_what_checkpoints_hold_of_a_frozen_base_is_decided_once_with_its_reason():
    model = _lora()
    assert FrozenBase.decide(model, full_checkpoints=False, sharded=False, fsdp=False).trainable_only
    for kw, words in (({"full_checkpoints": True}, "asked for"), ({"sharded": True}, "the sharded format (DCP)"),
                      ({"fsdp": True}, "under FSDP")):
        decided = FrozenBase.decide(model, **{"full_checkpoints": False, "sharded": False, "fsdp": False, **kw})
        assert not decided.trainable_only and words in decided.reason
    assert FrozenBase.decide(mlp(), full_checkpoints=False, sharded=False, fsdp=False).reason == \
        "full: every parameter trains"


# ---------------------------------------------------------------- the CLI: eval, export, memory, bad input

WORKLOAD = """
import torch, peft, transformers
from gputrain import Workload
from gputrain.workloads.base import DataSplits


def make(base_seed="0", seeded="1"):
    def model():
        if seeded == "1":
            torch.manual_seed(int(base_seed))  # a fixed base, as a pretrained one
        base = transformers.GPT2LMHeadModel(transformers.GPT2Config(
            vocab_size=32, n_positions=8, n_embd=32, n_layer=2, n_head=2, bos_token_id=0, eos_token_id=0))
        return peft.get_peft_model(base, peft.LoraConfig(r=4, lora_alpha=8, target_modules=["c_attn"],
                                                         fan_in_fan_out=True))

    def data():
        def tokens(n, seed):
            start = torch.randint(0, 32, (n, 1), generator=torch.Generator().manual_seed(seed))
            ids = (start + torch.arange(8)) % 32
            return {"input_ids": ids, "labels": ids}
        return DataSplits(train=tokens(256, 1), test=tokens(64, 2))

    return Workload("tiny-lora", "LoRA on a tiny GPT-2", data, model, loss_fn=None, task=None,
                    defaults={"batch_size": 32, "steps": 8, "lr": 1e-2, "log_every": 4})
"""


@pytest.fixture
def lora_workload(tmp_path_factory, monkeypatch) -> Path:
    """lora_wl:make importable (a folder on sys.path); returns the folder."""
    folder = tmp_path_factory.mktemp("lora_wl")
    (folder / "lora_wl.py").write_text(textwrap.dedent(WORKLOAD))
    monkeypatch.syspath_prepend(str(folder))
    return folder


@pytest.fixture
def lora_run(lora_workload):
    """A run of lora_wl:make stopped at step 4 of 8 (its checkpoint: trainable only)."""
    from gputrain import cli

    run = lora_workload / "run"
    assert cli.main(["fit", "lora_wl:make", "--device", "cpu", "--run-dir", str(run), "--no-tensorboard",
                     "--stop-at-step", "4"]) == 0
    return run


@needs_peft
def test_eval_and_export_read_a_trainable_only_checkpoint(lora_run, tmp_path, capsys):
    from gputrain import cli

    capsys.readouterr()
    assert "frozen" in load_checkpoint(_checkpoint(lora_run))
    assert cli.main(["eval", str(lora_run), "--json", "--device", "cpu"]) == 0
    evaluated = json.loads(capsys.readouterr().out)
    out = tmp_path / "adapter"
    assert cli.main(["export", str(lora_run), "--format", "hf", "--out", str(out)]) == 0
    assert {"adapter_config.json", "adapter_model.safetensors"} <= {p.name for p in out.iterdir()}
    assert not (out / "model.safetensors").exists()  # the adapter, not the base
    import lora_wl
    import peft

    trained = peft.PeftModel.from_pretrained(_base(), str(out))  # the workload's base
    splits = lora_wl.make().make_data()
    again = gputrain.evaluate(trained, splits.test, batch_size=256)["eval_loss"]
    assert again == pytest.approx(evaluated["metrics"]["eval_loss"], rel=1e-6)
    # another base: the same workload with another seed is refused in one line, naming the workload
    assert cli.main(["eval", str(lora_run), "--device", "cpu", "--workload", "lora_wl:make"]) == 0
    capsys.readouterr()
    code = cli.main(["eval", str(lora_run), "--device", "cpu", "--option", "base_seed=1"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1, err
    assert "another frozen base" in err and "lora_wl:make must build the base the run trained on" in err


@needs_peft
def test_eval_builds_the_base_seeded_as_fit_built_it(lora_workload, capsys):
    """A make_model that does not seed itself draws from the seed fit_workload set (TrainConfig.seed):
    eval rebuilds that base, and with another seed it would not be the same."""
    from gputrain import cli

    run = lora_workload / "unseeded"
    assert cli.main(["fit", "lora_wl:make", "--option", "seeded=0", "--seed", "3", "--device", "cpu", "--run-dir",
                     str(run), "--no-tensorboard", "--steps", "4", "--json"]) == 0
    trained = json.loads(capsys.readouterr().out)["summary"]
    assert cli.main(["eval", str(run), "--json", "--device", "cpu"]) == 0
    assert json.loads(capsys.readouterr().out)["metrics"]["eval_loss"] == pytest.approx(
        trained["final_eval_loss"], rel=1e-6)


@needs_peft
def test_fit_resume_on_another_base_is_one_line_and_changes_nothing(lora_run, capsys):
    from gputrain import cli

    before = {p.name: p.read_bytes() for p in (lora_run / "checkpoints").iterdir()}
    capsys.readouterr()
    code = cli.main(["fit", "lora_wl:make", "--device", "cpu", "--resume", str(lora_run), "--option", "base_seed=1"])
    captured = capsys.readouterr()
    err = captured.err.strip()
    assert code == 2 and len(err.splitlines()) == 1 and "Traceback" not in err, err
    assert re.search(r"step-000004\.pt: the checkpoint was trained on another frozen base: \d+ of \d+ frozen", err)
    assert {p.name: p.read_bytes() for p in (lora_run / "checkpoints").iterdir()} == before
    assert cli.main(["fit", "lora_wl:make", "--device", "cpu", "--resume", str(lora_run), "--no-tensorboard"]) == 0


@needs_peft
def test_memory_counts_trainable_and_frozen_parameters(lora_workload, capsys, monkeypatch):
    from gputrain import cli

    capsys.readouterr()
    assert cli.main(["memory", "lora_wl:make", "--device", "cpu", "--json"]) == 0
    est = json.loads(capsys.readouterr().out)["estimate"]
    assert est["trainable_parameters"] == 1024 and est["frozen_parameters"] == est["parameters"] - 1024 > 0
    assert est["gradient_bytes"] == 1024 * 4 and est["optimizer_state_bytes"] == 2 * 1024 * 4
    assert est["arithmetic"][0].startswith(f"parameters: {est['parameters']:,} (1,024 trainable, ")
    monkeypatch.setenv("COLUMNS", "200")  # the table on one line a row
    assert cli.main(["memory", "lora_wl:make", "--device", "cpu"]) == 0
    assert re.search(r"│ [\d,]+ parameters: 1,024 trainable, [\d,]+ frozen\s+│", capsys.readouterr().out)


# ---------------------------------------------------------------- the docs' example


@needs_peft
def test_the_lora_example_runs_and_is_the_one_the_docs_show(tmp_path, monkeypatch, capsys):
    path = ROOT / "docs" / "examples" / "finetune_lora.py"
    source = path.read_text().strip()
    assert f"```python\n{source}\n```" in docs_page("how-to/frozen-and-lora.md"), \
        f"docs/how-to/frozen-and-lora.md does not show {path}"
    monkeypatch.chdir(tmp_path)
    runpy.run_path(str(path), run_name="__main__")
    printed = capsys.readouterr().out
    before, after = map(float, re.search(r"eval loss ([0-9.]+) -> ([0-9.]+)", printed).groups())
    assert after < before - 0.5, printed
    assert "the adapter reloads onto the base with the same eval loss: True" in printed, printed


# ---------------------------------------------------------------- several processes


@pytest.mark.processes
def test_a_frozen_base_under_two_processes(tmp_path):
    """DDP with one-file checkpoints: trainable-only, resumed bit-equal to the uninterrupted run; the
    sharded format keeps every weight; another base and FSDP are refused, each with its reason."""

    proc = torchrun([str(DIST_SCRIPTS / "frozen_base.py"), str(tmp_path)], timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    r = json.loads((tmp_path / "result.json").read_text())
    assert r["equal"] and r["has_frozen"] and r["keys"] == ["3.bias", "3.weight"], r
    assert r["contents"].startswith("trainable only: 34 of 146 parameters")
    assert r["dcp"] and r["dcp_keys"] == ["0.bias", "0.weight", "3.bias", "3.weight"]
    assert r["dcp_contents"] == "full: the sharded format (DCP) writes each rank's share of every weight"
    assert re.search(r"step-000004\.pt: the checkpoint was trained on another frozen base: 2 of 2 frozen tensors "
                     r"differ from this run's model \(0\.weight, 0\.bias\)", r["another_base"]), r["another_base"]
    assert r["fsdp"].endswith("which a sharded (FSDP) run cannot take: resume it without --shard (DDP or one "
                              "process)"), r["fsdp"]
