"""Stage 1 against plain vLLM while the engine is full, from vLLM's own stats lines in the logs that
`bench/bench_generate.py --logs DIR` keeps (VLLM_LOG_STATS_INTERVAL=2, BENCH_ENGINE_STATS=1 for stage 1's AsyncLLM).

    python3 bench/steady_state.py plain=LOGS/0-plain.log stage1=LOGS/1-stage1.log [--json OUT.json]

Per log: the mean of "Avg generation throughput" over the intervals where the engine ran its full batch (Running =
the most it ever ran) with requests waiting behind it, leaving out the first (it holds the prefill of the first
batch); and over every interval after the first. The ratio is each log's against the first log's. Both contenders of
one call ran on the same machine one after the other: ratios hold within a call only.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics

STATS = re.compile(r"Avg generation throughput: ([\d.]+) tokens/s, Running: (\d+) reqs, Waiting: (\d+) reqs")


def intervals(path: str) -> list[tuple[float, int, int]]:
    with open(path, errors="replace") as f:
        return [(float(m[1]), int(m[2]), int(m[3])) for m in map(STATS.search, f) if m]


def summary(series: list[tuple[float, int, int]]) -> dict:
    batch = max(running for _, running, _ in series)
    full = [tps for tps, running, waiting in series if running == batch and waiting > 0][1:]
    after_first = [tps for tps, _, _ in series[1:]]
    return {"intervals": len(series), "batch": batch, "full_intervals": len(full),
            "steady_tok_per_s": statistics.mean(full), "all_tok_per_s": statistics.mean(after_first),
            "mean_running": statistics.mean(running for _, running, _ in series[1:])}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("logs", nargs="+", help="LABEL=PATH")
    parser.add_argument("--json", help="write the figures and the series here")
    args = parser.parse_args()
    out, base = {}, None
    for item in args.logs:
        label, path = item.split("=", 1)
        series = intervals(path)
        s = summary(series)
        base = base or s
        s["steady_vs_first"] = s["steady_tok_per_s"] / base["steady_tok_per_s"]
        s["all_vs_first"] = s["all_tok_per_s"] / base["all_tok_per_s"]
        print(f"{label}: full batch {s['batch']}, {s['full_intervals']} of {s['intervals']} intervals full; steady "
              f"{s['steady_tok_per_s']:,.1f} tok/s ({s['steady_vs_first']:.3f}x), every interval after the first "
              f"{s['all_tok_per_s']:,.1f} tok/s ({s['all_vs_first']:.3f}x), mean running {s['mean_running']:.2f}")
        out[label] = {**s, "series": [{"gen_tok_per_s": t, "running": r, "waiting": w} for t, r, w in series]}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
