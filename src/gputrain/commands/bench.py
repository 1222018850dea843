"""`gputrain bench BENCHMARK`: run a benchmark, print a table (or JSON), write plots and JSON with --out.

    gputrain bench matmul [--sizes 128 256 ...] [--dtypes fp32 bf16] [--cpu-max-size 2048]
    gputrain bench transfer [--sizes 4K 1M 1G]
    gputrain bench crossover [--widths 16 256 4096]
    gputrain bench precision [--workloads cifar-cnn wide-mlp] [--steps N] [--batch-size B]
    gputrain bench memory [--workload cifar-cnn] [--batch-sizes 16 32] [--max-batch N]
    gputrain bench all --out DIR          # every benchmark, plots, JSON and DIR/index.md

Common flags: --quick (tiny grids, for smoke tests), --json (print the result as JSON),
--out DIR (write <name>_<device>_<date>.json and PNG plots there), --device (auto, cpu, cuda:N).
On a GPU machine, `--out benchmarks/results` files the results where the project keeps them.
"""

from __future__ import annotations

import argparse
import json
import re
from dataclasses import dataclass
from typing import Any

from gputrain.commands.argtypes import positive_int as _positive_int
from gputrain.fields import boolean, setting

NAMES = ("matmul", "transfer", "crossover", "precision", "memory")


@dataclass
class BenchOptions:
    """What every benchmark takes (its flags generated as fit's are: gputrain/runs/flags.py)."""

    quick: bool = setting(False, flag="--quick", action="store_true", check=boolean,
                          help="tiny grids, sizes and step counts (smoke test)")
    json: bool = setting(False, flag="--json", action="store_true", check=boolean,
                         help="print the result as JSON instead of tables")
    out: str | None = setting(None, flag="--out", metavar="DIR", help="write the JSON result and PNG plots into DIR")
    device: str = setting("auto", flag="--device",
                          help="the GPU to compare with the CPU: auto (every CUDA GPU for matmul), cuda:N, or cpu "
                               "(CPU only)")


def _bytes(value: str) -> int:
    """'4096', '4K', '4KiB', '1M', '1G' -> bytes (binary units)."""
    m = re.fullmatch(r"\s*(\d+)\s*([kmg]?)(i?b)?\s*", value.lower())
    if not m:
        raise argparse.ArgumentTypeError(f"expected a size like 4096, 4K, 64M or 1G, got {value!r}")
    return int(m.group(1)) * {"": 1, "k": 1024, "m": 1024**2, "g": 1024**3}[m.group(2)]


def _sub(sub, name: str, common: argparse.ArgumentParser, help_text: str) -> argparse.ArgumentParser:
    return sub.add_parser(name, parents=[common], help=help_text, description=help_text.replace("%%", "%"))


def add_arguments(p: argparse.ArgumentParser) -> None:
    from gputrain.bench.settings import MemoryBench, PrecisionBench
    from gputrain.runs.flags import add_flags

    common = argparse.ArgumentParser(add_help=False)
    add_flags(common, BenchOptions)
    sub = p.add_subparsers(dest="benchmark", metavar="BENCHMARK")

    m = _sub(sub, "matmul", common, "square matmul TFLOP/s, %% of peak, GPU/CPU speed-up")
    m.add_argument("--sizes", nargs="+", type=_positive_int, metavar="N", help="matrix sizes (default 128..8192, doubling)")
    m.add_argument("--dtypes", nargs="+", choices=["fp32", "tf32", "bf16", "fp16"], help="default: all four")
    m.add_argument("--cpu-max-size", type=_positive_int, metavar="N",
                   help="largest size measured on the CPU (default 2048; larger CPU products take too long)")

    t = _sub(sub, "transfer", common, "host <-> device GB/s: pageable/pinned, blocking/non_blocking")
    t.add_argument("--sizes", nargs="+", type=_bytes, metavar="BYTES", help="copy sizes (default 4K..1G, x4 steps)")

    c = _sub(sub, "crossover", common, "where the GPU starts to win: MLP step over width x data size")
    c.add_argument("--widths", nargs="+", type=_positive_int, metavar="W", help="MLP widths (default 16 64 256 1024 4096)")

    # the benchmarks that train: their settings declared with gputrain.fields.setting, as fit's
    add_flags(_sub(sub, "precision", common, "samples/s, memory and loss in fp32/tf32/bf16/fp16"), PrecisionBench)
    add_flags(_sub(sub, "memory", common, "memory vs batch size, with and without recompute, largest batch"),
              MemoryBench)

    _sub(sub, "all", common, "every benchmark into --out DIR (default bench-results) with index.md")
    p.set_defaults(_bench_parser=p)


def _kwargs(args: argparse.Namespace, options: BenchOptions) -> dict[str, Any]:
    from gputrain.bench.settings import MemoryBench, PrecisionBench
    from gputrain.runs.flags import given

    kw: dict[str, Any] = {"device": options.device, "quick": options.quick}
    name = args.benchmark
    if name == "matmul":
        kw.update(sizes=args.sizes, dtypes=args.dtypes, cpu_max_size=args.cpu_max_size)
    elif name == "transfer":
        kw.update(sizes=args.sizes)
    elif name == "crossover":
        kw.update(widths=args.widths)
    elif name == "precision":
        kw.update(given(args, PrecisionBench))
    elif name == "memory":
        kw.update(given(args, MemoryBench))
    return kw


def run(args: argparse.Namespace) -> int:
    if not getattr(args, "benchmark", None):
        args._bench_parser.print_help()
        return 2
    from gputrain.bench import BENCHMARKS
    from gputrain.bench.common import to_json, write_json
    from gputrain.io.preflight import check_output_dir
    from gputrain.runs.flags import given

    options = BenchOptions(**given(args, BenchOptions))
    if options.out or args.benchmark == "all":  # before minutes of measuring: a bad --out costs nothing
        check_output_dir(options.out or "bench-results", "--out")
    if args.benchmark == "all":
        return _run_all(options, BENCHMARKS)
    result = BENCHMARKS[args.benchmark](**_kwargs(args, options))
    written = []
    if options.out:
        from gputrain.bench.plots import plot

        written = [*plot(result, options.out), write_json(result, options.out)]
    if options.json:
        print(to_json(result))
    else:
        render(result)
        _print_files(written, options.out)
    return 0


def _run_all(options: BenchOptions, benchmarks) -> int:
    from gputrain.bench.common import to_json
    from gputrain.bench.index import run_all

    out = options.out or "bench-results"
    show = None if options.json else render
    results, index = run_all(benchmarks, out, device=options.device, quick=options.quick, on_result=show)
    if options.json:
        print(json.dumps({"index": str(index), "results": [json.loads(to_json(r)) for r in results]}, indent=2))
    else:
        _console().print(f"\n[bold]index:[/bold] {index}")
    return 0


# ---------------------------------------------------------------- rendering (rich)


def _console():
    from rich.console import Console

    return Console()


def _print_files(paths, out) -> None:
    console = _console()
    if paths:
        console.print("[bold]wrote:[/bold] " + ", ".join(str(p) for p in paths))
    elif not out:
        console.print("[dim]plots and JSON: add --out DIR[/dim]")


def _num(x, spec: str = ".3g") -> str:
    return "-" if x is None else format(x, spec)


def _mib(x) -> str:
    return "-" if x is None else f"{x / 2**20:.1f}"


def _cell(status: str) -> str:
    """A short cell for a row that has no number: why not."""
    if status.startswith("no GPU"):
        return "[yellow]no GPU[/yellow]"
    if status.startswith("n/a"):
        return "[dim]n/a[/dim]"
    if status.startswith("skipped"):
        return "[dim]skipped[/dim]"
    return f"[red]{status[:40]}[/red]"


def render(result: dict[str, Any]) -> None:
    """Print a result for people: a header, its table(s), the notes."""
    from rich.table import Table

    console = _console()
    env = result["environment"]
    console.print(f"\n[bold]{result['title']}[/bold]")
    console.print(f"[dim]{', '.join(d['device'] + ': ' + d['name'] for d in env['devices'])} | torch {env['torch']}"
                  f" | CUDA {env['cuda'] or 'none'} | driver {env['driver'] or 'none'} | {env['time']}[/dim]")
    if not result["gpu"]["available"]:
        console.print(f"[yellow]{result['gpu']['status']}[/yellow]")
    table = {"matmul": _matmul_table, "transfer": _transfer_table, "crossover": _crossover_table,
             "precision": _precision_table, "memory": _memory_table}[result["benchmark"]](result, Table)
    console.print(table)
    for note in result["notes"]:
        console.print(f"[dim]- {note}[/dim]")


def _matmul_table(result, Table):
    rows = result["rows"]
    gpus = result["gpu"]["devices"]
    t = Table(title="TFLOP/s (median) and GPU/CPU speed-up, same dtype")
    t.add_column("n", justify="right")
    t.add_column("dtype")
    t.add_column("CPU TFLOP/s", justify="right")
    for g in gpus or ["GPU"]:
        t.add_column(f"{g} TFLOP/s (% peak)", justify="right")
        t.add_column(f"{g} speed-up", justify="right")
    speed = {(s["size"], s["dtype"], s["gpu"]): s for s in result["summary"]["speedup"]}
    for n in result["config"]["sizes"]:
        for dtype in result["config"]["dtypes"]:
            get = {r["device"]: r for r in rows if r["size"] == n and r["dtype"] == dtype}
            cpu = get["cpu"]
            cells = [str(n), dtype, _num(cpu.get("tflops")) if cpu["status"] == "measured" else _cell(cpu["status"])]
            for g in gpus or [None]:
                r = get.get(g)
                if r is None:
                    cells += [_cell(result["gpu"]["status"]), _cell(result["gpu"]["status"])]
                    continue
                if r["status"] != "measured":
                    cells += [_cell(r["status"]), ""]
                    continue
                pct = f" ({r['pct_of_peak']:.0f}%)" if r.get("pct_of_peak") else ""
                s = speed.get((n, dtype, g), {}).get("speedup")
                cells += [f"{r['tflops']:.3g}{pct}", "-" if s is None else f"{s:.1f}x"]
            t.add_row(*cells)
    return t


def _transfer_table(result, Table):
    from gputrain.bench.transfer import HOST_MEMCPY

    rows = result["rows"]
    labels = list(dict.fromkeys(r["label"] for r in rows if r["label"] != HOST_MEMCPY))
    gpu = result["gpu"]["available"]
    t = Table(title="GB/s (median; 1 GB = 1e9 bytes)")
    t.add_column("bytes", justify="right")
    for label in labels if gpu else ["device transfers"]:
        t.add_column(label.replace("non_blocking", "non-blk"), justify="right")
    t.add_column("host memcpy (not a device copy)", justify="right")
    for nbytes in result["config"]["sizes_bytes"]:
        get = {r["label"]: r for r in rows if r["bytes"] == nbytes}
        cells = [_size(nbytes)]
        if gpu:
            for label in labels:
                r = get[label]
                cells.append(f"{r['gb_per_s']:.2f}" if r["status"] == "measured" else _cell(r["status"]))
        else:
            cells.append(_cell(result["gpu"]["status"]))
        h = get.get(HOST_MEMCPY)
        cells.append(f"{h['gb_per_s']:.2f}" if h and h["status"] == "measured" else _cell(h["status"] if h else "-"))
        t.add_row(*cells)
    return t


def _size(n: int) -> str:
    for unit, size in (("GiB", 1024**3), ("MiB", 1024**2), ("KiB", 1024)):
        if n >= size:
            return f"{n / size:g} {unit}"
    return f"{n} B"


def _crossover_table(result, Table):
    gpu = result["gpu"]["available"]
    t = Table(title="One training step: ms (median); speed-up = CPU / GPU, green where the GPU wins")
    cols = ["data", "batch", "width", "GFLOP/step", "CPU ms"]
    cols += ["GPU eager ms", "graph ms", "eager+item ms", "eager x", "graph x", "eager+item x"] if gpu else ["GPU"]
    for col in cols:
        t.add_column(col, justify="left" if col == "data" else "right")
    for r in result["rows"]:
        def ms(mode):
            x = r["times"].get(mode, {})
            return f"{x['median_s'] * 1e3:.3g}" if x.get("median_s") else _cell(x.get("status", "-"))

        def sp(mode):
            s = r["speedup"].get(mode)
            if s is None:
                return _cell(r["times"].get(mode, {}).get("status", "-"))
            return f"[green]{s:.2g}x[/green]" if s > 1 else f"{s:.2g}x"

        cells = [f"{r['data']} ({r['features']})", str(r["batch"]), str(r["width"]), f"{r['flops_per_step'] / 1e9:.3g}",
                 ms("cpu")]
        if gpu:
            cells += [ms("gpu_eager"), ms("gpu_graph"), ms("gpu_eager_sync"),
                      sp("gpu_eager"), sp("gpu_graph"), sp("gpu_eager_sync")]
        else:
            cells.append(_cell(result["gpu"]["status"]))
        t.add_row(*cells)
    return t


def _precision_table(result, Table):
    t = Table(title=f"Training by precision on {result['config']['device']} ({result['config']['device_name']})")
    for col in ("workload", "prec.", "samples/s", "vs fp32", "spread", "final loss", "peak MiB", "saved act. MiB"):
        t.add_column(col, justify="left" if col in ("workload", "prec.") else "right")
    cpu_note = False
    for r in result["rows"]:
        if r.get("status") != "measured":
            t.add_row(r["workload"], r["precision"], _cell(r["status"]), *[""] * 5)
            continue
        peak = r["peak_memory_bytes"]
        cpu_note |= peak is None
        t.add_row(r["workload"], r["precision"], f"{r['samples_per_s']:.4g}", _num(r.get("speedup_vs_fp32"), ".2f"),
                  f"{100 * r['spread']:.0f}%" if r.get("spread") is not None else "-", f"{r['final_loss']:.4g}",
                  _mib(peak) if peak is not None else "[dim]n/m[/dim]", _mib(r["saved_activation_bytes"]))
    if cpu_note:
        t.caption = "n/m: device memory not measurable here; saved act. = tensors saved for backward (one step)"
    return t


def _memory_table(result, Table):
    cfg = result["config"]
    t = Table(title=f"Memory by batch size: {cfg['workload']} on {cfg['device']} ({cfg['device_name']})")
    for col in ("recompute", "batch", "peak MiB", "saved act. MiB", "KiB/sample", "step ms",
                "act. vs plain", "time vs plain"):
        t.add_column(col, justify="right")
    for r in result["rows"]:
        if r["status"] != "measured":
            t.add_row("on" if r["recompute"] else "off", str(r["batch"]), f"[red]{r['status']}[/red]", *[""] * 5)
            continue
        t.add_row("on" if r["recompute"] else "off", str(r["batch"]),
                  _mib(r["peak_bytes"]) if r["peak_bytes"] is not None else "[dim]n/m[/dim]",
                  _mib(r["saved_activation_bytes"]), f"{r['saved_bytes_per_sample'] / 1024:.1f}",
                  f"{r['step_s'] * 1e3:.3g}", _num(r.get("activations_vs_plain"), ".2f"),
                  _num(r.get("time_vs_plain"), ".2f"))
    lines = [f"largest batch ({mode}): {v['largest_batch'] or '-'}, {v['note']}"
             for mode, v in result["summary"]["largest_batch"].items()]
    if any(r.get("peak_bytes") is None for r in result["rows"] if r["status"] == "measured"):
        lines.append("n/m: device memory not measurable here; saved act. = tensors saved for backward")
    t.caption = "\n".join(lines)
    return t
