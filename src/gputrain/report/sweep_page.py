"""SWEEP_DIR/report.html: a sweep's trials on one self-contained page.

What it shows: the best trial and its parameters, a plot of the metric per trial with the best so
far, and a table of every trial (state, value, parameters, the step it reached, its time, a link
to its own report.html, why it failed or which trial it ran again). It takes plain rows (one dict
per trial, as gputrain/sweeps/study.py's `trial_rows` makes them) and needs nothing of Optuna.
A study shared by several machines (--storage) adds a column of the machine and folder each trial
ran in; a trial of another machine's folder has no link (its run directory is there).
"""

from __future__ import annotations

import datetime as _dt
import math
from typing import Any

from gputrain.io.run_layout import REPORT_FILE
from gputrain.report.page import escape as _e, page
from gputrain.report.plots import new_figure, png_data_uri

STATE_STYLE = {"complete": ("o", "#3b7dd8"), "pruned": ("x", "#d9822b"), "fail": ("v", "#b3261e")}


def best_so_far(rows: list[dict[str, Any]], direction: str) -> list[tuple[int, float]]:
    """(trial number, best value of the complete trials up to it) for each complete trial, in order."""
    out: list[tuple[int, float]] = []
    best: float | None = None
    for r in sorted(rows, key=lambda r: r["number"]):
        v = r.get("value")
        if r.get("state") != "complete" or not isinstance(v, (int, float)) or not math.isfinite(v):
            continue
        if best is None or (v < best if direction == "min" else v > best):
            best = float(v)
        out.append((r["number"], best))
    return out


def sweep_plot(rows: list[dict[str, Any]], metric: str, direction: str) -> str | None:
    """The metric of each trial (complete: dots, pruned: crosses at their last evaluation) and the
    best so far (a step line), against the trial number, as a PNG data URI; None without values."""
    points = [r for r in rows if isinstance(r.get("value"), (int, float)) and math.isfinite(r["value"])]
    if not points:
        return None
    fig = new_figure(7.0, 3.4)
    ax = fig.add_subplot(1, 1, 1)
    for state, (marker, color) in STATE_STYLE.items():
        mine = [r for r in points if r.get("state") == state]
        if mine:
            ax.scatter([r["number"] for r in mine], [r["value"] for r in mine], marker=marker, color=color,
                       label=f"{state} ({len(mine)})", zorder=3)
    best = best_so_far(rows, direction)
    if best:
        xs = [n for n, _ in best] + [max(r["number"] for r in rows)]
        ys = [v for _, v in best] + [best[-1][1]]
        ax.step(xs, ys, where="post", color="#1e7d32", label="best so far", zorder=2)
    values = [r["value"] for r in points]
    if all(v > 0 for v in values) and max(values) / min(values) > 20:
        ax.set_yscale("log")
    ax.set_xlabel("trial")
    ax.set_ylabel(f"{metric} ({'lower' if direction == 'min' else 'higher'} is better)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    return png_data_uri(fig)


def render_sweep_page(rows: list[dict[str, Any]], *, name: str, metric: str, direction: str, budget: int,
                      sweep_dir: str, space: dict[str, Any], storage: str = "", study_name: str = "gputrain",
                      best: int | None = None, here: str | None = None) -> str:
    """The sweep's report as one HTML string (no external resources). best: the best trial's number
    as Optuna names it (default: the complete trial with the best value); here: this machine's
    sweep folder (resolved) when the study is shared, so that each trial shows where it ran."""
    done = [r for r in rows if r["state"] == "complete" and isinstance(r.get("value"), (int, float))]
    if best is not None:
        best_row = next((r for r in rows if r["number"] == best), None)
    else:
        best_row = (min if direction == "min" else max)(done, key=lambda r: r["value"]) if done else None
    rows = [{**r, "elsewhere": here is not None and r.get("sweep_dir") not in (None, here)}
            for r in rows]  # another machine's run directory: named (machine:path), not linked
    counts = {s: sum(1 for r in rows if r["state"] == s) for s in ("complete", "pruned", "fail", "running", "waiting")}
    cards = [("trials finished", f"{counts['complete'] + counts['pruned']} of {budget}"),
             ("complete", str(counts["complete"])), ("pruned", str(counts["pruned"]))]
    if counts["fail"]:
        cards.append(("failed or interrupted", str(counts["fail"])))
    if best_row:
        cards.append((f"best {metric}", short(best_row["value"])))
        cards.append(("best trial", str(best_row["number"])))
    body = [f"<h1>gputrain sweep: {_e(name)}</h1>",
            f"<p class='sub'>{_e(metric)}, {'lower' if direction == 'min' else 'higher'} is better &middot; "
            f"{_e(sweep_dir)}</p>",
            "<div class='cards'>" + "".join(f"<div class='card'><div class='l'>{_e(k)}</div><div class='v'>{_e(v)}"
                                            "</div></div>" for k, v in cards) + "</div>"]
    if best_row:
        top = next(r for r in rows if r["number"] == best_row["number"])
        params = ", ".join(f"{k} = {short(v)}" for k, v in top["params"].items())
        link = f" (its run: {_e(_where(top))})" if top["elsewhere"] else \
            f" (<a href='{_e(top['run_dir'])}/{REPORT_FILE}'>its run</a>)" if top.get("run_dir") else ""
        body.append(f"<section id='best'><h2>Best trial</h2><p>trial {top['number']}: {_e(metric)} "
                    f"{_e(short(top['value']))} with {_e(params)}{link}</p></section>")
    plot = sweep_plot(rows, metric, direction)
    body.append("<section id='trials-plot'><h2>The metric per trial</h2>" + (
        f"<figure class=wide><img src='{plot}' alt='{_e(metric)} per trial and the best so far'><figcaption>"
        f"each trial's {_e(metric)} (pruned trials: at their last evaluation) and the best so far</figcaption></figure>"
        if plot else "<p>No trial has a value yet.</p>") + "</section>")
    body.append(f"<section id='trials'><h2>Trials</h2>{_trials_table(rows, list(space), here is not None)}</section>")
    body.append("<section id='space'><h2>Search space</h2><table>" + "".join(
        f"<tr><td class='k'>{_e(k)}</td><td>{_e(_spec(v))}</td></tr>" for k, v in space.items()) + "</table></section>")
    from gputrain.version import __version__

    body.append(f"<footer>written by gputrain {_e(__version__)} on {_dt.datetime.now().strftime('%Y-%m-%d %H:%M')}"
                + (f" &middot; the study: optuna.load_study(study_name={_e(repr(study_name))}, storage='{_e(storage)}')"
                   if storage else "")
                + " &middot; this page is self-contained</footer>")
    return page(f"gputrain sweep: {name}", "\n".join(body))


def _where(row: dict[str, Any]) -> str:
    """machine:folder/run_dir of a trial (what a shared study records of where it ran)."""
    folder = row.get("sweep_dir") or ""
    return f"{row.get('machine') or '?'}:{folder}/{row.get('run_dir') or ''}".rstrip("/")


def _trials_table(rows: list[dict[str, Any]], names: list[str], machines: bool = False) -> str:
    if not rows:
        return "<p>No trials yet.</p>"
    head = ["trial", "state", "value", *names, "last step", "time", *(["machine"] if machines else []), "run", "note"]
    out = ["<table><tr>" + "".join(f"<th>{_e(h)}</th>" for h in head) + "</tr>"]
    for r in sorted(rows, key=lambda r: r["number"]):
        note = r.get("error") or (f"runs trial {r['retry_of']} again" if r.get("retry_of") is not None else "")
        if r["state"] == "fail" and not r.get("error"):
            note = "interrupted (stopped, or its worker died): runs again" if machines else \
                "interrupted: runs again on resume"
        link = _e(_where(r)) if r.get("elsewhere") else \
            f"<a href='{_e(r['run_dir'])}/{REPORT_FILE}'>{_e(r['run_dir'])}</a>" if r.get("run_dir") else ""
        cells = [str(r["number"]), r["state"], short(r.get("value")),
                 *[short(r["params"].get(n)) for n in names], short(r.get("last_step")),
                 f"{r['seconds']:.1f} s" if r.get("seconds") is not None else "",
                 *([r.get("machine") or ""] if machines else [])]
        out.append("<tr>" + "".join(f"<td class='n'>{_e(c)}</td>" for c in cells) + f"<td>{link}</td>"
                   f"<td>{_e(note)}</td></tr>")
    out.append("</table>")
    return "".join(out)


def short(v: Any) -> str:
    """A table cell: 4 significant digits for a float, "" for None."""
    return "" if v is None else f"{v:.4g}" if isinstance(v, float) else str(v)


def _spec(spec: Any) -> str:
    if isinstance(spec, dict):
        return ", ".join(f"{k} = {v}" for k, v in spec.items())
    return str(spec)
