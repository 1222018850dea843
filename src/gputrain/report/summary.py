"""A run summary as (label, value) rows and as a rich table for the terminal."""

from __future__ import annotations

from typing import Any

from gputrain.metric_direction import MAX, MIN, Direction
from gputrain.report.format import format_bytes, format_duration

_KNOWN_METRICS = ("loss", "eval_loss", "eval_accuracy")


def summary_rows(summary: dict[str, Any]) -> list[tuple[str, str]]:
    """(label, value) pairs of a run summary, formatted for people; missing entries are left out."""
    rows: list[tuple[str, str]] = []

    def add(label: str, value) -> None:
        if value is not None and value != "":
            rows.append((label, str(value)))

    add("workload", summary.get("workload"))
    add("device", summary.get("device"))
    if summary.get("precision"):
        reason = summary.get("precision_reason")
        add("precision", f"{summary['precision']} ({reason})" if reason else summary["precision"])
    add("data", summary.get("data_reason"))
    add("optimizer", summary.get("optimizer"))
    if summary.get("parameters") is not None:
        add("parameters", parameters_text(summary.get("trainable_parameters") or 0,
                                          summary.get("frozen_parameters") or 0))
    eff = summary.get("effective_batch")
    if eff is not None:
        ws, acc, bs = summary.get("world_size") or 1, summary.get("accumulate") or 1, summary.get("batch_size")
        parts = [f"{bs} per step"] if bs is not None else []
        if acc > 1:
            parts.append(f"{acc} accumulated")
        if ws > 1:
            parts.append(f"{ws} processes")
        add("effective batch", f"{eff} = {' x '.join(parts)}" if bs is not None and (acc > 1 or ws > 1) else eff)
    steps = summary.get("steps")
    if steps is not None:
        total = summary.get("total_steps")
        add("steps", (f"{steps} of {total}" if total is not None else str(steps))
            + (" (stopped early)" if summary.get("stopped_early") else ""))
    add("stopped by", summary.get("stopped_by"))
    if summary.get("time_s") is not None:
        add("time", format_duration(summary["time_s"]))
    if summary.get("samples_per_s") is not None:
        how = summary.get("samples_per_s_how") or "median over log intervals after the first"
        add("samples/s", f"{summary['samples_per_s']:,.0f} ({how})")
    if summary.get("final_loss") is not None:
        add("final train loss", _num(summary["final_loss"]))
    if summary.get("evaluation") and summary["evaluation"] != "none":
        add("evaluations", f"{summary.get('evaluations', '?')} ({summary['evaluation']})")
    others = sorted(k[len("final_"):] for k in summary if k.startswith("final_"))
    directions = summary.get("metric_directions")
    for key in ("eval_loss", "eval_accuracy", *[k for k in others if k not in _KNOWN_METRICS]):
        final, best = summary.get(f"final_{key}"), summary.get(f"best_{key}")
        if final is None:
            continue
        label = key.replace("_", " ")
        add(f"{label} (final / {best_label(directions, key)})" if best is not None else label,
            f"{_num(final)} / {_num(best)}" if best is not None else _num(final))
    peak = summary.get("peak_memory_bytes")
    add("peak device memory", format_bytes(peak) if peak else "not measured on this device")
    add("CUDA graphs", summary.get("cuda_graphs"))
    if summary.get("checkpoint_saves"):
        blocked, written = summary.get("checkpoint_blocked_s_per_save"), summary.get("checkpoint_write_s_per_save")
        how = f"{summary.get('checkpoint_format')}{', async' if summary.get('checkpoint_async') else ''}"
        text = f"{counted(summary['checkpoint_saves'], 'save')} ({how}): training blocked {_short(blocked)} per save" \
            + (" (median)" if summary["checkpoint_saves"] > 1 else "")
        if written is not None and summary.get("checkpoint_async"):
            text += f"; writing took {_short(written)}"
        add("checkpoints", text)
    if summary.get("frozen_parameters"):
        add("checkpoint contents", summary.get("checkpoint_contents"))
    add("callbacks", summary.get("callbacks"))
    if (summary.get("oom_splits") or 1) > 1:
        add("OOM recovery", f"micro-batches split {summary['oom_splits']}x")
    add("run directory", summary.get("run_dir"))
    return rows


def counted(n: int | float, word: str, plural: str | None = None) -> str:
    """"1 save", "2 saves", "0 saves": a count with its noun in the number it takes."""
    return f"{n:g} {word if n == 1 else plural or word + 's'}" if isinstance(n, float) else \
        f"{n:,} {word if n == 1 else plural or word + 's'}"


def parameters_text(trainable: int, frozen: int) -> str:
    """"1,024 trainable of 29,568 (3.46%); 28,544 frozen", or "29,568, all trainable"."""
    total = trainable + frozen
    if not frozen:
        return f"{total:,}, all trainable"
    return f"{trainable:,} trainable of {total:,} ({100 * trainable / max(total, 1):.2f}%); {frozen:,} frozen"


def best_label(directions: Any, key: str) -> str:
    """"lowest" / "highest" (and "guessed from the name" / "guessed" where the rule guessed) for a
    metric of a summary with "metric_directions"; "best" for an older summary, which does not say."""
    way = directions.get(key) if isinstance(directions, dict) else None
    if not isinstance(way, dict):
        return "best"
    word = Direction(mode=MIN if way.get("mode") == MIN else MAX, by=str(way.get("by"))).best_word
    guess = {"name": ", guessed from the name", "default": ", guessed: say otherwise with metric_modes"}
    return word + guess.get(str(way.get("by")), "")


def _short(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    return f"{seconds * 1000:.1f} ms" if seconds < 1 else format_duration(seconds)


def _num(value) -> str:
    return f"{value:.4f}" if isinstance(value, float) else str(value)


def summary_table(summary: dict[str, Any]):
    """A two-column rich Table of `summary_rows(summary)`."""
    from rich.table import Table

    table = Table(title="gputrain fit", show_header=False, title_justify="left")
    table.add_column("what", style="bold")
    table.add_column("value")
    for label, value in summary_rows(summary):
        table.add_row(label, value)
    return table


def render_summary(summary: dict[str, Any], console=None) -> None:
    """Print the summary table to `console` (a new rich Console on stdout when None)."""
    from rich.console import Console

    (console or Console()).print(summary_table(summary))
