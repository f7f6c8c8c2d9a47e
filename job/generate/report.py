"""Stage 1's report: counts and rates of every quality flag, length percentiles, finish reasons, error kinds;
stored at reports/generate.json when stage 1 ends (as stage 2 stores its own), printed by `python -m job report`.

Built from the completion shards committed so far, so `python -m job report RUN` works on a finished run and on
one still running. Reads only the small columns (no token lists, job/scan/), so it stays cheap on a 1M-row run.
"""

from __future__ import annotations

import re
from collections import Counter

import numpy as np
import pyarrow as pa

from job import layout, scan, schema, storage
from job.storage import StorageConfig

_REPORT_COLUMNS = [schema.ID, schema.FINISH_REASON, schema.NUM_PROMPT_TOKENS, schema.NUM_OUTPUT_TOKENS,
                   schema.NUM_REASONING_TOKENS, schema.NUM_ANSWER_TOKENS, *schema.QUALITY_FLAGS, schema.ERROR,
                   schema.VARIANT]


def error_kind(message: str) -> str:
    """`prompt too long: 5000 tokens ...` → `prompt too long`: the text before the first colon."""
    return re.split(r"[:(]", message, maxsplit=1)[0].strip()


def _percentiles(values: np.ndarray) -> dict[str, float]:
    if len(values) == 0:
        return {"p50": 0, "p90": 0, "p99": 0, "mean": 0}
    p50, p90, p99 = np.percentile(values, [50, 90, 99])
    return {"p50": float(p50), "p90": float(p90), "p99": float(p99), "mean": float(values.mean())}


def build_report(run_uri: str, storage_config: StorageConfig | None = None, rows: pa.Table | None = None,
                 unreadable: dict[str, str] | None = None, found: scan.CompletionShards | None = None) -> dict:
    """The run's quality report from its trusted shards' small columns. `rows`: those columns already read (the
    notebook's `read_rows`, with the shards it could not read in `unreadable`): every shard is read once, not twice
    (at 20,000 shards on S3 each read is 20,000 GETs). `found`: the shards as `scan.judge_completion_shards`
    judged them a moment ago (stage 1's end), else they are listed and judged now."""
    storage_config = storage_config or StorageConfig()
    run = scan.require_run(run_uri, storage_config)
    if rows is None:
        problems: dict[str, str] = {}
        table = scan.read_columns(run_uri, _REPORT_COLUMNS, storage_config, unreadable=problems,
                                  found=found)  # trusted only
    else:
        # As read_columns gives them: a column an older shard lacks (`variant`) is absent, not an error.
        table = rows.select([c for c in _REPORT_COLUMNS if c in rows.column_names])
        problems = dict(unreadable or {})
    errors = table.column(schema.ERROR).to_pylist()
    ok_mask = scan.ok_rows(table)
    num_ok = int(ok_mask.sum())

    def col(name: str) -> np.ndarray:
        return scan.ints(table, name)[ok_mask]

    flags = {}
    for flag in schema.QUALITY_FLAGS:
        n = int(scan.bools(table, flag)[ok_mask].sum())
        flags[flag] = {"count": n, "rate": n / num_ok if num_ok else 0.0}
    return {
        "run": run_uri,
        "status": run.status("generate", "unknown"),
        "rows_total": run.rows_total,
        "rows_done": table.num_rows,
        "rows_ok": num_ok,
        "rows_error": table.num_rows - num_ok,
        "output_tokens": int(col(schema.NUM_OUTPUT_TOKENS).sum()),
        "flags": flags,
        "tokens": {name: _percentiles(col(c)) for name, c in (
            ("prompt", schema.NUM_PROMPT_TOKENS), ("reasoning", schema.NUM_REASONING_TOKENS),
            ("answer", schema.NUM_ANSWER_TOKENS), ("output", schema.NUM_OUTPUT_TOKENS))},
        "finish_reasons": dict(Counter(r for r, ok in zip(table.column(schema.FINISH_REASON).to_pylist(), ok_mask)
                                       if ok)),
        "error_kinds": dict(Counter(error_kind(e) for e in errors if e is not None)),
        "variants": variant_mix(table, ok_mask, run.setting("generate.sampling_variants")),
        "unreadable_shards": problems,
    }


def variant_mix(table, ok_mask: np.ndarray, variants: list[dict] | None) -> list[dict]:
    """generate.sampling_variants and the rows sampled with each (non-error rows, from the `variant` column), in
    the config's order; [] for a run without variants."""
    if not variants:
        return []
    counts = Counter(v for v, ok in zip(table.column(schema.VARIANT).to_pylist()
                                        if schema.VARIANT in table.column_names else [], ok_mask) if ok)
    total = sum(counts.values())
    return [{"variant": i, "settings": v, "rows": counts.get(i, 0), "share": counts.get(i, 0) / total if total else 0.0}
            for i, v in enumerate(variants)]


def format_report(report: dict) -> str:
    total = report["rows_total"]
    done = f"{report['rows_done']:,}" + (f" of {total:,}" if total else "")
    lines = [f"run {report['run']} ({report['status']}): {done} rows, {report['rows_error']:,} errors, "
             f"{report['output_tokens']:,} output tokens",
             "quality flags (share of non-error rows):"]
    lines += [f"  {flag:<18} {v['count']:>8,}  {v['rate']:6.1%}" for flag, v in report["flags"].items()]
    lines.append("tokens per row          p50      p90      p99     mean")
    lines += [f"  {name:<18} {v['p50']:>8.0f} {v['p90']:>8.0f} {v['p99']:>8.0f} {v['mean']:>8.1f}"
              for name, v in report["tokens"].items()]
    lines.append("finish reasons: " + (", ".join(f"{k}={v:,}" for k, v in report["finish_reasons"].items()) or "-"))
    lines.append("error kinds: " + (", ".join(f"{k}={v:,}" for k, v in report["error_kinds"].items()) or "none"))
    if report.get("variants"):
        lines.append("sampling variants (generate.sampling_variants; share of non-error rows):")
        lines += [f"  {v['variant']:>2}  {v['rows']:>8,}  {v['share']:6.1%}  "
                  + ", ".join(f"{k}={x}" for k, x in v["settings"].items()) for v in report["variants"]]
    if report.get("unreadable_shards"):
        lines.append(scan.unreadable_line(report["unreadable_shards"], "not counted here; the next `generate` on "
                                          "this output moves them aside to quarantine/ and generates their rows again"))
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------------------------
# The report and the closing lines
# ---------------------------------------------------------------------------------------------------------------


def write_report(run_uri: str, fence, found: scan.CompletionShards | None = None) -> dict:
    """Stage 1's report (`build_report`, from the shards; `found` as there) stored at reports/generate.json through
    the writer lock's fence, as stage 2 stores its own."""
    report = build_report(run_uri, fence.storage_config, found=found)
    fence.write_json(storage.join(run_uri, layout.REPORTS_DIR, layout.GENERATE_REPORT), report)
    return report


def print_summary(config, summary) -> None:
    """What `python -m job generate` and `make demo` print when stage 1 ends."""
    if summary.already_complete:
        print(f"run {config.output} was already complete: {summary.num_rows_total:,} rows, nothing regenerated")
        return
    report = summary.quality  # as the job stored it; else (it could not be written) read now
    if report is None:
        try:
            report = build_report(config.output, config.storage)
        except storage.StorageError as e:
            print(f"\n(report unavailable right now: {e})")
    if report:
        print()
        print(format_report(report))
    print(f"\nthis job: {summary.num_rows:,} rows, {summary.num_output_tokens:,} output tokens in "
          f"{summary.seconds:.0f} s ({summary.output_tokens_per_s:,.0f} output tokens/s over the generation window)")
    print(f"shards:  {storage.join(config.output, layout.COMPLETIONS_DIR)}/*.arrow  (report: "
          f"{storage.join(config.output, layout.REPORTS_DIR, layout.GENERATE_REPORT)})")
    print(f"look at them: make notebook RUN_DIR={config.output}, or "
          f"`python -m job report {config.output}`, or pyarrow.dataset.dataset('{config.output}/completions', "
          "format='arrow')")
