"""Live progress on the driver: plain periodic lines when not a terminal (as under `ray job submit`), a bar
redrawn in place on a terminal, and the totals the canary reads. No Ray, no vLLM: milliseconds."""

from __future__ import annotations

import io
import time

from job import schema
from job.progress import Progress, fmt_duration


def unit(rows=64, tokens=6400, errors=0, seconds=2.0, **flags):
    s = {"shard": "f00000-r0000000000-0000000064.arrow", "num_rows": rows, "num_errors": errors,
         "num_prompt_tokens": rows * 10, "num_output_tokens": tokens, "seconds": seconds}
    s.update({f"num_{f}": 0 for f in schema.QUALITY_FLAGS})
    s.update({f"num_{k}": v for k, v in flags.items()})
    return s


class FakeTTY(io.StringIO):
    def isatty(self):
        return True


def test_plain_lines_when_not_a_tty():
    out = io.StringIO()
    p = Progress(total_rows=1000, done_rows=200, label="generate", log_every_s=0, stream=out,
                 num_engines=4, engines_fn=lambda: 3, heartbeat=False, metrics=False)
    for _ in range(3):
        p.update(unit(rows=100, tokens=10_000, errors=2, too_short=7))
    p.close()
    text = out.getvalue()
    assert "\r" not in text and "█" not in text  # no terminal control in logs
    lines = text.strip().splitlines()
    assert len(lines) >= 3
    last = lines[-1]
    # Every figure the issue asks for, on one self-contained line.
    assert last.startswith("[generate] 500/1,000 rows (50.0%)")
    assert "tok/s now" in last and "avg" in last
    assert "ETA " in last and "ETA ?" not in last
    assert "errors 2.0%" in last  # 6 errors / 300 rows of this job
    assert "short 7%" in last  # 21 flagged / 294 non-error rows
    assert "engines 3/4" in last
    assert "elapsed" in last


def test_totals_accumulate_counts_for_the_canary():
    p = Progress(total_rows=100, done_rows=0, label="generate", stream=io.StringIO(), heartbeat=False,
                 metrics=False)
    p.update(unit(rows=10, tokens=100, errors=1, unclosed_think=2))
    p.update(unit(rows=5, tokens=50, template_mismatch=1))
    assert p.totals["num_rows"] == 15
    assert p.totals["num_errors"] == 1
    assert p.totals["num_output_tokens"] == 150
    assert p.totals[f"num_{schema.FLAG_UNCLOSED_THINK}"] == 2
    assert p.totals[f"num_{schema.FLAG_TEMPLATE_MISMATCH}"] == 1
    assert "seconds" not in p.totals and "shard" not in p.totals
    p.close()


def test_rates_and_eta_use_the_generation_window():
    p = Progress(total_rows=1000, done_rows=0, label="generate", stream=io.StringIO(), heartbeat=False,
                 metrics=False, engines_fn=lambda: None)
    # The first unit took 10 s: the window opens then, not when the driver started (engine start-up excluded).
    p.update(unit(rows=100, tokens=5000, seconds=10.0))
    f = p.figures()
    assert 400 < f["output_tokens_per_s_avg"] <= 500  # 5000 tokens over ~10 s
    assert 85 < f["eta_s"] < 91  # 900 rows at ~10 rows/s
    assert f["rows_done"] == 100 and f["fraction"] == 0.1
    p.close()


def test_heartbeat_prints_while_no_unit_finishes():
    out = io.StringIO()
    p = Progress(total_rows=50, done_rows=0, label="generate", log_every_s=0.2, stream=out, metrics=False,
                 engines_fn=lambda: 0)
    deadline = time.monotonic() + 10
    while "waiting for the first unit" not in out.getvalue() and time.monotonic() < deadline:
        time.sleep(0.05)
    p.update(unit(rows=50, tokens=500))
    p.close()
    lines = out.getvalue().strip().splitlines()
    assert "waiting for the first unit" in lines[0] and "engines 0" in lines[0]
    assert lines[-1].startswith("[generate] 50/50 rows (100.0%)") and "ETA 0m00s" in lines[-1]


def test_final_line_after_the_last_units():
    out = io.StringIO()
    p = Progress(total_rows=1000, done_rows=0, label="generate", log_every_s=3600, stream=out, heartbeat=False,
                 metrics=False, engines_fn=lambda: None)
    p.update(unit(rows=10))  # printed: the first line
    p.update(unit(rows=10))  # not printed yet (interval)
    p.close()  # the log ends on the final figures
    lines = out.getvalue().strip().splitlines()
    assert len(lines) == 2 and lines[-1].startswith("[generate] 20/1,000 rows")


def test_bar_redrawn_in_place_on_a_tty():
    out = FakeTTY()
    p = Progress(total_rows=200, done_rows=0, label="generate", stream=out, heartbeat=False, metrics=False,
                 engines_fn=lambda: 2)
    p.update(unit(rows=100, tokens=1000))
    p.close()
    text = out.getvalue()
    assert text.startswith("\r[generate] |") and "█" * 10 + "░" * 10 in text
    assert text.endswith("\n") and text.count("\n") == 1


def test_a_stage_without_quality_flags():
    """Stage 2 reports rows, tokens and errors only: no flag columns in its line."""
    out = io.StringIO()
    p = Progress(total_rows=10, done_rows=0, label="hidden-states", log_every_s=0, stream=out, heartbeat=False,
                 metrics=False, engines_fn=lambda: 1)
    p.update({"num_rows": 10, "num_output_tokens": 3000, "num_errors": 0})
    p.close()
    line = out.getvalue().strip().splitlines()[-1]
    assert line.startswith("[hidden-states] 10/10 rows") and "short" not in line and "engines 1" in line


def test_metrics_are_best_effort_without_ray():
    p = Progress(total_rows=10, done_rows=0, label="generate", stream=io.StringIO(), heartbeat=False)
    p.update(unit(rows=10))  # ray is not initialized here: metrics are off, nothing raises
    p.close()


def test_fmt_duration():
    assert fmt_duration(59) == "0m59s"
    assert fmt_duration(3 * 3600 + 5 * 60) == "3h05m"
    assert fmt_duration(45 * 3600) == "1d21h"
    assert fmt_duration(float("inf")) == "?"


def test_engine_line_on_a_cluster_says_nodes_and_lost_engines():
    """The census the driver reads from Ray's actor table (job/cluster.py), as the progress line shows it: a pool
    that may grow (min 8, max 16), the nodes its engines run on, engines lost with a node and their replacements."""
    from job.cluster import EngineCensus

    census = [EngineCensus(alive=8, nodes=1, lost=0, replaced=0), EngineCensus(alive=7, nodes=1, lost=1, replaced=0),
              EngineCensus(alive=9, nodes=2, lost=1, replaced=1)]
    lines = []
    for c in census:
        out = io.StringIO()
        p = Progress(total_rows=100, done_rows=0, label="generate", log_every_s=0, stream=out, num_engines=8,
                     max_engines=16, engines_fn=lambda c=c: c, heartbeat=False, metrics=False)
        p.update(unit(rows=10, tokens=100))
        p.close()
        lines.append(out.getvalue().strip().splitlines()[-1])
    assert "| engines 8/8-16 on 1 node |" in lines[0] and "lost" not in lines[0]
    assert "| engines 7/8-16 on 1 node, 1 lost, 0 replaced |" in lines[1]
    assert "| engines 9/8-16 on 2 nodes, 1 lost, 1 replaced |" in lines[2]
