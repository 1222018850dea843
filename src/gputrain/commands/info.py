"""`gputrain info`: what PyTorch was built with and every device it can use."""

from __future__ import annotations

import json


def add_arguments(p) -> None:
    p.add_argument("--json", action="store_true", help="print JSON for programs")


def _gib(n) -> str:
    return "-" if n is None else f"{n / 2**30:.1f} GiB"


def _unit(value, unit: str, fmt: str = "") -> str:
    return "-" if value is None else f"{value:{fmt}}{unit}"


def run(args) -> int:
    from gputrain.diagnostics.info import collect_info

    info = collect_info()
    if args.json:
        print(json.dumps(info, indent=2, default=str))
        return 0
    from rich.console import Console
    from rich.table import Table

    console = Console()
    t = info["torch"]
    build = f"CUDA {t['cuda']}, cuDNN {t['cudnn']}" if t["cuda"] else ("ROCm " + t["hip"] if t["hip"] else "CPU-only build")
    console.print(f"[bold]gputrain {info['gputrain']}[/] · Python {info['python']['version']} · "
                  f"PyTorch {t['torch']} ({build})")
    devices = info["devices"]
    nvml = info["nvml"]
    table = Table(title="devices", title_justify="left")
    for col in ("device", "name", "memory (free / total)", "capability", "SMs", "bf16", "TF32"):
        table.add_column(col)
    for d in devices["cuda"]:
        table.add_row(d["device"], d["name"], f"{_gib(d['free_memory_bytes'])} / {_gib(d['total_memory_bytes'])}",
                      d["compute_capability"], str(d["multiprocessors"]), "yes" if d["bf16"] else "no",
                      "yes" if d["tf32"] else "no")
    mps = devices["mps"]
    if mps["built"]:
        table.add_row("mps", "Apple GPU" if mps["available"] else "not available", "shared with host", "-", "-", "-", "-")
    cpu = devices["cpu"]
    table.add_row("cpu", cpu["name"], f"{_gib(cpu['available_memory_bytes'])} / {_gib(cpu['total_memory_bytes'])}",
                  "-", f"{cpu['physical_cores']} cores / {cpu['logical_cores']} threads", "-", "-")
    console.print(table)
    if devices.get("cuda_error"):
        console.print(f"[red]CUDA error:[/] {devices['cuda_error']}")
    if nvml.get("available"):
        nt = Table(title=f"NVML: driver {nvml.get('driver')}, CUDA driver API {nvml.get('cuda_driver')}", title_justify="left")
        for col in ("gpu", "name", "util", "temp", "power / limit", "memory used", "other processes"):
            nt.add_column(col)
        for g in nvml["gpus"]:
            others = [x for x in g["processes"] if not x["this_process"]]
            held = g["other_processes_memory_bytes"]
            nt.add_row(str(g["index"]), str(g["name"]), _unit(g["utilization_pct"], "%"), _unit(g["temperature_c"], " C"),
                       f"{_unit(g['power_w'], ' W', '.0f')} / {_unit(g['power_limit_w'], ' W', '.0f')}",
                       f"{_gib(g['memory_used_bytes'])} / {_gib(g['memory_total_bytes'])}",
                       f"{len(others)}" + (f" ({_gib(held)})" if held else ""))
        console.print(nt)
    else:
        console.print(f"NVML: not available ({nvml.get('reason')})")
    for name, fw in info["frameworks"].items():
        if "error" in fw:
            console.print(f"{name}: installed but broken ({fw['error']})")
        else:
            console.print(f"{name} {fw.get('version')}: GPUs {fw.get('gpus') or 'none'}")
    if not devices["cuda"] and not mps["available"]:
        console.print("No GPU is usable: training runs on the CPU. `gputrain doctor` says why and what to do.")
    return 0
