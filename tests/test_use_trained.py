"""Use what it trained: gputrain.evaluate / predict, and `gputrain eval / predict / export RUN_DIR`."""

import importlib.util
import json
import re
import runpy
import textwrap
from pathlib import Path

import pytest
import torch
from torch import nn
from helpers import docs_page, mlp

import gputrain
from gputrain import TrainConfig, fit

ROOT = Path(__file__).resolve().parents[1]


def _data(n=200, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 6, generator=g)
    return x, (x[:, :2].sum(1) > 0).long()


# ---------------------------------------------------------------- the Python API


def test_evaluate_gives_fits_numbers_and_predict_the_outputs_in_order(tmp_path):
    x, y = _data()
    model = mlp(classes=2)
    history = fit(model, (x[:150], y[:150]), loss_fn=nn.CrossEntropyLoss(), eval_data=(x[150:], y[150:]),
                  config=TrainConfig(device="cpu", batch_size=16, epochs=3))
    metrics = gputrain.evaluate(model, (x[150:], y[150:]), loss_fn=nn.CrossEntropyLoss(), batch_size=7)
    assert metrics["eval_loss"] == pytest.approx(history.records[-1]["eval_loss"], rel=1e-5)
    assert metrics["eval_accuracy"] == pytest.approx(history.records[-1]["eval_accuracy"])
    # inputs alone (a tensor), batched: the outputs of the whole tensor, in order, on the CPU
    out = gputrain.predict(model, x[150:], batch_size=7, out=tmp_path / "p.npy")
    with torch.no_grad():
        assert torch.allclose(out, model(x[150:]), atol=1e-6)
    assert out.device.type == "cpu" and out.shape == (50, 2)
    assert (out.argmax(1) == y[150:]).float().mean().item() == pytest.approx(metrics["eval_accuracy"])
    import numpy as np

    assert np.allclose(np.load(tmp_path / "p.npy"), out.numpy())
    # a pair with loss_fn: the targets are ignored; a .pt file round-trips
    pairs = gputrain.predict(model, (x[150:], y[150:]), loss_fn=nn.CrossEntropyLoss(), out=tmp_path / "p.pt")
    assert torch.allclose(pairs, out, atol=1e-6) and torch.equal(torch.load(tmp_path / "p.pt"), pairs)


def test_predict_follows_fits_batch_rule_for_dict_batches_and_nested_outputs():
    class TwoHeads(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Linear(3, 2), nn.Linear(4, 2)

        def forward(self, image, meta):
            return {"logits": self.a(image) + self.b(meta), "extra": (self.a(image), meta.sum(1))}

    torch.manual_seed(0)
    model = TwoHeads()
    batch = {"image": torch.randn(10, 3), "meta": torch.randn(10, 4)}
    out = gputrain.predict(model, batch, batch_size=4)  # model(**batch); its ["logits"]
    with torch.no_grad():
        assert torch.allclose(out, model(**batch)["logits"], atol=1e-6) and out.shape == (10, 2)

    def compute_loss(m, b):
        outputs = m(b["image"], b["meta"])
        return outputs["logits"].sum(), outputs["extra"]

    nested = gputrain.predict(model, batch, compute_loss=compute_loss, batch_size=4)
    assert isinstance(nested, tuple) and nested[0].shape == (10, 2) and torch.allclose(nested[1], batch["meta"].sum(1))


# ---------------------------------------------------------------- the commands, on a digits-cnn run


@pytest.fixture(scope="module")
def digits_run(tmp_path_factory):
    """`gputrain fit digits-cnn --steps 30 --ema 0.9`: a run directory with EMA weights in its checkpoint."""
    from gputrain import cli

    d = tmp_path_factory.mktemp("trained") / "digits"
    rc = cli.main(["fit", "digits-cnn", "--run-dir", str(d), "--steps", "30", "--log-every", "15", "--ema", "0.9",
                   "--device", "cpu", "--precision", "fp32", "--no-tensorboard", "--json", "--progress", "off"])
    assert rc == 0
    import logging

    logger = logging.getLogger("gputrain")
    logger.handlers.clear()
    logger.propagate = True
    return d


def _cli_json(capsys, *args):
    from gputrain import cli

    assert cli.main(list(args)) == 0
    return json.loads(capsys.readouterr().out)


def test_eval_command_reproduces_the_runs_evaluation(digits_run, capsys):
    last = json.loads((digits_run / "history.json").read_text())["records"][-1]
    ema = _cli_json(capsys, "eval", str(digits_run), "--json", "--device", "cpu")
    assert ema["weights"] == "ema" and ema["step"] == 30
    assert ema["metrics"]["eval_loss"] == pytest.approx(last["eval_ema_loss"], rel=1e-5)
    assert ema["metrics"]["eval_accuracy"] == pytest.approx(last["eval_ema_accuracy"])
    raw = _cli_json(capsys, "eval", str(digits_run), "--weights", "raw", "--json", "--device", "cpu")
    assert raw["metrics"]["eval_loss"] == pytest.approx(last["eval_loss"], rel=1e-5)
    assert raw["metrics"]["eval_loss"] != ema["metrics"]["eval_loss"]


def test_predict_command_writes_the_outputs(digits_run, tmp_path, capsys):
    from gputrain import cli
    from gputrain.workloads import get_workload

    out = tmp_path / "preds.pt"
    assert cli.main(["predict", str(digits_run), "--data", "test", "--out", str(out), "--device", "cpu"]) == 0
    assert "predictions (360, 10)" in capsys.readouterr().out
    preds = torch.load(out)
    labels = get_workload("digits-cnn").make_data().test[1]
    accuracy = (preds.argmax(1) == labels).float().mean().item()
    last = json.loads((digits_run / "history.json").read_text())["records"][-1]
    assert accuracy == pytest.approx(last["eval_ema_accuracy"])
    # a file of raw inputs (uint8 images, as the workload stores them) gets the workload's normalization
    raw = tmp_path / "images.pt"
    torch.save(get_workload("digits-cnn").make_data().test[0][:5], raw)
    assert cli.main(["predict", str(digits_run), "--data", str(raw), "--out", str(tmp_path / "five.pt"),
                     "--device", "cpu"]) == 0
    assert torch.allclose(torch.load(tmp_path / "five.pt"), preds[:5], atol=1e-5)


def test_export_safetensors_loads_into_a_fresh_model(digits_run, tmp_path, capsys):
    pytest.importorskip("safetensors", reason="safetensors is not installed (pip install 'gputrain[export]')")
    from safetensors.torch import load_file

    from gputrain.checkpoint.format import load_checkpoint
    from gputrain.workloads import get_workload
    from gputrain.workloads.from_run import checkpoint_path

    info = _cli_json(capsys, "export", str(digits_run), "--format", "safetensors", "--out",
                     str(tmp_path / "m.safetensors"), "--json")
    assert info["weights"] == "ema"
    fresh = get_workload("digits-cnn").make_model()
    state = load_file(tmp_path / "m.safetensors")
    fresh.load_state_dict(state)
    saved = load_checkpoint(checkpoint_path(digits_run))["callbacks"]["EMA"]["weights"]
    assert set(state) == set(saved) and all(torch.equal(state[k], saved[k].cpu()) for k in state)
    raw = _cli_json(capsys, "export", str(digits_run), "--weights", "raw", "--out", str(tmp_path / "r.safetensors"),
                    "--json")
    assert raw["weights"] == "raw"
    raw_state = load_file(tmp_path / "r.safetensors")
    assert not torch.equal(raw_state["net.0.weight"], state["net.0.weight"])


def test_export_onnx_matches_torch_under_onnxruntime(digits_run, tmp_path, capsys):
    pytest.importorskip("onnx", reason="onnx is not installed (pip install 'gputrain[export]')")
    info = _cli_json(capsys, "export", str(digits_run), "--format", "onnx", "--out", str(tmp_path / "m.onnx"), "--json")
    if info["check"] == "onnx.checker":
        pytest.skip("onnxruntime is not installed: the file was checked with onnx.checker only")
    assert info["check"] == "onnxruntime" and info["max_abs_diff"] <= 1e-4
    import onnxruntime as ort

    from gputrain.data import BatchTransform
    from gputrain.workloads import get_workload
    from gputrain.workloads.from_run import load_run

    splits = get_workload("digits-cnn").make_data()
    x = BatchTransform(splits.mean, splits.std).tensor(splits.test[0][:37], train=False)  # another batch size
    session = ort.InferenceSession(str(tmp_path / "m.onnx"), providers=["CPUExecutionProvider"])
    (got,) = session.run(None, {"input": x.numpy()})
    with torch.no_grad():
        expected = load_run(digits_run).model(x)
    assert got.shape == (37, 10) and torch.allclose(torch.from_numpy(got), expected, atol=1e-4)


def test_export_hf_round_trips_through_from_pretrained(tmp_path, monkeypatch, capsys):
    pytest.importorskip("transformers", reason="transformers is not installed (pip install -e .[test])")
    (tmp_path / "tiny_bert.py").write_text(textwrap.dedent('''
        import torch
        from transformers import BertConfig, BertForSequenceClassification
        import gputrain

        def data(n, seed):
            g = torch.Generator().manual_seed(seed)
            labels = torch.randint(0, 2, (n,), generator=g)
            ids = torch.randint(5, 30, (n, 6), generator=g)
            ids[:, 1] = torch.where(labels == 1, 3, 4)
            return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": labels}

        def make():
            config = BertConfig(vocab_size=30, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                                intermediate_size=32, max_position_embeddings=8, num_labels=2)
            return gputrain.Workload(
                name="tiny-bert", description="", loss_fn=None, task=None,
                make_data=lambda: gputrain.workloads.base.DataSplits(train=data(64, 1), test=data(32, 2)),
                make_model=lambda: BertForSequenceClassification(config),
                defaults={"batch_size": 16, "steps": 4, "log_every": 2})
    '''))
    monkeypatch.syspath_prepend(str(tmp_path))
    from gputrain import cli

    d = tmp_path / "run"
    assert cli.main(["fit", "tiny_bert:make", "--run-dir", str(d), "--device", "cpu", "--no-tensorboard", "--json",
                     "--progress", "off"]) == 0
    capsys.readouterr()
    info = _cli_json(capsys, "export", str(d), "--format", "hf", "--out", str(tmp_path / "hf"), "--json")
    assert info["workload"] == "tiny-bert" and (tmp_path / "hf" / "config.json").exists()
    from transformers import BertForSequenceClassification

    from gputrain.workloads.from_run import load_run

    loaded = BertForSequenceClassification.from_pretrained(str(tmp_path / "hf")).eval()
    trained = load_run(d).model
    ids = torch.randint(5, 30, (3, 6), generator=torch.Generator().manual_seed(9))
    with torch.no_grad():
        a = loaded(input_ids=ids, attention_mask=torch.ones_like(ids)).logits
        b = trained(input_ids=ids, attention_mask=torch.ones_like(ids)).logits
    assert torch.equal(a, b)
    assert json.loads((d / "workload.json").read_text())["workload"] == "tiny_bert:make"
    from gputrain.errors import ConfigError
    from gputrain.export import export_hf

    with pytest.raises(ConfigError, match="not one: use --format safetensors"):
        export_hf(nn.Linear(2, 2), tmp_path / "nope")


def test_a_failed_export_says_which_format_and_leaves_nothing_at_its_destination(tmp_path, monkeypatch):
    from gputrain import export

    class HalfSaves(nn.Linear):
        """Looks like a Hugging Face model; its save_pretrained writes one file and then fails."""

        config: dict = {}

        def save_pretrained(self, folder):
            (Path(folder) / "config.json").write_text("{}")
            raise RuntimeError("disk on fire")

    with pytest.raises(export.ExportError, match=r"^--format hf failed: save_pretrained raised RuntimeError: disk on "
                                                 r"fire; nothing was written, and the other formats still work "
                                                 r"\(--format safetensors or --format onnx\)$"):
        export.export_hf(HalfSaves(2, 2), tmp_path / "hf")
    assert not (tmp_path / "hf").exists()
    if importlib.util.find_spec("onnxruntime") is None or importlib.util.find_spec("onnx") is None:
        return
    monkeypatch.setattr(export, "ONNX_TOLERANCE", -1.0)  # no file can pass: the check fails after the export
    with pytest.raises(export.ExportError, match=r"--format onnx failed: onnxruntime's outputs differ .*the other "
                                                 r"formats still work \(--format safetensors\)"):
        export.export_onnx(nn.Linear(3, 2), torch.randn(4, 3), tmp_path / "out" / "m.onnx")
    assert not (tmp_path / "out").exists()


# ---------------------------------------------------------------- a run of several processes (sharded checkpoints)


@pytest.fixture(scope="module")
def twin_runs(tmp_path_factory):
    """The same 2-process (torchrun, gloo) digits-cnn run twice: saved sharded (step-N.dcp folders,
    the default with several processes) and saved as one file (--checkpoint-format file)."""
    import os
    import subprocess
    import sys

    base = tmp_path_factory.mktemp("two-processes")
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR",
                                                           "MASTER_PORT") and not k.startswith("TORCHELASTIC_")}
    env.update(GLOO_SOCKET_IFNAME="lo", OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT / "src"), env.get("PYTHONPATH")])))
    for name, extra in (("dcp", ()), ("file", ("--checkpoint-format", "file"))):
        proc = subprocess.run([sys.executable, "-m", "gputrain", "fit", "digits-cnn", "--nproc", "2", "--batch-size",
                               "32", "--steps", "6", "--checkpoint-every", "3", "--ema", "0.9", "--device", "cpu",
                               "--precision", "fp32", "--run-dir", name, "--no-tensorboard", "--progress", "off",
                               "--quiet", *extra], cwd=base, env=env, capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, proc.stderr[-4000:]
    assert (base / "dcp" / "checkpoints" / "step-000006.dcp" / "MANIFEST.sha256").is_file()
    assert (base / "file" / "checkpoints" / "step-000006.pt").is_file()
    return base


@pytest.mark.processes
@pytest.mark.parametrize("checkpoint", ["best", "last", "step-000003"])
def test_eval_and_predict_of_a_sharded_run_match_its_one_file_twin(twin_runs, checkpoint, tmp_path, capsys):
    from gputrain import cli

    def named(run):  # best, last, or a named checkpoint: step-N.dcp in one, step-N.pt in the other
        if checkpoint in ("best", "last"):
            return checkpoint
        return str(next((twin_runs / run / "checkpoints").glob(checkpoint + ".*[tp]")))

    metrics = {}
    for run in ("dcp", "file"):
        result = _cli_json(capsys, "eval", str(twin_runs / run), "--checkpoint", named(run), "--json", "--device", "cpu")
        assert result["checkpoint"].endswith(".dcp" if run == "dcp" else ".pt") and result["weights"] == "ema"
        metrics[run] = result
        assert cli.main(["predict", str(twin_runs / run), "--checkpoint", named(run), "--data", "test", "--out",
                         str(tmp_path / f"{run}.pt"), "--device", "cpu"]) == 0
        capsys.readouterr()
    assert metrics["dcp"]["step"] == metrics["file"]["step"] == (3 if checkpoint == "step-000003" else 6)
    assert metrics["dcp"]["metrics"] == metrics["file"]["metrics"]
    assert torch.equal(torch.load(tmp_path / "dcp.pt"), torch.load(tmp_path / "file.pt"))


def test_export_of_a_sharded_run_matches_its_one_file_twin(twin_runs, tmp_path, capsys):
    pytest.importorskip("safetensors", reason="safetensors is not installed (pip install 'gputrain[export]')")
    from safetensors.torch import load_file

    from gputrain import cli

    for run in ("dcp", "file"):
        for weights in ("ema", "raw"):
            assert cli.main(["export", str(twin_runs / run), "--weights", weights, "--out",
                             str(tmp_path / f"{run}-{weights}.safetensors")]) == 0
    for weights in ("ema", "raw"):
        a, b = (load_file(tmp_path / f"{run}-{weights}.safetensors") for run in ("dcp", "file"))
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert not torch.equal(*(load_file(tmp_path / f"dcp-{w}.safetensors")["net.0.weight"] for w in ("ema", "raw")))
    if importlib.util.find_spec("onnx") is not None:
        assert cli.main(["export", str(twin_runs / "dcp"), "--format", "onnx", "--out", str(tmp_path / "m.onnx")]) == 0
        assert (tmp_path / "m.onnx").is_file()
    capsys.readouterr()


def test_a_damaged_sharded_checkpoint_is_refused_by_its_manifest(twin_runs, tmp_path, capsys):
    import shutil

    from gputrain import cli

    run = tmp_path / "dcp"
    shutil.copytree(twin_runs / "dcp", run)
    shard = run / "checkpoints" / "step-000006.dcp" / "__1_0.distcp"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    assert cli.main(["eval", str(run), "--checkpoint", str(shard.parent), "--device", "cpu"]) == 2
    assert re.search(r"step-000006.dcp: does not verify \(__1_0.distcp: its content hash does not match",
                     capsys.readouterr().err)
    # best / last pass over it to the step before, and say so
    result = _cli_json(capsys, "eval", str(run), "--json", "--device", "cpu")
    assert result["step"] == 3 and result["checkpoint"].endswith("step-000003.dcp")
    assert cli.main(["eval", str(run), "--device", "cpu"]) == 0
    assert "warning: checkpoint step-000006.dcp: __1_0.distcp: its content hash" in capsys.readouterr().err


# ---------------------------------------------------------------- the docs' examples


@pytest.mark.parametrize("name, page", [("callbacks_and_tracking", "how-to/callbacks-and-trackers.md"),
                                        ("use_the_trained_model", "how-to/use-trained.md")])
def test_the_examples_run_and_are_the_ones_the_docs_show(name, page, tmp_path, monkeypatch, capsys):
    path = ROOT / "docs" / "examples" / f"{name}.py"
    source = path.read_text().strip()
    assert f"```python\n{source}\n```" in docs_page(page), f"docs/{page} does not show {path}"
    monkeypatch.chdir(tmp_path)  # the examples write into runs/ under the working directory
    monkeypatch.setenv("WANDB_MODE", "offline")
    runpy.run_path(str(path), run_name="__main__")
    printed = capsys.readouterr().out
    accuracy = float(re.search(r"eval accuracy ([0-9.]+)", printed).group(1))
    assert accuracy >= 0.9, printed


@pytest.mark.skipif(importlib.util.find_spec("onnx") is None, reason="needs onnx (pip install 'gputrain[export]')")
@pytest.mark.parametrize("example, says", [
    ((torch.zeros(4, 3), torch.ones(4, dtype=torch.long)), "(4, 3) float32, (4,) int64"),
    ({"features": torch.zeros(2, 5)}, "features (2, 5)"),
])
def test_a_model_that_raises_before_the_onnx_export_keeps_its_error_and_names_the_inputs(example, says, tmp_path):
    """The model's own forward failing on the example inputs is the model's error, kept as raised, with
    a note of the inputs it was given; nothing is written."""
    from gputrain.export import export_onnx

    class Fails(nn.Module):
        def forward(self, *args, **kwargs):
            raise ValueError("the model's own bug")

    with pytest.raises(ValueError, match="the model's own bug") as info:
        export_onnx(Fails(), example, tmp_path / "model.onnx")
    assert f"from its workload's data ({says}), before the ONNX export" in "\n".join(info.value.__notes__)
    assert list(tmp_path.iterdir()) == []
