"""A run's plots, matplotlib on the Agg canvas: curves.png in the run directory (`plot_history`),
and the line and bar plots report.html holds as PNG data URIs."""

from __future__ import annotations

import base64
import io
import math
from pathlib import Path
from typing import Any, Iterable

from gputrain.io.atomic import atomic_file


def plot_history(history, path: str | Path) -> Path | None:
    """Loss (train, and eval where present) and accuracy against step as a PNG.

    Returns the path, or None when the history has no records.
    """
    recs = [r for r in history.records if r.get("step") is not None]
    if not recs:
        return None
    def series(key: str) -> tuple[list, list]:
        points = [(r["step"], r[key]) for r in recs if isinstance(r.get(key), (int, float))]
        return [p[0] for p in points], [p[1] for p in points]

    # The losses (train, eval, the EMA weights' eval) on the left; every other evaluation metric (the
    # built-in accuracy and the user's eval_<name> values) on the right.
    eval_keys = sorted({k for r in recs for k in r if k.startswith("eval_") and isinstance(r[k], (int, float))})
    loss_keys = [k for k in eval_keys if k == "eval_loss" or k.endswith("_loss")]
    acc_keys = [k for k in eval_keys if k not in loss_keys]
    fig = new_figure(10 if acc_keys else 6, 4)
    ax = fig.add_subplot(1, 2 if acc_keys else 1, 1)
    losses = []
    dots = {"marker": "o", "markersize": 3}
    # a step of your own's named losses (train/step/own_step.py), beside their sum
    named: list[tuple[str, str, dict[str, Any]]] = [(k, f"train {k.replace('_', ' ')}", {"linestyle": "--"}) for k in (history.summary or {}).get("step_losses") or {}
             if k != "loss"]
    for key, label, style in (("loss", "train loss", {}), *named, *[(k, k.replace("_", " "), dots) for k in loss_keys]):
        x, y = series(key)
        if x:
            ax.plot(x, y, label=label, **style)
            losses += y
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("loss")
    if losses and all(math.isfinite(v) and v > 0 for v in losses):
        ax.set_yscale("log")
    if losses:
        ax.legend()
    ax.grid(alpha=0.3)
    if acc_keys:
        ax2 = fig.add_subplot(1, 2, 2)
        for key in acc_keys:
            x, y = series(key)
            ax2.plot(x, y, marker="o", markersize=3, label=key.replace("_", " "))
        ax2.set_xlabel("optimizer step")
        ax2.set_ylabel("accuracy" if all(k.endswith("accuracy") for k in acc_keys) else "eval metrics")
        ax2.legend()
        ax2.grid(alpha=0.3)
    summary = history.summary or {}
    title = " | ".join(str(summary[k]) for k in ("device", "precision") if summary.get(k))
    if title:
        fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    path = Path(path)
    with atomic_file(path, "wb") as f:
        fig.savefig(f, format="png")
    return path


# ---------------------------------------------------------------- the report's plots, as PNG data URIs

def new_figure(w: float = 5.2, h: float = 3.0):
    """A matplotlib Figure on the Agg canvas (no pyplot: no GUI backend, no global figure state)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(w, h), dpi=100)
    FigureCanvasAgg(fig)
    return fig


def png_data_uri(fig) -> str:
    """A matplotlib Figure as a data:image/png;base64 URI."""
    buf = io.BytesIO()
    fig.tight_layout()
    fig.savefig(buf, format="png")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode("ascii")


def line_plot(lines: list[tuple[str, tuple[list, list], dict]], ylabel: str, log_if_positive: bool = False,
          marks: Iterable[float] = ()) -> str | None:
    """Lines [(label, (steps, values), matplotlib style)] against the optimizer step as a PNG data
    URI (None when no line has a point); `marks`: steps marked with a vertical line."""
    lines = [(label, xy, style) for label, xy, style in lines if xy[0]]
    if not lines:
        return None
    fig = new_figure()
    ax = fig.add_subplot(1, 1, 1)
    values = []
    for label, (x, y), style in lines:
        ax.plot(x, y, label=label, **style)
        values += y
    for m in marks:
        ax.axvline(m, color="#d9822b", alpha=0.6, linewidth=1)
    ax.set_xlabel("optimizer step")
    ax.set_ylabel(ylabel)
    if log_if_positive and values and all(math.isfinite(v) and v > 0 for v in values):
        ax.set_yscale("log")
    if len(lines) > 1:
        ax.legend()
    ax.grid(alpha=0.3)
    return png_data_uri(fig)


def breakdown_plot(breakdown: list[dict[str, Any]]) -> str | None:
    """A profile's time per phase ([{phase, ms}]) as horizontal bars, a PNG data URI (None: no time)."""
    rows = [(str(b.get("phase", "?")), float(b.get("ms") or 0)) for b in breakdown]
    if not rows or sum(ms for _, ms in rows) <= 0:
        return None
    fig = new_figure(8, 0.45 * len(rows) + 0.9)
    ax = fig.add_subplot(1, 1, 1)
    names = [n for n, _ in rows][::-1]
    ms = [m for _, m in rows][::-1]
    bars = ax.barh(names, ms, color="#3b7dd8")
    total = sum(ms)
    for bar, m in zip(bars, ms):
        ax.text(bar.get_width(), bar.get_y() + bar.get_height() / 2, f" {m:.2f} ms ({100 * m / total:.0f}%)",
                va="center", fontsize=8)
    ax.set_xlabel("ms per step")
    ax.set_xlim(0, max(ms) * 1.3)
    ax.grid(alpha=0.3, axis="x")
    return png_data_uri(fig)
