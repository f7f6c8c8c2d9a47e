"""The small columns of a run's completion shards, read the one way every reader shares: `python -m job report`,
`python -m job status` (and `plan --from` through it) and the notebook's helpers.

- `list_completion_shards`: one listing of `completions/`; names, sizes and modification times come with it. Only
  files named like a completion shard (job/layout.py) count: a file someone copied in is ignored.
- `read_columns`: chosen small columns of those shards in a thread pool, as one table (plus the shard's URI per row
  when asked). The Arrow IPC footer locates each column's buffers, so only those are fetched (a few range GETs per
  shard on S3): token lists, texts and carried input columns stay where they are.
- `ok_rows`, `kept_rows`, `kept_tokens`: which rows count, defined once (stage 2 skips the others).
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np
import pyarrow as pa

from job import layout, schema, storage
from job.storage import StorageConfig

SMALL_COLUMNS = [schema.ID, schema.FINISH_REASON, schema.NUM_PROMPT_TOKENS, schema.NUM_OUTPUT_TOKENS,
                 schema.NUM_REASONING_TOKENS, schema.NUM_ANSWER_TOKENS, schema.TURN, schema.ORIGINAL_TURN_TOKENS,
                 *schema.QUALITY_FLAGS, schema.ERROR]
"""Every per-row column of a completion shard that is a number, a flag or short text (no token lists)."""


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


def list_completion_shards(run_uri: str, storage_config: StorageConfig | None = None) -> list[CompletionShard]:
    """The completion shards of a run, sorted by name; [] before the first one is written."""
    directory = storage.join(run_uri, layout.COMPLETIONS_DIR)
    shards = []
    for name, size, mtime in storage.list_file_infos(directory, layout.SHARD_SUFFIX, storage_config):
        parsed = layout.parse_completion_shard_name(name)
        if parsed is None:  # not ours (a file someone copied in): ignored, never counted
            continue
        shards.append(CompletionShard(name=name, uri=storage.join(directory, name), file_index=parsed[0],
                                      start=parsed[1], stop=parsed[2], size=size, mtime=mtime or 0.0))
    return shards


def completion_shards(run_uri: str, storage_config: StorageConfig | None = None) -> list[str]:
    """URIs of the completion shards of a run, sorted by name."""
    return [s.uri for s in list_completion_shards(run_uri, storage_config)]


def read_shard_tables(uris: list[str], columns: list[str], storage_config: StorageConfig | None = None,
                      num_threads: int = 16) -> list[pa.Table]:
    """`columns` (those each shard has, in that order) of every shard in `uris`, one table per shard."""
    def read(uri: str) -> pa.Table:
        t = storage.read_shard_columns(uri, columns, storage_config)
        return t.select([c for c in columns if c in t.column_names])

    if not uris:
        return []
    with ThreadPoolExecutor(min(num_threads, len(uris))) as pool:
        return list(pool.map(read, uris))


def read_columns(run_uri: str, columns: list[str] | None = None, storage_config: StorageConfig | None = None, *,
                 shard_column: str | None = None, shards: list[str] | None = None,
                 num_threads: int = 16) -> pa.Table:
    """`columns` (default SMALL_COLUMNS) of every completion shard of the run (or of `shards`: URIs) as one table,
    in shard-name order; with `shard_column`, a column of that name holds each row's shard URI."""
    columns = list(columns or SMALL_COLUMNS)
    uris = completion_shards(run_uri, storage_config) if shards is None else shards
    tables = read_shard_tables(uris, columns, storage_config, num_threads)
    if shard_column:
        tables = [t.append_column(shard_column, pa.array([uri] * t.num_rows, pa.string()))
                  for uri, t in zip(uris, tables)]
    if tables:
        return pa.concat_tables(tables, promote_options="default")
    empty = schema.completion_schema().empty_table().select([c for c in columns if c in schema.COMPLETION_COLUMNS])
    return empty.append_column(shard_column, pa.array([], pa.string())) if shard_column else empty


# ---------------------------------------------------------------------------------------------------------------
# Columns as numpy, and which rows count
# ---------------------------------------------------------------------------------------------------------------


def ints(table: pa.Table, name: str) -> np.ndarray:
    """An integer column as int64, nulls as 0."""
    return table.column(name).fill_null(0).to_numpy(zero_copy_only=False).astype(np.int64)


def bools(table: pa.Table, name: str) -> np.ndarray:
    """A boolean column, nulls as False; all False when the table has no such column."""
    if name not in table.column_names:
        return np.zeros(table.num_rows, dtype=bool)
    return table.column(name).fill_null(False).to_numpy(zero_copy_only=False).astype(bool)


def ok_rows(table: pa.Table) -> np.ndarray:
    """Rows that are not errors (`error` null): the rows quality rates and lengths are measured on."""
    return ~table.column(schema.ERROR).is_valid().to_numpy(zero_copy_only=False)


def kept_rows(table: pa.Table, keep_flagged: bool = True) -> np.ndarray:
    """Rows stage 2 turns into samples: not errors and, unless `keep_flagged`, no quality flag set."""
    keep = ok_rows(table)
    if not keep_flagged:
        for flag in schema.QUALITY_FLAGS:
            keep &= ~bools(table, flag)
    return keep


def kept_tokens(table: pa.Table, keep_flagged: bool = True, max_length: int | None = None) -> tuple[int, int]:
    """(rows kept, their tokens): prompt + output tokens of each kept row, clipped at `max_length`, summed."""
    keep = kept_rows(table, keep_flagged)
    tokens = ints(table, schema.NUM_PROMPT_TOKENS) + ints(table, schema.NUM_OUTPUT_TOKENS)
    if max_length is not None:
        tokens = np.minimum(tokens, max_length)
    return int(keep.sum()), int(tokens[keep].sum())


# ---------------------------------------------------------------------------------------------------------------
# Hidden-state parts (stage 2)
# ---------------------------------------------------------------------------------------------------------------


def hidden_state_parts(run_uri: str, storage_config: StorageConfig | None = None) -> list[tuple[str, int]]:
    """(URI, size) of every hidden-state part of a run, sorted by name, from one listing."""
    directory = storage.join(run_uri, layout.HIDDEN_STATES_DIR)
    return [(storage.join(directory, name), size)
            for name, size, _ in storage.list_file_infos(directory, layout.SHARD_SUFFIX, storage_config)]
