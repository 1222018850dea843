"""report.html: one self-contained page that shows a run and explains its speed.

`write_report(run_dir)` reads what a run left in its directory (history.json, else metrics.jsonl;
profile_summary.json when `gputrain profile --out RUN_DIR` was run into it) and writes
RUN_DIR/report.html. The page needs no network: the plots are PNGs inside it as data URIs, the
style is inline, and there are no scripts or web fonts. It opens the same from a laptop, a CI
artifact or a mail attachment.

What it shows: the summary (the same rows as the terminal table), the loss / metric / lr /
samples/s / memory curves, every speed decision and its reason, data placement, precision, the
CUDA-graph status, peak memory against the device's memory, warnings (OOM splits, non-finite
losses, loss spikes, recompilations), and the profile's time breakdown and verdict when present.
Any of the summary's keys may be missing (older runs, a run that crashed): that part then says so.
The document and its style are report/page.py's; the plots report/plots.py's.
"""

from __future__ import annotations

import datetime as _dt
import json
import math
from pathlib import Path
from typing import Any, Iterable

from gputrain.errors import GputrainError
from gputrain.metric_direction import metric_figures
from gputrain.io.atomic import write_text
from gputrain.io.run_layout import HISTORY_FILE, METRICS_JSONL, PROFILE_SUMMARY, REPORT_FILE
from gputrain.report.format import format_bytes, format_duration
from gputrain.report.page import escape as _e, page, with_code
from gputrain.report.plots import breakdown_plot, line_plot
from gputrain.report.startup_section import startup_html
from gputrain.report.summary import counted, parameters_text, summary_rows


# Settings the trainer decides for speed, with the summary key that holds each (for runs whose
# summary predates the explicit "decisions" list).
_DERIVED_DECISIONS = (("precision", "precision", "precision_reason"),
                      ("data placement", "data", "data_reason"),
                      ("optimizer", "optimizer", None),
                      ("cuda_graphs", "cuda_graphs", None),
                      ("channels_last", "channels_last", None),
                      ("compile", "compile", None),
                      ("recompute", "activation_checkpointing", None))  # the old summaries' key


# ---------------------------------------------------------------- reading a run directory

def load_run(run_dir: str | Path) -> dict[str, Any]:
    """records, config, summary, profile (or None) and notes from a run directory.

    GputrainError when the directory is missing or holds neither history.json nor metrics.jsonl.
    """
    from gputrain.io.history import History

    d = Path(run_dir)
    if not d.is_dir():
        raise GputrainError(f"{d}: no such run directory (give the --run-dir of a `gputrain fit` run)")
    notes: list[str] = []
    history, jsonl = d / HISTORY_FILE, d / METRICS_JSONL
    records: list[dict[str, Any]] = []
    config: dict[str, Any] = {}
    summary: dict[str, Any] = {}
    if history.is_file():
        h = History.load(history)
        records, config, summary = h.records, h.config, h.summary
    if not records and jsonl.is_file():
        records = _read_jsonl(jsonl)
        if not history.is_file():
            notes.append("history.json is missing (the run did not finish, or is still running): "
                         "the curves come from metrics.jsonl and there is no summary")
    if not history.is_file() and not jsonl.is_file():
        raise GputrainError(f"{d}: not a run directory: it has no history.json or metrics.jsonl "
                            "(`gputrain fit WORKLOAD --run-dir DIR` writes them)")
    profile = None
    prof = d / PROFILE_SUMMARY
    if prof.is_file():
        try:
            profile = json.loads(prof.read_text(encoding="utf-8"))
            if not isinstance(profile, dict):
                raise ValueError("not a JSON object")
        except (OSError, UnicodeDecodeError, ValueError) as exc:
            profile = None
            notes.append(f"{PROFILE_SUMMARY} could not be read ({exc}); rerun `gputrain profile WORKLOAD --out {d}`")
    return {"records": records, "config": config, "summary": summary, "profile": profile, "notes": notes,
            "run_dir": str(d)}


def _read_jsonl(path: Path) -> list[dict[str, Any]]:
    records = []
    for line in path.read_text(encoding="utf-8", errors="replace").splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue  # a line cut short by a crash
        if isinstance(record, dict):
            records.append(record)
    return records


def write_report(run_dir: str | Path, out: str | Path | None = None) -> Path:
    """Write the run's report (default RUN_DIR/report.html) atomically; returns its path."""
    run = load_run(run_dir)
    text = render_report(run["records"], run["summary"], run["config"], run["profile"],
                         run_dir=run["run_dir"], notes=run["notes"])
    return write_text(Path(out) if out is not None else Path(run_dir) / REPORT_FILE, text)


# ---------------------------------------------------------------- the page

def render_report(records: list[dict[str, Any]], summary: dict[str, Any] | None = None,
                  config: dict[str, Any] | None = None, profile: dict[str, Any] | None = None, *,
                  run_dir: str | None = None, notes: Iterable[str] = (), title: str | None = None) -> str:
    """The report as one HTML string (no external resources)."""
    summary, config = dict(summary or {}), dict(config or {})
    has_summary = bool(summary)
    if has_summary and "metric_directions" not in summary and records:
        # An older summary took the max of every metric but eval_loss: its best values again, by the rule.
        summary.update(metric_figures(records))
    if run_dir and "run_dir" not in summary:
        summary["run_dir"] = run_dir
    name = title or summary.get("workload") or (Path(run_dir).name if run_dir else "run")
    body = [f"<h1>gputrain run: {_e(name)}</h1>",
            f"<p class='sub'>{_e(summary.get('device') or 'device not recorded')}"
            + (f" &middot; {_e(run_dir)}" if run_dir else "") + "</p>"]
    body += [f"<p class='note'>{_e(n)}</p>" for n in notes]
    body += _headline(records, summary)
    body += _section("Summary", _table(summary_rows(summary)) if has_summary else
                     "<p>No summary: the run has not written history.json.</p>", "summary")
    body += _section("Curves", _curves(records, summary), "curves")
    body += _section("Speed decisions", _decisions(summary), "decisions")
    body += _section("Time to the first step", startup_html(summary), "startup")  # report/startup_section.py
    body += _section("Memory", _memory(records, summary), "memory")
    body += _section("Warnings", _warnings(records, summary), "warnings")
    body += _section("Profile: where a step's time goes", _profile(profile), "profile")
    body += _section("Config", _details("the run's settings (TrainConfig)",
                                        _table([(k, _json(config[k])) for k in sorted(config)]))
                     if config else "<p>No config recorded.</p>", "config")
    body += _section("Log points", _details(f"{counted(len(records), 'record')} (metrics.jsonl)", _records_table(records))
                     if records else "<p>No log points.</p>", "records")
    from gputrain.version import __version__

    body.append(f"<footer>written by gputrain {_e(__version__)} on "
                f"{_dt.datetime.now().strftime('%Y-%m-%d %H:%M')} &middot; "
                "this page is self-contained: no scripts, fonts or images from the network</footer>")
    return page(f"gputrain report: {name}", "\n".join(body))


# ---------------------------------------------------------------- sections

def _headline(records: list[dict[str, Any]], s: dict[str, Any]) -> list[str]:
    cards: list[tuple[str, str]] = []
    if s.get("samples_per_s") is not None:
        cards.append(("samples/s", f"{s['samples_per_s']:,.0f}"))
    if s.get("time_s") is not None:
        cards.append(("time", format_duration(s["time_s"])))
    if s.get("steps") is not None:
        cards.append(("steps", str(s["steps"])))
    loss = s.get("final_loss", _last(records, "loss"))
    if loss is not None:
        cards.append(("final train loss", _num(loss)))
    metrics = sorted({k for r in records for k in r if k.startswith("eval_")} |
                     {k[len("final_"):] for k in s if k.startswith("final_eval_")})
    for key in metrics:
        value = s.get(f"final_{key}", _last(records, key))
        if value is not None:
            cards.append((f"final {key.replace('_', ' ')}", _num(value)))
    if s.get("precision"):
        cards.append(("precision", str(s["precision"])))
    peak = s.get("peak_memory_bytes")
    if peak:
        cards.append(("peak memory", format_bytes(peak)))
    if not cards:
        return []
    return ["<div class='cards'>" + "".join(
        f"<div class='card'><div class='l'>{_e(label)}</div><div class='v'>{_e(value)}</div></div>"
        for label, value in cards) + "</div>"]


def _decisions(s: dict[str, Any]) -> str:
    parts = []
    # The three the issue names, each with its reason, first (from the decision log when there is one).
    cards = []
    for label, name, key, reason_key in (("data placement", "data", "data", "data_reason"),
                                         ("precision", "precision", "precision", "precision_reason"),
                                         ("CUDA graphs", "cuda_graphs", "cuda_graphs", None)):
        d = _decision(s, name)
        value = d.get("value") if d else s.get(key)
        reason = (d.get("reason") if d else None) or (s.get(reason_key) if reason_key else None)
        value = "not recorded" if value in (None, "") else _text(value)
        cards.append(f"<div class='card'><div class='l'>{_e(label)}</div><div class='v'>{_e(value)}</div>"
                     + (f"<div>{_e(reason)}</div>" if reason else "") + "</div>")
    parts.append("<div class='cards three'>" + "".join(cards) + "</div>")
    decisions = s.get("decisions")
    if isinstance(decisions, list) and decisions:
        rows = []
        for d in decisions:
            if isinstance(d, dict):
                rows.append((str(d.get("name", "?")), _text(d.get("value")), _text(d.get("reason"))))
            else:
                rows.append((str(d), "", ""))
        parts.append(_table(rows, header=("decision", "value", "reason")))
    else:
        rows = []
        for label, key, reason_key in _DERIVED_DECISIONS:
            if key in s:
                rows.append((label, _text(s[key]), _text(s.get(reason_key)) if reason_key else ""))
        if rows:
            parts.append("<p class='sub'>This run's summary has no decision log; the settings it recorded:</p>")
            parts.append(_table(rows, header=("setting", "value", "reason")))
        else:
            parts.append("<p>No speed decisions recorded.</p>")
    return "\n".join(parts)


def _decision(s: dict[str, Any], name: str) -> dict[str, Any] | None:
    for d in s.get("decisions") or []:
        if isinstance(d, dict) and d.get("name") == name:
            return d
    return None


def _memory(records: list[dict[str, Any]], s: dict[str, Any]) -> str:
    return _parameters(s) + _peak(records, s)


def _parameters(s: dict[str, Any]) -> str:
    """Which parameters train (gradients and optimizer state are theirs), and what checkpoints hold."""
    if s.get("parameters") is None:
        return ""
    text = parameters_text(s.get("trainable_parameters") or 0, s.get("frozen_parameters") or 0)
    held = f" Checkpoints: {s['checkpoint_contents']}." if s.get("frozen_parameters") and s.get("checkpoint_contents") \
        else ""
    return f"<p>Parameters: <b>{_e(text)}</b>; gradients and optimizer state are the trainable ones'.{_e(held)}</p>"


def _peak(records: list[dict[str, Any]], s: dict[str, Any]) -> str:
    peak = s.get("peak_memory_bytes")
    if peak is None:
        peaks = [r["peak_memory_bytes"] for r in records if isinstance(r.get("peak_memory_bytes"), (int, float))]
        peak = max(peaks) if peaks else None
    total = s.get("device_memory_bytes")
    if not peak:
        return ("<p>Peak device memory: <b>not measured on this device</b> "
                "(gputrain reads it from CUDA's allocator, or from MPS; a CPU run has none).</p>"
                + (f"<p>Device memory: {_e(format_bytes(total))}</p>" if total else ""))
    if not total:
        return (f"<p>Peak device memory: <b>{_e(format_bytes(peak))}</b>. The device's total memory was "
                "not recorded by this run, so the share is unknown.</p>")
    share = peak / total
    cls = "full" if share > 0.9 else "hot" if share > 0.7 else ""
    return (f"<p>Peak device memory: <b>{_e(format_bytes(peak))}</b> of {_e(format_bytes(total))} "
            f"(<b>{100 * share:.1f}%</b>)</p>"
            f"<div class='bar {cls}' title='peak memory / device memory'><span style='width:{min(100.0, 100 * share):.2f}%'></span></div>"
            + ("<p class='warn'>Above 90% of the device: a larger batch or model will run out of memory.</p>"
               if share > 0.9 else ""))


def _warnings(records: list[dict[str, Any]], s: dict[str, Any]) -> str:
    items: list[tuple[str, str]] = []  # (css class, text)
    for w in s.get("warnings") or []:
        items.append(("warn", str(w)))
    for a in s.get("advice") or []:  # measured on this run, not printed in the terminal (train/loop/run_summary.py)
        items.append(("note", f"advice: {a}"))
    splits = s.get("oom_splits") or 1
    if isinstance(splits, (int, float)) and splits > 1:
        items.append(("warn", f"out of memory: micro-batches were split {splits:g}x (accumulation raised to match; "
                              "the effective batch is unchanged, each step is slower)"))
    nonfinite = s.get("nonfinite_steps")
    what = "non-finite loss (NaN/inf), steps"
    if nonfinite is None:  # older runs: look at the records
        nonfinite = [r.get("step") for r in records
                     if isinstance(r.get("loss"), float) and not math.isfinite(r["loss"])]
        what = "non-finite train loss (NaN/inf) at log points, steps"
    _count_item(items, "bad", what, nonfinite)
    _count_item(items, "warn", "loss spikes, steps", s.get("loss_spikes"))
    _count_item(items, "warn", "torch.compile recompilations", s.get("recompilations"))
    if s.get("stopped_early"):
        items.append(("warn", f"stopped early at step {s.get('steps')} of {s.get('total_steps')}"))
    if not items:
        checked = ["OOM splits", "non-finite losses"]
        checked += [n for k, n in (("loss_spikes", "loss spikes"), ("recompilations", "recompilations")) if k in s]
        return f"<p class='ok'>No warnings ({_e(', '.join(checked))} checked).</p>"
    return "<ul class='w'>" + "".join(f"<li class='{c}'>{_e(t)}</li>" for c, t in items) + "</ul>"


def _count_item(items: list[tuple[str, str]], cls: str, what: str, value: Any) -> None:
    """One warning line for a count (int) or a list of steps / events; nothing for 0, [] or None."""
    if value is None or value is False or value == 0 or value == []:
        return
    if isinstance(value, (list, tuple)):
        shown = ", ".join(_text(v) for v in value[:12]) + (", ..." if len(value) > 12 else "")
        items.append((cls, f"{what}: {len(value)} ({shown})"))
    else:
        items.append((cls, f"{what}: {_text(value)}"))


def _profile(p: dict[str, Any] | None) -> str:
    if not p:
        return ("<p>No profile in this run directory. <code>gputrain profile WORKLOAD --out RUN_DIR</code> "
                f"writes {PROFILE_SUMMARY} there; the report then shows where a step's time goes and what bounds it.</p>")
    out = []
    head = [p.get("workload"), p.get("device_name") or p.get("device"), p.get("precision")]
    if p.get("batch_size") is not None:
        head.append(f"batch {p['batch_size']:,}")
    line = ", ".join(str(x) for x in head if x)
    if p.get("step_ms") is not None:
        timed = p.get("timed_steps")
        line += f": step {_ms(p['step_ms'])} (median of {counted(timed, 'step') if isinstance(timed, int) else '? steps'})"
    if p.get("samples_per_s") is not None:
        line += f", {p['samples_per_s']:,.0f} samples/s"
    out.append(f"<p>{_e(line)}" + (f" <span class='sub'>(profiled {_e(p['date'])})</span>" if p.get("date") else "")
               + "</p>")
    v = p.get("verdict") or {}
    if v:
        out.append(f"<p>verdict: <span class='verdict'>{_e(v.get('verdict', '?'))}</span></p>")
        if v.get("evidence"):
            out.append("<h3>evidence</h3><ul>" + "".join(f"<li>{with_code(str(x))}</li>" for x in v["evidence"]) + "</ul>")
        if v.get("suggestions"):
            out.append("<h3>try</h3><ul>" + "".join(f"<li>{with_code(str(x))}</li>" for x in v["suggestions"]) + "</ul>")
        if v.get("also"):
            out.append("<ul class='sub'>" + "".join(f"<li>also: {with_code(str(x))}</li>" for x in v["also"]) + "</ul>")
    breakdown = [b for b in p.get("breakdown") or [] if isinstance(b, dict)]
    if breakdown:
        out.append("<h3>time breakdown</h3>")
        img = breakdown_plot(breakdown)
        if img:
            out.append(_figure(img, "share of a step's time per phase", "time breakdown", wide=True))
        out.append(_table([(b.get("phase", "?"), _ms(b.get("ms")), _pct(b.get("share"))) for b in breakdown],
                          header=("phase", "time", "share"), numeric=(1, 2)))
    if p.get("mfu") is not None:
        out.append(f"<p>MFU: <b>{100 * p['mfu']:.1f}%</b> of the device's {p.get('precision', '')} peak"
                   + (f" ({p['achieved_tflops']:.2f} of {p['peak_tflops']:g} TFLOP/s)"
                      if p.get("achieved_tflops") is not None and p.get("peak_tflops") else "") + "</p>")
    elif p.get("flops_per_step"):
        out.append(f"<p>FLOPs: {p['flops_per_step'] / 1e9:.3f} GFLOP per step; MFU: no peak figure for this device</p>")
    ops = [o for o in p.get("top_ops") or [] if isinstance(o, dict)]
    if ops:
        on_gpu = str(p.get("device", "")).startswith("cuda")
        key = "self_device_ms_per_step" if on_gpu else "self_cpu_ms_per_step"
        steps = f", {counted(p['top_ops_steps'], 'training step')}" if p.get("top_ops_steps") else ""
        out.append(_details(f"top {counted(len(ops), 'op')} by {p.get('top_ops_by', 'time')} (per training step{steps})", _table(
            [(o.get("name", "?")[:80], f"{o.get('calls_per_step', 0):g}", _ms(o.get(key)), _pct(o.get("share")))
             for o in ops], header=("op", "calls/step", "self time/step", "share"), numeric=(1, 2, 3))))
        other = [o for o in p.get("other_ops") or [] if isinstance(o, dict)]
        if other:
            key = key.replace("_per_step", "")
            out.append(_details(f"the profiled window's other work (log points: the loss read, evaluation): "
                                f"top {counted(len(other), 'op')}, totals over the window, not per step", _table(
                [(o.get("name", "?")[:80], f"{o.get('calls', 0):g}", _ms(o.get(key)), _pct(o.get("share")))
                 for o in other], header=("op", "calls", "self time", "share"), numeric=(1, 2, 3))))
    return "\n".join(out)


def _curves(records: list[dict[str, Any]], s: dict[str, Any]) -> str:
    recs = [r for r in records if isinstance(r.get("step"), (int, float))]
    if not recs:
        return "<p>No log points to plot.</p>"
    figs = []
    marks = _steps_of(s.get("nonfinite_steps")) + _steps_of(s.get("loss_spikes"))
    figs.append(_figure(line_plot([("train loss", _series(recs, "loss"), {}),
                               ("eval loss", _series(recs, "eval_loss"), {"marker": "o", "markersize": 3})],
                              "loss", log_if_positive=True, marks=marks),
                        "loss against optimizer step" + (" (orange lines: warnings)" if marks else ""), "loss curve"))
    metrics = sorted({k for r in recs for k in r if k.startswith("eval_") and k != "eval_loss"
                      and isinstance(r.get(k), (int, float)) and not isinstance(r.get(k), bool)})
    for key in metrics:
        figs.append(_figure(line_plot([(key.replace("_", " "), _series(recs, key), {"marker": "o", "markersize": 3})],
                                  key.replace("_", " ")), f"{key} against optimizer step", f"{key} curve"))
    for key, label, scale, unit in (("lr", "learning rate", 1, ""), ("samples_per_s", "samples/s", 1, ""),
                                    ("peak_memory_bytes", "peak memory", 2**20, "MiB")):
        xs, ys = _series(recs, key)
        if xs:
            ys = [y / scale for y in ys]
            figs.append(_figure(line_plot([(label, (xs, ys), {})], f"{label} ({unit})" if unit else label),
                                f"{label} at each log point", f"{label} curve"))
    figs = [f for f in figs if f]
    return "<div class='plots'>" + "".join(figs) + "</div>" if figs else "<p>No numeric series to plot.</p>"


def _series(recs: list[dict[str, Any]], key: str) -> tuple[list, list]:
    pts = [(r["step"], float(r[key])) for r in recs
           if isinstance(r.get(key), (int, float)) and not isinstance(r.get(key), bool)]
    return [p[0] for p in pts], [p[1] for p in pts]


def _steps_of(value: Any) -> list[float]:
    """Step numbers from a warning list: ints, or dicts with a 'step'."""
    out = []
    for v in value if isinstance(value, (list, tuple)) else []:
        step = v.get("step") if isinstance(v, dict) else v
        if isinstance(step, (int, float)) and not isinstance(step, bool):
            out.append(step)
    return out


# ---------------------------------------------------------------- HTML helpers

def _section(title: str, content: str, anchor: str) -> list[str]:
    return [f"<section id='{anchor}'><h2>{_e(title)}</h2>\n{content}\n</section>"]


def _details(label: str, content: str) -> str:
    return f"<details><summary>{_e(label)}</summary>\n{content}\n</details>"


def _figure(uri: str | None, caption: str, alt: str, wide: bool = False) -> str:
    if not uri:
        return ""
    return f"<figure{' class=wide' if wide else ''}><img src='{uri}' alt='{_e(alt)}'><figcaption>{_e(caption)}</figcaption></figure>"


def _table(rows: Iterable[tuple], header: tuple[str, ...] | None = None, numeric: tuple[int, ...] = ()) -> str:
    out = ["<table>"]
    if header:
        out.append("<tr>" + "".join(f"<th{' class=n' if i in numeric else ''}>{_e(h)}</th>"
                                    for i, h in enumerate(header)) + "</tr>")
    for row in rows:
        cells = []
        for i, cell in enumerate(row):
            cls = " class='k'" if i == 0 and not header else " class='n'" if i in numeric else ""
            cells.append(f"<td{cls}>{_e(cell)}</td>")
        out.append("<tr>" + "".join(cells) + "</tr>")
    out.append("</table>")
    return "".join(out)


MAX_TABLE_RECORDS = 500  # a long run's table keeps its first and last log points; the curves show all


def _records_table(records: list[dict[str, Any]]) -> str:
    keys: list[str] = []
    for r in records:
        keys += [k for k in r if k not in keys]
    shown = records
    note = ""
    if len(records) > MAX_TABLE_RECORDS:
        half = MAX_TABLE_RECORDS // 2
        shown = records[:half] + records[-half:]
        note = (f"<p class='sub'>the first and last {half} of {len(records)} log points; "
                "metrics.jsonl and metrics.csv hold every one</p>")
    return note + _table([tuple(_cell(r.get(k)) for k in keys) for r in shown], header=tuple(keys),
                         numeric=tuple(range(len(keys))))


def _cell(v: Any) -> str:
    if v is None:
        return ""
    if isinstance(v, float):
        return f"{v:.6g}"
    return _text(v)


def _text(v: Any) -> str:
    if v is None:
        return "-"
    if isinstance(v, bool):
        return "on" if v else "off"
    if isinstance(v, (list, dict)):
        return _json(v) if v else "none"
    return str(v)


def _json(v: Any) -> str:
    return v if isinstance(v, str) else json.dumps(v, default=str)


def _num(v: Any) -> str:
    return f"{v:.4g}" if isinstance(v, float) else str(v)


def _ms(x: Any) -> str:
    if not isinstance(x, (int, float)):
        return "-"
    return f"{x * 1000:.1f} us" if x < 1 else f"{x:.2f} ms"


def _pct(x: Any) -> str:
    return f"{100 * x:.1f}%" if isinstance(x, (int, float)) else "-"


def _last(records: list[dict[str, Any]], key: str):
    for r in reversed(records):
        if r.get(key) is not None:
            return r[key]
    return None
