"""Requests in flight in the engine over time, from the logs `bench/bench_generate.py --logs DIR` keeps.

    .venv/bin/python bench/plot_in_flight.py LABEL=LOG [LABEL=LOG ...] --out docs/x.png [--csv docs/x.csv]

A series is read from vLLM's stats lines ("... HH:MM:SS [loggers.py:...] Engine 000: ... Running: N reqs,
Waiting: M reqs", every VLLM_LOG_STATS_INTERVAL seconds), with t = 0 at the engine's "init engine ... took" line
(plain `LLM`) or job.generate.engine's "engine ready" line (stage 1): the start of each one's generation window. Stage
1's
log has stats lines only when bench_generate.py ran it with BENCH_ENGINE_STATS=1; a log without any is reported
and left out. Timestamps have 1 s resolution (vLLM's log format).
"""

from __future__ import annotations

import argparse
import csv
import re
import sys
from datetime import datetime

STATS = re.compile(r"(\d\d-\d\d \d\d:\d\d:\d\d) \[loggers\.py:\d+\].*Running: (\d+) reqs, Waiting: (\d+) reqs")
START = (re.compile(r"(\d\d-\d\d \d\d:\d\d:\d\d) \[core\.py:\d+\] init engine"),
         re.compile(r"(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d),\d+ job\.(?:generate\.)?engine engine ready"))
# Stage 1's own stats line (BENCH_ENGINE_STATS=1): rows its admission gate has in the engine.
ROWS = re.compile(r"(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d),\d+ bench\.engine_stats rows in flight (\d+)")


def _time(stamp: str) -> datetime:
    return datetime.strptime(stamp if len(stamp) > 14 else "2000-" + stamp, "%Y-%m-%d %H:%M:%S")


def read_series(path: str) -> tuple[list[tuple[float, int, int]], str]:
    """[(t seconds since the window start, running, waiting)] and a note about the log."""
    start, rows = None, []
    with open(path, errors="replace") as f:
        for line in f:
            for pattern in START:
                m = pattern.search(line)
                if m and start is None:
                    start = _time(m.group(1))
            m = STATS.search(line)
            if m:
                rows.append((_time(m.group(1)), int(m.group(2)), int(m.group(3))))
    if not rows:
        return [], f"{path}: no vLLM stats lines (Running: N reqs): no in-flight series"
    t0 = start or rows[0][0]
    # vLLM's stats lines carry month-day only: keep the year of the window start for the difference.
    return [((t.replace(year=t0.year) - t0).total_seconds(), run, wait) for t, run, wait in rows], \
        f"{path}: {len(rows)} stats lines" + ("" if start else " (no engine-start line: t = 0 at the first)")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("series", nargs="+", help="LABEL=PATH of a log")
    parser.add_argument("--out", required=True, help="the chart (.png or .svg)")
    parser.add_argument("--csv", help="the series as label,t_s,running,waiting")
    parser.add_argument("--title", default="Requests in the engine over time (vLLM stats lines, every 2 s)")
    parser.add_argument("--limit", type=int, default=128, help="max_num_seqs, drawn as a line")
    parser.add_argument("--mark", nargs="*", default=[], help="LABEL=SECONDS: a vertical line (e.g. a window's end)")
    args = parser.parse_args()

    data = {}
    for spec in args.series:
        label, path = spec.split("=", 1)
        series, note = read_series(path)
        print(note, file=sys.stderr)
        if series:
            data[label] = series
    if not data:
        sys.exit("no log has stats lines")
    if args.csv:
        with open(args.csv, "w", newline="") as f:
            w = csv.writer(f)
            w.writerow(["label", "t_s", "running", "waiting"])
            for label, series in data.items():
                w.writerows([label, f"{t:.0f}", run, wait] for t, run, wait in series)

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4), dpi=120)
    for label, series in data.items():
        t = [s[0] for s in series]
        line, = ax.plot(t, [s[1] for s in series], marker="o", markersize=3, label=f"{label}: running")
        if any(s[2] for s in series):
            ax.plot(t, [s[2] for s in series], linestyle="--", color=line.get_color(), label=f"{label}: waiting")
    ax.axhline(args.limit, color="grey", linewidth=0.8, linestyle=":")
    ax.text(0, args.limit + 2, f"max_num_seqs {args.limit}", color="grey", fontsize=8)
    for spec in args.mark:
        label, seconds = spec.rsplit("=", 1)
        ax.axvline(float(seconds), color="black", linewidth=0.8, linestyle="-.")
        ax.text(float(seconds), 4, " " + label, rotation=90, fontsize=7, va="bottom")
    ax.set_xlabel("seconds since the engine was ready (start of the generation window)")
    ax.set_ylabel("requests")
    ax.set_ylim(bottom=0)
    ax.set_title(args.title, fontsize=10)
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(args.out)
    print(f"wrote {args.out}" + (f" and {args.csv}" if args.csv else ""), file=sys.stderr)


if __name__ == "__main__":
    main()
