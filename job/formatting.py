"""How numbers read in the package's text output: bytes, durations. One formatter per kind of number, so
`status`, `report`, the notebook, `plan` and the stage logs print the same thing for the same value."""

from __future__ import annotations

_BYTE_UNITS = ("B", "KB", "MB", "GB", "TB", "PB")


def format_bytes(n: float | None) -> str:
    """Decimal units, one decimal above bytes: 999 → `999 B`, 1541 → `1.5 KB`, 2.3e12 → `2.3 TB`; None → `?`."""
    if n is None:
        return "?"
    for unit in _BYTE_UNITS:
        if abs(n) < 1000 or unit == _BYTE_UNITS[-1]:
            return f"{n:,.0f} {unit}" if unit == "B" else f"{n:,.1f} {unit}"
        n /= 1000
    raise AssertionError


def format_duration(seconds: float | None) -> str:
    """`59s` → `0m59s`, `3h05m`, `1d21h`: two units, the largest first; None, NaN, inf or negative → `?`."""
    if seconds is None or seconds != seconds or seconds == float("inf") or seconds < 0:
        return "?"
    seconds = int(seconds)
    d, rem = divmod(seconds, 86400)
    h, rem = divmod(rem, 3600)
    m, s = divmod(rem, 60)
    if d:
        return f"{d}d{h:02d}h"
    return f"{h}h{m:02d}m" if h else f"{m}m{s:02d}s"
