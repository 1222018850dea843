"""The GPU day's goals and its Markdown summary, read from the day's JSON (gpu_day/day.py).

The goals, reported against (not tuned toward). Issue 42's: iris whole run < 1.0 s; the seed CNN
>= 10x the seed's GPU loop; ResNet-18 and GPT-mini >= 1.0x the hand eager loop and >= 1.3x Lightning
and Accelerate; the graphed step's wall time <= 1.3x its replay; 0 steady host syncs in every row.
Issue 45's (part (e), the 12-block GPT-mini): regional compile's cold start at least 3x shorter than
the whole model's, its steady step within 5% of the whole model's, a second start (the compile cache
loaded) at least 3x shorter than the first.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

FINE = ("ok", "not present", "not installed", "not applicable")
OPTIONAL = ("e", "f")  # skipped for want of time, the day is still whole
# A second device call's seconds: a session's 15 minutes of device time, less the machine's start,
# the day's first call (its 510 s budget and the parts' grace) and a minute to spare.
RERUN_BUDGET_S = 180


def _get(d: Any, *keys: Any) -> Any:
    for k in keys:
        if isinstance(d, dict):
            d = d.get(k)
        elif isinstance(d, list) and isinstance(k, int) and -len(d) <= k < len(d):
            d = d[k]
        else:
            return None
    return d


def _goal(goal: str, value: float | None, need: float, at_most: bool = False, unit: str = "x") -> dict[str, Any]:
    met = None if value is None else (value <= need if at_most else value >= need)
    return {"goal": goal, "value": value, "bar": f"{'<=' if at_most else '>='} {need}{unit}", "met": met}


def goals(day: dict[str, Any]) -> list[dict[str, Any]]:
    """Each goal with the measured value and met True/False, or None where it was not measured."""
    speed = _get(day, "parts", "d", "result", "rows") or {}
    out = [
        _goal("iris-mlp 20000 epochs, gputrain whole run (s)",
              _get(speed, "iris", "results", "gputrain-default", "median_s"), 1.0, at_most=True, unit=" s"),
        _goal("seed CNN at batch 64, gputrain default vs the seed's GPU loop",
              _get(speed, "seed-cnn", "results", "gputrain-default", "x_vs", "seed-gpu"), 10.0),
        _goal("seed CNN at batch 64, gputrain fast vs the seed's GPU loop",
              _get(speed, "seed-cnn", "results", "gputrain-fast", "x_vs", "seed-gpu"), 10.0),
    ]
    for key, label in (("resnet18", "ResNet-18"), ("gpt-mini", "GPT-mini")):
        summary = {s["contender"]: s for s in _get(speed, key, "summary") or []}
        ours = summary.get("gputrain", {})
        out += [_goal(f"{label} bf16, gputrain vs the hand eager loop", ours.get("vs_hand-eager"), 1.0),
                _goal(f"{label} bf16, gputrain vs Lightning bf16-mixed", ours.get("vs_lightning-bf16"), 1.3),
                _goal(f"{label} bf16, gputrain vs Accelerate bf16", ours.get("vs_accelerate-bf16"), 1.3)]
    for row in _get(speed, "graphed", "rows") or []:
        out.append(_goal(f"graphed step wall / replay, {row['workload']}", row.get("wall_over_replay"), 1.3,
                         at_most=True))
    for row in _get(day, "parts", "c", "result", "rows") or []:
        out.append(_goal(f"steady host syncs, {row['case']}", row.get("syncs"), 0, at_most=True, unit=""))
    return out + first_step_goals(_get(day, "parts", "e", "result", "results") or {})


def first_step_goals(cases: dict[str, Any]) -> list[dict[str, Any]]:
    """Issue 45's goals from first_step.py's cases (seconds from fit() or the loop's first line to the
    end of the first step; steady ms per step)."""

    def ratio(a: str, b: str, key: str) -> float | None:
        x, y = _get(cases, a, key), _get(cases, b, key)
        return x / y if isinstance(x, (int, float)) and isinstance(y, (int, float)) and y else None

    out = []
    for way in ("loop", "fit"):
        who = "the hand loop" if way == "loop" else "gputrain fit"
        out += [_goal(f"GPT-mini 12 blocks, {who}: whole compile's first step / regional's",
                      ratio(f"gpt-mini {way} whole", f"gpt-mini {way} regional", "from_fit_s"), 3.0),
                _goal(f"GPT-mini 12 blocks, {who}: regional's steady step / whole compile's",
                      ratio(f"gpt-mini {way} regional", f"gpt-mini {way} whole", "steady_ms"), 1.05, at_most=True)]
    for how in ("whole", "regional"):
        out.append(_goal(f"GPT-mini 12 blocks, gputrain fit {how}: first start / second start (compile cache)",
                         ratio(f"gpt-mini fit {how}", f"gpt-mini fit {how} second start", "from_fit_s"), 3.0))
    return out


def not_fine(day: dict[str, Any]) -> dict[str, str]:
    """The parts that did not end fine (failed, crashed, overran, skipped), by key, with their status;
    an optional part skipped for want of time is not among them."""
    return {k: p["status"] for k, p in day["parts"].items()
            if p["status"] not in FINE and not (k in OPTIONAL and p["status"].startswith("skipped"))}


def next_call(day: dict[str, Any]) -> dict[str, str] | None:
    """What the session's second device call should run, or None when the day is whole: the parts
    that did not end fine and those the day never reached (a call cut short), after their fix; else
    the optional parts that were skipped or cut short (a first-step case skipped or timed out)."""
    wanted, parts = day["config"]["parts"], day["parts"]
    bad, unrun = not_fine(day), [k for k in wanted if k not in parts]
    short = [k for k in wanted if k in OPTIONAL and k in parts and k not in bad and (
        parts[k]["status"].startswith("skipped") or _get(parts[k], "result", "skipped")
        or _get(parts[k], "result", "timed_out"))]
    if bad or unrun:
        keys = [k for k in wanted if k in bad or k in unrun]
        why = "; ".join([f"({k}) {bad[k]}" for k in keys if k in bad] + [f"({k}) not reached" for k in unrun])
        why = f"fix what failed, then rerun it alone: {why}" if bad else f"the day ended before: {why}"
    elif short:
        keys = short
        why = "every part ended fine; the optional parts ran short of time: " + "; ".join(
            f"({k}) {parts[k]['status'] if parts[k]['status'].startswith('skipped') else 'cases skipped or cut'}"
            for k in keys)
    else:
        return None
    cpu = day["config"]["device"] == "cpu"
    command = (f"bash benchmarks/gpu_session.sh day{' --device cpu' if cpu else ''} --parts {','.join(keys)}"
               + ("" if cpu else f" --budget {RERUN_BUDGET_S}"))
    lines = _smoke_lines_to_rerun(_get(parts, "a", "result") or {})
    if "a" in keys and lines:  # the smoke lines that passed are not run again
        command += f" --smoke-only '^({'|'.join(lines)})$'"
    if not cpu:
        why += f" (--budget: the device time left, less a minute; {RERUN_BUDGET_S} s after a full day)"
    return {"command": command, "why": why}


def _smoke_lines_to_rerun(smoke: dict[str, Any]) -> list[str]:
    """The smoke lines that failed, or were cut or skipped by the smoke's budget (not those skipped
    for a reason that a rerun keeps: no optuna, a CUDA-only line on the CPU)."""
    return [ln["name"] for ln in smoke.get("lines", [])
            if ln["status"].startswith("fail") or (ln["status"].startswith("skipped") and "budget" in ln["status"])]


def headline(env: dict[str, Any], device: str) -> str:
    """The device the day ran on, by name, and the versions: the first line of the day's output and
    of its summary ('cuda:0 (NVIDIA H100 80GB HBM3); torch 2.11.0+cu130, CUDA 13.0, ...')."""
    if "torch" not in env:
        return f"{device}: the environment could not be read: {str(env.get('error', '?')).strip()[-300:]}"
    kind = device.split(":")[0]
    ran = [d for d in env.get("devices", []) if d.get("device", "").split(":")[0] == kind]
    where = f"{ran[0]['device']} ({ran[0]['name']})" if ran else f"{device} (not seen by torch)"
    return (f"{where}; torch {env['torch']}, CUDA {env.get('cuda')}, cuDNN {env.get('cudnn')}, driver "
            f"{env.get('driver')}, Python {env.get('python')}")


# ---------------------------------------------------------------- Markdown


def _f(v: Any, fmt: str = ".3g") -> str:
    return "-" if v is None else (format(v, fmt) if isinstance(v, (int, float)) and not isinstance(v, bool) else str(v))


def _table(head: list[str], rows: list[list[Any]]) -> list[str]:
    return ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)] + \
        ["| " + " | ".join(_f(c) for c in r) + " |" for r in rows]


def _smoke(result: dict) -> list[str]:
    out = [f"{result.get('passed')} passed, {result.get('failed')} failed, {result.get('skipped')} skipped "
           f"in {_f(result.get('wall_s'))} s.", ""]
    out += _table(["line", "status", "s"], [[f"`{ln['name']}`", ln["status"], ln["seconds"]]
                                           for ln in result.get("lines", [])])
    for ln in result.get("lines", []):
        if ln["status"].startswith("fail"):
            out += ["", f"`{ln['name']}`: `{ln['command']}`", "```", ln.get("tail", "").rstrip()[-1500:], "```"]
    return out


def _zoo(result: dict) -> list[str]:
    out = [f"{result['passed']} passed, {result['failed']} failed, {result['error']} errors, "
           f"{result['skipped']} skipped.", ""]
    return out + _table(["case", "outcome", "s", "message"],
                        [[c["name"], c["outcome"], c["seconds"], c["message"][:200].replace("\n", " ")]
                         for c in result["cases"]])


def _syncs(result: dict) -> list[str]:
    out = [f"{result.get('method')}; {result.get('steps')} steps after {result.get('warmup_steps')}.", ""]
    return out + _table(["case", "status", "syncs", "graphs", "where"],
                        [[r["case"], r["status"], r.get("syncs"), (r.get("graph_status") or "")[:40],
                          "; ".join(f"`{s['where']}` {s['what']} x{s['count']}" for s in r.get("sites", []))
                          or r.get("error", "")] for r in result.get("rows", [])])


def _speed(result: dict) -> list[str]:
    out: list[str] = [f"compile: {result.get('compile')}; medians of {result.get('repeats')} rounds.", ""]
    out += [f"- failed: {line}" for line in result.get("failed_contenders", [])]
    for key, row in result.get("rows", {}).items():
        out += [f"**{key}** ({row.get('status')}, {_f(row.get('seconds'))} s)", ""]
        if "results" in row:  # whole runs (train_speed.py)
            out += [f"{row['case']}: batch {row['batch_size']}, {row['epochs']} epochs, {row['samples']} samples; "
                    f"{row['timing']}.", ""]
            names = [n for n, r in row["results"].items() if r["status"] == "ok"]
            out += _table(["contender", "precision", "median s", "min s", "max s", "n", *[f"x {n}" for n in names]],
                          [[n, r.get("precision"), r.get("median_s"), r.get("min_s"), r.get("max_s"), r.get("n"),
                            *[r.get("x_vs", {}).get(o) for o in names]] if r["status"] == "ok" else [n, r["status"]]
                           for n, r in row["results"].items()])
        elif key == "graphed":
            out += _table(["workload", "graphs", "wall us/step", "replay us", "wall/replay", "n"],
                          [[r["workload"], (r.get("graphs") or "")[:40], _get(r, "wall_us_per_step", "median"),
                            _get(r, "replay_us", "median"), r.get("wall_over_replay"), r.get("n")]
                           for r in row.get("rows", [])])
        elif "summary" in row:  # real_models.py
            out += _table(["contender", "samples/s", "tokens/s", "step ms", "n", "MFU", "compile s", "x hand-eager",
                           "x hand-compile", "x lightning", "x accelerate"],
                          [[s["contender"], s.get("samples_per_s"), s.get("tokens_per_s"),
                            (_get(s, "step_s", "median_s") or 0) * 1e3 if s["status"] == "ok" else
                            f"{s['status']}: {str(s.get('reason'))[:160]}",
                            s.get("n"), s.get("mfu"), s.get("compile_s"), s.get("vs_hand-eager"),
                            s.get("vs_hand-compile"), s.get("vs_lightning-bf16"), s.get("vs_accelerate-bf16")]
                           for s in row["summary"]])
        elif "error" in row:
            out.append(f"error: {row['error']}")
        out.append("")
    return out


def _first_step(result: dict) -> list[str]:
    size = result.get("size", {})
    gpt = size.get("gpt", {})
    out = [f"GPT-mini {gpt.get('n_layer')} x {gpt.get('n_embd')}, context {gpt.get('block_size')}, batch "
           f"{_get(size, 'batch', 'gpt-mini')}; {result.get('steps')} steps; each case a fresh process with empty "
           f"compile caches (a second start: the first start's cache folder); medians of {result.get('repeats')}.", ""]
    out += _table(["case", "from fit s", "from command s", "steady ms", "precision", "compile"],
                  [[name, r.get("from_fit_s"), r.get("from_command_s"), r.get("steady_ms"), r.get("precision"),
                    (r.get("compile_decision") or "")[:80]] if "error" not in r else [name, f"error: {r['error']}"]
                   for name, r in result.get("results", {}).items()])
    out += [""] + [f"- {k}: {_f(v)}x" for k, v in result.get("ratios", {}).items()]
    if result.get("timed_out"):
        out += ["", f"timed out (killed at the part's end, not failed): {', '.join(result['timed_out'])}"]
    if result.get("skipped"):
        out += ["", f"skipped (the part's time was spent): {', '.join(result['skipped'])}"]
    return out


def _float8(result: dict) -> list[str]:
    if result.get("status") in ("not installed", "not applicable"):
        return [f"{result['status']}: {result.get('reason')}"]
    return _table(["precision", "status", "step ms", "tokens/s", "n"],
                  [[k, r["status"], (_get(r, "step_s", "median") or 0) * 1e3, r.get("tokens_per_s"),
                    _get(r, "step_s", "n")] for k, r in result.get("rows", {}).items()]) + \
        ["", f"float8 / bf16 tokens/s: {_f(result.get('float8_over_bf16'))}"]


RENDER = {"a": _smoke, "b": _zoo, "c": _syncs, "d": _speed, "e": _first_step, "f": _float8}


def write_markdown(day: dict[str, Any], path: Path) -> None:
    env = day.get("environment", {})
    dev = ", ".join(f"{d['device']} ({d['name']})" for d in env.get("devices", [])) or env.get("error", "?")
    out = [f"# GPU day, {env.get('date', '?')}: {day['device_slug']}", "",
           f"**{headline(env, day['config']['device'])}**", "",
           f"`{day['command']}`: {dev}; {_f(day.get('wall_s'))} s of a {day['config']['budget_s']:.0f} s budget. "
           f"A GPU day's JSON goes to `{day['results_path']}`.", ""]
    out += _table(["part", "status", "s", "budget s", "what"],
                  [[f"({k}) {p['name']}", p["status"], f"{p.get('seconds') or 0:.0f}", f"{p.get('budget_s') or 0:.0f}",
                    p["title"]]
                   for k, p in day["parts"].items()])
    after = next_call(day)
    out += ["", f"**Next device call:** `{after['command']}`: {after['why']}." if after else
            "**Next device call:** none: every part ended fine and whole; give the machine back."]
    out += ["", "## Goals (issues 42 and 45; reported against, not tuned toward)", ""]
    if day["device_slug"] == "cpu":
        out += ["A CPU run at tiny sizes checks that every part's code runs: its figures and these goals mean "
                "nothing on the CPU (the goals are for a GPU).", ""]
    out += _table(["goal", "value", "bar", "met"],
                  [[g["goal"], g["value"], g["bar"], {True: "yes", False: "**no**", None: "not measured"}[g["met"]]]
                   for g in day.get("goals", [])])
    for key, part in day["parts"].items():
        out += ["", f"## ({key}) {part['name']}: {part['status']}", ""]
        if part.get("reason"):
            out.append(part["reason"])
        result = part.get("result")
        if result:
            out += RENDER[key](result)
        if part.get("tail"):
            out += ["", f"`{part.get('command', '')}`, the end of its log:", "```", part["tail"].rstrip(), "```"]
    path.write_text("\n".join(out) + "\n")
