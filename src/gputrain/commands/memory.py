"""`gputrain memory WORKLOAD`: where a training step's memory goes, what fits, and what would save memory."""

from __future__ import annotations

import argparse
import json
import math
from dataclasses import dataclass
from typing import Any

from gputrain.fields import boolean, one_of, positive_int, positive_int_arg, setting
from gputrain.report.format import format_bytes as fmt_bytes

SAMPLE = 16  # samples in the measured batch (the estimate fits a line through it and its half)
DEFAULT_MAX_BATCH = 2**20  # the search stops here unless --max-batch says otherwise
OPTIMIZERS = ("adamw", "adam", "sgd", "rmsprop", "adagrad", "none")  # whose state a step holds (diagnostics/probe.py)
# The TrainConfig fields `memory` takes from the command line (as `gputrain fit` declares them);
# --config's file may set any of [train].
RUN_FLAGS = ("batch_size", "precision", "device")


def _bytes_arg(value: str) -> int:
    """1000000, 512MiB, 8GiB, 2GB, 1.5G ..."""
    text = value.strip().lower().replace(" ", "")
    units = {"": 1, "b": 1, "k": 1024, "kb": 1000, "kib": 1024, "m": 1024**2, "mb": 1000**2, "mib": 1024**2,
             "g": 1024**3, "gb": 1000**3, "gib": 1024**3, "t": 1024**4, "tb": 1000**4, "tib": 1024**4}
    num = text.rstrip("kmgtib")
    unit = text[len(num):]
    try:
        n = float(num)
    except ValueError:
        n = -1
    if unit not in units or n <= 0:
        raise argparse.ArgumentTypeError(f"expected a size in bytes such as 4000000, 512MiB or 8GiB, got {value!r}")
    return int(n * units[unit])


@dataclass
class MemorySettings:
    """What `gputrain memory` counts and searches, besides the run whose step it measures."""

    optimizer: str = setting("adamw", flag="--optimizer", choices=OPTIMIZERS, choices_first=True,
                             check=one_of(OPTIMIZERS), help="whose state to count (sgd: with momentum)")
    find_max: bool = setting(False, flag="--find-max", action="store_true", check=boolean,
                             help="search for the largest batch that fits")
    limit: int | None = setting(None, flag="--limit", parse=_bytes_arg, metavar="BYTES",
                                check=positive_int(optional=True),
                                help="pretend the device has BYTES of memory (e.g. 512MiB): a dry run of --find-max on "
                                     "any device")
    max_batch: int = setting(DEFAULT_MAX_BATCH, flag="--max-batch", parse=positive_int_arg, check=positive_int(),
                             help=f"--find-max searches up to this batch (default {DEFAULT_MAX_BATCH:,})")
    json: bool = setting(False, flag="--json", action="store_true", check=boolean, help="print the report as JSON")


def add_arguments(p: argparse.ArgumentParser) -> None:
    from gputrain.runs.flags import add_flags, add_spec_arguments

    p.add_argument("workload", nargs="?", default=argparse.SUPPRESS,
                   help="a built-in workload (gputrain fit --list) or module:function (default: --config's)")
    p.add_argument("--config", default=None, metavar="FILE",
                   help="a run's TOML file (workload, [options], [train]; RUN_DIR/config.toml measures that run's "
                        "step); flags given here override it")
    add_spec_arguments(p, train=RUN_FLAGS, fit=())
    add_flags(p, MemorySettings, ("optimizer", "find_max", "limit", "max_batch"))
    p.add_argument("--data-dir", default=argparse.SUPPRESS, help="folder of a local data set (cifar10-cnn, mnist-cnn)")
    add_flags(p, MemorySettings, ("json",))


def device_capacity(device, stats: dict[str, Any], limit: int | None = None) -> tuple[int, str]:
    """(bytes, label) a step's memory is judged against: --limit, else the CUDA device's total
    memory, else the host's available memory (MPS and the CPU share it)."""
    if limit is not None:
        return limit, "--limit"
    if device.type == "cuda":
        return stats["total_bytes"], "device memory"
    return stats["free_bytes"], "available host memory"


def memory_report(workload, config, settings: MemorySettings) -> dict[str, Any]:
    """Everything `gputrain memory` shows, as data: the estimate, the step fit runs (the probe,
    diagnostics/probe.py) measured at the batch size, the largest batch, and what would save memory.
    workload: the Workload; config: the TrainConfig of the run whose step is measured."""
    import torch

    from gputrain.diagnostics.advice import recommendations
    from gputrain.diagnostics.estimate import estimate_memory, max_batch_from_estimate
    from gputrain.diagnostics.memory_stats import memory_stats
    from gputrain.diagnostics.probe import StepProbe, probe_batches
    from gputrain.errors import ConfigError
    from gputrain.runtime.devices import pick_device
    from gputrain.runtime.oom import free_after_oom, is_oom
    from gputrain.train.step.loss import LossRule

    device = pick_device(config.device)
    config = config.replace(device=str(device))
    batch_size = config.batch_size
    data = workload.make_data()
    torch.manual_seed(0)
    model = workload.make_model().to(device)
    loss = LossRule(loss_fn=workload.loss_fn, compute_loss=workload.compute_loss)
    with StepProbe(model, loss, config, optimizer=settings.optimizer) as probe:
        make_batch = probe_batches(data, probe)
        if make_batch is None:
            raise ConfigError(f"gputrain memory estimates workloads whose data are tensor columns (a tuple of tensors "
                              f"or a dict of equal-length tensors); {workload.name} trains on a Dataset or DataLoader: "
                              "measure it with `gputrain profile` (peak memory per step) or fit's summary "
                              "(peak_memory_bytes)")
        precision = probe.precision.precision
        few = min(SAMPLE, batch_size, make_batch.n)
        estimate = estimate_memory(model, make_batch(few if few >= 2 else min(2, batch_size)), settings.optimizer,
                                   precision, batch_size=batch_size, loss=loss, probe=probe)
        stats = memory_stats(device)
        capacity, capacity_label = device_capacity(device, stats, settings.limit)
        try:
            measured = probe.measure(make_batch(batch_size))
        except Exception as exc:  # noqa: BLE001 - an OOM is a finding here, not a failure
            if not is_oom(exc):
                raise
            measured = {"peak_bytes": None, "measured": device.type == "cuda", "batch_size": batch_size,
                        "method": f"out of memory at batch {batch_size}"}
        free_after_oom(device)
        search = _max_batch(settings, probe, make_batch, batch_size)
    search["predicted_from_estimate"] = max_batch_from_estimate(estimate, capacity)
    return {
        "workload": workload.name,
        "device": str(device),
        "device_stats": stats,
        "precision": precision.name,
        "precision_reason": precision.reason,
        "batch_size": batch_size,
        "step": {"optimizer": probe.optimizer_desc, "switches": probe.speed.decisions(),
                 "recompute": probe.recomputed},
        "capacity_bytes": capacity,
        "capacity_label": capacity_label,
        "estimate": estimate,
        "measured": measured,
        "max_batch": search,
        "recommendations": recommendations(estimate, capacity, precision, device),
    }


def _max_batch(settings: MemorySettings, probe, make_batch, batch_size: int) -> dict[str, Any]:
    """--find-max: the largest batch whose step runs (CUDA) or fits --limit; a note where it cannot run."""
    from gputrain.diagnostics.batch_search import batch_trial, find_max_batch
    from gputrain.runtime.oom import free_after_oom

    device = probe.device
    search: dict[str, Any] = {"requested": bool(settings.find_max)}
    if not settings.find_max:
        return search
    if device.type != "cuda" and settings.limit is None:
        search["result"] = None
        search["note"] = (f"finding the largest batch needs a device with bounded memory: on {device.type} the "
                          "OS swaps instead of failing. Run it on a CUDA GPU, or pass --limit BYTES for a dry run "
                          "against a pretend memory size")
        return search
    trial = batch_trial(probe, make_batch, limit_bytes=settings.limit)
    result = find_max_batch(trial, start=max(1, min(batch_size, settings.max_batch)), limit=settings.max_batch,
                            device=device)
    search["result"] = result
    search["limit"] = settings.max_batch
    search["how"] = ("real training steps until CUDA ran out of memory" if settings.limit is None
                     else f"steps measured against --limit {settings.limit:,} B"
                     + (" (CUDA peak)" if device.type == "cuda" else " (CPU estimate)"))
    if result >= settings.max_batch:
        search["note"] = f"stopped at --max-batch {settings.max_batch:,}: a larger batch may fit"
    free_after_oom(device)
    return search


def render(report: dict[str, Any], console) -> None:
    from rich.table import Table

    est = report["estimate"]
    cap = report["capacity_bytes"]
    table = Table(title=f"{report['workload']}: memory of one training step at batch {report['batch_size']:,} "
                        f"({report['precision']}, {est['optimizer']}, {report['device']})")
    table.add_column("part")
    table.add_column("bytes", justify="right")
    table.add_column(f"of {report['capacity_label']}", justify="right")
    table.add_column("how it is counted")
    rows = [
        ("parameters", est["parameter_bytes"], f"{est['parameters']:,} parameters" + (
            f": {est['trainable_parameters']:,} trainable, {est['frozen_parameters']:,} frozen"
            if est.get("frozen_parameters") else ", all trainable")),
        ("gradients", est["gradient_bytes"], f"{est['trainable_parameters']:,} trainable"),
        ("optimizer state", est["optimizer_state_bytes"], f"{est['optimizer_states_per_parameter']} x gradients"),
        ("activations", est["activation_bytes"],
         f"{fmt_bytes(est['activation_bytes_per_sample'])}/sample x {est['batch_size']:,} + "
         f"{fmt_bytes(est['activation_bytes_fixed'])} fixed"),
    ]
    def share(b: int) -> str:
        if not cap:
            return "-"
        pct = 100 * b / cap
        return f"{pct:.2f}%" if pct >= 0.01 or b == 0 else "<0.01%"

    for name, b, how in rows:
        table.add_row(name, fmt_bytes(b), share(b), how)
    table.add_row("[bold]total (estimate)", f"[bold]{fmt_bytes(est['total_bytes'])}", share(est["total_bytes"]), "")
    console.print(table)
    console.print(f"[dim]not counted: {est['not_counted']}")

    m = report["measured"]
    label = "measured peak" if m["measured"] else "step estimate at this batch"
    console.print(f"{label}: [bold]{fmt_bytes(m['peak_bytes'])}[/] ({m['method']})")
    step = report["step"]
    switches = ", ".join(f"{d['name']} {d['value']}" for d in step["switches"])
    console.print(f"[dim]the step fit runs: {step['optimizer']}, {switches}"
                  + (f", recompute {', '.join(step['recompute'])}" if step["recompute"] else ""))
    console.print(f"{report['capacity_label']}: {fmt_bytes(cap)}")
    s = report["max_batch"]
    console.print(f"largest batch by the estimate: [bold]{s['predicted_from_estimate']:,}[/] "
                  f"(fits {fmt_bytes(cap)} {report['capacity_label']})")
    if s["requested"]:
        if s.get("result") is not None:
            console.print(f"largest batch that ran: [bold]{s['result']:,}[/] ({s['how']})")
        if s.get("note"):
            console.print(f"[yellow]{s['note']}")
    else:
        console.print("[dim]--find-max searches for the largest batch that runs")

    recs = report["recommendations"]
    if recs:
        t = Table(title="to need less memory")
        for col in ("change", "saves", "total after", "setting"):
            t.add_column(col, justify="right" if col in ("saves", "total after") else "left")
        for r in recs:
            t.add_row(r["what"], fmt_bytes(r["saves_bytes"]), fmt_bytes(r["total_bytes_after"]), r["how"])
        console.print(t)


def run(args) -> int:
    from gputrain.runs.flags import given, stated_run
    from gputrain.runs.resolve import resolve_measured
    from gputrain.runs.train import decided

    settings = MemorySettings(**given(args, MemorySettings))
    spec, workload = resolve_measured(stated_run(args, train=RUN_FLAGS, fit=(), extras=("workload", "data_dir")))
    config, _ = decided(spec, workload)  # --batch-size auto: the largest that fits, as fit searches it
    report = memory_report(workload, config, settings)
    if settings.json:
        print(json.dumps(report, indent=2, default=lambda o: None if isinstance(o, float) and math.isnan(o) else str(o)))
        return 0
    from rich.console import Console

    render(report, Console())
    return 0
