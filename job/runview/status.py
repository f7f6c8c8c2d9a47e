"""Progress of a run from its run directory alone: no driver, no Ray, works while the job runs or after it died.

    python -m job status s3://my-bucket/runs/qwen3.6-914k
    python -m job status demo-run --json

What it reads:
- `run.json`: the total rows of the run (`generate.input.num_rows`), its status, rows per shard;
- the completion shard *names* (`f{file:05d}-r{start:010d}-{stop:010d}.arrow`): which rows are done, and the
  holes between done ranges (units lost with a crashed job, redone by the next `generate`);
- the shard *modification times*: rates and ETA (a shard is written when its whole unit is done);
- a few small columns of every shard (`num_output_tokens`, `num_prompt_tokens`, `error`, the quality flags), read
  the way job/scan/ reads them: only those buffers, never the token lists.
- stage 2's parts and done markers under `hidden_states/` (names parsed by job/layout.py).
"""

from __future__ import annotations

import statistics
import time
from dataclasses import asdict, dataclass, field

from job import rowranges, scan, schema
from job.formatting import format_bytes, format_duration
from job.run_record import RunRecord
from job.storage import StorageConfig

# Columns a shard scan reads; everything else (token lists, texts, carried columns) stays on disk.
_SCAN_COLUMNS = (schema.NUM_OUTPUT_TOKENS, schema.NUM_PROMPT_TOKENS, schema.ERROR, *schema.QUALITY_FLAGS)

# Two shards written further apart than this belong to different active stretches of the run (a crash and a
# restart, a stopped cluster): the gap is not counted as generation time. A healthy 8-engine run writes a shard
# every few seconds to a minute; a resumed run spends ~5-15 min starting engines before its first shard.
MIN_GAP_S = 900.0


@dataclass
class ShardStat:
    """One trusted completion shard (its name, rows, size and time: `shard`) with the counts of its small columns."""

    shard: scan.CompletionShard
    num_rows: int = 0
    num_errors: int = 0
    num_output_tokens: int = 0
    num_prompt_tokens: int = 0
    flags: dict[str, int] = field(default_factory=dict)

    @property
    def name(self) -> str:
        return self.shard.name

    @property
    def size(self) -> int:
        return self.shard.size

    @property
    def mtime(self) -> float:
        return self.shard.mtime


def scan_completions(run_uri: str, storage_config: StorageConfig | None = None, *, read_columns: bool = True,
                     num_threads: int = 32, found: scan.CompletionShards | None = None) -> list[ShardStat]:
    """Every trusted completion shard of a run (scan.judge_completion_shards, or `found`: its answer already
    taken) with its counts, sorted by modification time. The untrusted ones are the caller's to name."""
    storage_config = storage_config or StorageConfig()
    found = found if found is not None else scan.judge_completion_shards(run_uri, storage_config)
    stats = [ShardStat(shard=s, num_rows=s.stop - s.start) for s in found.trusted]
    if not read_columns:
        return sorted(stats, key=lambda s: (s.mtime, s.name))
    # Each shard's counts (scan.shard_counts, the one rule): as its writer stamped them in its footer, else (a shard
    # from before footers held them) from its small columns, read now.
    unread = [stat for stat in stats if found.checks[stat.name].counts is None]
    tables = scan.read_shard_tables([s.shard.uri for s in unread], list(_SCAN_COLUMNS), storage_config, num_threads)
    counted = {stat.name: scan.shard_counts(t) for stat, t in zip(unread, tables)}
    for stat in stats:
        counts = found.checks[stat.name].counts or counted[stat.name]
        stat.num_rows, stat.num_errors = counts["rows"], counts["errors"]
        stat.num_output_tokens, stat.num_prompt_tokens = counts["output_tokens"], counts["prompt_tokens"]
        stat.flags = dict(counts["flags"])
    return sorted(stats, key=lambda s: (s.mtime, s.name))


# ---------------------------------------------------------------------------------------------------------------
# Rates from shard modification times
# ---------------------------------------------------------------------------------------------------------------


def active_segments(shards: list[ShardStat], min_gap_s: float = MIN_GAP_S) -> list[list[ShardStat]]:
    """Split shards (sorted by mtime) where the run was not producing: a gap much longer than the usual one."""
    if not shards:
        return []
    gaps = [b.mtime - a.mtime for a, b in zip(shards, shards[1:])]
    max_gap = max(min_gap_s, 20 * statistics.median(gaps)) if gaps else min_gap_s
    segments, current = [], [shards[0]]
    for gap, shard in zip(gaps, shards[1:]):
        if gap > max_gap:
            segments.append(current)
            current = []
        current.append(shard)
    segments.append(current)
    return segments


@dataclass
class Rate:
    rows_per_s: float
    output_tokens_per_s: float
    seconds: float
    """The generation time the rate was measured over."""


def measure_rate(shards: list[ShardStat], min_gap_s: float = MIN_GAP_S) -> Rate | None:
    """Throughput while the run was producing: per active stretch, the work of every shard but the first (which
    was done before the stretch's first timestamp) over the stretch's span. None with fewer than two shards."""
    rows = tokens = seconds = 0.0
    for seg in active_segments(shards, min_gap_s):
        if len(seg) < 2:
            continue
        seconds += seg[-1].mtime - seg[0].mtime
        # input rows (a conversation may give several outputs)
        rows += sum(s.shard.stop - s.shard.start for s in seg[1:])
        tokens += sum(s.num_output_tokens for s in seg[1:])
    if seconds <= 0:
        return None
    return Rate(rows_per_s=rows / seconds, output_tokens_per_s=tokens / seconds, seconds=seconds)


# ---------------------------------------------------------------------------------------------------------------
# The status of a run
# ---------------------------------------------------------------------------------------------------------------


def _ranges(shards: list[ShardStat]) -> dict[int, list[tuple[int, int]]]:
    return rowranges.by_file((s.shard.file_index, s.shard.start, s.shard.stop) for s in shards)


def _holes(shards: list[ShardStat]) -> list[tuple[int, int, int]]:
    """(file_index, start, stop) row ranges missing *between* done shards of one file (rowranges.holes)."""
    return [(f, a, b) for f, ranges in sorted(_ranges(shards).items()) for a, b in rowranges.holes(ranges)]


def _covered_rows(shards: list[ShardStat]) -> int:
    """Rows covered by shard names, overlaps counted once (rowranges.covered_rows, as stage 1's resume counts)."""
    return sum(rowranges.covered_rows(ranges) for ranges in _ranges(shards).values())


def scan_hidden_states(run_uri: str, run: RunRecord, shards: list[ShardStat], storage_config: StorageConfig,
                       found: scan.CompletionShards, *, read_markers: bool = True) -> dict | None:
    """Stage 2's progress against the completion shards written so far; None before stage 2 first ran.

    Stage 2 turns each completion shard into parts `hidden_states/<stem>[-n<limit>]-p<k>.arrow` and, after its
    last part, a marker `hidden_states/_done/<stem>[-n<limit>].json` (`<stem>`: the shard's name, `/` → `__`).
    A shard's rows are done when a full marker made from its current content exists (scan.marker_matches, the rule
    stage 2 itself follows); a `--limit` run's marker covers its first <limit> rows. Markers of a shard regenerated
    since are counted as stale. Parts and bytes are those of done units (scan.done_parts, the one byte rule)."""
    markers = scan.stage2_markers(run_uri, found.listed, found.checks, storage_config)  # as stage 2 judges them
    files = markers.files
    if not files and run.hidden_states is None:
        return None
    parts = scan.done_parts(markers, found.trusted, run_uri)
    rows_done, used = 0, []
    for stat in shards:
        rows, _, marker = markers.covered(stat.shard.name, stat.num_rows)
        if marker is not None:
            rows_done += rows
            used.append(marker)
    rows_written = sum(s.num_rows for s in shards)
    out = {
        "status": run.status("hidden_states", "running" if files else "not started"),
        "rows_done": rows_done,
        "rows_to_do": max(0, rows_written - rows_done),
        "rows_from_stage1": rows_written,
        "completion_shards_done": len(used),
        "completion_shards_to_do": len(shards) - len(used),
        "completion_shards_changed": sorted(markers.stale),
        "parts": len(parts),
        "bytes": sum(size for _, size in parts),
        "samples": None,
        "tokens": None,
    }
    if read_markers and used:
        out["samples"] = sum(int(m.get("num_samples", 0)) for m in used)
        out["tokens"] = sum(int(m.get("num_tokens", 0)) for m in used)
    return out


def build_status(run_uri: str, storage_config: StorageConfig | None = None, *, window_s: float = 1800.0,
                 now: float | None = None, read_columns: bool = True,
                 found: scan.CompletionShards | None = None) -> dict:
    """Everything `python -m job status` prints, as a dict (also what `--json` prints). `found`: the completion
    shards as `scan.judge_completion_shards` judged them a moment ago (the notebook shares one listing between
    its cells); by default they are listed and judged now."""

    storage_config = storage_config or StorageConfig()
    now = time.time() if now is None else now
    run = scan.require_run(run_uri, storage_config)
    total = run.rows_total
    rows_per_shard = run.setting("generate.rows_per_shard")
    found = found if found is not None else scan.judge_completion_shards(run_uri, storage_config)
    shards = scan_completions(run_uri, storage_config, read_columns=read_columns, found=found)

    done = _covered_rows(shards)
    rows_read = sum(s.num_rows for s in shards)
    errors = sum(s.num_errors for s in shards)
    ok = max(1, rows_read - errors)
    out_tokens = sum(s.num_output_tokens for s in shards)
    prompt_tokens = sum(s.num_prompt_tokens for s in shards)
    remaining = max(0, total - done) if total is not None else None

    overall = measure_rate(shards)
    recent_shards = [s for s in shards if s.mtime >= now - window_s]
    # The recent rate needs a shard written just before the window, as the first timestamp.
    before = [s for s in shards if s.mtime < now - window_s]
    recent = measure_rate(before[-1:] + recent_shards) if recent_shards else None
    last_mtime = shards[-1].mtime if shards else None
    rate_for_eta = recent or overall
    eta_s = None
    if remaining == 0:
        eta_s = 0.0
    elif remaining and rate_for_eta and rate_for_eta.rows_per_s > 0:
        eta_s = remaining / rate_for_eta.rows_per_s

    stage2 = scan_hidden_states(run_uri, run, shards, storage_config, found, read_markers=read_columns)

    return {
        "run": run_uri,
        "status": run.status("generate", "not started" if not shards else "unknown"),
        "created_at": run.created_at,
        "canary_passed": run.generate.canary_passed if run.generate is not None else None,
        "rows_total": total,
        "rows_done": done,
        "rows_remaining": remaining,
        "fraction_done": done / total if total else None,
        "shards_done": len(shards),
        "rows_per_shard": rows_per_shard,
        "shards_remaining_approx": -(-remaining // rows_per_shard) if remaining and rows_per_shard else
        (0 if remaining == 0 else None),
        "bytes_done": sum(s.size for s in shards),
        "output_tokens": out_tokens,
        "prompt_tokens": prompt_tokens,
        "output_tokens_per_row": out_tokens / rows_read if rows_read and read_columns else None,
        "error_rate": errors / rows_read if rows_read and read_columns else None,
        "flag_rates": {f: sum(s.flags.get(f, 0) for s in shards) / ok for f in schema.QUALITY_FLAGS}
        if rows_read and read_columns else {},
        "rate_recent": asdict(recent) if recent else None,
        "rate_recent_window_s": window_s,
        "rate_overall": asdict(overall) if overall else None,
        "eta_s": eta_s,
        "eta_at": time.strftime("%Y-%m-%dT%H:%MZ", time.gmtime(now + eta_s)) if eta_s else None,
        "last_shard_age_s": now - last_mtime if last_mtime else None,
        "holes": [{"file_index": f, "start": a, "stop": b} for f, a, b in _holes(shards)],
        "unreadable_shards": found.problems,
        "hidden_states": stage2,
    }


def format_status(st: dict) -> str:
    total = st["rows_total"]
    lines = [f"run      {st['run']}  (generate: {st['status']}, created {st['created_at'] or '?'}"
             + (", canary passed" if st["canary_passed"] else "") + ")"]
    if total is not None:
        lines.append(f"rows     {st['rows_done']:,} / {total:,} done ({st['fraction_done']:.1%}), "
                     f"{st['rows_remaining']:,} to go")
    else:
        lines.append(f"rows     {st['rows_done']:,} done (total unknown: run.json has no generate.input)")
    shards = f"shards   {st['shards_done']:,} written ({format_bytes(st['bytes_done'])})"
    if st["shards_remaining_approx"]:
        shards += f", ~{st['shards_remaining_approx']:,} to go at {st['rows_per_shard']} rows per shard"
    lines.append(shards)
    if st["output_tokens_per_row"] is not None:
        lines.append(f"tokens   {st['output_tokens']:,} output ({st['output_tokens_per_row']:,.0f} per row), "
                     f"{st['prompt_tokens']:,} prompt")
    recent, overall = st["rate_recent"], st["rate_overall"]
    if overall:
        rate = f"rate     {overall['output_tokens_per_s']:,.0f} output tok/s, {overall['rows_per_s']:,.2f} rows/s " \
               f"avg over {format_duration(overall['seconds'])} of generation"
        if recent:
            rate += (f"; {recent['output_tokens_per_s']:,.0f} tok/s, {recent['rows_per_s']:,.2f} rows/s over the "
                     f"last {format_duration(st['rate_recent_window_s'])}")
        lines.append(rate)
    else:
        lines.append("rate     not enough shards yet to measure (needs two)")
    if st["rows_remaining"] == 0:
        lines.append("ETA      done")
    elif st["eta_s"] is not None:
        basis = "recent" if recent else "average"
        lines.append(f"ETA      {format_duration(st['eta_s'])} at the {basis} rate (~{st['eta_at']})")
    if st["last_shard_age_s"] is not None:
        age = st["last_shard_age_s"]
        note = ""
        if st["rows_remaining"] and age > MIN_GAP_S:
            note = "  <- nothing written for a while: is the job still running? (`ray job status`, then rerun " \
                   "`generate` with the same --output to resume)"
        lines.append(f"last     shard written {format_duration(age)} ago{note}")
    if st["error_rate"] is not None:
        flags = " | ".join(f"{k} {v:.1%}" for k, v in st["flag_rates"].items())
        lines.append(f"quality  errors {st['error_rate']:.1%} | {flags}")
    if st["holes"]:
        shown = ", ".join(f"f{h['file_index']:05d} rows {h['start']}-{h['stop']}" for h in st["holes"][:5])
        more = f" and {len(st['holes']) - 5} more" if len(st["holes"]) > 5 else ""
        lines.append(f"holes    {len(st['holes'])} row range(s) not written between done shards: {shown}{more} "
                     "(units still in flight, or lost with a dead job: the next `generate` on this output "
                     "fills them)")
    if st["unreadable_shards"]:
        lines.append("damaged  " + scan.unreadable_line(
            st["unreadable_shards"], "not counted; the next `generate` on this output moves them aside to "
                                     "quarantine/ and generates their rows again"))
    hs = st["hidden_states"]
    if hs is None:
        lines.append("stage 2  not started (`python -m job hidden-states` with the same --output)")
    else:
        shards_total = hs['completion_shards_done'] + hs['completion_shards_to_do']
        line = (f"stage 2  {hs['rows_done']:,} / {hs['rows_from_stage1']:,} rows done"
                f" ({hs['completion_shards_done']:,} of {shards_total:,}"
                f" completion shards), {hs['rows_to_do']:,} to do; {hs['parts']:,} parts"
                f" ({format_bytes(hs['bytes'])})")
        if hs["samples"] is not None:
            line += f", {hs['samples']:,} samples, {hs['tokens']:,} tokens"
        lines.append(line + f"  [{hs['status']}]")
        if hs["completion_shards_changed"]:
            changed = hs["completion_shards_changed"]
            lines.append(f"         {len(changed)} completion shard(s) changed since their hidden states were made "
                         f"({', '.join(changed[:5])}{' …' if len(changed) > 5 else ''}): counted as to do; the next "
                         "`hidden-states` run makes them again")
        if total is not None and hs["rows_from_stage1"] < total:
            lines.append(f"         (stage 1 has written {hs['rows_from_stage1']:,} of {total:,} rows: stage 2 can "
                         "only follow what exists)")
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------------------------
