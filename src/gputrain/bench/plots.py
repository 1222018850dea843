"""PNG plots of benchmark results (matplotlib's Agg renderer through Figure objects: no display,
no pyplot global state). Each function takes a result dict and an output folder, writes its PNGs
as <result stem>_<what>.png, records their names in result["files"]["plots"] and returns the paths.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from gputrain.bench.common import result_stem
from gputrain.io.atomic import atomic_file

DTYPE_STYLE = {"fp32": "o-", "tf32": "s-", "bf16": "^-", "fp16": "v-"}


def _figure(width: float = 7.5, height: float = 4.8):
    from matplotlib.figure import Figure

    return Figure(figsize=(width, height), layout="constrained")


def _save(fig, result: dict[str, Any], out_dir: str | Path, what: str) -> Path:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"{result_stem(result)}_{what}.png"
    with atomic_file(path, "wb") as f:
        fig.savefig(f, dpi=110, format="png")
    result["files"].setdefault("plots", [])
    if path.name not in result["files"]["plots"]:
        result["files"]["plots"].append(path.name)
    return path


def _subtitle(result: dict[str, Any]) -> str:
    env = result["environment"]
    names = " vs ".join(d["name"] for d in env["devices"])
    return f"{names} | torch {env['torch']} | {env['date']}"


def _bytes_label(n: float) -> str:
    for unit, size in (("GiB", 1024**3), ("MiB", 1024**2), ("KiB", 1024)):
        if n >= size:
            return f"{n / size:g} {unit}"
    return f"{n:g} B"


# ---------------------------------------------------------------- matmul


def plot_matmul(result: dict[str, Any], out_dir: str | Path) -> list[Path]:
    """TFLOP/s against size per (device, dtype); GPU/CPU speed-up against size (when a GPU ran)."""
    rows = [r for r in result["rows"] if r["status"] == "measured"]
    fig = _figure()
    ax = fig.add_subplot()
    for dev in dict.fromkeys(r["device"] for r in rows):
        for dtype in dict.fromkeys(r["dtype"] for r in rows):
            pts = sorted((r["size"], r["tflops"]) for r in rows if r["device"] == dev and r["dtype"] == dtype)
            if pts:
                ax.plot(*zip(*pts), DTYPE_STYLE.get(dtype, "o-"), label=f"{dev} {dtype}")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("matrix size n (n x n @ n x n)")
    ax.set_ylabel("TFLOP/s (2 n^3 / median time)")
    ax.set_title(f"Matmul throughput\n{_subtitle(result)}", fontsize=10)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8, ncol=2)
    paths = [_save(fig, result, out_dir, "tflops")]

    speed = [s for s in result["summary"].get("speedup", []) if s.get("speedup")]
    if speed:
        fig = _figure()
        ax = fig.add_subplot()
        for gpu in dict.fromkeys(s["gpu"] for s in speed):
            for dtype in dict.fromkeys(s["dtype"] for s in speed):
                pts = sorted((s["size"], s["speedup"]) for s in speed if s["gpu"] == gpu and s["dtype"] == dtype)
                if pts:
                    ax.plot(*zip(*pts), DTYPE_STYLE.get(dtype, "o-"), label=f"{gpu} {dtype} vs cpu {dtype}")
        ax.axhline(1.0, color="gray", lw=1, ls="--")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("matrix size n")
        ax.set_ylabel("speed-up: CPU time / GPU time (same dtype)")
        ax.set_title(f"GPU over CPU, square matmul\n{_subtitle(result)}", fontsize=10)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
        paths.append(_save(fig, result, out_dir, "speedup"))
    return paths


# ---------------------------------------------------------------- transfer


def plot_transfer(result: dict[str, Any], out_dir: str | Path) -> list[Path]:
    rows = [r for r in result["rows"] if r["status"] == "measured"]
    fig = _figure(8.5, 5.0)
    ax = fig.add_subplot()
    for label in dict.fromkeys(r["label"] for r in rows):
        pts = sorted((r["bytes"], r["gb_per_s"]) for r in rows if r["label"] == label)
        style = ":" if label.startswith("host memcpy") else ("-" if "pinned" in label else "--")
        ax.plot(*zip(*pts), style, marker="o", ms=3, label=label)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    sizes = sorted({r["bytes"] for r in result["rows"]})
    ax.set_xticks(sizes, [_bytes_label(s) for s in sizes], rotation=45, fontsize=8)
    ax.set_xlabel("bytes per copy")
    ax.set_ylabel("GB/s (1e9 bytes / s, median)")
    title = "Host <-> device copy bandwidth"
    if not result["gpu"]["available"]:
        title += " (no GPU: host memcpy only, for reference)"
    ax.set_title(f"{title}\n{_subtitle(result)}", fontsize=10)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7, ncol=2)
    return [_save(fig, result, out_dir, "bandwidth")]


# ---------------------------------------------------------------- crossover


def plot_crossover(result: dict[str, Any], out_dir: str | Path) -> list[Path]:
    """Heat map of GPU/CPU speed-up (log colour scale, 1 = white) per GPU mode; CPU ms/step without a GPU."""
    from matplotlib.colors import LogNorm

    rows = result["rows"]
    cols = list(dict.fromkeys((r["data"], r["features"], r["batch"]) for r in rows))
    widths = sorted({r["width"] for r in rows})
    col_labels = [f"{d}\n{f} feat\nbatch {b}" for d, f, b in cols]

    def grid(value):
        return [[value(next((r for r in rows if (r["data"], r["features"], r["batch"]) == c and r["width"] == w), None))
                 for c in cols] for w in widths]

    gpu = result["gpu"]["available"]
    modes = [m for m in ("gpu_eager", "gpu_graph", "gpu_eager_sync")
             if gpu and any(r["speedup"].get(m) for r in rows)]
    panels = modes or ["cpu"]
    fig = _figure(4.2 * len(panels) + 1.2, 4.6)
    axes = fig.subplots(1, len(panels), squeeze=False)[0]
    if modes:
        values = [s for r in rows for m in modes for s in [r["speedup"].get(m)] if s]
        m = max(max(values), 1 / min(values), 1.5)
        norm, cmap = LogNorm(vmin=1 / m, vmax=m), "RdBu"  # symmetric in log: 1x sits in the middle
    else:
        values = [r["times"]["cpu"]["median_s"] * 1e3 for r in rows if r["times"]["cpu"].get("median_s")]
        norm, cmap = LogNorm(vmin=min(values), vmax=max(values) * 1.0001), "viridis"
    titles = {"gpu_eager": "GPU eager / CPU", "gpu_graph": "GPU CUDA graph / CPU",
              "gpu_eager_sync": "GPU eager + loss.item() / CPU", "cpu": "CPU ms per step"}
    image = None
    for ax, mode in zip(axes, panels):
        if mode == "cpu":
            z = grid(lambda r: r["times"]["cpu"].get("median_s", math.nan) * 1e3 if r else math.nan)
        else:
            z = grid(lambda r, mode=mode: (r["speedup"].get(mode) or math.nan) if r else math.nan)
        image = ax.imshow(z, origin="lower", aspect="auto", cmap=cmap, norm=norm)
        for i, w in enumerate(widths):
            for j in range(len(cols)):
                v = z[i][j]
                if not math.isnan(v):
                    text = f"{v:.3g}" if mode == "cpu" else f"{v:.2g}x"
                    r, g, b, _ = image.cmap(image.norm(v))
                    ink = "white" if 0.299 * r + 0.587 * g + 0.114 * b < 0.5 else "black"  # readable on dark cells
                    ax.text(j, i, text, ha="center", va="center", fontsize=7, color=ink)
        if mode != "cpu":  # outline the first width at which the GPU wins, per data size
            for j in range(len(cols)):
                first = next((i for i in range(len(widths)) if not math.isnan(z[i][j]) and z[i][j] > 1), None)
                if first is not None:
                    ax.add_patch(_box(j, first))
        ax.set_xticks(range(len(cols)), col_labels, fontsize=7)
        ax.set_yticks(range(len(widths)), [str(w) for w in widths], fontsize=8)
        ax.set_ylabel("MLP width")
        ax.set_title(titles[mode], fontsize=10)
    assert image is not None, "panels is never empty"
    fig.colorbar(image, ax=list(axes), label="speed-up (>1: GPU wins)" if modes else "ms per step (CPU)")
    head = "Training step, GPU vs CPU (box: where the GPU starts to win)" if modes else \
        "Training step on the CPU (no GPU: speed-ups not measured)"
    fig.suptitle(f"{head}\n{_subtitle(result)}", fontsize=10)
    return [_save(fig, result, out_dir, "heatmap")]


def _box(x: int, y: int):
    from matplotlib.patches import Rectangle

    return Rectangle((x - 0.5, y - 0.5), 1, 1, fill=False, edgecolor="black", lw=2)


# ---------------------------------------------------------------- precision


def plot_precision(result: dict[str, Any], out_dir: str | Path) -> list[Path]:
    rows = [r for r in result["rows"] if r.get("status") == "measured"]
    workloads = list(dict.fromkeys(r["workload"] for r in rows))
    precisions = list(dict.fromkeys(r["precision"] for r in rows))
    fig = _figure(9.0, 4.5)
    ax1, ax2 = fig.subplots(1, 2)
    use_peak = any(r.get("peak_memory_bytes") for r in rows)
    key = "peak_memory_bytes" if use_peak else "saved_activation_bytes"
    n = max(1, len(precisions))
    for k, p in enumerate(precisions):
        xs = [i + (k - (n - 1) / 2) * 0.8 / n for i in range(len(workloads))]
        get = {r["workload"]: r for r in rows if r["precision"] == p}
        ax1.bar(xs, [get[w]["samples_per_s"] if w in get else 0 for w in workloads], 0.8 / n, label=p)
        ax2.bar(xs, [(get[w][key] or 0) / 2**20 if w in get else 0 for w in workloads], 0.8 / n, label=p)
    for ax in (ax1, ax2):
        ax.set_xticks(range(len(workloads)), workloads)
        ax.legend(fontsize=8)
        ax.grid(True, axis="y", alpha=0.3)
    ax1.set_ylabel("samples/s (median)")
    ax1.set_title("Throughput", fontsize=10)
    ax2.set_ylabel("MiB")
    ax2.set_title("Peak device memory" if use_peak else "Activations saved for backward (one step)", fontsize=10)
    fig.suptitle(f"Training by precision on {result['config']['device_name']}\n{_subtitle(result)}", fontsize=10)
    return [_save(fig, result, out_dir, "precision")]


# ---------------------------------------------------------------- memory


def plot_memory(result: dict[str, Any], out_dir: str | Path) -> list[Path]:
    rows = [r for r in result["rows"] if r["status"] == "measured"]
    use_peak = any(r.get("peak_bytes") for r in rows)
    fig = _figure()
    ax = fig.add_subplot()
    for recompute in (False, True):
        label = "recompute" if recompute else "plain"
        for key, style, what in (("peak_bytes", "-", "peak allocated"),
                                 ("saved_activation_bytes", "--", "saved for backward")):
            if key == "peak_bytes" and not use_peak:
                continue
            pts = sorted((r["batch"], r[key] / 2**20) for r in rows if r["recompute"] == recompute and r.get(key))
            if pts:
                ax.plot(*zip(*pts), style, marker="o", ms=3, label=f"{label}: {what}")
    total = result["summary"].get("device_total_bytes")
    if total:
        ax.axhline(total / 2**20, color="red", lw=1, ls=":", label="device memory")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("batch size")
    ax.set_ylabel("MiB")
    title = f"Memory against batch size: {result['config']['workload']} on {result['config']['device_name']}"
    if not use_peak:
        title += "\n(device memory not measurable here: activation bytes saved for backward)"
    ax.set_title(f"{title}\n{_subtitle(result)}", fontsize=9)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    return [_save(fig, result, out_dir, "memory")]


PLOTTERS = {"matmul": plot_matmul, "transfer": plot_transfer, "crossover": plot_crossover,
            "precision": plot_precision, "memory": plot_memory}


def plot(result: dict[str, Any], out_dir: str | Path) -> list[Path]:
    """Write the plots of any benchmark result."""
    return PLOTTERS[result["benchmark"]](result, out_dir)
