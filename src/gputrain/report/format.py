"""Numbers for people: byte counts and durations."""

from __future__ import annotations


def format_bytes(n: int | float | None) -> str:
    """1536 -> '1.5 KiB' (binary units); None -> '-'."""
    if n is None:
        return "-"
    n = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


def format_duration(seconds: float | None) -> str:
    """3.5 -> '3.50 s', 125 -> '2 min 05 s', 3725 -> '1 h 02 min'."""
    if seconds is None:
        return "-"
    if seconds < 60:
        return f"{seconds:.2f} s"
    minutes, s = divmod(int(round(seconds)), 60)
    if minutes < 60:
        return f"{minutes} min {s:02d} s"
    hours, minutes = divmod(minutes, 60)
    return f"{hours} h {minutes:02d} min"
