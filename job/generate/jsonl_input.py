"""JSON Lines input (`.jsonl`, `.jsonl.gz`, `.jsonl.zst`): row counts, row ranges and ids, never the whole file.

A row is a non-blank line (a line with only `\\r` is blank, so CRLF files and a trailing newline are fine); rows
are numbered in file order, like parquet rows, so work units are row ranges here too.

- The scan (every start of a run) counts rows in one streaming pass over the bytes (no JSON parsing, ~4 MB
  held) and keeps a *checkpoint* every CHECKPOINT_ROWS rows: the byte offset where that row starts. For plain
  `.jsonl` a unit seeks to the checkpoint at or before its first row and reads on from there (it skips fewer
  than CHECKPOINT_ROWS lines); 1M rows need ~1k checkpoints (8 KB).
- Compressed files cannot seek: a unit decompresses from the start and skips the lines before its rows, holding
  one 4 MB block at a time. Work grows with the unit's position in the file (docs/OPERATIONS.md: decompress a
  large file once, or split it); memory does not.
- Validation (a run's first start) parses every line once: the ids, and the union of the top-level keys, which
  become the columns. Every column except `id` is carried as a string: a JSON string as is, any other value
  (lists, objects, numbers) as its JSON text; the conversation columns are parsed back by prompts.py. `id`
  is a string too (`7` and `"7"` are the same id, as in the completion shards).
"""

from __future__ import annotations

import json
from collections.abc import Iterator

import pyarrow as pa

from job import schema, storage
from job.storage import StorageConfig

SUFFIXES = (".jsonl", ".jsonl.gz", ".jsonl.zst")
CHECKPOINT_ROWS = 1024
_BLOCK = 4 << 20


def codec_of(uri: str) -> str | None:
    return "gzip" if uri.endswith(".gz") else "zstd" if uri.endswith(".zst") else None


def _open(uri: str, storage_config: StorageConfig, offset: int = 0):
    """A byte stream of the decompressed file, starting at `offset` (plain files only)."""
    fs, path = storage.resolve(uri, storage_config)
    codec = codec_of(uri)
    if codec is None:
        f = fs.open_input_file(path)  # random access (S3: ranged GETs), so a unit starts at its checkpoint
        if offset:
            f.seek(offset)
        return f
    assert offset == 0, "compressed files cannot seek"
    return pa.CompressedInputStream(fs.open_input_stream(path, compression=None), codec)


def _lines(stream, offset: int = 0) -> Iterator[tuple[int, bytes]]:
    """(byte offset in the decompressed stream, line) for every non-blank line, one block in memory at a time."""
    pos, rest = offset, b""
    while True:
        block = stream.read(_BLOCK)
        if not block:
            break
        buf = rest + block
        parts = buf.split(b"\n")
        rest = parts.pop()
        for line in parts:
            if line and line != b"\r":
                yield pos, line
            pos += len(line) + 1
    if rest and rest != b"\r":
        yield pos, rest


def scan(uri: str, storage_config: StorageConfig) -> tuple[int, tuple[int, ...]]:
    """(number of rows, checkpoints): checkpoints[k] is the byte offset of row k * CHECKPOINT_ROWS (plain files;
    () for compressed ones, which cannot seek)."""
    def _scan():
        rows, checkpoints, seekable = 0, [], codec_of(uri) is None
        with _open(uri, storage_config) as stream:
            for pos, _ in _lines(stream):
                if seekable and rows % CHECKPOINT_ROWS == 0:
                    checkpoints.append(pos)
                rows += 1
        return rows, tuple(checkpoints)

    return storage.with_retries(_scan, what=f"read {uri}", storage=storage_config)


def _parse(line: bytes, uri: str, row: int) -> dict:
    try:
        obj = json.loads(line)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"input file {uri}: row {row} is not valid JSON ({e}): {line[:80]!r}") from None
    if not isinstance(obj, dict):
        raise ValueError(f"input file {uri}: row {row} is a JSON {type(obj).__name__}, not an object")
    return obj


def _as_text(value) -> str | None:
    if value is None or isinstance(value, str):
        return value
    return json.dumps(value, ensure_ascii=False)


def read_ids(uri: str, storage_config: StorageConfig) -> tuple[pa.Array, list[str]]:
    """Every row's id (as a string; null where absent) and the top-level keys in order of first appearance. Parses
    every line once; holds the ids and one block."""
    def _read():
        ids, keys = [], {}
        with _open(uri, storage_config) as stream:
            for row, (_, line) in enumerate(_lines(stream)):
                obj = _parse(line, uri, row)
                keys.update(dict.fromkeys(obj))
                value = obj.get(schema.ID)
                ids.append(None if value is None else value if isinstance(value, str) else _as_text(value))
        return pa.array(ids, pa.string()), list(keys)

    return storage.with_retries(_read, what=f"read {uri}", storage=storage_config)


def table_schema(keys: list[str]) -> pa.Schema:
    """The columns of JSONL rows with these keys: all strings (see the module docstring)."""
    return pa.schema([pa.field(k, pa.string()) for k in [schema.ID, *[k for k in keys if k != schema.ID]]])


def read_rows(uri: str, storage_config: StorageConfig, columns_schema: pa.Schema, start: int, stop: int,
              seek_row: int = 0, seek_byte: int = 0) -> pa.Table:
    """Rows [start, stop) as a table of `columns_schema`, reading from the checkpoint (`seek_row` starts at
    `seek_byte`) and stopping after row `stop - 1`. Keys outside the schema are ignored, missing ones are null."""
    if codec_of(uri) is not None:
        seek_row, seek_byte = 0, 0

    def _read():
        wanted = []
        with _open(uri, storage_config, seek_byte) as stream:
            for row, (_, line) in enumerate(_lines(stream, seek_byte), start=seek_row):
                if row >= stop:
                    break
                if row >= start:
                    wanted.append(_parse(line, uri, row))
        return pa.table({f.name: pa.array([_as_text(r.get(f.name)) for r in wanted], f.type) for f in columns_schema},
                        schema=columns_schema)

    return storage.with_retries(_read, what=f"read {uri}", storage=storage_config)


def checkpoint_for(checkpoints: tuple[int, ...], start: int) -> tuple[int, int]:
    """(row, byte offset) of the last checkpoint at or before row `start`; (0, 0) without checkpoints."""
    if not checkpoints:
        return 0, 0
    k = min(start // CHECKPOINT_ROWS, len(checkpoints) - 1)
    return k * CHECKPOINT_ROWS, checkpoints[k]
