"""`gputrain fit --autotune`: a short trial of candidate switch sets on the real workload.

Each candidate (cuda_graphs, channels_last, precision, compile) runs a few real training steps
through `Trainer.train_one_step`; the fastest by samples/s wins. On CUDA the winner is then tried
compiled, and, when it ran in gputrain's whole-step CUDA graph, also with compile's own CUDA graphs
(mode "reduce-overhead": cudagraph trees around the model, gputrain's graph off): which of the two
replays a compiled step faster depends on the model, so it is measured, not assumed. The choice is
cached per (model
signature, device, batch shape, torch version, untried config fields) so the next run skips the
trial. The batch size and accumulation are never changed: the effective batch stays as configured.
"""

from __future__ import annotations

import hashlib
import json
import logging
import time
from pathlib import Path
from typing import Any, Callable

import torch
from torch import nn

from gputrain.runtime.devices import cuda_capability_flags, device_name

log = logging.getLogger("gputrain")

TRIED_FIELDS = ("cuda_graphs", "channels_last", "precision", "compile")
TREES_MODE = "reduce-overhead"  # torch.compile with its own CUDA graphs (cudagraph trees)
DEFAULT_STEPS = 5
WARMUP_STEPS = 2  # compile / capture / cudnn autotuning happen here (reported as compile_s)


def default_cache_path() -> Path:
    from gputrain.workloads.datasets import cache_root

    return cache_root() / "autotune.json"


def _is_conv_net(model: nn.Module) -> bool:
    return any(isinstance(m, (nn.Conv2d, nn.Conv3d)) for m in model.modules())


def candidates(config, device: torch.device, model: nn.Module, include_compile: bool | None = None) -> list[dict]:
    """TrainConfig overrides to try (not compiled; the compiled variant of the winner is tried after).

    CUDA: cuda_graphs on/off x precision (bf16, or fp16 without bf16; and fp32), plus channels_last
    with the low precision for conv nets: at most 6 sets, and 1 compiled set after them (<= 7).
    CPU/MPS: precision fp32/bf16 x channels_last on/off for conv nets (<= 4): the measurement that fit's
    own first step makes for long runs (train/step/layout.py). A channels_last set whose step failed in NHWC
    (and ran again in the user's layout) is an error row, never the winner.
    `include_compile` is used by `autotune` (default: on CUDA only).
    """
    conv = _is_conv_net(model)
    out: list[dict] = []
    if device.type == "cuda":
        # The capability of `device`, as resolve_precision decides: torch.cuda.is_bf16_supported()
        # asks the current device and says True on a V100/T4 too (bf16 emulated), where bf16 is refused.
        low = "bf16" if cuda_capability_flags(*torch.cuda.get_device_capability(device))["bf16"] else "fp16"
        for graphs in (True, False):
            for precision in (low, "fp32"):
                out.append({"cuda_graphs": graphs, "channels_last": False, "precision": precision, "compile": False})
            if conv:
                out.append({"cuda_graphs": graphs, "channels_last": True, "precision": low, "compile": False})
    else:
        for precision in ("fp32", "bf16"):
            for cl in ((False, True) if conv else (False,)):
                out.append({"cuda_graphs": False, "channels_last": cl, "precision": precision, "compile": False})
    return out


def compile_choice(model: nn.Module) -> bool | str:
    """"regional" for a model whose repeated blocks hold most of its weights (compiled once, a
    shorter trial and a shorter start; runtime/compile_regions.py), else True (the whole model)."""
    from gputrain.runtime.compile_regions import MIN_SHARE, find_repeated_blocks

    found = find_repeated_blocks(model)
    return "regional" if found is not None and found.share >= MIN_SHARE else True


def run_trial(workload, config, overrides: dict, steps: int = DEFAULT_STEPS, warmup: int = WARMUP_STEPS) -> dict:
    """Time `steps` real training steps of `workload` under `config` + `overrides`; a row of the table.

    An exception (OOM, a failed compile, an unsupported precision) becomes status "error: ...".
    """
    from gputrain.runtime.devices import synchronizer
    from gputrain.train import Trainer

    row: dict[str, Any] = {"overrides": dict(overrides), "samples_per_s": None, "step_ms": None,
                           "peak_memory": None, "compile_s": None, "graphs": None, "status": "ok"}
    trainer = None
    try:
        cfg = config.replace(**overrides, steps=10**9, epochs=None, log_every=10**9, run_dir=None, resume=False,
                             progress=False, stop_at_step=None)
        torch.manual_seed(cfg.seed)
        trainer = Trainer(workload.make_model(), workload.make_data(), config=cfg, task=workload.task,
                          **workload.loss_kwargs())
        device = trainer.parts.device
        sync = synchronizer(device)
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        if trainer.graph_status() == "on":  # cuda-only; eager warm-up steps, then the capture, stay out of the timing
            from gputrain.train.step.graphs import WARMUP_STEPS as GRAPH_WARMUP

            warmup = max(warmup, GRAPH_WARMUP + 2)
        t0 = time.perf_counter()
        for _ in range(warmup):
            trainer.train_one_step()
        sync()
        t1 = time.perf_counter()
        for _ in range(steps):
            trainer.train_one_step()
        sync()
        elapsed = time.perf_counter() - t1
        row["compile_s"] = t1 - t0
        row["step_ms"] = 1000 * elapsed / steps
        row["samples_per_s"] = cfg.batch_size * cfg.accumulate * steps / max(elapsed, 1e-9)
        if device.type == "cuda":
            row["peak_memory"] = int(torch.cuda.max_memory_allocated(device))
        if overrides.get("channels_last") and not trainer.parts.speed.channels_last:
            # A step failed in NHWC and ran again in the user's layout (train/step/layout.py): this set is not NHWC.
            row["status"] = f"error: channels_last refused: {trainer.parts.speed.reasons['channels_last']}"[:300]
        try:
            row["graphs"] = trainer.graph_status()
        except Exception:  # noqa: BLE001 - reporting only
            row["graphs"] = None
    except Exception as exc:  # noqa: BLE001 - a failing candidate is a row, not a crash
        row["status"] = f"error: {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"[:300]
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    finally:
        if trainer is not None:
            trainer.close()
        del trainer
    return row


def cache_key(workload, config, device: torch.device) -> tuple[str, dict]:
    """(hash, what it hashes): model signature, device name, batch signature, torch version, untried fields."""
    from gputrain import batch as batches

    where = device_name(device) if device.type == "cuda" else f"{device.type}:{device_name(device)}"
    model = workload.make_model()
    params = [(n, tuple(p.shape), str(p.dtype)) for n, p in model.named_parameters()]
    data = workload.make_data()
    x, y = data.train if isinstance(data.train, (tuple, list)) and len(data.train) == 2 else (data.train, None)
    try:
        one = (x[: config.batch_size], y[: config.batch_size]) if y is not None else None
        batch_sig = str(batches.signature(one)) if one is not None else type(data.train).__name__
    except Exception:  # noqa: BLE001 - an unusual data container: its type stands in
        batch_sig = type(data.train).__name__
    cfg = config.to_dict()
    untried = {k: cfg[k] for k in sorted(cfg) if k not in TRIED_FIELDS and k in
               ("batch_size", "accumulate", "data_on_device", "cudnn_benchmark", "fused_optimizer",
                "compile_mode", "recompute", "max_grad_norm", "shard")}
    parts = {"model": type(model).__name__, "params": repr(params), "device": where,
             "batch": batch_sig, "torch": torch.__version__, "config": repr(untried)}
    digest = hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()[:24]
    return digest, parts


def _read_cache(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}


def _write_cache(path: Path, key: str, entry: dict) -> None:
    from gputrain.io.atomic import atomic_file

    data = _read_cache(path)
    data[key] = entry
    try:
        with atomic_file(path, "w") as f:
            json.dump(data, f, indent=2, default=str)
    except OSError as exc:  # the choice measured stands; only its reuse by the next run is lost
        from gputrain.workloads.datasets import cache_error

        log.warning("autotune: the choice is used but not kept: %s", cache_error(path, exc))


def _batch_note(config) -> str:
    eff = config.batch_size * config.accumulate
    acc = f" x {config.accumulate} accumulated" if config.accumulate > 1 else ""
    return f"kept at {config.batch_size}{acc} = {eff} (autotune does not change the effective batch)"


def autotune(workload, config, steps: int = DEFAULT_STEPS, cache_path: str | Path | None = None,
             force: bool = False, include_compile: bool | None = None,
             trial: Callable | None = None, device: torch.device | None = None) -> tuple[Any, dict]:
    """Try the candidates on `workload`, keep the fastest; returns (config with the choice, report).
    device: the run's, where the caller decided it (runs/train.py); else config.device's."""
    from gputrain.runtime.distributed import process_device

    trial = trial or run_trial
    device = device if device is not None else process_device(config.device)
    config = config.replace(device=str(device))
    path = Path(cache_path) if cache_path is not None else default_cache_path()
    key, parts = cache_key(workload, config, device)
    report: dict[str, Any] = {"rows": [], "choice": None, "cached": False, "key": key, "cache_path": str(path),
                              "device": parts["device"], "batch": _batch_note(config), "steps": steps}
    resumed = resumed_choice(config)
    if resumed is not None:  # the choice the run was measured with, not a new measurement
        choice, where = resumed
        report.update(choice=choice, from_checkpoint=where)
        log.info("autotune: the resumed run's choice %s (recorded in %s); nothing measured", _describe(choice), where)
        return config.replace(**choice), report
    if not force:
        entry = _read_cache(path).get(key)
        if entry and isinstance(entry.get("choice"), dict):
            report.update(rows=entry.get("rows", []), choice=entry["choice"], cached=True)
            log.info("autotune: cached choice %s (from %s); --autotune-force to measure again",
                     _describe(entry["choice"]), path)
            return config.replace(**entry["choice"]), report

    if include_compile is None:
        include_compile = device.type == "cuda"
    cands = candidates(config, device, workload.make_model())
    rows = []
    for overrides in cands:
        log.info("autotune: trying %s", _describe(overrides))
        rows.append(trial(workload, config, overrides, steps))
    ok = [r for r in rows if r["status"] == "ok" and r["samples_per_s"]]
    if include_compile and ok:
        best = max(ok, key=lambda r: r["samples_per_s"])
        how = compile_choice(workload.make_model())
        tries: list[dict[str, Any]] = [dict(best["overrides"], compile=how)]
        if best["overrides"].get("cuda_graphs") and config.compile_mode in (None, "default"):
            tries.append(dict(best["overrides"], compile=how, compile_mode=TREES_MODE, cuda_graphs=False))
        for compiled in tries:
            log.info("autotune: trying %s", _describe(compiled))
            rows.append(trial(workload, config, compiled, steps))
        ok = [r for r in rows if r["status"] == "ok" and r["samples_per_s"]]
    report["rows"] = rows
    if not ok:
        log.warning("autotune: every candidate failed; training with the configured switches")
        return config, report
    best = max(ok, key=lambda r: r["samples_per_s"])
    for r in rows:
        r["chosen"] = r is best
    choice = dict(best["overrides"])
    report["choice"] = choice
    _write_cache(path, key, {"choice": choice, "rows": rows, "key_parts": parts,
                             "written": time.strftime("%Y-%m-%dT%H:%M:%S")})
    log.info("autotune: chose %s (%.0f samples/s); batch %s", _describe(choice), best["samples_per_s"],
             report["batch"])
    return config.replace(**choice), report


def resumed_choice(config) -> tuple[dict, str] | None:
    """A resumed run's autotuned switches, as its checkpoint recorded the config it trained with
    (config.resume: a checkpoint, or True for the run directory's newest), and where; None when the run
    is not resumed or no checkpoint is there yet. Timing picks once: a resume takes that pick again, so
    the resumed run computes what the uninterrupted one would have."""
    from gputrain.checkpoint import CheckpointStore, read_checkpoint

    if not config.resume:
        return None
    path = Path(config.resume) if isinstance(config.resume, str) else None
    if path is None and config.run_dir:
        path = CheckpointStore(Path(config.run_dir)).latest_path()
    if path is None or not path.exists():
        return None
    saved = read_checkpoint(path, weights=False).get("config") or {}
    choice = {k: saved[k] for k in (*TRIED_FIELDS, "compile_mode") if k in saved}
    return (choice, str(path)) if choice else None


def _describe(overrides: dict) -> str:
    def v(x):
        return "on" if x is True else "off" if x is False else str(x)

    text = ", ".join(f"{k}={v(overrides[k])}" for k in TRIED_FIELDS if k in overrides)
    return text + (f" (mode {overrides['compile_mode']})" if overrides.get("compile_mode") else "")


def _graphs_cell(requested, status: str | None) -> str:
    """'on' / 'off'; 'on (not used)' when graphs were asked for but the step ran eagerly."""
    if not requested:
        return "off"
    used = status is None or not str(status).lower().startswith("off")
    return "on" if used else "on (not used)"


def render_report(report: dict, console) -> None:
    """The trial table and the choice (rich)."""
    from rich.table import Table

    title = "autotune" + (" (cached: " + report.get("cache_path", "") + ")" if report.get("cached") else "") + (
        " (the resumed run's choice: " + report["from_checkpoint"] + ")" if report.get("from_checkpoint") else "")
    table = Table(title=title)
    for col in ("graphs", "channels_last", "precision", "compile", "samples/s", "step ms", "memory",
                "compile s", "status"):
        table.add_column(col)
    for r in report.get("rows", []):
        o = r.get("overrides", {})
        mem = r.get("peak_memory")
        table.add_row(
            _graphs_cell(o.get("cuda_graphs"), r.get("graphs")),
            "on" if o.get("channels_last") else "off", str(o.get("precision")),
            (o.get("compile_mode") or ("regional" if o.get("compile") == "regional" else "on")) if o.get("compile")
            else "off",
            f"{r['samples_per_s']:,.0f}" if r.get("samples_per_s") else "-",
            f"{r['step_ms']:.2f}" if r.get("step_ms") else "-",
            f"{mem / 2**20:,.0f} MiB" if mem else "-",
            f"{r['compile_s']:.2f}" if r.get("compile_s") is not None else "-",
            ("* chosen" if r.get("chosen") else r.get("status", "")) if r.get("status") == "ok" else r.get("status"),
        )
    console.print(table)
    console.print(f"choice: {_describe(report['choice']) if report.get('choice') else 'none (configured switches)'}")
    console.print(f"batch: {report.get('batch')}")
