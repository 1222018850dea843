"""Runs as files: `gputrain fit --config`, `--print-config`, RUN_DIR/config.toml, and bad files.

The CLI runs in this process (gputrain.cli.main) on the smallest workloads, a few steps each.
"""

from __future__ import annotations

import json
import math
import tomllib
from pathlib import Path

import pytest
from helpers import cli, docs_page

QUIET = ("--device", "cpu", "--no-tensorboard", "--progress", "off", "--json")


def _summary(out: str) -> dict:
    return json.loads(out)["summary"]


# ---------------------------------------------------------------- a run repeated from its recorded config


def test_a_run_repeated_from_its_config_ends_with_the_same_loss(tmp_path, capsys, monkeypatch):
    """Flags, a workload option and a setting no flag has (warmup_steps, from a first config file)
    are all recorded in RUN_DIR/config.toml; `fit --config RUN_DIR/config.toml --run-dir NEW`
    trains the same batches in the same order to the same losses, and records the same config."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "first.toml").write_text('[train]\nwarmup_steps = 4\nschedule = "cosine"\n')
    code, out, err = cli(capsys, "fit", "linear-regression", "--config", "first.toml", "--option", "n=300",
                         "--batch-size", "16", "--steps", "30", "--log-every", "5", "--lr", "0.02", "--seed", "7",
                         "--run-dir", "a", *QUIET)
    assert code == 0, err
    first = _summary(out)
    recorded = tomllib.loads((tmp_path / "a" / "config.toml").read_text())
    assert recorded["workload"] == "linear-regression" and recorded["options"] == {"n": "300"}
    train = recorded["train"]
    assert (train["batch_size"], train["steps"], train["lr"], train["seed"]) == (16, 30, 0.02, 7)
    assert (train["warmup_steps"], train["schedule"], train["loggers"]) == (4, "cosine", ["csv"])  # --no-tensorboard
    assert "tensorboard" not in train
    assert "epochs" not in train and "run_dir" not in train and "resume" not in train

    code, out, err = cli(capsys, "fit", "--config", "a/config.toml", "--run-dir", "b", "--json")
    assert code == 0, err
    again = _summary(out)
    assert again["workload"] == "linear-regression" and again["steps"] == 30
    assert again["final_loss"] == first["final_loss"]  # exact: same machine, same batches in the same order
    losses = [[r["loss"] for r in json.loads((tmp_path / d / "history.json").read_text())["records"]] for d in "ab"]
    assert losses[0] == losses[1] and len(losses[0]) >= 6  # every log point, the same value
    strip = lambda text: [line for line in text.splitlines() if "run_dir" not in line]  # noqa: E731
    assert strip((tmp_path / "a" / "config.toml").read_text()) == strip((tmp_path / "b" / "config.toml").read_text())


def test_the_recorded_config_holds_every_field_and_reads_back(tmp_path, capsys):
    """Every TrainConfig field but where the run wrote (run_dir, resume) and fields left at None,
    every [fit] flag; a field switched off with None (spike_ratio) reads back as None."""
    from gputrain.config import TrainConfig
    from gputrain.runs.stated import load_run_config
    from gputrain.runs.spec import RunSettings

    code, _, err = cli(capsys, "fit", "iris-mlp", "--steps", "2", "--run-dir", str(tmp_path / "r"), *QUIET[:-1],
                       "--quiet")
    assert code == 0, err
    path = tmp_path / "r" / "config.toml"
    text = path.read_text()
    data = tomllib.loads(text)
    defaults_none = {f for f in TrainConfig.field_names() if getattr(TrainConfig(), f) is None}
    expected = set(TrainConfig.field_names()) - {"run_dir", "resume", "name"} - defaults_none | {"steps"}
    assert set(data["train"]) == expected
    assert set(data["fit"]) == {f for f in RunSettings.__dataclass_fields__ if getattr(RunSettings(), f) is not None}
    assert f'# run_dir = "{tmp_path / "r"}"' in text
    (tmp_path / "off.toml").write_text('[train]\nspike_ratio = "none"\nstop_signals = ["SIGTERM"]\n')
    rc = load_run_config(tmp_path / "off.toml")
    assert rc.train == {"spike_ratio": None, "stop_signals": ("SIGTERM",)}


def test_the_old_tensorboard_key_warns_and_sets_the_loggers(tmp_path, capsys, monkeypatch):
    """[train] tensorboard, in every RUN_DIR/config.toml recorded before TensorBoard became one of
    the loggers: still read (false drops it from the loggers, true leaves them as they are), with a
    DeprecationWarning naming the line and what to write; the run records loggers, not the old key."""
    from gputrain.runs.stated import load_run_config

    monkeypatch.chdir(tmp_path)
    Path("old.toml").write_text('workload = "iris-mlp"\n[train]\nsteps = 2\ndevice = "cpu"\ntensorboard = false\n')
    with pytest.warns(DeprecationWarning, match=r"old.toml line 5: \[train\] tensorboard is deprecated: TensorBoard is "
                                                r"one of the loggers.*write loggers = \[\"csv\"\] instead"):
        code, _, err = cli(capsys, "fit", "--config", "old.toml", "--run-dir", "r", "--progress", "off", "--json")
    assert code == 0, err
    assert not list(Path("r").glob("events.out.tfevents.*")) and Path("r/metrics.jsonl").is_file()
    recorded = tomllib.loads(Path("r/config.toml").read_text())["train"]
    assert recorded["loggers"] == ["csv"] and "tensorboard" not in recorded
    Path("kept.toml").write_text('[train]\nloggers = ["csv", "wandb"]\ntensorboard = true\n')
    with pytest.warns(DeprecationWarning, match=r'write loggers = \["csv", "wandb"\] instead'):
        assert load_run_config("kept.toml").train == {"loggers": ("csv", "wandb")}


# ---------------------------------------------------------------- precedence and --print-config


def test_the_command_line_overrides_the_file_which_overrides_the_workload(tmp_path, capsys):
    """iris-mlp's defaults (epochs 500, lr 0.01), the file's (lr, steps, warmup, ema, an option-less
    workload) and the command line's --lr: the command line wins, then the file, then the workload.
    --epochs on the command line drops the file's steps. --print-config writes nothing."""
    cfg = tmp_path / "run.toml"
    cfg.write_text('workload = "iris-mlp"\n[train]\nlr = 0.05\nsteps = 7\nwarmup_steps = 3\ndevice = "cpu"\n'
                   '[fit]\nema = 0.9\npatience = 5\n')
    code, out, err = cli(capsys, "fit", "--config", str(cfg), "--lr", "0.02", "--run-dir", str(tmp_path / "x"),
                         "--print-config")
    assert code == 0, err
    printed = tomllib.loads(out)
    t = printed["train"]
    assert printed["workload"] == "iris-mlp"
    assert (t["lr"], t["steps"], t["warmup_steps"], t["device"], t["log_every"]) == (0.02, 7, 3, "cpu", 100)
    assert t["batch_size"] == 120  # the workload's full batch, resolved
    assert t["run_dir"] == str(tmp_path / "x") and "epochs" not in t
    assert (printed["fit"]["ema"], printed["fit"]["patience"]) == (0.9, 5)
    assert not (tmp_path / "x").exists()

    code, out, _ = cli(capsys, "fit", "--config", str(cfg), "--epochs", "2", "--print-config")
    t = tomllib.loads(out)["train"]
    assert code == 0 and t["epochs"] == 2 and "steps" not in t and t["lr"] == 0.05

    code, out, _ = cli(capsys, "fit", "digits-cnn", "--config", str(cfg), "--no-save", "--print-config")
    printed = tomllib.loads(out)
    assert code == 0 and printed["workload"] == "digits-cnn" and printed["fit"]["no_save"] is True
    assert printed["train"]["batch_size"] == 64 and printed["train"]["lr"] == 0.05  # digits' batch, the file's lr


def test_print_config_output_is_itself_a_config(tmp_path, capsys):
    """What --print-config prints trains as the same command line would (the same final loss)."""
    argv = ("iris-mlp", "--steps", "6", "--log-every", "3", "--lr", "0.05", "--seed", "2")
    code, out, _ = cli(capsys, "fit", *argv, "--print-config", *QUIET)
    assert code == 0
    (tmp_path / "printed.toml").write_text(out)
    code, direct, err = cli(capsys, "fit", *argv, "--no-save", *QUIET)
    assert code == 0, err
    code, from_file, err = cli(capsys, "fit", "--config", str(tmp_path / "printed.toml"), "--no-save")
    assert code == 0, err
    assert _summary(direct)["final_loss"] == _summary(from_file)["final_loss"]


def test_the_flags_are_the_fields_and_an_absent_flag_states_nothing():
    """The command line is generated from the spec's fields: every field with a flag is one argument
    whose dest is the field's name; an empty command line states nothing (so a file's value is never
    overridden by a flag's default), and the spec it resolves to has the fields' own defaults."""
    import argparse
    import dataclasses

    from gputrain.commands.fit import add_arguments
    from gputrain.config import TrainConfig
    from gputrain.fields import flags_of
    from gputrain.runs.spec import RunSettings
    from gputrain.runs.flags import stated
    from gputrain.runs.resolve import resolve

    p = argparse.ArgumentParser()
    add_arguments(p)
    dests: dict[str, list[list[str]]] = {}
    for a in p._actions:
        dests.setdefault(a.dest, []).append(a.option_strings)
    for cls in (TrainConfig, RunSettings):
        for f in dataclasses.fields(cls):
            if flags_of(f):  # each flag of the field (--compile and --compile-scope: one field)
                assert dests[f.name] == [list(flag.names) for flag in flags_of(f)], f.name
    empty = stated(p.parse_args(["iris-mlp"]))
    assert (empty.train, empty.fit, empty.options) == ({}, {}, {})
    spec, _ = resolve(empty)
    assert spec.fit == RunSettings() and spec.train.seed == TrainConfig().seed and spec.auto == ("progress",)
    assert (stated(p.parse_args(["--lr", "0.5", "--patience", "4"])).train,
            stated(p.parse_args(["--patience", "4"])).fit) == ({"lr": 0.5}, {"patience": 4})


def test_fit_config_trains_from_python_what_the_command_line_repeats(tmp_path, capsys):
    """gputrain.fit_config(tree, **train) resolves and trains the spec as `gputrain fit` does: the
    config.toml it records, given to the command line, ends with the same loss; a value a field
    refuses is a ConfigError before anything is written."""
    import gputrain

    tree = {"workload": "iris-mlp", "train": {"steps": 6, "log_every": 3, "lr": 0.05, "seed": 2, "device": "cpu",
                                              "loggers": ["csv"]}}
    history = gputrain.fit_config(tree, run_dir=str(tmp_path / "py"), progress=False)
    code, out, err = cli(capsys, "fit", "--config", str(tmp_path / "py" / "config.toml"),
                         "--run-dir", str(tmp_path / "cli"), "--json", "--quiet")
    assert code == 0, err
    assert history.summary["final_loss"] == _summary(out)["final_loss"] and history.summary["steps"] == 6
    with pytest.raises(gputrain.ConfigError, match=r"\[train\] weight_decay: weight_decay must be a finite number >= 0"):
        gputrain.fit_config(tree, weight_decay=-1.0, run_dir=str(tmp_path / "refused"))
    assert not (tmp_path / "refused").exists()


# ---------------------------------------------------------------- bad files: one line, the key and its line


BAD = [
    ("unknown-key", '[train]\nsteps = 2\nbatch-size = 3\n', r"line 3: unknown key 'batch-size' in \[train\]: did you "
                                                            r"mean 'batch_size'\?"),
    ("wrong-type", 'workload = "iris-mlp"\n[train]\nlr = "fast"\n', r"line 3: \[train\] lr must be a number, got "
                                                                    r"'fast' \(a string\)"),
    ("refused-value", '[train]\n\nlr = -1\n', r"line 3: \[train\] lr: lr must be > 0"),
    ("int-for-bool", '[train]\nshard = 1\n', r"line 2: \[train\] shard must be true or false, got 1"),
    ("list-of-wrong-type", '[train]\nloggers = ["csv", 3]\n', r"line 2: \[train\] loggers must be a list of strings"),
    ("field-at-the-top", 'lr = 0.1\n', r"line 1: 'lr' at the top of the file: put it under \[train\]"),
    ("flag-under-train", '[train]\nema = 0.9\n', r"line 2: \[train\] has no key 'ema': it belongs under \[fit\]"),
    ("unknown-section", '[trainer]\nlr = 1\n', r"line 1: unknown key 'trainer': a config file has workload and the "
                                               r"tables \[options\], \[optimizers\], \[train\], \[fit\], \[sweep\]"),
    ("epochs-and-steps", '[train]\nepochs = 2\nsteps = 3\n', r"line 3: \[train\] sets both epochs and steps"),
    ("fit-below-minimum", '[fit]\nnproc = 0\n', r"line 2: \[fit\] nproc must be at least 1, got 0"),
    ("option-list", '[options]\nn = [1, 2]\n', r"line 2: \[options\] n: a workload option is a string, number"),
    ("workload-number", 'workload = 3\n', r"line 1: workload must be a string"),
    ("old-name", '[train]\ncheckpointing = true\n', r"line 2: \[train\] checkpointing is the old name of recompute"),
    ("old-tensorboard-not-bool", '[train]\ntensorboard = "no"\n', r"line 2: \[train\] tensorboard must be true or "
                                                                 r"false, got 'no' \(a string\)"),
    ("not-toml", '[train\nlr = 1\n', r"not valid TOML: .*\(at line 1, column 7\)"),
]


@pytest.mark.parametrize("name,text,says", BAD, ids=[b[0] for b in BAD])
def test_a_bad_config_file_is_one_line_naming_the_key_and_its_line(name, text, says, tmp_path, capsys, monkeypatch):
    import re

    monkeypatch.chdir(tmp_path)
    (tmp_path / "run.toml").write_text(text)
    code, out, err = cli(capsys, "fit", "iris-mlp", "--config", "run.toml", "--run-dir", "r")
    lines = err.strip().splitlines()
    assert code == 2 and out == "" and len(lines) == 1, err
    assert lines[0].startswith("gputrain fit: error: ") and "run.toml" in lines[0], lines[0]
    assert re.search(says, lines[0]), lines[0]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run.toml"]  # nothing written


def test_a_missing_or_folder_config_is_one_line(tmp_path, capsys):
    code, _, err = cli(capsys, "fit", "--config", str(tmp_path / "nope.toml"))
    assert code == 2 and "--config" in err and "no such file" in err and len(err.strip().splitlines()) == 1
    code, _, err = cli(capsys, "fit", "--config", str(tmp_path))
    assert code == 2 and "is a folder: give a TOML file" in err


# ---------------------------------------------------------------- the TOML reader and writer


def test_key_lines_find_headers_dotted_keys_and_inline_tables():
    from gputrain.io.toml_file import TomlFile, key_lines

    text = ('workload = "x"\n# a comment\n[train]\n  lr = 0.1  # inline\n"quoted key" = 1\nsnippet = """\n'
            'fake = 1\n"""\nafter = 2\n[sweep.space]\nlr = {loguniform = [1e-4, 0.1]}\noptions.n = {int = [1, 2]}\n')
    lines = key_lines(text)
    assert lines[("workload",)] == 1 and lines[("train",)] == 3 and lines[("train", "lr")] == 4
    assert lines[("train", "quoted key")] == 5 and lines[("train", "after")] == 9
    assert ("train", "fake") not in lines  # inside a multi-line string
    assert lines[("sweep", "space", "options", "n")] == 12
    f = TomlFile("s.toml", tomllib.loads(text), lines)
    assert f.where(("sweep", "space", "lr", "loguniform")) == "s.toml line 11"  # inside an inline table: its line


def test_dumps_reads_back_to_the_same_values():
    from gputrain.io.toml_file import dumps

    tables = {"t": {"s": 'quote " back \\ slash\nnew line, ünïcode, tab\t', "i": -3, "f": 1e-05, "big": 1e300,
                    "inf": math.inf, "neg": -math.inf, "b": False, "l": [1, "a", [2.5]], "d": {"a b": 1, "c": "x"},
                    "none": None},
              "nested": {"space": {"lr": {"loguniform": [0.0001, 0.1]}, "options.n": {"choices": [1, 2]}}}}
    back = tomllib.loads(dumps({"workload": "w"}, tables, header=["a comment"]))
    assert back["workload"] == "w"
    assert back["t"] == {k: v for k, v in tables["t"].items() if v is not None}
    assert back["nested"] == tables["nested"]
    assert math.isnan(tomllib.loads(dumps({"x": math.nan}, {}))["x"])


# ---------------------------------------------------------------- the docs' example


def test_the_docs_config_example_runs_and_repeats(tmp_path, capsys, monkeypatch):
    """docs/examples/run.toml is the file docs/how-to/configs.md shows, and the page's three commands do what
    their comments say: train, print a resolved config with one change, repeat to the same loss."""
    import shlex
    import shutil

    root = Path(__file__).resolve().parents[1]
    section = docs_page("how-to/configs.md")
    example = (root / "docs" / "examples" / "run.toml").read_text().strip()
    assert f"```toml\n{example}\n```" in section, "docs/how-to/configs.md does not show docs/examples/run.toml"
    commands = [line.split("#")[0].strip() for line in section.split("```bash\n", 1)[1].split("```", 1)[0].splitlines()]
    assert len(commands) == 3 and all(c.startswith("gputrain fit ") for c in commands)

    shutil.copytree(root / "docs" / "examples", tmp_path / "docs" / "examples")
    monkeypatch.chdir(tmp_path)
    outputs = []
    for command in commands:
        code, out, err = cli(capsys, "fit", *shlex.split(command)[2:], "--quiet", "--progress", "off")
        assert code == 0, err
        outputs.append(out)
    printed = tomllib.loads(outputs[1])
    assert printed["train"]["lr"] == 0.05 and printed["options"] == {"n": "2000"}
    assert printed["fit"]["early_stop"] == "eval_loss"
    finals = [json.loads((tmp_path / "runs" / d / "history.json").read_text())["records"][-1]["loss"]
              for d in ("first", "again")]
    assert finals[0] == finals[1]
