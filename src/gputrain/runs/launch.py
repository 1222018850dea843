"""Where a run's processes start: in this process, as N processes on this machine (torchrun), or as
Ray Train's workers. `launch` is the one function that decides it (`launcher_of`, from the run's
[fit] settings) and trains there; `gputrain fit` and `gputrain.fit_config` call it.

    stated (RunConfig) -> launch -> here:     resolve -> train_spec
                                    torchrun: resolve, check_before_launch (every check, once) -> N x `gputrain
                                              fit` -> the run directory
                                    ray:      runs/ray_run.train_on_ray (the same checks first) -> the run directory

A process that torchrun started (LOCAL_RANK in its environment) is one of the N: it trains here.
The processes torchrun starts get the command line's own arguments from `gputrain fit` (without
--nproc and --max-restarts), and from Python the resolved spec as a config file, so that every rank
trains the same run in the same run directory; rank 0 prints the run's summary, and the launcher
reads its history back from the run directory.
"""

from __future__ import annotations

import dataclasses
import os
import tempfile
from pathlib import Path
from typing import Any, Sequence

from gputrain.errors import ConfigError
from gputrain.runs.spec import RunSettings, RunSpec, spec_text
from gputrain.runs.stated import RunConfig
from gputrain.runs.train import RunResult, check_run_dir_owner, named_optimizers, read_result, train_spec

HERE, TORCHRUN, RAY = "here", "torchrun", "ray"


def launcher_of(settings: RunSettings) -> str:
    """Where a run with these settings trains, seen from this process: RAY (--launcher ray),
    TORCHRUN (--nproc above 1), else HERE; HERE in a process that torchrun started."""
    if "LOCAL_RANK" in os.environ:
        return HERE
    if settings.launcher == "ray":
        return RAY
    return TORCHRUN if (settings.nproc or 1) > 1 else HERE


def launch(stated: RunConfig, *, argv: Sequence[str] | None = None, callbacks: Sequence[Any] = ()) -> RunResult:
    """Train what `stated` says where its settings say (`launcher_of`); returns its RunResult.

    argv: the command line (`fit ...`, without the launcher's flags) that torchrun's processes are
    started with; None: they read the resolved spec from a file (`gputrain.fit_config`), and the
    history is read back from the run directory. callbacks: objects of this process, so refused
    (ConfigError) for a run in other processes. The result of a run in torchrun's processes is
    `shown` (its rank 0 printed the summary) and carries their `exit_code`. Raises ConfigError
    (one line) for what a field or the launcher refuses, before any process starts.
    """
    settings = RunSettings(**stated.fit)
    where = launcher_of(settings)
    if where != HERE and callbacks:
        raise ConfigError(f"callbacks live in this process: they cannot reach the processes {where} starts; train "
                          "in this process (no nproc, no launcher ray) to use them")
    if where == RAY:
        from gputrain.runs.ray_run import train_on_ray

        return train_on_ray(stated)
    from gputrain.runs.resolve import resolve

    spec, workload = resolve(stated)  # every check here, once, before any process starts
    if where == TORCHRUN:
        check_before_launch(spec, workload)  # what the processes would refuse at their start
        return _on_torchrun(spec, settings, argv)
    return train_spec(spec, workload, callbacks)


def check_before_launch(spec: RunSpec, workload: Any) -> None:
    """Raise GputrainError (one line), in the launcher, for what the processes of `spec` (torchrun's,
    Ray's workers) would refuse at their start, before they start, a cluster is joined or a file is
    written. `resolve` checked every field; these need the disk or the workload: the run directory
    (another workload's run, a file in its way, a folder that cannot be written), the resume (a
    checkpoint of the run's global batch and seed with `nproc` processes), and the settings of a step
    of your own's named optimizers ([optimizers.NAME], --optimizer)."""
    from gputrain.checkpoint.manager import check_resume_before_start
    from gputrain.io.preflight import check_run_dir

    if spec.train.run_dir:
        run_dir = Path(spec.train.run_dir)
        check_run_dir_owner(run_dir, spec.workload.name, workload.name)
        check_run_dir(run_dir)
        check_resume_before_start(spec.train, spec.fit.nproc or 1)
    named = named_optimizers(spec, workload)
    if named is not None:
        named.check(workload.make_model)


def _on_torchrun(spec: RunSpec, settings: RunSettings, argv: Sequence[str] | None) -> RunResult:
    """Train `spec` in settings.nproc processes that torchrun starts on this machine."""
    from gputrain.runtime import distributed

    nproc = settings.nproc or 1
    if argv is not None:
        code = distributed.launch_torchrun(nproc, list(argv), max_restarts=settings.max_restarts)
        return RunResult(spec, None, {}, None, True, shown=True, exit_code=code)
    if not spec.train.run_dir:
        raise ConfigError("a run in several processes started from Python is read back from its run directory: "
                          "drop no_save")
    from gputrain.io.atomic import write_text

    text = spec_text(dataclasses.replace(spec, run_dir_stated=True), record=False)  # every rank the same run_dir
    with tempfile.TemporaryDirectory(prefix="gputrain-launch-") as folder:
        path = Path(folder) / "config.toml"
        write_text(path, text)
        code = distributed.launch_torchrun(nproc, ["fit", "--config", str(path)], max_restarts=settings.max_restarts)
    if code != 0:
        return RunResult(spec, None, {}, None, True, shown=True, exit_code=code)
    return dataclasses.replace(read_result(spec), shown=True)
