"""The report's "Time to the first step" section: the run's measured setup parts (summary "startup",
train/loop/startup_costs.py), largest first, each with its share of the wall time from fit to the end of
the first optimizer step."""

from __future__ import annotations

from html import escape
from typing import Any


def startup_html(summary: dict[str, Any]) -> str:
    """A table of the parts (seconds, share), the wall time, and import gputrain beside it."""
    startup = summary.get("startup") or {}
    wall = startup.get("wall_s")
    parts = [p for p in startup.get("parts") or [] if isinstance(p, dict)]
    if not wall or not parts:
        return "<p>No first step recorded (a run from before this was measured, or one that took no step).</p>"
    rows = "".join(f"<tr><td>{escape(str(p['name']))}</td><td class=n>{p['s']:.3f}</td>"
                   f"<td class=n>{100 * p['s'] / wall:.1f}%</td></tr>"
                   for p in sorted(parts, key=lambda p: -p["s"]))
    counted = sum(p["s"] for p in parts)
    imp = startup.get("import_s")
    return ("<table><tr><th>part</th><th class=n>seconds</th><th class=n>share</th></tr>" + rows
            + f"<tr><td>not in a named part</td><td class=n>{wall - counted:.3f}</td>"
              f"<td class=n>{100 * (wall - counted) / wall:.1f}%</td></tr></table>"
            + f"<p class='sub'>{wall:.2f} s from fit to the end of the first optimizer step, measured "
              "(perf_counter marks, one device sync after the first step)"
            + (f"; import gputrain took {imp:.2f} s in this process, before fit" if imp is not None else "")
            + ".</p>")
