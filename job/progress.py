"""Live progress of a running stage on the driver: rows done/total, output tokens/s (now and average), ETA,
error and quality rates so far, engines alive.

    tracker = Progress(total_rows=914_000, done_rows=0, label="generate")
    for unit_summary in summaries:        # {"num_rows": 256, "num_output_tokens": ..., "num_errors": ..., ...}
        tracker.update(unit_summary)
    tracker.close()

Two renderings of the same figures:
- a terminal gets a bar redrawn in place about once a second;
- anything else (`ray job submit` logs, `nohup`, CI) gets one plain line every `log_every_s` (30 s: ~5,400 lines
  over a 45-hour run, each one complete on its own, so `tail` and `grep` work), and a line at the end.
A background thread keeps printing while no unit finishes (engines starting, a long first unit), so silence in
the log always means the driver itself is stuck.

The same figures are exported as Prometheus metrics through `ray.util.metrics` (names `datagen_*`, tag `stage`;
Prometheus shows them as `ray_datagen_*`): Ray's dashboard and Grafana chart them next to Ray's own GPU and
object-store metrics. Metrics are best effort: a run never fails because of them.
"""

from __future__ import annotations

import shutil
import sys
import threading
import time
from collections import deque
from collections.abc import Callable

from job import schema
from job.formatting import format_duration as fmt_duration

# Short names for the quality flags in the progress line.
_FLAG_ABBREV = {
    schema.FLAG_TOO_SHORT: "short",
    schema.FLAG_UNCLOSED_THINK: "unclosed",
    schema.FLAG_EMPTY_ANSWER: "empty",
    schema.FLAG_TRUNCATED: "trunc",
    schema.FLAG_REPETITION: "rep",
    schema.FLAG_TEMPLATE_MISMATCH: "tmpl",
}


class Progress:
    def __init__(self, *, total_rows: int, done_rows: int, label: str, log_every_s: float = 30.0,
                 window_s: float = 300.0, stream=None, num_engines: int | None = None,
                 max_engines: int | None = None, engines_fn: Callable[[], object] | None = None,
                 heartbeat: bool = True, metrics: bool = True, tokens_key: str = "num_output_tokens"):
        """
        tokens_key: the key of a unit summary that counts the stage's tokens (stage 1: output tokens generated;
        stage 2: `num_tokens_extracted`).
        total_rows / done_rows: rows of the whole run, and those already done before this job started.
        log_every_s: plain-line interval when the stream is not a terminal.
        window_s: the "now" rate is measured over this many seconds (units finish in bursts; 5 min smooths them).
        num_engines: engines the stage asked for, shown as `alive/asked` when given.
        max_engines: the pool's maximum when it may grow (nodes joining), shown as `alive/asked-max`.
        engines_fn: returns the engines now, an int (alive) or a cluster.EngineCensus (alive, nodes, lost,
        replaced), or None (not known: the line leaves engines out); the stages pass their cluster.StageCensus.
        """
        self.total_rows = total_rows
        self.tokens_key = tokens_key
        self.done_before = done_rows
        self.label = label
        self.stream = stream or sys.stdout
        self.tty = bool(getattr(self.stream, "isatty", lambda: False)())
        self.log_every_s = 1.0 if self.tty else log_every_s
        self.window_s = window_s
        self.num_engines = num_engines
        self.max_engines = max_engines
        self.engines_fn = engines_fn if engines_fn is not None else lambda: None
        self.started = time.monotonic()
        self.window_start: float | None = None  # when the first unit began work (engine start-up excluded)
        self.last_print = float("-inf")
        self._dirty = False  # an update arrived since the last printed line
        self.totals: dict[str, int] = {}
        self.recent: deque[tuple[float, int, int]] = deque()  # (time, rows, output tokens) of recent units
        self._engines: tuple[float, object] = (-1e9, None)
        self._lock = threading.RLock()
        self._closed = threading.Event()
        self.metrics = _Metrics(label) if metrics else None
        self._thread = None
        if heartbeat:
            self._thread = threading.Thread(target=self._heartbeat, daemon=True, name=f"progress-{label}")
            self._thread.start()

    # -----------------------------------------------------------------------------------------------------------
    @property
    def rows(self) -> int:
        """Rows finished by this job (not counting those done before it started)."""
        return self.totals.get("num_rows", 0)

    def update(self, unit_summary: dict) -> None:
        now = time.monotonic()
        with self._lock:
            if self.window_start is None:
                # The unit began `seconds` ago: that, not the driver's start, opens the generation window.
                self.window_start = now - float(unit_summary.get("seconds", 0.0) or 0.0)
            for k, v in unit_summary.items():
                if k.startswith("num_"):
                    self.totals[k] = self.totals.get(k, 0) + int(v)
            self.recent.append((now, int(unit_summary.get("num_rows", 0)),
                                int(unit_summary.get(self.tokens_key, 0))))
            while self.recent and now - self.recent[0][0] > self.window_s:
                self.recent.popleft()
            self._dirty = True
            finished = self.done_before + self.rows >= self.total_rows
            if finished:  # the last line counts the engines afresh (lost and replaced ones included)
                self._engines = (-1e9, None)
            if now - self.last_print >= self.log_every_s or finished:
                self._emit(now)
            elif self.metrics:
                self.metrics.update(self.figures(now))

    # -----------------------------------------------------------------------------------------------------------
    def figures(self, now: float | None = None) -> dict:
        """Every figure the line and the metrics show, computed once."""
        now = time.monotonic() if now is None else now
        with self._lock:
            done = self.done_before + self.rows
            tokens = self.totals.get(self.tokens_key, 0)
            gen_s = now - self.window_start if self.window_start is not None else 0.0
            avg_tps = tokens / gen_s if gen_s > 0 else 0.0
            avg_rps = self.rows / gen_s if gen_s > 0 else 0.0
            span = min(self.window_s, gen_s)
            recent = [r for r in self.recent if now - r[0] <= self.window_s]
            now_tps = sum(r[2] for r in recent) / span if span > 0 else 0.0
            now_rps = sum(r[1] for r in recent) / span if span > 0 else 0.0
            # ETA from the recent rate once the window holds a few units, else from the average.
            rps = now_rps if len(recent) >= 3 else avg_rps
            remaining = max(0, self.total_rows - done)
            eta = 0.0 if remaining == 0 else (remaining / rps if rps > 0 else float("inf"))
            # Rates are over output rows: a conversation regenerated turn by turn gives several per input row.
            outputs = self.totals.get("num_outputs", self.rows)
            ok_rows = max(1, outputs - self.totals.get("num_errors", 0))
            return {
                "rows_done": done,
                "rows_this_job": self.rows,
                "rows_total": self.total_rows,
                "fraction": done / self.total_rows if self.total_rows else 1.0,
                "output_tokens": tokens,
                "output_tokens_per_s_now": now_tps,
                "output_tokens_per_s_avg": avg_tps,
                "eta_s": eta,
                "elapsed_s": now - self.started,
                "error_rate": self.totals.get("num_errors", 0) / max(1, outputs),
                # Only the flags the stage reports (stage 2 reports none).
                "flag_rates": {f: self.totals["num_" + f] / ok_rows for f in schema.QUALITY_FLAGS
                               if "num_" + f in self.totals},
                **self._engine_figures(now),
                "engines_asked": self.num_engines,
            }

    def _engine_figures(self, now: float) -> dict:
        checked, value = self._engines
        if now - checked >= 10.0:  # one GCS query per 10 s at most
            try:
                value = self.engines_fn()
            except Exception:
                value = None
            self._engines = (now, value)
        if value is None or isinstance(value, int):
            return {"engines_alive": value}
        return {"engines_alive": value.alive, "engine_nodes": value.nodes, "engines_lost": value.lost,
                "engines_replaced": value.replaced}

    def _format(self, f: dict, *, bar: bool) -> str:
        rows = f"{f['rows_done']:,}/{f['rows_total']:,} rows ({f['fraction']:.1%})"
        if bar:
            filled = int(20 * min(1.0, f["fraction"]))
            rows = "|" + "█" * filled + "░" * (20 - filled) + "| " + rows
        if self.window_start is None:
            speed = "waiting for the first unit"
        else:
            speed = f"{f['output_tokens_per_s_now']:,.0f} tok/s now, {f['output_tokens_per_s_avg']:,.0f} avg"
        parts = [f"[{self.label}] {rows}", speed, f"ETA {fmt_duration(f['eta_s'])}",
                 f"errors {f['error_rate']:.1%}"]
        # On a terminal only the non-zero flags, to fit one line.
        flags = [f"{_FLAG_ABBREV.get(k, k)} {v:.0%}" for k, v in f["flag_rates"].items() if v or not bar]
        if flags and self.rows:
            parts.append(" ".join(flags))
        if f["engines_alive"] is not None:
            asked = f"/{f['engines_asked']}" if f["engines_asked"] else ""
            if asked and self.max_engines and self.max_engines > f["engines_asked"]:
                asked += f"-{self.max_engines}"
            nodes = f.get("engine_nodes")
            engines = f"engines {f['engines_alive']}{asked}"
            if nodes:
                engines += f" on {nodes} node{'s' * (nodes != 1)}"
            if f.get("engines_lost"):  # a node or an engine process died; Ray restarts its actors elsewhere
                engines += f", {f['engines_lost']} lost, {f['engines_replaced']} replaced"
            parts.append(engines)
        if not bar:
            parts.append(f"elapsed {fmt_duration(f['elapsed_s'])}")
        return " | ".join(parts)

    # -----------------------------------------------------------------------------------------------------------
    def _emit(self, now: float) -> None:
        with self._lock:
            self.last_print = now
            self._dirty = False
            f = self.figures(now)
            if self.metrics:
                self.metrics.update(f)
            if self.tty:
                width = shutil.get_terminal_size((120, 20)).columns
                self.stream.write("\r" + self._format(f, bar=True)[: width - 1].ljust(width - 1))
            else:
                self.stream.write(self._format(f, bar=False) + "\n")
            self.stream.flush()

    def _heartbeat(self) -> None:
        while not self._closed.wait(min(self.log_every_s, 5.0) if not self.tty else 1.0):
            now = time.monotonic()
            try:
                if now - self.last_print >= self.log_every_s:
                    self._emit(now)
            except Exception:  # a closed stream at interpreter exit: progress is never worth a crash
                return

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        """Stop the heartbeat and print the final figures. Idempotent; call it on every exit path (or use the
        Progress as a context manager), or the heartbeat thread keeps printing until the process exits."""
        if self._closed.is_set():
            return
        self._closed.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        with self._lock:
            if self.tty:
                self._emit(time.monotonic())
                self.stream.write("\n")
                self.stream.flush()
            elif self._dirty:  # the last units since the last line: the log ends on the final figures
                self._emit(time.monotonic())


class _Metrics:
    """The progress figures as Prometheus metrics through ray.util.metrics (Ray's dashboard / Grafana)."""

    def __init__(self, label: str):
        self.ok = False
        try:
            import ray  # heavy: imported on use
            from ray.util.metrics import Counter, Gauge  # heavy: imported on use

            if not ray.is_initialized():
                return
            tags = ("stage",)
            self.tags = {"stage": label}
            self.rows = Counter("datagen_rows", "Rows written to shards by this job", tag_keys=tags)
            self.tokens = Counter("datagen_output_tokens", "Output tokens written by this job", tag_keys=tags)
            self.gauges = {name: Gauge(f"datagen_{name}", desc, tag_keys=tags) for name, desc in (
                ("rows_done", "Rows done in the run (all jobs)"),
                ("rows_total", "Rows in the run"),
                ("progress_fraction", "Rows done / rows in the run"),
                ("output_tokens_per_s", "Output tokens/s over the last few minutes"),
                ("output_tokens_per_s_avg", "Output tokens/s since the first unit of this job started"),
                ("eta_seconds", "Seconds until the run is done at the recent rate"),
                ("error_rate", "Error rows / rows, this job"),
                ("engines_alive", "Engine actors alive"),
            )}
            self.flag_rate = Gauge("datagen_quality_flag_rate", "Rows with a quality flag / non-error rows",
                                   tag_keys=("stage", "flag"))
            self.last = (0, 0)
            self.ok = True
        except Exception:  # metrics are best effort: never fail a run for them
            self.ok = False

    def update(self, f: dict) -> None:
        if not self.ok:
            return
        try:
            rows, tokens = f["rows_this_job"], f["output_tokens"]
            if rows > self.last[0]:
                self.rows.inc(rows - self.last[0], tags=self.tags)
            if tokens > self.last[1]:
                self.tokens.inc(tokens - self.last[1], tags=self.tags)
            self.last = (max(rows, self.last[0]), max(tokens, self.last[1]))
            values = {"rows_done": f["rows_done"], "rows_total": f["rows_total"], "progress_fraction": f["fraction"],
                      "output_tokens_per_s": f["output_tokens_per_s_now"],
                      "output_tokens_per_s_avg": f["output_tokens_per_s_avg"],
                      "eta_seconds": f["eta_s"] if f["eta_s"] != float("inf") else -1,
                      "error_rate": f["error_rate"], "engines_alive": f["engines_alive"]}
            for name, value in values.items():
                if value is not None:
                    self.gauges[name].set(float(value), tags=self.tags)
            for flag, rate in f["flag_rates"].items():
                self.flag_rate.set(float(rate), tags={**self.tags, "flag": flag})
        except Exception:
            self.ok = False
