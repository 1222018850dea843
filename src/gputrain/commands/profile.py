"""`gputrain profile WORKLOAD`: profile a few training steps, show where the time goes and what bounds them."""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gputrain.fields import boolean, positive_int, positive_int_arg, setting

# The TrainConfig fields a profile takes from the command line (as `gputrain fit` declares them);
# --config's file may set any of [train].
RUN_FLAGS = ("batch_size", "precision", "device", "log_every", "data_on_device")


@dataclass
class ProfileSettings:
    """What `gputrain profile` measures and shows, besides the run it profiles."""

    steps: int = setting(20, flag="--steps", parse=positive_int_arg, check=positive_int(),
                         help="timed steps for the breakdown (default 20)")
    active: int = setting(3, flag="--active", parse=positive_int_arg, check=positive_int(),
                          help="steps recorded by torch.profiler (default 3)")
    out: str | None = setting(None, flag="--out", metavar="DIR",
                              help="where trace.json and profile_summary.json go (default runs/WORKLOAD/profile-TIME)")
    top: int = setting(12, flag="--top", parse=positive_int_arg, check=positive_int(), help="rows of the top-ops table")
    json: bool = setting(False, flag="--json", action="store_true", check=boolean, help="print the summary as JSON")


def add_arguments(p: argparse.ArgumentParser) -> None:
    from gputrain.runs.flags import add_flags, add_spec_arguments

    p.add_argument("workload", nargs="?", default=argparse.SUPPRESS,
                   help="a built-in workload (gputrain fit --list) or module:function (default: --config's)")
    p.add_argument("--config", default=None, metavar="FILE",
                   help="a run's TOML file (workload, [options], [train]; RUN_DIR/config.toml profiles that run); "
                        "flags given here override it")
    add_flags(p, ProfileSettings, ("steps", "active"))
    add_spec_arguments(p, train=RUN_FLAGS, fit=())
    p.add_argument("--data-dir", default=argparse.SUPPRESS, help="folder of a local data set (cifar10-cnn, mnist-cnn)")
    add_flags(p, ProfileSettings, ("out", "top", "json"))


def _ms(x: float | None) -> str:
    if x is None:
        return "-"
    return f"{x * 1000:.1f} us" if x < 1 else f"{x:.2f} ms"


def render(s: dict[str, Any], console) -> None:
    from rich.table import Table

    console.print(f"[bold]{s['workload']}[/] on {s['device']} ({s['device_name']}), {s['precision']}, "
                  f"batch {s['batch_size']:,}, data {s['data']}")
    lo, hi = s["phased_step_ms_spread"]
    console.print(f"step: [bold]{_ms(s['step_ms'])}[/] per step as fit runs it (median of {len(s['step_ms_chunks'])} "
                  f"timed chunks, CUDA graphs {s['cuda_graphs']}), {s['samples_per_s']:,.0f} samples/s")
    console.print(f"the same step run eagerly in phases: {_ms(s['phased_step_ms'])} median (min {_ms(lo)}, max {_ms(hi)})")

    t = Table(title="where an eager step's time goes")
    on_gpu = s["device"].startswith("cuda")
    for col in ("phase", "time", "share", "host time") + (("device time",) if on_gpu else ()):
        t.add_column(col, justify="left" if col == "phase" else "right")
    for row in s["breakdown"]:
        cells = [row["phase"], _ms(row["ms"]), f"{100 * row['share']:.1f}%", _ms(row["host_ms"])]
        if on_gpu:
            cells.append(_ms(row["device_ms"]))
        t.add_row(*cells)
    console.print(t)

    t = Table(title=f"top ops by {s['top_ops_by']} (per step, {s['profiled_steps']['active']} profiled steps)")
    for col in ("op", "calls", "self", "share", "total"):
        t.add_column(col, justify="left" if col == "op" else "right")
    key, tot = (("self_device_ms_per_step", "device_ms_per_step") if on_gpu
                else ("self_cpu_ms_per_step", "cpu_ms_per_step"))
    for r in s["top_ops"]:
        t.add_row(r["name"][:60], f"{r['calls_per_step']:g}", _ms(r[key]), f"{100 * r['share']:.1f}%", _ms(r[tot]))
    console.print(t)

    tr = s["trace"]
    if tr.get("kernels_per_step") is not None:
        console.print(f"kernels: {tr['kernels_per_step']:.0f} per step, median {tr['median_kernel_us'] or 0:.1f} us; "
                      f"GPU busy {100 * (tr['gpu_busy'] or 0):.0f}% of the profiled steps; "
                      f"{tr['syncs_per_step']:g} synchronizing call(s) per step")
    util = s.get("gpu_utilization")
    if util:
        console.print(f"NVML GPU utilization: mean {util['mean_pct']:.0f}% ({util['samples']} samples)")
    elif on_gpu:
        console.print(f"[dim]NVML GPU utilization: not available ({s.get('gpu_utilization_note')})")
    flops = s["flops_per_step"]
    if s.get("mfu") is not None:
        console.print(f"MFU: [bold]{100 * s['mfu']:.1f}%[/] ({flops / 1e9:.3f} GFLOP/step, "
                      f"{s['achieved_tflops']:.2f} of {s['peak_tflops']:g} TFLOP/s {s['precision']} peak)")
    else:
        console.print(f"FLOPs: {flops / 1e9:.3f} GFLOP/step, {s['achieved_tflops'] * 1000:.2f} GFLOP/s achieved; "
                      "MFU: no peak figure for this device")

    syncs = s["syncs"]
    if syncs["supported"]:
        console.print(f"syncs (CUDA sync debug mode): {syncs['per_step']:g} per step")
        for site in syncs["sites"][:8]:
            console.print(f"  {site['file']}:{site['line']}  {site['code']}  [dim]{site['what']}, "
                          f"{site['per_step']:g}/step")
    else:
        console.print(f"[yellow]sync detector: {syncs['reason']}")
    reads = s["host_reads"]
    if reads["sites"]:
        console.print(f"host reads of tensors (each syncs on a GPU): {reads['per_step']:g} per step")
        for site in reads["sites"][:8]:
            console.print(f"  {site['file']}:{site['line']}  {site['code']}  [dim]{site['what']}, "
                          f"{site['per_step']:g}/step")
    else:
        console.print("host reads of tensors: none in the profiled steps")

    v = s["verdict"]
    console.print(f"\nverdict: [bold]{v['verdict']}[/]")
    for e in v["evidence"]:
        console.print(f"  - {e}")
    if v["suggestions"]:
        console.print("try:")
        for x in v["suggestions"]:
            console.print(f"  - {x}")
    for x in v["also"]:
        console.print(f"  [dim]also: {x}")
    console.print(f"\nChrome trace: {s['files']['trace']} (open in chrome://tracing or ui.perfetto.dev)")
    console.print(f"summary: {s['files']['summary']}")


def run(args) -> int:
    from gputrain.diagnostics.profile import profile_workload
    from gputrain.runs.flags import given, stated_run
    from gputrain.runs.resolve import resolve_measured
    from gputrain.runs.train import decided

    settings = ProfileSettings(**given(args, ProfileSettings))
    spec, workload = resolve_measured(stated_run(args, train=RUN_FLAGS, fit=(), extras=("workload", "data_dir")))
    config, _ = decided(spec, workload)  # --batch-size auto: the largest that fits, as fit searches it
    out = settings.out or os.path.join("runs", workload.name.replace(":", "_").replace("/", "_"),
                                       "profile-" + _dt.datetime.now().strftime("%Y%m%d-%H%M%S"))
    from gputrain.io.preflight import check_output_dir

    check_output_dir(out, "--out")  # before the steps run: a bad --out costs nothing
    summary = profile_workload(workload, config, steps=settings.steps, active=settings.active, out_dir=Path(out),
                               top=settings.top)
    if settings.json:
        print(json.dumps(summary, indent=2, default=str))
        return 0
    from rich.console import Console

    render(summary, Console())
    return 0
