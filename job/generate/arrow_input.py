"""Arrow IPC input: a directory written by Hugging Face `datasets.save_to_disk`, or a set of `.arrow` files.

`save_to_disk` writes `data-00000-of-0000N.arrow` files in the Arrow *stream* format (record batches of
`writer_batch_size` rows, 1,000 by default) beside `state.json`, whose `_data_files` gives their order; that
order is the dataset's row order, so it is the listing order here (files sorted by name otherwise). A DatasetDict
directory holds one such directory per split: point the input at the split (`.../train`).

Both IPC formats are read: the *file* format (magic `ARROW1`, a footer) reads only the record batches that cover
a unit; the *stream* format has no index, so a unit reads through the batches before its rows, keeping none of
them (local files are memory-mapped, so skipping costs no copy; on S3 it costs the download of the prefix).
Memory stays at about one record batch plus the unit's rows.
"""

from __future__ import annotations

import json

import numpy as np
import pyarrow as pa

from job import storage
from job.storage import StorageConfig

SUFFIXES = (".arrow",)
STATE_JSON = "state.json"
_FILE_MAGIC = b"ARROW1"


def ordered_names(uri: str, names: list[str], storage_config: StorageConfig) -> list[str]:
    """The `.arrow` names under a `save_to_disk` directory in the dataset's order (state.json), else sorted."""
    state_uri = storage.join(uri, STATE_JSON)
    if not storage.exists(state_uri, storage_config):
        return sorted(names)
    state = json.loads(storage.read_bytes(state_uri, storage_config))
    order = [d["filename"] for d in state.get("_data_files", [])]
    missing = [n for n in order if n not in names]
    if missing:
        raise ValueError(f"input {uri}: state.json lists {missing[0]}, which is not there")
    return order + sorted(n for n in names if n not in order)


class _Reader:
    """One open IPC file: batches in order, with their row counts."""

    def __init__(self, uri: str, storage_config: StorageConfig):
        fs, path = storage.resolve(uri, storage_config)
        self.source = pa.memory_map(path) if not storage.is_s3(uri) else fs.open_input_file(path)
        magic = self.source.read(len(_FILE_MAGIC))
        self.source.seek(0)
        if magic == _FILE_MAGIC:
            self.file = pa.ipc.open_file(self.source)
            self.schema = self.file.schema
        else:
            self.file = None
            self.stream = pa.ipc.open_stream(self.source)
            self.schema = self.stream.schema

    def batches(self):
        if self.file is not None:
            for i in range(self.file.num_record_batches):
                yield self.file.get_batch(i)
        else:
            yield from self.stream

    def close(self):
        self.source.close()


def scan(uri: str, storage_config: StorageConfig) -> tuple[pa.Schema, int, int]:
    """(schema, number of rows, largest record batch) of one IPC file."""
    def _scan():
        r = _Reader(uri, storage_config)
        try:
            sizes = [b.num_rows for b in r.batches()]
            return r.schema, sum(sizes), max(sizes, default=0)
        finally:
            r.close()

    return storage.with_retries(_scan, what=f"read {uri}", storage=storage_config)


def read_rows(uri: str, storage_config: StorageConfig, columns: list[str] | None, start: int,
              stop: int | None) -> pa.Table:
    """Rows [start, stop) of one IPC file: reads up to the batch holding row `stop - 1`, keeps only those rows."""
    def _read():
        r = _Reader(uri, storage_config)
        try:
            kept, pos = [], 0
            for batch in r.batches():
                end = pos + batch.num_rows if stop is None else stop
                a, b = max(start, pos), min(end, pos + batch.num_rows)
                if b > a:
                    part = batch.slice(a - pos, b - a)
                    kept.append(part.select(columns) if columns else part)
                pos += batch.num_rows
                if stop is not None and pos >= stop:
                    break
            out_schema = pa.schema([r.schema.field(c) for c in columns]) if columns else r.schema
            table = pa.Table.from_batches(kept, schema=out_schema)
            # A copy of just these rows: slices would keep their batches (or the whole mapped file) alive.
            return table.take(pa.array(np.arange(table.num_rows)))
        finally:
            r.close()

    return storage.with_retries(_read, what=f"read {uri}", storage=storage_config)
