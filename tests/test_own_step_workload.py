"""A step of your own from the command line: a Workload carrying step_fn and named optimizers
(docs/examples/gan_workload.py) trains with `gputrain fit mod:fn`, repeats equal from its
config.toml, takes each optimizer's settings by name ([optimizers.NAME]), and sweeps over them."""

from __future__ import annotations

import json
import tomllib
from pathlib import Path

import pytest
import torch

from helpers import cli as _cli

EXAMPLE = str(Path(__file__).resolve().parents[1] / "docs" / "examples" / "gan_workload.py") + ":make_workload"
QUIET = ("--device", "cpu", "--no-tensorboard", "--progress", "off", "--json")


def _weights(run_dir: Path) -> dict[str, torch.Tensor]:
    from gputrain.workloads.from_run import load_run

    return load_run(run_dir, checkpoint="last").model.state_dict()


def test_a_gan_workload_trains_from_the_command_line_and_repeats_equal_from_its_config(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    code, out, err = _cli(capsys, "fit", EXAMPLE, "--option", "n=256", "--steps", "12", "--run-dir", "a", *QUIET)
    assert code == 0, err
    first = json.loads(out)["summary"]
    assert set(first["step_losses"]) == {"d_loss", "g_loss"}
    assert set(first["learning_rates"]) == {"generator", "discriminator"}
    recorded = tomllib.loads((tmp_path / "a" / "config.toml").read_text())
    # The workload's own settings, recorded although none was given: a repeat does not change with them.
    assert recorded["optimizers"] == {"generator": {"lr": 2e-3, "betas": [0.5, 0.999], "weight_decay": 0.0,
                                                    "eps": 1e-8},
                                      "discriminator": {"lr": 2e-3, "betas": [0.5, 0.999], "weight_decay": 0.0,
                                                        "eps": 1e-8}}

    code, out, err = _cli(capsys, "fit", "--config", "a/config.toml", "--run-dir", "b", "--json")
    assert code == 0, err
    again = json.loads(out)["summary"]
    assert again["final_loss"] == first["final_loss"] and again["step_losses"] == first["step_losses"]
    a, b = _weights(tmp_path / "a"), _weights(tmp_path / "b")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)  # bit-equal on the CPU


def test_each_optimizers_settings_by_name_are_set_and_recorded(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "run.toml").write_text(f'workload = "{EXAMPLE}"\n[options]\nn = 256\n'
                                       '[optimizers.generator]\nlr = 5e-4\nbetas = [0.0, 0.9]\n')
    code, out, err = _cli(capsys, "fit", "--config", "run.toml", "--steps", "6", "--run-dir", "a", *QUIET)
    assert code == 0, err
    summary = json.loads(out)["summary"]
    assert summary["learning_rates"] == {"generator": 5e-4, "discriminator": 2e-3}  # the other keeps its own
    recorded = tomllib.loads((tmp_path / "a" / "config.toml").read_text())["optimizers"]
    assert (recorded["generator"]["lr"], recorded["generator"]["betas"]) == (5e-4, [0.0, 0.9])
    assert (recorded["discriminator"]["lr"], recorded["discriminator"]["betas"]) == (2e-3, [0.5, 0.999])


@pytest.mark.parametrize("table, says", [
    ("[optimizers.critic]\nlr = 1e-3\n", "its optimizers are generator, discriminator"),
    ("[optimizers.generator]\nmomentum = 0.9\n", "Adam takes no momentum"),
    ("[optimizers.generator]\nlr = -1\n", "[optimizers.generator] lr must be a number above 0"),
    ("[optimizers.generator]\nspeed = 1\n", "unknown key 'speed' in [optimizers.generator]"),
])
def test_a_wrong_optimizer_setting_is_one_line_and_writes_nothing(table, says, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "run.toml").write_text(f'workload = "{EXAMPLE}"\n[options]\nn = 64\n{table}')
    code, out, err = _cli(capsys, "fit", "--config", "run.toml", "--steps", "2", "--run-dir", "a", *QUIET)
    assert code != 0 and says in err and len(err.strip().splitlines()) == 1, err
    assert not (tmp_path / "a").exists()


def test_optimizer_settings_on_a_built_in_step_are_refused(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "run.toml").write_text('workload = "iris-mlp"\n[optimizers.generator]\nlr = 1e-3\n')
    code, out, err = _cli(capsys, "fit", "--config", "run.toml", "--steps", "2", "--run-dir", "a", *QUIET)
    assert code != 0 and "trains with the built-in step" in err, err
    assert not (tmp_path / "a").exists()


@pytest.mark.processes
def test_a_sweep_searches_a_named_optimizers_lr(tmp_path):
    optuna = pytest.importorskip("optuna")
    import gputrain

    (tmp_path / "sweep.toml").write_text(f'workload = "{EXAMPLE}"\n[options]\nn = 128\n'
                                         '[train]\nsteps = 4\ndevice = "cpu"\nloggers = ["csv"]\nprogress = false\n'
                                         '[sweep]\ntrials = 2\nworkers = 1\nmetric = "loss"\n'
                                         '[sweep.space]\noptimizers.generator.lr = {loguniform = [1e-4, 1e-2]}\n')
    result = gputrain.sweep(tmp_path / "sweep.toml", sweep_dir=tmp_path / "s")
    study = optuna.load_study(study_name="gputrain", storage=result.storage)  # Optuna reads the study
    trials = study.get_trials()
    assert len(trials) == 2 and all(t.state.name == "COMPLETE" for t in trials)
    lrs = [t.params["optimizers.generator.lr"] for t in trials]
    assert lrs[0] != lrs[1]
    for t, lr in zip(trials, lrs):
        run = tmp_path / "s" / t.user_attrs["run_dir"]
        recorded = tomllib.loads((run / "config.toml").read_text())["optimizers"]
        assert recorded["generator"]["lr"] == lr and recorded["discriminator"]["lr"] == 2e-3
        history = json.loads((run / "history.json").read_text())
        assert history["records"][-1]["lr_generator"] == pytest.approx(lr)


@pytest.fixture(scope="module")
def gan_run(tmp_path_factory):
    """A trained run of the GAN workload (its default part: the generator)."""
    folder = tmp_path_factory.mktemp("gan")
    from gputrain.cli import main

    assert main(["fit", EXAMPLE, "--option", "n=128", "--steps", "4", "--run-dir", str(folder / "run"), *QUIET]) == 0
    return folder / "run"


def test_export_and_predict_use_the_workloads_default_part_or_the_named_one(gan_run, tmp_path, capsys):
    from safetensors.torch import load_file

    from gputrain.workloads.from_run import load_run

    whole = load_run(gan_run).model
    code, out, err = _cli(capsys, "export", str(gan_run), "--out", str(tmp_path / "g.safetensors"), "--json")
    assert code == 0, err
    assert json.loads(out)["part"] == "generator"
    saved = load_file(str(tmp_path / "g.safetensors"))
    assert saved.keys() == whole.generator.state_dict().keys()
    assert all(torch.equal(saved[k], v) for k, v in whole.generator.state_dict().items())
    code, out, err = _cli(capsys, "export", str(gan_run), "--part", "discriminator", "--out",
                          str(tmp_path / "d.safetensors"), "--json")
    assert code == 0 and json.loads(out)["part"] == "discriminator", err
    assert load_file(str(tmp_path / "d.safetensors")).keys() == whole.discriminator.state_dict().keys()

    noise = torch.randn(5, 16)
    torch.save(noise, tmp_path / "noise.pt")
    code, out, err = _cli(capsys, "predict", str(gan_run), "--data", str(tmp_path / "noise.pt"), "--out",
                          str(tmp_path / "fake.pt"), "--device", "cpu")
    assert code == 0, err
    assert "(part generator)" in out
    with torch.no_grad():
        assert torch.equal(torch.load(tmp_path / "fake.pt"), whole.generator(noise))


def test_an_unknown_part_is_one_line_naming_the_parts(gan_run, tmp_path, capsys):
    for command in (["eval", str(gan_run)], ["export", str(gan_run), "--out", str(tmp_path / "x.safetensors")],
                    ["predict", str(gan_run), "--data", "train", "--out", str(tmp_path / "p.pt")]):
        code, out, err = _cli(capsys, *command, "--part", "critic")
        assert code != 0 and len(err.strip().splitlines()) == 1, err
        assert "--part critic" in err and "its parts are generator, discriminator" in err
    assert not list(tmp_path.iterdir())  # a refused command writes nothing


def test_a_step_of_your_own_without_a_default_part_says_which_parts_exist(gan_run, tmp_path, capsys):
    examples = Path(EXAMPLE.partition(":")[0]).parent
    (tmp_path / "no_part.py").write_text(
        f"import sys\nsys.path.insert(0, {str(examples)!r})\nfrom gan_workload import make_workload as made\n\n\n"
        "def make_workload(**options):\n    w = made(**options)\n    w.eval_part = None\n    return w\n")
    code, out, err = _cli(capsys, "eval", str(gan_run), "--workload", f"{tmp_path / 'no_part.py'}:make_workload")
    assert code != 0 and len(err.strip().splitlines()) == 1, err
    assert "choose the part to use with --part (its parts: generator, discriminator)" in err


def test_the_optimizer_flag_sets_a_named_optimizer_over_the_config_file(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "run.toml").write_text(f'workload = "{EXAMPLE}"\n[options]\nn = 128\n'
                                       '[optimizers.generator]\nlr = 5e-4\n')
    code, out, err = _cli(capsys, "fit", "--config", "run.toml", "--optimizer", "generator.lr=1e-3",
                          "--optimizer", "discriminator.betas=0.0,0.9", "--steps", "3", "--run-dir", "a", *QUIET)
    assert code == 0, err
    recorded = tomllib.loads((tmp_path / "a" / "config.toml").read_text())["optimizers"]
    assert recorded["generator"]["lr"] == 1e-3 and recorded["discriminator"]["betas"] == [0.0, 0.9]
    code, out, err = _cli(capsys, "fit", EXAMPLE, "--optimizer", "generator.lr", "--run-dir", "b", *QUIET)
    assert code != 0 and "expected NAME.KEY=VALUE" in err and not (tmp_path / "b").exists(), err
