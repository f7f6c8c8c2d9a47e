"""The small columns of a run's trusted completion shards in one object, so that a reader of every row (the
notebook's cells, `python -m job report`, stage 1's own end-of-run report) makes one GET instead of a few per shard
(without it the notebook's opening at 20,000 shards on S3 took 136 s, one GET per shard).

The same rules as the trust cache (job/trust_cache.py), whose companion it is:
- One file, `<output>/cache/rows.arrows` (job/layout.py), written only by stage 1 under its writer lock's fence
  (`scan.remember_small_columns`: when it saves the trust cache, every ~10 min of a run and at its end). Readers
  (`scan.read_columns`: the notebook, `report`) use it and never write it.
- Content, not names: a shard's rows count only when the listing's size AND ETag are those recorded with them
  (`Rows.get`). A shard regenerated, truncated or replaced under its name has another ETag: its rows are read from
  the shard again. Only trusted shards are kept.
- The file is checked as a whole: a header line carries the SHA-256 of the index and of the Arrow bytes after it; a
  file that does not read, or whose digest does not match, counts as no cache (every shard is read, as without one).
- Local runs have no ETag, so nothing is cached for them.

The format: one line of JSON (version, kind, digest, the columns kept, and the index {shard name: [size, ETag, first
row, rows, [columns the shard lacks]]}), then an Arrow IPC stream (zstd) of every cached shard's SMALL_COLUMNS, in
shard-name order.
"""

from __future__ import annotations

import hashlib
import json

import pyarrow as pa
import pyarrow.ipc as ipc

from job import layout, storage
from job.storage import StorageConfig

KIND = "rows"
VERSION = 1


class Rows:
    """The cached rows and their index; `get` is the one rule of when a shard's cached rows count."""

    def __init__(self, table: pa.Table | None = None, index: dict[str, list] | None = None,
                 columns: list[str] | None = None):
        self.table = table
        self.index = dict(index or {})
        self.columns = list(columns or [])
        """The columns it was made to keep: of those, each shard's that it has."""

    def get(self, name: str, size: int, etag: str | None, columns: list[str]) -> pa.Table | None:
        """The shard's rows, `columns` of them that the shard has (in that order, as a read of the shard gives
        them), only if the shard listed now has the size and ETag recorded and the cache holds every one of
        `columns` that the shard has; else None (read the shard)."""
        found = self.index.get(name)
        if etag is None or found is None or found[0] != size or found[1] != etag or self.table is None:
            return None
        if any(c not in self.columns for c in columns):
            return None  # a column the cache does not keep (a token list, a carried input column)
        lacks = set(found[4])
        return self.table.slice(found[2], found[3]).select([c for c in columns if c not in lacks])


def build(shards: list[tuple[str, int, str, pa.Table]], columns: list[str]) -> Rows:
    """A cache of these (name, size, ETag, the shard's `columns`: those it has) in name order. Raises
    pyarrow.ArrowTypeError (or ArrowInvalid) when the shards' columns do not concatenate (a type changed): the caller
    then keeps none."""
    shards = sorted(shards, key=lambda s: s[0])
    index, offset = {}, 0
    for name, size, etag, t in shards:
        index[name] = [size, etag, offset, t.num_rows, [c for c in columns if c not in t.column_names]]
        offset += t.num_rows
    tables = [t for *_, t in shards]
    table = pa.concat_tables(tables, promote_options="default") if tables else None
    return Rows(table.combine_chunks() if table is not None else None, index, columns)


def _digest(index_bytes: bytes, body: bytes) -> str:
    return hashlib.sha256(index_bytes + b"\n" + body).hexdigest()


def encode(rows: Rows) -> bytes:
    sink = pa.BufferOutputStream()
    if rows.table is not None:
        with ipc.new_stream(sink, rows.table.schema, options=ipc.IpcWriteOptions(compression="zstd")) as w:
            w.write_table(rows.table)
    body = sink.getvalue().to_pybytes()
    index = json.dumps([rows.columns, rows.index], separators=(",", ":"), sort_keys=True).encode()
    head = json.dumps({"version": VERSION, "kind": KIND, "sha256": _digest(index, body), "columns": rows.columns,
                       "index": rows.index}, separators=(",", ":"), sort_keys=True).encode()
    return head + b"\n" + body


def decode(data: bytes) -> Rows:
    """The cache in these bytes; empty when they do not read whole, are of another kind or version, or do not match
    their digest, or the index does not fit the table."""
    try:
        head, body = data.split(b"\n", 1)
        meta = json.loads(head)
        index, columns = meta["index"], meta["columns"]
        index_bytes = json.dumps([columns, index], separators=(",", ":"), sort_keys=True).encode()
        if meta.get("version") != VERSION or meta.get("kind") != KIND or meta.get("sha256") != _digest(index_bytes,
                                                                                                       body):
            return Rows()
        table = ipc.open_stream(pa.py_buffer(body)).read_all() if body else None
        total = table.num_rows if table is not None else 0
        if any(e[2] + e[3] > total for e in index.values()):
            return Rows()
        return Rows(table, index, columns)
    except (ValueError, TypeError, IndexError, KeyError, pa.ArrowInvalid, OSError):
        return Rows()


def uri_of(run_uri: str) -> str:
    return storage.join(run_uri, layout.rows_cache_name())


def load(run_uri: str, storage_config: StorageConfig | None = None) -> Rows:
    """The run's cache (one GET on S3); empty for a local run, before stage 1 first writes it, or when it does not
    check."""
    if not storage.is_s3(run_uri):
        return Rows()
    try:
        return decode(storage.read_bytes(uri_of(run_uri), storage_config))
    except FileNotFoundError:
        return Rows()


def save(run_uri: str, rows: Rows, fence) -> None:
    """Write the cache (atomically, under `fence`: only stage 1 calls this)."""
    fence.write_bytes(uri_of(run_uri), encode(rows))
