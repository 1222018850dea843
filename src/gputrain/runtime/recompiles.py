"""Recompilations and graph breaks of torch.compile during a run, with their reasons and a hint.

    watcher = RecompileWatcher().start()      # or: with RecompileWatcher() as watcher:
    ... compiled training ...
    watcher.report()   # {"recompilations": 1, "graph_breaks": 0, "events": [...], "summary": "..."}
    watcher.summary()  # "recompiled 1 time: input 0 dim 0 8 -> 3 (last partial batch): set drop_last ..."
    watcher.stop()

Where the data comes from (dynamo's records, read only, nothing switched on; reached through
torch_compat.py, which says what happens on a torch without them):
- `torch._dynamo.utils.get_compilation_metrics()`: one CompilationMetrics per frame compilation,
  kept in a deque of the last 64. A recompilation carries `recompile_reason`, the first guard that
  failed (e.g. "0/0: tensor 'args[0]' size mismatch at index 0. expected 8, actual 3"), and every
  entry its compile time (`duration_us`). A backward graph, compiled at the first backward, has
  its own entry (is_forward=False) when it is compiled rather than loaded from the compile caches.
- `torch._dynamo.utils.counters["graph_break"]`: a Counter of graph-break messages (each message
  starts with a one-line title, then "Explanation:" and "Hint:" lines).

Turning on the `recompiles` log artifact (torch._logging.set_logs) would also give the reasons, but
it is process-wide state (set_logs resets every other log setting) and prints to the user's stderr;
reading what dynamo records anyway leaves nothing behind and costs nothing while nothing compiles:
a poll compares the deque's last entry and the counter's total with what it saw before.
"""

from __future__ import annotations

import re
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from gputrain import torch_compat

_SIZE = re.compile(r"tensor '(?P<name>[^']+)' size mismatch at index (?P<dim>\d+)\. "
                   r"expected (?P<expected>\d+), actual (?P<actual>\d+)")
_DTYPE = re.compile(r"tensor '(?P<name>[^']+)' dtype mismatch\. expected (?P<expected>\S+), actual (?P<actual>\S+)")
_STRIDE = re.compile(r"tensor '(?P<name>[^']+)' stride mismatch")
_DEVICE = re.compile(r"tensor '(?P<name>[^']+)' (?:device|dispatch key set) mismatch")
_COMPILE_ID = re.compile(r"^\s*\[?\d+/\d+[^:]*\]?:\s*")
_ARG = re.compile(r"^(?:L\[')?args\[(\d+)\](?:'\])?$")


def _input_name(name: str) -> str:
    """dynamo's source name of a tensor -> what a user calls it: "args[0]" -> "input 0"."""
    m = _ARG.match(name)
    if m:
        return f"input {m.group(1)}"
    m = re.fullmatch(r"L\['([^']+)'\]", name)
    return f"input {m.group(1)!r}" if m else name


def explain_guard_failure(reason: str) -> tuple[str, str]:
    """A guard failure reason -> (short description, hint). Unknown reasons keep their first line."""
    text = _COMPILE_ID.sub("", reason.strip()).splitlines()[0] if reason.strip() else "unknown reason"
    m = _SIZE.search(reason)
    if m:
        name, dim = _input_name(m["name"]), int(m["dim"])
        exp, act = int(m["expected"]), int(m["actual"])
        what = f"{name} dim {dim} {exp} -> {act}"
        if dim == 0 and act < exp:
            return (f"{what} (last partial batch)",
                    "set drop_last, or compile with dynamic=True (or torch._dynamo.mark_dynamic(x, 0))")
        if dim == 0:
            return (f"{what} (batch size changed)",
                    "keep one batch size, or compile with dynamic=True (or torch._dynamo.mark_dynamic(x, 0))")
        return (f"{what} (a non-batch dimension changed)",
                "pad inputs to a fixed size (e.g. sequence length), or compile with dynamic=True")
    m = _DTYPE.search(reason)
    if m:
        return (f"{_input_name(m['name'])} dtype {m['expected']} -> {m['actual']}",
                "feed one dtype (cast inputs once, before the compiled model)")
    m = _STRIDE.search(reason)
    if m:
        return (f"{_input_name(m['name'])} memory layout (strides) changed",
                "feed one layout: make inputs .contiguous() (or channels_last) every time")
    m = _DEVICE.search(reason)
    if m:
        return (f"{_input_name(m['name'])} device or dispatch keys changed",
                "keep inputs on one device; requires_grad or autocast changes also count")
    if "grad_mode" in reason:
        return ("grad mode changed (torch.no_grad)",
                "expected once for evaluation; repeated, it means train and eval alternate one frame")
    if "autocast" in reason.lower():
        return ("autocast state changed", "call the compiled model under one autocast setting")
    if ".training" in reason:
        return ("module train/eval mode changed", "expected once for evaluation (model.eval())")
    if "___check_obj_id" in reason or "ID_MATCH" in reason or "id mismatch" in reason:
        return (text, "a Python object the graph depends on was replaced (a new module, function or "
                      "constant); keep it the same object between calls")
    return text, "run with TORCH_LOGS=recompiles for the full guard"


def _where(m) -> str | None:
    """The compiled function of a CompilationMetrics, as "name (file:line)"."""
    name, filename = getattr(m, "co_name", None), getattr(m, "co_filename", None) or ""
    if not name:
        return None
    if torch_compat.is_compiled_forward_wrapper(filename):
        return "a compiled module's forward"  # torch.compile(module) wraps forward in external_utils.inner
    return f"{name} ({filename}:{getattr(m, 'co_firstlineno', '?')})"


def _unchanged(records, seen: list) -> bool:
    """Whether dynamo's records end where they ended at the last poll (or both are empty)."""
    return bool(seen and records and records[-1] is seen[-1]) or (not seen and not records)


def _compile_seconds(m) -> float:
    """Seconds one CompilationMetrics entry took: `duration_us` covers a forward frame's whole
    compile and a backward graph's (compiled lazily at the first backward, its own entry with
    is_forward=False and no entire_frame_compile_time_s); older records have only the latter."""
    us = getattr(m, "duration_us", None)
    if us:
        return us / 1e6
    return float(getattr(m, "entire_frame_compile_time_s", None) or 0.0)


def _graph_break_parts(message: str) -> tuple[str, str, str]:
    """A graph-break counter key -> (title, explanation, first hint)."""
    lines = [ln.strip() for ln in message.splitlines() if ln.strip()]
    title = lines[0] if lines else "graph break"
    explanation = next((ln[len("Explanation:"):].strip() for ln in lines if ln.startswith("Explanation:")), "")
    hint = next((ln[len("Hint:"):].strip() for ln in lines if ln.startswith("Hint:")), "")
    return title, explanation, hint or "see the graph-break site linked in the message"


@dataclass
class RecompileWatcher:
    """Counts torch.compile's (re)compilations and graph breaks between start() and stop().

    Polls dynamo's own records (see the module docstring); report() and summary() poll first, so
    calling them at log points is all a trainer needs. Cheap when nothing compiled since the last
    poll: one identity check and one sum over the graph-break counter.
    """

    events: list[dict[str, Any]] = field(default_factory=list)
    compilations: int = 0  # frame compilations, the first ones included
    compile_time_s: float = 0.0  # seconds compiling: forward frames (dynamo + backend) and backward graphs
    missed: bool = False  # more than the deque's 64 compiles happened between two polls
    _seen: list = field(default_factory=list, repr=False)  # CompilationMetrics already counted
    _breaks: Counter = field(default_factory=Counter, repr=False)
    _break_total: int = field(default=0, repr=False)
    _running: bool = field(default=False, repr=False)

    # ------------------------------------------------------------ lifecycle

    def start(self) -> "RecompileWatcher":
        """Remember what dynamo has recorded so far; only later compilations are reported."""
        self._seen = torch_compat.compilation_metrics()
        self._breaks = Counter(torch_compat.dynamo_counters().get("graph_break", {}))
        self._break_total = sum(self._breaks.values())
        self._running = True
        return self

    def stop(self) -> dict[str, Any]:
        """Poll once more, stop watching, and return report() (which stays readable afterwards)."""
        self.poll()
        self._running = False
        self._seen = []  # drop the references to dynamo's records
        return self.report()

    def __enter__(self) -> "RecompileWatcher":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    # ------------------------------------------------------------ reading

    def poll(self) -> None:
        """Take in what dynamo recorded since the last poll."""
        if not self._running:
            return
        self._poll_compiles()
        graph_breaks = torch_compat.dynamo_counters().get("graph_break")
        if graph_breaks is not None and sum(graph_breaks.values()) != self._break_total:
            self._poll_breaks(graph_breaks)

    def _poll_compiles(self) -> None:
        live = torch_compat.compilation_metrics_log()  # None: a torch without it; then a copy per poll
        if live is not None and _unchanged(live, self._seen):
            return  # nothing new (the common case): no copy
        metrics = torch_compat.compilation_metrics()
        if live is None and _unchanged(metrics, self._seen):
            return
        maxlen = live.maxlen if live is not None else None
        seen_ids = {id(m) for m in self._seen}
        new = [m for m in metrics if id(m) not in seen_ids]
        if self._seen and new and len(metrics) == maxlen and not any(id(m) in seen_ids for m in metrics):
            self.missed = True  # everything we had seen was pushed out: some compiles went unseen
        for m in new:
            if getattr(m, "is_runtime", False):
                continue  # runtime autotuning records, not compilations
            if getattr(m, "is_forward", None) is not False:  # a backward graph is part of its forward's compile
                self.compilations += 1
            self.compile_time_s += _compile_seconds(m)
            reason = getattr(m, "recompile_reason", None)
            fail = getattr(m, "fail_reason", None) or ""
            where = _where(m)
            if reason:
                short, hint = explain_guard_failure(reason)
                self.events.append({"kind": "recompile", "compile_id": str(m.compile_id), "function": where,
                                    "reason": reason, "short": short, "hint": hint,
                                    "compile_time_s": _compile_seconds(m)})
            if "recompile limit" in fail.lower() or "cache_size_limit" in fail:
                self.events.append({"kind": "recompile_limit", "compile_id": str(m.compile_id), "function": where,
                                    "reason": fail.splitlines()[0] if fail else "", "short": "recompile limit hit",
                                    "hint": "this function now runs eagerly (slow): remove the cause of the "
                                            "recompilations above"})
        self._seen = metrics

    def _poll_breaks(self, graph_breaks: Counter) -> None:
        for message, count in graph_breaks.items():
            added = count - self._breaks.get(message, 0)
            if added <= 0:
                continue
            title, explanation, hint = _graph_break_parts(message)
            self.events.append({"kind": "graph_break", "count": added, "reason": title, "short": title,
                                "explanation": explanation, "hint": hint})
        self._breaks = Counter(graph_breaks)
        self._break_total = sum(self._breaks.values())

    # ------------------------------------------------------------ results

    @property
    def recompilations(self) -> int:
        return sum(1 for e in self.events if e["kind"] == "recompile")

    @property
    def graph_breaks(self) -> int:
        return sum(e["count"] for e in self.events if e["kind"] == "graph_break")

    def report(self) -> dict[str, Any]:
        """{"recompilations", "graph_breaks", "compilations", "compile_time_s", "missed", "events",
        "summary"}; events are dicts with kind ("recompile" | "graph_break" | "recompile_limit"),
        reason (dynamo's text), short (what changed) and hint (what to do)."""
        self.poll()
        return {
            "recompilations": self.recompilations,
            "graph_breaks": self.graph_breaks,
            "compilations": self.compilations,
            "compile_time_s": self.compile_time_s,
            "missed": self.missed,
            "events": [dict(e) for e in self.events],
            "summary": self.summary(),
        }

    def summary(self) -> str:
        """One line, e.g. "recompiled 3 times: input 0 dim 0 64 -> 16 (last partial batch): set drop_last, ..."."""
        self.poll()
        parts = []
        recompiles = [e for e in self.events if e["kind"] == "recompile"]
        if recompiles:
            n = len(recompiles)
            # The most frequent cause first; others are counted.
            causes = Counter((e["short"], e["hint"]) for e in recompiles).most_common()
            (short, hint), _ = causes[0]
            more = f" (and {len(causes) - 1} other cause{'s' if len(causes) > 2 else ''})" if len(causes) > 1 else ""
            parts.append(f"recompiled {n} time{'s' if n != 1 else ''}: {short}: {hint}{more}")
        if any(e["kind"] == "recompile_limit" for e in self.events):
            parts.append("recompile limit hit: a function fell back to eager")
        breaks = [e for e in self.events if e["kind"] == "graph_break"]
        if breaks:
            n = sum(e["count"] for e in breaks)
            top = max(breaks, key=lambda e: e["count"])
            parts.append(f"{n} graph break{'s' if n != 1 else ''}: {top['short']}: {top['hint']}")
        if self.missed:
            parts.append("some compilations went unseen (more than 64 between two polls)")
        return "; ".join(parts) if parts else "no recompilations, no graph breaks"
