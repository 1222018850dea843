"""A run's curves as a PNG (curves.png in the run directory)."""

from __future__ import annotations

import math
from pathlib import Path


def plot_history(history, path: str | Path) -> Path | None:
    """Loss (train, and eval where present) and accuracy against step as a PNG.

    Returns the path, or None when the history has no records. Uses matplotlib's Agg canvas
    directly (no pyplot: no GUI backend, no global figure state).
    """
    recs = [r for r in history.records if r.get("step") is not None]
    if not recs:
        return None
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    from gputrain.io.checkpoint import atomic_file

    def series(key: str) -> tuple[list, list]:
        points = [(r["step"], r[key]) for r in recs if isinstance(r.get(key), (int, float))]
        return [p[0] for p in points], [p[1] for p in points]

    # Every evaluation metric but the loss: the built-in accuracy and the user's eval_<name> values.
    acc_keys = sorted({k for r in recs for k in r if k.startswith("eval_") and k != "eval_loss"
                       and isinstance(r[k], (int, float))})
    fig = Figure(figsize=(10 if acc_keys else 6, 4), dpi=100)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot(1, 2 if acc_keys else 1, 1)
    losses = []
    for key, label, style in (("loss", "train loss", {}), ("eval_loss", "eval loss", {"marker": "o", "markersize": 3})):
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
