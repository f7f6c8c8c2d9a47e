"""Completion shards, read the one way every reader shares (both stages, `status`, `report`, `plan --from`, export,
the notebook):

- `require_run`: run.json, or the one refusal of a path that is not a run directory (`NotARunDirectory`).
- `list_completion_shards`: one listing of `completions/`; names, sizes and modification times come with it. Only
  files named like a completion shard (job/layout.py) count: a file someone copied in is ignored.
- `judge_completion_shards`: THE rule of which completion shards can be trusted (their footers read whole, the
  columns of a completion shard): every shard listed, with its verdict; readers take `.trusted` and name the others
  with `unreadable_line`.
- `read_columns`: chosen small columns of the trusted shards in a thread pool, as one table (plus the shard's URI per
  row when asked). The Arrow IPC footer locates each column's buffers, so only those are fetched (a few range GETs
  per shard on S3): token lists, texts and carried input columns stay where they are.
- `ok_rows`, `kept_rows`, `kept_tokens`, `shard_counts`: which rows count and what a shard holds, defined once
  (stage 2 extracts exactly the kept rows; its estimate and `status` count them with the same functions).
"""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import numpy as np
import pyarrow as pa

from job import layout, rows_cache, run_record, schema, shard_reads, storage, trust_cache
from job.run_record import RunRecord
from job.runs import RunError
from job.storage import StorageConfig

SMALL_COLUMNS = [schema.ID, schema.FINISH_REASON, schema.NUM_PROMPT_TOKENS, schema.NUM_OUTPUT_TOKENS,
                 schema.NUM_REASONING_TOKENS, schema.NUM_ANSWER_TOKENS, schema.TURN, schema.ORIGINAL_TURN_TOKENS,
                 schema.VARIANT, *schema.QUALITY_FLAGS, schema.ERROR]
"""Every per-row column of a completion shard that is a number, a flag or short text (no token lists)."""


class NotARunDirectory(RunError):
    """The path holds no run.json: the one refusal every reader of a run gives (`status`, `report`, `plan --from`,
    the notebook). A RunError, so the command line prints it in one line like the job's other refusals."""


def require_run(run_uri: str, storage_config: StorageConfig | None = None, *, hint: str = "") -> RunRecord:
    """The run's record (run.json); a path without one is refused with `NotARunDirectory` (`hint`: what to do
    instead)."""
    run = run_record.read(run_uri, storage_config or StorageConfig())
    if run is None:
        raise NotARunDirectory(f"{run_uri}: no {layout.RUN_JSON} there, so it is not a run directory (or not yet: "
                               f"`generate` writes it before the first shard){'. ' + hint if hint else ''}")
    return run


@dataclass(frozen=True)
class CompletionShard:
    """One completion shard, from the listing alone."""
    name: str
    """Path relative to completions/."""
    uri: str
    file_index: int
    start: int
    stop: int
    size: int
    mtime: float
    """Seconds since the epoch (0.0 when the store gives none)."""
    etag: str | None = None
    """The listing's content id (S3's ETag; None for a local file): what the trust cache keys on."""


def list_completion_shards(run_uri: str, storage_config: StorageConfig | None = None) -> list[CompletionShard]:
    """The completion shards of a run, sorted by name; [] before the first one is written."""
    directory = storage.join(run_uri, layout.COMPLETIONS_DIR)
    shards = []
    for name, size, mtime, etag in storage.list_file_entries(directory, layout.SHARD_SUFFIX, storage_config):
        parsed = layout.parse_completion_shard_name(name)
        if parsed is None:  # not ours (a file someone copied in): ignored, never counted
            continue
        shards.append(CompletionShard(name=name, uri=storage.join(directory, name), file_index=parsed[0],
                                      start=parsed[1], stop=parsed[2], size=size, mtime=mtime or 0.0, etag=etag))
    return shards


def trusted_completion_uris(run_uri: str, storage_config: StorageConfig | None = None) -> list[str]:
    """URIs of the completion shards of a run that can be trusted (`judge_completion_shards`), sorted by name."""
    return [s.uri for s in judge_completion_shards(run_uri, storage_config).trusted]


def read_shard_tables(uris: list[str], columns: list[str], storage_config: StorageConfig | None = None,
                      num_threads: int = 16) -> list[pa.Table]:
    """`columns` (those each shard has, in that order) of every shard in `uris`, one table per shard."""
    def read(uri: str) -> pa.Table:
        t = shard_reads.read_shard_columns(uri, columns, storage_config)
        return t.select([c for c in columns if c in t.column_names])

    if not uris:
        return []
    with ThreadPoolExecutor(min(num_threads, len(uris))) as pool:
        return list(pool.map(read, uris))


def cached_or_read(shards: list[CompletionShard], columns: list[str], cached: rows_cache.Rows,
                   storage_config: StorageConfig | None = None, num_threads: int = 16) -> tuple[list[pa.Table], int]:
    """Each shard's `columns`, in `shards`' order: from the rows cache where it holds the shard's listed size and
    ETag, else read from the shard (one read each, in parallel). Returns (the tables, how many shards were read)."""
    hits = [cached.get(s.name, s.size, s.etag, columns) for s in shards]
    misses = [s.uri for s, hit in zip(shards, hits) if hit is None]
    read = iter(read_shard_tables(misses, columns, storage_config, num_threads))
    return [hit if hit is not None else next(read) for hit in hits], len(misses)


def read_columns(run_uri: str, columns: list[str] | None = None, storage_config: StorageConfig | None = None, *,
                 shard_column: str | None = None, shards: list[str] | None = None,
                 unreadable: dict[str, str] | None = None, num_threads: int = 16,
                 found: CompletionShards | None = None) -> pa.Table:
    """`columns` (default SMALL_COLUMNS) of every trusted completion shard of the run (or of `shards`: URIs the
    caller took from `judge_completion_shards`) as one table, in shard-name order; with `shard_column`, a column
    of that name holds each row's shard URI. `unreadable` receives {name: problem} of the shards left out. `found`:
    `judge_completion_shards`' answer already taken (else it is asked now).
    On S3, the rows of every shard whose size and ETag the rows cache holds come from it (job/rows_cache.py: one
    GET in all), the others from the shards."""
    columns = list(columns or SMALL_COLUMNS)
    if shards is None:
        found = found if found is not None else judge_completion_shards(run_uri, storage_config)
        uris = [s.uri for s in found.trusted]
        if unreadable is not None:
            unreadable.update(found.problems)
        tables, _ = cached_or_read(found.trusted, columns, rows_cache.load(run_uri, storage_config), storage_config,
                                   num_threads)
    else:
        uris, tables = shards, read_shard_tables(shards, columns, storage_config, num_threads)
    if tables:
        table = pa.concat_tables(tables, promote_options="default")
        if shard_column:  # each row's shard URI, made in one take (a column per shard was ~1 s at 20,000 shards)
            which = np.repeat(np.arange(len(uris), dtype=np.int32), [t.num_rows for t in tables])
            table = table.append_column(shard_column, pa.array(uris, pa.string()).take(pa.array(which)))
        return table
    empty = schema.completion_schema().empty_table().select([c for c in columns if c in schema.COMPLETION_COLUMNS])
    return empty.append_column(shard_column, pa.array([], pa.string())) if shard_column else empty


# ---------------------------------------------------------------------------------------------------------------
# Columns as numpy, and which rows count
# ---------------------------------------------------------------------------------------------------------------


def ints(table: pa.Table, name: str) -> np.ndarray:
    """An integer column as int64, nulls as 0; all 0 when the table has no such column."""
    if name not in table.column_names:
        return np.zeros(table.num_rows, dtype=np.int64)
    return table.column(name).fill_null(0).to_numpy(zero_copy_only=False).astype(np.int64)


def bools(table: pa.Table, name: str) -> np.ndarray:
    """A boolean column, nulls as False; all False when the table has no such column."""
    if name not in table.column_names:
        return np.zeros(table.num_rows, dtype=bool)
    return table.column(name).fill_null(False).to_numpy(zero_copy_only=False).astype(bool)


def ok_rows(table: pa.Table) -> np.ndarray:
    """Rows that are not errors (`error` null): the rows quality rates and lengths are measured on."""
    if schema.ERROR not in table.column_names:
        return np.ones(table.num_rows, dtype=bool)
    return ~table.column(schema.ERROR).is_valid().to_numpy(zero_copy_only=False)


def flagged_rows(table: pa.Table) -> np.ndarray:
    """Rows with any quality flag set."""
    flagged = np.zeros(table.num_rows, dtype=bool)
    for flag in schema.QUALITY_FLAGS:
        flagged |= bools(table, flag)
    return flagged


def kept_rows(table: pa.Table, keep_flagged: bool = True) -> np.ndarray:
    """THE rule of the rows stage 2 turns into samples: not errors, at least one token (prompt + output) and, unless
    `keep_flagged`, no quality flag set. Stage 2 extracts these (hidden_states/samples.py); its estimate, `status`
    and the notebook count them."""
    keep = ok_rows(table)
    if schema.NUM_PROMPT_TOKENS in table.column_names or schema.NUM_OUTPUT_TOKENS in table.column_names:
        keep &= ints(table, schema.NUM_PROMPT_TOKENS) + ints(table, schema.NUM_OUTPUT_TOKENS) > 0
    if not keep_flagged:
        keep &= ~flagged_rows(table)
    return keep


def kept_tokens(table: pa.Table, keep_flagged: bool = True, max_length: int | None = None) -> tuple[int, int]:
    """(rows kept, their tokens): prompt + output tokens of each kept row, clipped at `max_length`, summed."""
    keep = kept_rows(table, keep_flagged)
    tokens = ints(table, schema.NUM_PROMPT_TOKENS) + ints(table, schema.NUM_OUTPUT_TOKENS)
    if max_length is not None:
        tokens = np.minimum(tokens, max_length)
    return int(keep.sum()), int(tokens[keep].sum())


def shard_counts(table: pa.Table) -> dict:
    """A completion shard's counts, as its writer stamps them in its footer (schema.META_COUNTS) and the trust cache
    keeps them: what `status` sums (rows, error rows, prompt and output tokens, each quality flag) and what stage 2's
    estimate needs (`kept`, `kept_unflagged`: `kept_tokens` with keep_flagged true / false and no clipping, and the
    longest kept row, so a `max_length` at or above it clips nothing and the sums are exact)."""
    tokens = ints(table, schema.NUM_PROMPT_TOKENS) + ints(table, schema.NUM_OUTPUT_TOKENS)

    def kept(keep_flagged: bool) -> list[int]:
        keep = kept_rows(table, keep_flagged)
        return [int(keep.sum()), int(tokens[keep].sum()), int(tokens[keep].max()) if keep.any() else 0]

    return {"rows": table.num_rows, "errors": int((~ok_rows(table)).sum()),
            "prompt_tokens": int(ints(table, schema.NUM_PROMPT_TOKENS).sum()),
            "output_tokens": int(ints(table, schema.NUM_OUTPUT_TOKENS).sum()),
            "flags": {f: int(bools(table, f).sum()) for f in schema.QUALITY_FLAGS if f in table.column_names},
            "kept": kept(True), "kept_unflagged": kept(False)}


def counted_kept_tokens(counts: dict | None, keep_flagged: bool, max_length: int | None) -> tuple[int, int] | None:
    """`kept_tokens` of a whole shard from its counts (`shard_counts`), or None when they cannot say (no counts, or
    a kept row longer than `max_length`: the clipped sum needs the rows' lengths)."""
    if not counts:
        return None
    rows, tokens, longest = counts["kept" if keep_flagged else "kept_unflagged"]
    if max_length is not None and longest > max_length:
        return None
    return rows, tokens


# ---------------------------------------------------------------------------------------------------------------
# Trusting a completion shard, and the one rule of when stage 2 is done with it
# ---------------------------------------------------------------------------------------------------------------

REQUIRED_COMPLETION_COLUMNS = (schema.ID, schema.ERROR)


@dataclass(frozen=True)
class ShardCheck:
    """What a completion shard's footer says: its content id (job/schema.py META_SHARD_ID; None for a shard written
    before ids were recorded), or why it cannot be trusted (`problem`: truncated, zero bytes, wrong schema)."""
    shard_id: str | None = None
    problem: str | None = None
    counts: dict | None = None
    """What its writer stamped in its footer (`shard_counts`); None for a shard written before that."""
    read: bool = True
    """False when the file was gone by the time its footer was read (nothing to remember of it)."""


def check_completion_shard(shard: CompletionShard, storage_config: StorageConfig | None = None) -> ShardCheck:
    if shard.size == 0:
        return ShardCheck(problem="zero bytes")
    try:
        s = shard_reads.read_shard_schema(shard.uri, storage_config)
    except (pa.ArrowInvalid, OSError) as e:  # no footer: cut short by a copy, a full disk, a tool
        if isinstance(e, FileNotFoundError):  # moved aside or regenerated since the listing: not ours to judge
            return ShardCheck(read=False)
        first = (str(e).strip().splitlines() or [""])[0]
        return ShardCheck(problem=f"not a whole Arrow file ({first}; {shard.size:,} bytes: truncated?)")
    missing = [c for c in REQUIRED_COMPLETION_COLUMNS if c not in s.names]
    if missing:
        return ShardCheck(problem=f"not a completion shard (no column {', '.join(missing)})")
    meta = s.metadata or {}
    counts = None
    if schema.META_COUNTS in meta:
        try:
            counts = json.loads(meta[schema.META_COUNTS])
        except ValueError:  # unreadable counts are no counts: `status` reads the columns
            pass
    return ShardCheck(shard_id=meta[schema.META_SHARD_ID].decode() if schema.META_SHARD_ID in meta else None,
                      counts=counts)


def check_completion_shards(shards: list[CompletionShard], storage_config: StorageConfig | None = None,
                            num_threads: int = storage.PARALLEL_READS,
                            cache: trust_cache.Entries | None = None) -> dict[str, ShardCheck]:
    """`check_completion_shard` of every shard, by shard name: from `cache` where it holds the shard's listed size
    and ETag (`trust_cache.Entries.get`), else its footer read (one read each, in a thread pool) and, when trusted,
    put in `cache`. Entries of shards no longer listed are dropped."""
    cache = cache if cache is not None else trust_cache.Entries()
    checks: dict[str, ShardCheck] = {}
    to_read = []
    for s in shards:
        hit = cache.get(s.name, s.size, s.etag)
        if hit is not None:
            checks[s.name] = ShardCheck(shard_id=hit.get("shard_id"), counts=hit.get("counts"))
        else:
            to_read.append(s)
    if to_read:
        with ThreadPoolExecutor(min(num_threads, len(to_read))) as pool:
            for s, check in zip(to_read, pool.map(lambda s: check_completion_shard(s, storage_config), to_read)):
                checks[s.name] = check
                if check.problem is None and check.read:  # only what was read and trusted is remembered
                    cache.put(s.name, s.size, s.etag, {"shard_id": check.shard_id, "counts": check.counts})
    cache.keep_only({s.name for s in shards if not checks[s.name].problem})
    return {s.name: checks[s.name] for s in shards}


def unreadable(checks: dict[str, ShardCheck]) -> dict[str, str]:
    """{shard name: problem} of the shards that cannot be trusted."""
    return {name: c.problem for name, c in checks.items() if c.problem}


def unreadable_line(problems: dict[str, str], what_now: str) -> str:
    """One line naming every untrusted shard (the first 5 in full) and what happens to them."""
    named = "; ".join(f"{name}: {why}" for name, why in list(problems.items())[:5])
    more = f" and {len(problems) - 5} more" if len(problems) > 5 else ""
    return f"{len(problems)} completion shard(s) cannot be read whole ({named}{more}): {what_now}"


@dataclass
class CompletionShards:
    """A run's completion shards as `judge_completion_shards` judged them."""
    listed: list[CompletionShard]
    """Every shard of the listing, trusted or not (stage 2 judges its markers against all of them)."""
    checks: dict[str, ShardCheck]
    """Shard name → what its footer said."""
    cache: trust_cache.Entries = field(default_factory=trust_cache.Entries)
    """The trust cache as this answer left it: stage 1 saves it (`remember_completion_shards`)."""

    @property
    def problems(self) -> dict[str, str]:
        """{shard name: why it cannot be trusted}, in name order."""
        return unreadable(self.checks)

    @property
    def trusted(self) -> list[CompletionShard]:
        """The shards every reader counts, sorted by name."""
        return [s for s in self.listed if not self.checks[s.name].problem]

    def problem_line(self, what_now: str) -> str | None:
        """`unreadable_line` naming the untrusted shards, None when every shard can be trusted."""
        return unreadable_line(self.problems, what_now) if self.problems else None


def listed_beside_cache(list_files, run_uri: str, kind: str, storage_config: StorageConfig | None):
    """(`list_files()`, the run's trust cache of `kind`): the cache's GET and decoding in a helper thread while the
    listing's pages come (on S3 a page is a round trip of 0.05-0.4 s in which the listing thread only waits)."""
    with ThreadPoolExecutor(1) as pool:
        cached = pool.submit(trust_cache.load, run_uri, kind, storage_config)
        listed = list_files()
        return listed, cached.result()


def judge_completion_shards(run_uri: str, storage_config: StorageConfig | None = None,
                              num_threads: int = storage.PARALLEL_READS) -> CompletionShards:
    """THE rule of which completion shards of a run can be trusted, for every reader (stage 1's resume, stage 2's
    plan, `status`, `report`, `plan --from`, export, the notebook): one listing (`list_completion_shards`), then each
    shard's footer read (`check_completion_shard`: zero bytes, no whole Arrow file, not a completion shard's
    columns). What a reader does with the untrusted ones is its own: stage 1 moves them aside and generates their
    rows again, the others leave them out and name them (`CompletionShards.problem_line`)."""
    listed, cache = listed_beside_cache(lambda: list_completion_shards(run_uri, storage_config), run_uri,
                                         trust_cache.COMPLETIONS, storage_config)  # cache: footers already trusted
    return CompletionShards(listed=listed, checks=check_completion_shards(listed, storage_config, num_threads, cache),
                            cache=cache)


def remember_completion_shards(run_uri: str, found: CompletionShards, fence) -> bool:
    """Save what `found` trusted as the run's completion trust cache: stage 1 only, under its writer lock's fence
    (job/trust_cache.py). Returns whether it wrote (nothing new: nothing written)."""
    return trust_cache.save(run_uri, trust_cache.COMPLETIONS, found.cache, fence)


def remember_small_columns(run_uri: str, found: CompletionShards, fence, num_threads: int = 16) -> int | None:
    """Save the SMALL_COLUMNS of every shard `found` trusted as the run's rows cache (job/rows_cache.py): stage 1
    only, under its writer lock's fence. Rows the cache already holds for a shard's listed size and ETag are kept;
    only the other shards are read (one read each). Returns how many shards were read, or None when nothing was
    written (a local run, or nothing changed)."""
    if not storage.is_s3(run_uri):
        return None
    storage_config = fence.storage_config
    cached = rows_cache.load(run_uri, storage_config)
    shards = [s for s in found.trusted if s.etag is not None]
    tables, num_read = cached_or_read(shards, SMALL_COLUMNS, cached, storage_config, num_threads)
    if num_read == 0 and set(cached.index) == {s.name for s in shards}:
        return None
    try:
        rows = rows_cache.build([(s.name, s.size, s.etag, t) for s, t in zip(shards, tables)], SMALL_COLUMNS)
    except (pa.ArrowInvalid, pa.ArrowTypeError):  # the shards' columns do not concatenate (a type changed): no cache
        return None
    rows_cache.save(run_uri, rows, fence)
    return num_read
