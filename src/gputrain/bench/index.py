"""`bench all`: run every benchmark into one folder and write index.md, a page that links them, and
index.html, the same page self-contained (plots inlined) for a browser."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

from gputrain.bench.common import write_json
from gputrain.io.atomic import write_text


def _fmt(x, spec: str = ".3g") -> str:
    return "-" if x is None else format(x, spec)


def headline(result: dict[str, Any]) -> list[str]:
    """A few markdown lines with a result's key figures (the tables live in the JSON)."""
    name, s = result["benchmark"], result["summary"]
    lines: list[str] = []
    if name == "matmul":
        lines.append("| device/dtype | best TFLOP/s |\n|---|---|")
        lines += [f"| {k} | {_fmt(v)} |" for k, v in s.get("best", {}).items() if v is not None]
        measured = [x for x in s.get("speedup", []) if x.get("speedup")]
        if measured:
            top = max(x["size"] for x in measured)
            lines.append("")
            lines += [f"- GPU/CPU speed-up at n={top}, {x['dtype']}: {x['speedup']:.3g}x"
                      for x in measured if x["size"] == top]
    elif name == "transfer":
        lines.append("| copy | peak GB/s |\n|---|---|")
        lines += [f"| {k} | {v:.3g} |" for k, v in s.get("peak_gb_per_s", {}).items()]
    elif name == "crossover":
        cross = s.get("crossover")
        if isinstance(cross, list):
            lines.append("| data | batch | GPU eager wins from width | CUDA graph wins from width |\n|---|---|---|---|")
            lines += [f"| {c['data']} ({c['features']} features) | {c['batch']} | {_fmt(c['gpu_eager_wins_from_width'], '')} | "
                      f"{_fmt(c['gpu_graph_wins_from_width'], '')} |" for c in cross]
        else:
            widths = sorted({r["width"] for r in result["rows"]})
            lines.append("CPU ms per step (no GPU: speed-ups not measured)\n")
            lines.append("| data | batch | " + " | ".join(f"width {w}" for w in widths) + " |")
            lines.append("|---|---|" + "---|" * len(widths))
            for d in result["config"]["data"]:
                cells = [r for r in result["rows"] if r["data"] == d["label"] and r["batch"] == d["batch"]]
                ms = {r["width"]: r["times"]["cpu"].get("median_s") for r in cells}
                lines.append(f"| {d['label']} ({d['features']} features) | {d['batch']} | "
                             + " | ".join(_fmt(ms[w] * 1e3 if ms.get(w) else None) for w in widths) + " |")
    elif name == "precision":
        lines.append("| workload | precision | samples/s | vs fp32 | final loss | peak memory MiB | saved activations MiB |\n"
                     "|---|---|---|---|---|---|---|")
        for r in result["rows"]:
            if r.get("status") != "measured":
                lines.append(f"| {r['workload']} | {r['precision']} | {r['status']} | | | | |")
                continue
            peak = r.get("peak_memory_bytes")
            lines.append(f"| {r['workload']} | {r['precision']} | {r['samples_per_s']:.4g} | "
                         f"{_fmt(r.get('speedup_vs_fp32'))} | {r['final_loss']:.4g} | "
                         f"{'-' if peak is None else f'{peak / 2**20:.1f}'} | {r['saved_activation_bytes'] / 2**20:.2f} |")
    elif name == "memory":
        for mode, v in s.get("largest_batch", {}).items():
            lines.append(f"- largest batch ({mode}): {_fmt(v.get('largest_batch'), '')} ({v['note']})")
    if result["gpu"]["status"] != "measured":
        lines += ["", f"- GPU: {result['gpu']['status']}"]
    return lines


def write_index(results: list[dict[str, Any]], out_dir: str | Path, elapsed_s: float | None = None) -> Path:
    """Write out_dir/index.md linking each result's JSON and plots (all relative to out_dir), and
    index.html beside it; returns the index.md path."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    first = results[0]["environment"] if results else {}
    lines = ["# gputrain bench results", ""]
    if first:
        lines += [f"- date: {first['time']}",
                  f"- devices: {', '.join(d['device'] + ' (' + d['name'] + ')' for d in first['devices'])}",
                  f"- torch {first['torch']}, CUDA {first['cuda'] or 'none'}, cuDNN {first['cudnn'] or 'none'}, "
                  f"driver {first['driver'] or 'none'}, python {first['python']}",
                  f"- command: `{first['command']}`"]
        if elapsed_s is not None:
            lines.append(f"- wall time: {elapsed_s:.1f} s")
        lines.append("")
    for r in results:
        lines += [f"## {r['benchmark']}: {r['title']}", ""]
        lines += headline(r)
        lines.append("")
        for png in r["files"].get("plots", []):
            lines += [f"![{r['benchmark']} {png}]({png})", ""]
        if r["files"].get("json"):
            lines.append(f"Data (config, environment, every figure): [{r['files']['json']}]({r['files']['json']})")
        if r["notes"]:
            lines.append("")
            lines += [f"- {n}" for n in r["notes"]]
        lines.append("")
    path = out / "index.md"
    markdown = "\n".join(lines)
    write_text(path, markdown)
    write_index_html(markdown, out)
    return path


def write_index_html(markdown: str, out_dir: str | Path) -> Path:
    """out_dir/index.html: index.md as one self-contained page (the plots inlined as data URIs)."""
    from gputrain.report.markdown import markdown_page

    return write_text(Path(out_dir) / "index.html", markdown_page(markdown, out_dir, "gputrain bench results"))


def run_all(runners: dict[str, Callable[..., dict[str, Any]]], out_dir: str | Path, *, device: str = "auto",
            quick: bool = False, on_result: Callable[[dict[str, Any]], None] | None = None) -> tuple[list[dict[str, Any]], Path]:
    """Run each benchmark, write its JSON and plots into out_dir, then index.md and index.html.
    Returns (results, index.md path)."""
    import time

    from gputrain.bench.plots import plot

    t0 = time.perf_counter()
    results = []
    for name, runner in runners.items():
        result = runner(device=device, quick=quick)
        plot(result, out_dir)
        write_json(result, out_dir)
        results.append(result)
        if on_result is not None:
            on_result(result)
    return results, write_index(results, out_dir, time.perf_counter() - t0)
