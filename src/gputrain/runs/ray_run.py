"""`gputrain fit --launcher ray`: a run spec trained by Ray Train's TorchTrainer, N workers, with the
same run directory and outputs as under torchrun.

The driver (this process) resolves the spec once (every check before Ray starts), joins the Ray
cluster RAY_ADDRESS names or starts one on this machine (runtime/ray_train.py: refused in one line
when it cannot be reached or has no room), and runs `_worker` on each of N workers. Ray creates the
process group (gloo on CPU workers, NCCL with one GPU each); fit takes it as it is. Each worker
resolves the same spec (a file workload by its absolute path, the run directory absolute: Ray runs
workers in a folder of its own), resumes from the newest checkpoint Ray holds when its group was
restarted after a failure (`--max-restarts`: FailureConfig(max_failures=...)), and trains with
`RayReport` (report/ray_report.py). Rank 0 writes the run directory, as under torchrun; the driver
reads its history.json for the summary.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from pathlib import Path
from typing import Any

from gputrain.errors import ConfigError, GputrainError
from gputrain.runs.stated import RunConfig, merge
from gputrain.runs.train import RunResult, read_result

log = logging.getLogger("gputrain")


def train_on_ray(stated: RunConfig) -> RunResult:
    """Train what `stated` says on Ray Train workers (fit.nproc of them); returns rank 0's result as
    the run directory holds it. ConfigError (one line) for a refusal before Ray starts: --no-save, a
    --ray-storage Ray cannot store in, what the workers would refuse at their start (runs/launch.py),
    Ray not installed, a cluster that cannot be reached or has no room."""
    from gputrain.runs.launch import check_before_launch
    from gputrain.runs.resolve import resolve

    spec, workload = resolve(stated)  # every check, once, before Ray starts
    if spec.fit.no_save or not spec.train.run_dir:
        raise ConfigError("--launcher ray keeps the run's checkpoints (a restarted worker group resumes from them): "
                          "drop --no-save")
    storage = ray_storage(spec.fit.ray_storage)  # refused here, before Ray starts
    check_before_launch(spec, workload)  # what the workers would refuse at their start
    _fit_trainer(stated, spec, storage)
    return read_result(spec)


def _fit_trainer(stated: RunConfig, spec: Any, storage: str | None) -> Any:
    """TorchTrainer.fit over spec.fit.nproc workers on the Ray cluster `connect` joins or starts,
    each resolving what `stated` says in the run directory `spec` resolved (absolute: Ray runs
    workers in folders of their own); a worker's refusal (a GputrainError) is raised here as its own
    one line, any other failure with Ray's report. Ray is shut down after."""
    from gputrain.runtime.ray_train import connect
    from gputrain.workloads.from_run import stored_spec

    nproc = spec.fit.nproc or 1
    run_dir = Path(spec.train.run_dir).resolve()
    resume = spec.train.resume
    train = {"run_dir": str(run_dir), "resume": str(Path(resume).resolve()) if isinstance(resume, str) else resume}
    worker_stated = merge(stated, RunConfig(workload=stored_spec(spec.workload.name), train=train))
    worker_stated = dataclasses.replace(worker_stated, source=None)  # the parsed file is not needed there
    where, gpus = connect(nproc, spec.train.device)  # refused in one line when Ray is missing or has no room
    log.info("training on %d Ray worker(s) (%s) in %s", nproc, "one GPU each" if gpus else "CPU", where)
    import ray

    timeout_s = 300  # collectives on a lost peer fail after this, as init_distributed's
    try:
        from ray.train import CheckpointConfig, FailureConfig, RunConfig as RayRunConfig, ScalingConfig
        from ray.train.torch import TorchConfig, TorchTrainer

        trainer = TorchTrainer(
            _worker, train_loop_config={"stated": worker_stated},
            scaling_config=ScalingConfig(num_workers=nproc, use_gpu=gpus, resources_per_worker={"CPU": 1}),
            torch_config=TorchConfig(backend="nccl" if gpus else "gloo", timeout_s=timeout_s),
            run_config=RayRunConfig(
                name=f"gputrain-{run_dir.name}-{time.strftime('%Y%m%d-%H%M%S')}",
                storage_path=storage,
                failure_config=FailureConfig(max_failures=spec.fit.max_restarts),
                checkpoint_config=CheckpointConfig(num_to_keep=spec.train.keep_last)))
        return trainer.fit()
    except Exception as exc:  # noqa: BLE001 - Ray's TrainingFailedError wraps the worker's error
        refusal = _refusal_in(exc)
        if refusal is not None:
            raise refusal from None
        raise
    finally:
        ray.shutdown()


# The URI schemes Ray Train stores through (pyarrow.fs.FileSystem.from_uri's), and those that name a
# bucket (or container) first: s3://BUCKET/PATH.
STORAGE_SCHEMES = ("s3", "gs", "gcs", "hdfs", "viewfs", "abfs", "abfss", "file")
BUCKET_SCHEMES = ("s3", "gs", "gcs", "abfs", "abfss")


def ray_storage(stated: str | None) -> str | None:
    """Ray Train's storage_path for --ray-storage: a URI (s3://, gs://, ...) as given, a folder made
    absolute (Ray's workers run in folders of their own); None: Ray's default, ~/ray_results.
    ConfigError, before Ray starts (Ray would fail only after its workers started, behind its
    tracebacks): a local folder that is a file, below a file or cannot be written (nothing is made to
    find out); a URI of a scheme Ray does not store through, or without its bucket."""
    from urllib.parse import urlsplit

    from gputrain.io.preflight import check_output_dir

    if stated is None:
        return None
    if "://" in stated:
        uri = urlsplit(stated)
        scheme = uri.scheme.lower()
        if scheme not in STORAGE_SCHEMES:
            raise ConfigError(f"--ray-storage {stated}: Ray Train stores through pyarrow's file systems, which know no "
                              f"{uri.scheme}://: give {', '.join(f'{s}://' for s in STORAGE_SCHEMES[:-1])} or a "
                              "folder")
        if scheme in BUCKET_SCHEMES and not uri.netloc:
            raise ConfigError(f"--ray-storage {stated} names no bucket: give {scheme}://BUCKET/PATH")
        if scheme != "file":
            return stated
    local = Path(urlsplit(stated).path if "://" in stated else stated).expanduser()
    if local.exists() and not local.is_dir():
        raise ConfigError(f"--ray-storage {stated}: a file, not a folder: give a folder (made if missing) or a URI "
                          "(s3://bucket/path)")
    check_output_dir(local, "--ray-storage")  # below a file, or not writable (the local path a file:// names)
    return str(local.resolve())


def _refusal_in(exc: BaseException) -> GputrainError | None:
    """A gputrain refusal raised on a worker, found in Ray's error (its cause chain and the errors it
    carries by rank), as the same type and line."""
    seen: set[int] = set()
    todo: list[Any] = [exc]
    while todo:
        e = todo.pop()
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        if isinstance(e, GputrainError):
            return type(e)(str(e).splitlines()[0])
        todo += [e.__cause__, e.__context__, getattr(e, "cause", None)]
        errors = getattr(e, "worker_failures", None) or getattr(e, "errors", None)
        if isinstance(errors, dict):
            todo += list(errors.values())
        elif isinstance(errors, (list, tuple)):
            todo += list(errors)
    return None


def _worker(loop_config: dict[str, Any]) -> None:
    """What each Ray Train worker runs: the spec resolved here (as the driver did), resumed from
    Ray's newest checkpoint after a restart, trained with RayReport."""
    from gputrain.report.ray_report import RayReport, resume_from_ray
    from gputrain.runs.resolve import resolve
    from gputrain.runs.train import train_spec

    spec, workload = resolve(loop_config["stated"])
    _worker_log(spec.fit.quiet or spec.fit.json)
    with resume_from_ray(spec.train) as config:
        train_spec(dataclasses.replace(spec, train=config), workload, callbacks=[RayReport()])


def _worker_log(quiet: bool) -> None:
    """The run log on a worker's stderr, which Ray passes to the driver with the worker's name: rank 0's
    from INFO (as `gputrain fit` sets it up), the other ranks' warnings only."""
    from gputrain.runtime.distributed import is_main_process

    logger = logging.getLogger("gputrain")
    if logger.handlers:
        return
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter("%(message)s"))
    logger.addHandler(handler)
    logger.setLevel(logging.WARNING if quiet or not is_main_process() else logging.INFO)
    logger.propagate = False
