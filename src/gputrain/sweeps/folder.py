"""The sweep's folder on this machine: whether it holds this sweep (a resume), another, or something
else, and SWEEP_DIR/sweep.toml, the sweep's resolved config (what a resume and the workers read).

On a shared study (--storage) each machine has its own folder: its sweep.toml names the storage
(without its password) and the study, and its trials/ holds the trials this machine ran.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from gputrain.errors import ConfigError
from gputrain.runs.stated import RunConfig, load_run_config
from gputrain.sweeps.settings import SWEEP_FILE, SweepSettings, check_sweep
from gputrain.sweeps.study import DB_FILE, differences


def check_folder(folder: Path, rc: RunConfig, settings: SweepSettings, direction: str) -> bool:
    """True when `folder` holds this sweep (a resume), False when it is new or empty; ConfigError
    when it is a file, holds another sweep, or holds something else."""
    if folder.exists() and not folder.is_dir():
        raise ConfigError(f"--sweep-dir {folder} is a file: give a folder")
    recorded = folder / SWEEP_FILE
    if recorded.is_file():
        old = load_run_config(recorded, what="--sweep-dir")
        old_settings = check_sweep(old)
        differs = differences(identity(old, old_settings, old_settings.direction or direction),
                              identity(rc, settings, direction))
        if differs:
            raise ConfigError(f"{folder} holds another study (its {SWEEP_FILE} differs in {', '.join(differs[:4])}"
                              f"{' and more' if len(differs) > 4 else ''}): resume it with `gputrain sweep --sweep-dir "
                              f"{folder}`, or start this sweep in another --sweep-dir")
        return True
    if (folder / DB_FILE).exists():
        raise ConfigError(f"{folder} holds a {DB_FILE} that gputrain sweep did not make (no {SWEEP_FILE}): "
                          "give another --sweep-dir")
    if folder.is_dir() and any(folder.iterdir()):
        raise ConfigError(f"--sweep-dir {folder} is not empty and holds no sweep (no {SWEEP_FILE}): give a new or "
                          "empty folder")
    return False


def identity(rc: RunConfig, settings: SweepSettings, direction: str, where: bool = True) -> dict[str, Any]:
    """What makes two sweeps one: the run config and the sweep's settings, less the budget and the
    workers (where=False: less where the study lives too, what the study records of itself)."""
    sweep = settings.identity() if where else settings.study_identity()
    sweep["direction"] = direction
    return {"workload": rc.workload, "options": rc.options, **({"optimizers": rc.optimizers} if rc.optimizers else {}),
            "train": rc.train, "fit": rc.fit, "sweep": sweep}


def write_sweep_file(folder: Path, rc: RunConfig, settings: SweepSettings, direction: str) -> None:
    """SWEEP_DIR/sweep.toml: the run config and [sweep] as resolved (the storage without its password)."""
    from gputrain.io.atomic import write_text
    from gputrain.io.toml_file import dumps

    table = settings.table()
    table["direction"] = direction
    optimizers = {n: {k: list(v) if isinstance(v, tuple) else v for k, v in values.items()}
                  for n, values in rc.optimizers.items()}
    tables = {"options": rc.options, **({"optimizers": optimizers} if optimizers else {}),
              "train": {k: list(v) if isinstance(v, tuple) else v for k, v in rc.train.items()},
              "fit": rc.fit, "sweep": table}
    header = ["gputrain sweep: this sweep's config. Resume it: gputrain sweep --sweep-dir THIS_FOLDER",
              "(trials and workers may change on a resume; the rest is the study's identity)."]
    write_text(folder / SWEEP_FILE, dumps({"workload": rc.workload}, tables, header=header))


def load_sweep_file(sweep_dir: Path) -> tuple[RunConfig, SweepSettings, str]:
    """(run config, settings, direction) of SWEEP_DIR/sweep.toml, for the workers."""
    rc = load_run_config(sweep_dir / SWEEP_FILE, what="--sweep-dir")
    settings = check_sweep(rc)
    return rc, settings, settings.direction or "min"


def safe_name(name: str) -> str:
    return "".join(c if c.isalnum() or c in "-_." else "_" for c in name)
