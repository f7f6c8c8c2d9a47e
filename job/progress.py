"""Live progress of a running stage on the driver: rows done/total, output tokens/s (now and average), ETA,
error and quality rates so far.

A terminal gets a one-line bar redrawn in place; anything else (e.g. `ray job submit` logs) gets a plain line
every `log_every_s` seconds, so logs stay readable over a 45-hour run.
"""

from __future__ import annotations

import sys
import time
from collections import deque

from job import schema


def fmt_duration(seconds: float) -> str:
    if seconds != seconds or seconds == float("inf"):
        return "?"
    seconds = int(seconds)
    h, rem = divmod(seconds, 3600)
    m, s = divmod(rem, 60)
    return f"{h}h{m:02d}m" if h else f"{m}m{s:02d}s"


class Progress:
    def __init__(self, *, total_rows: int, done_rows: int, label: str, log_every_s: float = 30.0, stream=None):
        self.total_rows = total_rows
        self.done_before = done_rows
        self.label = label
        self.stream = stream or sys.stdout
        self.tty = self.stream.isatty()
        self.log_every_s = 1.0 if self.tty else log_every_s
        self.started = time.monotonic()
        self.last_print = 0.0
        self.totals: dict[str, int] = {}
        self.recent: deque[tuple[float, int]] = deque()  # (time, output tokens) over the last minute
        self.metrics = _Metrics(label)

    @property
    def rows(self) -> int:
        return self.totals.get("num_rows", 0)

    def update(self, unit_summary: dict) -> None:
        for k, v in unit_summary.items():
            if k.startswith("num_"):
                self.totals[k] = self.totals.get(k, 0) + int(v)
        now = time.monotonic()
        self.recent.append((now, int(unit_summary.get("num_output_tokens", 0))))
        while self.recent and now - self.recent[0][0] > 60:
            self.recent.popleft()
        self.metrics.update(self)
        if now - self.last_print >= self.log_every_s or self.done_before + self.rows >= self.total_rows:
            self.last_print = now
            self._print(self.line())

    def line(self) -> str:
        now = time.monotonic()
        elapsed = max(now - self.started, 1e-9)
        done = self.done_before + self.rows
        tokens = self.totals.get("num_output_tokens", 0)
        avg = tokens / elapsed
        window = now - self.recent[0][0] if len(self.recent) > 1 else 0
        current = sum(t for _, t in self.recent) / window if window > 0 else avg
        rows_per_s = self.rows / elapsed
        eta = (self.total_rows - done) / rows_per_s if rows_per_s else float("inf")
        ok_rows = max(1, self.rows - self.totals.get("num_errors", 0))
        flags = " ".join(f"{flag}={self.totals.get('num_' + flag, 0) / ok_rows:.0%}"
                         for flag in schema.QUALITY_FLAGS if self.totals.get("num_" + flag))
        pct = done / self.total_rows if self.total_rows else 1.0
        return (f"[{self.label}] {done:,}/{self.total_rows:,} rows ({pct:.1%}) | {current:,.0f} tok/s now, "
                f"{avg:,.0f} avg | ETA {fmt_duration(eta)} | errors "
                f"{self.totals.get('num_errors', 0) / max(1, self.rows):.1%}" + (f" | {flags}" if flags else ""))

    def _print(self, text: str) -> None:
        if self.tty:
            self.stream.write("\r" + text[:200].ljust(120))
        else:
            self.stream.write(text + "\n")
        self.stream.flush()

    def close(self) -> None:
        if self.tty:
            self.stream.write("\n")
            self.stream.flush()


class _Metrics:
    """The same figures as Prometheus metrics through ray.util.metrics (Ray's dashboard / Grafana)."""

    def __init__(self, label: str):
        self.gauges = None
        try:
            import ray
            from ray.util.metrics import Counter, Gauge

            if not ray.is_initialized():
                return
            tags = ("stage",)
            self.tags = {"stage": label}
            self.rows = Counter("datagen_rows_done", "Rows written to shards", tag_keys=tags)
            self.tokens = Counter("datagen_output_tokens", "Output tokens written", tag_keys=tags)
            self.gauges = {"progress": Gauge("datagen_progress_fraction", "Rows done / total", tag_keys=tags),
                           "errors": Gauge("datagen_error_rate", "Error rows / rows", tag_keys=tags)}
            self.last = (0, 0)
        except Exception:  # metrics are best effort: never fail a run for them
            self.gauges = None

    def update(self, p: Progress) -> None:
        if not self.gauges:
            return
        rows, tokens = p.rows, p.totals.get("num_output_tokens", 0)
        if rows > self.last[0]:
            self.rows.inc(rows - self.last[0], tags=self.tags)
        if tokens > self.last[1]:
            self.tokens.inc(tokens - self.last[1], tags=self.tags)
        self.last = (rows, tokens)
        total = max(1, p.total_rows)
        self.gauges["progress"].set((p.done_before + rows) / total, tags=self.tags)
        self.gauges["errors"].set(p.totals.get("num_errors", 0) / max(1, rows), tags=self.tags)
