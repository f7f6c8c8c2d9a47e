"""What a stage-2 job through the CLI measured, from what it left in the run (bench/gpu_stage2_cli.sh):

    python3 bench/stage2_cli_figures.py RUN --started EPOCH_SECONDS --out figures.json

- `report_tokens_per_s`: the job's report (reports/hidden_states.json): its tokens over the time from its first
  unit's dispatch to its last summary, the extractor actor's start (loading the model, the self-check, the first
  batches' compiles) included;
- `steady_tokens_per_s`: the units after the first, each timed by its worker from reading its completion shard to
  its last part committed (the markers' `seconds`), one worker: what a long run sustains;
- `first_part_s`: from `--started` (the command's start) to the first part committed (its file's mtime).
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from job import layout  # noqa: E402  the run directory's names, as the job makes them


def figures(run: str, started: float) -> dict:
    """The figures; a job cut off before its report still gives its markers' (the report's figures then None)."""
    report_path = os.path.join(run, layout.REPORTS_DIR, layout.HIDDEN_STATES_REPORT)
    report = json.load(open(report_path)) if os.path.exists(report_path) else {}
    hidden = os.path.join(run, layout.HIDDEN_STATES_DIR)
    markers = [json.load(open(p)) for p in glob.glob(os.path.join(hidden, layout.DONE_DIR, "*.json"))]
    parts = glob.glob(os.path.join(hidden, "*" + layout.SHARD_SUFFIX))
    later = [m for m in markers if not m.get("self_check")]  # a worker's first unit carries its self-check
    tokens, seconds = sum(m["num_tokens_extracted"] for m in later), sum(m["seconds"] for m in later)
    return {"report_tokens_per_s": report.get("tokens_per_s"), "report_extract_s": report.get("extract_seconds"),
            "report_seconds": report.get("seconds"), "num_tokens": report.get("num_tokens_extracted"),
            "units": len(markers), "parts": len(parts), "steady_units": len(later),
            "steady_tokens_per_s": tokens / seconds if seconds else 0.0,
            # the same units: time in the extractor's loop, the extraction waiting on writes, and the rest (the
            # shard read and the last parts' writes before the marker)
            "steady_extract_s": sum(m["extract_seconds"] for m in later), "steady_unit_s": seconds,
            "steady_writer_blocked_s": sum(m.get("writer_blocked_s", 0.0) for m in later),
            # per unit: where a slow unit's time went
            "units_timed": [{k: m.get(k) for k in ("unit", "num_tokens_extracted", "num_batches", "seconds", "read_s",
                                                   "extract_seconds", "wait_gpu_s", "host_copy_s", "writer_blocked_s")}
                            for m in sorted(markers, key=lambda m: str(m.get("unit")))],
            "first_part_s": min(os.path.getmtime(p) for p in parts) - started if parts else None,
            "self_checks": report.get("self_checks"), "padding_waste": report.get("padding_waste")}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("run")
    parser.add_argument("--started", type=float, required=True)
    parser.add_argument("--out")
    args = parser.parse_args()
    result = figures(args.run, args.started)
    print(json.dumps(result), flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
