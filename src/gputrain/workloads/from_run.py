"""A trained workload model back from its run directory, for `gputrain eval / predict / export RUN_DIR`.

The workload comes from RUN_DIR/workload.json (what `gputrain fit` was given: a built-in name or
module:function, and its --option values), else from the checkpoint's config name. Its model is
built fresh and takes the weights of the best checkpoint (by the run's best_metric) when there is
one, else the newest that verifies; the EMA weights when the run kept an average (`--ema`), unless
the raw ones are asked for. A checkpoint that holds only the trainable parameters of a frozen base
(checkpoint/frozen.py) takes the base from the model the workload builds (seeded as fit seeded it), once it
matches the checkpoint's fingerprint. A checkpoint is a file (one process wrote it) or a sharded step-N.dcp
folder (every process of a multi-process run wrote its part): either is verified by its hashes
first, and the sharded one is read whole in this process (checkpoint/read.py, the reader the resume
uses too), so a run of N processes evaluates, predicts and exports on one.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from gputrain.errors import CheckpointError, ConfigError
from gputrain.io.run_layout import WORKLOAD_FILE
from gputrain.workloads.base import Workload

EMA_KEY = "EMA"  # the EMA callback's state key in checkpoints (train/loop/ema.py)


@dataclass
class TrainedRun:
    run_dir: Path
    workload: Workload
    model: nn.Module  # the workload's model with the chosen weights, on the CPU, in eval mode
    weights: str  # "ema" | "raw"
    checkpoint: Path
    step: int
    config: dict[str, Any]
    skipped: list[str] = field(default_factory=list)  # "NAME: why" of newer checkpoints that did not verify
    part: str | None = None  # the part of the model that `model` is (choose_part), None: the whole model


def choose_part(run: TrainedRun, name: str | None) -> TrainedRun:
    """The run with `model` narrowed to one part of it (a submodule by name, e.g. "generator"): `name`,
    else the workload's eval_part. A workload with a step of its own and no default part keeps the whole
    model only when the model has a forward of its own (a GAN has none: its step calls the parts); else,
    and for a name the model has not, ConfigError naming the parts."""
    module, chosen = run.workload.part(run.model, name)
    if chosen is None:
        if run.workload.step_fn is not None and type(run.model).forward is nn.Module.forward:
            shown = ", ".join(n for n, _ in run.model.named_children()) or "none"
            raise ConfigError(f"{run.workload.name} trains with a step of its own and its model has no forward: "
                              f"choose the part to use with --part (its parts: {shown})")
        return run
    return dataclasses.replace(run, model=module, part=chosen)


def checkpoint_path(run_dir: Path, which: str = "best", skipped: list[str] | None = None) -> Path:
    """The checkpoint, verified: `which` = "best" (falls back to the newest), "last", or a path (a
    checkpoint file, or a step-N.dcp folder). Newer checkpoints that do not verify are passed over
    and listed in `skipped` ("NAME: why"). Raises ConfigError / CheckpointError saying which to
    choose instead."""
    from gputrain.checkpoint.store import CheckpointStore

    if which not in ("best", "last"):
        return _named_checkpoint(Path(which))
    if not run_dir.is_dir():
        raise ConfigError(f"{run_dir}: no such run directory")
    store = CheckpointStore(run_dir)
    if store.folder.exists() and not store.folder.is_dir():
        raise ConfigError(f"{store.folder} is a file, not the run's checkpoints folder: the run has no checkpoint to "
                          "load; restore the folder from a copy, or give --checkpoint FILE")
    passed_over = [] if skipped is None else skipped
    if which == "best":
        best = store.best_path()
        if best is not None:
            why = store.verify(best)
            if why is True:
                return best
            passed_over.append(f"{best.name} (the best): {why}")

    def verify(path: Path):
        why = store.verify(path)
        if why is not True:
            passed_over.append(f"{path.name}: {why}")
        return why

    try:
        path = store.find_latest(verify=verify, warn=False)
    except CheckpointError:
        raise CheckpointError(f"{run_dir}: no checkpoint verifies ({'; '.join(passed_over)}): each was damaged or "
                              "changed after it was written; restore the checkpoints folder from a copy, or train "
                              "again") from None
    if path is None:
        raise CheckpointError(f"{run_dir}: the run has no checkpoint (was it trained with --no-save?)")
    return path


def _named_checkpoint(path: Path) -> Path:
    """--checkpoint PATH: a sharded folder must match its MANIFEST.sha256, a file its .sha256 when it
    has one (a file from elsewhere, without one, is loaded as it is)."""
    from gputrain.checkpoint.digests import verify
    from gputrain.checkpoint.names import is_dcp, sha256_sidecar

    if path.is_dir() and not is_dcp(path):
        raise ConfigError(f"--checkpoint {path}: a folder, but not a sharded checkpoint (step-N.dcp); give RUN_DIR "
                          "with --checkpoint best or last, or a checkpoint from RUN_DIR/checkpoints/")
    if not path.exists():
        raise ConfigError(f"--checkpoint {path}: no such file; choose best, last, or a checkpoint file (step-N.pt) "
                          "or folder (step-N.dcp) from RUN_DIR/checkpoints/")
    if is_dcp(path) or sha256_sidecar(path).is_file():
        why = verify(path)
        if why is not True:
            raise CheckpointError(f"{path}: does not verify ({why}); choose another checkpoint "
                                  "(--checkpoint best, last, or another step)")
    return path


def recorded_workload(run_dir: Path) -> dict[str, Any] | None:
    """RUN_DIR/workload.json as {"workload": spec, "options": {...}, "name": ...}; None when absent or
    unreadable."""
    try:
        data = json.loads((run_dir / WORKLOAD_FILE).read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(data, dict) or not isinstance(data.get("workload"), str):
        return None
    options = data.get("options")
    return {**data, "options": dict(options) if isinstance(options, dict) else {}}


def stored_spec(spec: str) -> str:
    """A workload spec as RUN_DIR/workload.json keeps it: a file workload (path/to/file.py:function)
    with its absolute path, so that eval / predict / export find it from any folder; others as given."""
    module_part, sep, attr = spec.rpartition(":")
    if sep and module_part.endswith(".py"):
        return f"{Path(module_part).expanduser().resolve()}:{attr}"
    return spec


def workload_spec(run_dir: Path, config: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    """(workload name or module:function, its options) the run was trained with."""
    recorded = recorded_workload(run_dir)
    if recorded is not None:
        return recorded["workload"], recorded["options"]
    name = config.get("name")
    if not name:
        raise ConfigError(f"{run_dir}: cannot tell which workload trained this run (no workload.json, no name in "
                          "the checkpoint's config): pass --workload")
    return str(name), {}


def load_run(run_dir: str | Path, *, checkpoint: str = "best", weights: str = "auto", workload: str | None = None,
             options: dict[str, Any] | None = None) -> TrainedRun:
    """The run's workload and its model with trained weights.

    weights: "auto" (EMA when the run kept one, else raw), "ema" (an error when there is none) or "raw".
    workload / options: override what RUN_DIR/workload.json says.
    """
    from gputrain.checkpoint.format import check_model_state
    from gputrain.checkpoint.read import read_checkpoint
    from gputrain.workloads import resolve_workload

    if weights not in ("auto", "ema", "raw"):
        raise ConfigError(f"weights must be auto, ema or raw, got {weights!r}")
    run_dir = Path(run_dir)
    skipped: list[str] = []
    path = checkpoint_path(run_dir, checkpoint, skipped)
    state = read_checkpoint(path)
    config = dict(state.get("config") or {})
    spec, saved_options = workload_spec(run_dir, config) if workload is None else (workload, {})
    wl = resolve_workload(spec, **{**saved_options, **(options or {})})
    if "frozen" in state:  # a trainable-only checkpoint: the base comes from the model, built as fit built it
        torch.manual_seed(int(config.get("seed", 0)))
    model = wl.make_model()
    ema = (state.get("callbacks") or {}).get(EMA_KEY)
    if weights == "ema" and not ema:
        raise ConfigError(f"{path}: this run kept no EMA of its weights (train with --ema DECAY); use the raw weights")
    use_ema = bool(ema) and weights != "raw"
    weights_state = ema["weights"] if use_ema and ema is not None else state["model"]
    if "frozen" in state and not use_ema:  # the EMA's weights are whole
        weights_state = _with_frozen_base(model, state, path, spec)
    try:
        check_model_state(weights_state, model, path=str(path))
    except CheckpointError as exc:
        raise CheckpointError(f"{exc}{_which_workload_hint(run_dir, config, spec, workload)}") from None
    model.load_state_dict(weights_state)
    model.eval()
    step = int(state.get("step", (state.get("run") or {}).get("step", 0)))
    return TrainedRun(run_dir, wl, model, "ema" if use_ema else "raw", path, step, config, skipped)


def _with_frozen_base(model: nn.Module, state: dict[str, Any], path: Path, spec: str) -> dict[str, Any]:
    """A trainable-only checkpoint's weights (checkpoint/frozen.py) completed with the frozen base of the
    model the workload built, once that base matches the checkpoint's fingerprint."""
    from gputrain.checkpoint.frozen import FrozenBase

    frozen = FrozenBase(model, trainable_only=True, reason="")
    frozen.check(state["frozen"], str(path), model=f"the model {spec} builds",
                 advice=f"{spec} must build the base the run trained on (the same pretrained weights, or the same "
                        "seeded initialization), or pass --workload with the one that does")
    return frozen.complete(state["model"])


def _which_workload_hint(run_dir: Path, config: dict[str, Any], spec: str, given: str | None) -> str:
    """Where the workload that does not fit came from, and how to name the right one."""
    from gputrain.workloads.registry import WORKLOADS

    trained = config.get("name")  # a user workload's name is not its module:function, so only built-ins
    source = "--workload" if given is not None else f"{run_dir / WORKLOAD_FILE}" if \
        recorded_workload(run_dir) is not None else "the checkpoint's config"
    if trained in WORKLOADS and trained != spec:
        return (f"; {source} names {spec}, but the checkpoint was trained as {trained}: pass --workload {trained}"
                f"{' (or correct ' + WORKLOAD_FILE + ')' if given is None else ''}")
    return f"; the model was built from {spec} ({source}): pass --workload with the workload this run trained"
