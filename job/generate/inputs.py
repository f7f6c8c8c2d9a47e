"""Input prompt shards: listing, up-front validation, and the work units of a run.

Formats: parquet, JSON Lines (`.jsonl`, `.jsonl.gz`, `.jsonl.zst`, jsonl_input.py) and Arrow IPC
(`datasets.save_to_disk` directories and `.arrow` files, arrow_input.py), local or s3://. Everything here is
the same for all three: each file has a row count from the scan, rows are addressed by position, and a unit
reads only its range (`read_unit`). One input is one format.

A *work unit* is a row range of one input file: `(file_index, start, stop)`. It becomes exactly one output
shard named `f{file_index:05d}-r{start:010d}-{stop:010d}.arrow`, so the run directory's listing alone says
which rows are done. Resuming = listing the output, subtracting the covered row ranges from the wanted
ones, and cutting what is left into new units. The bookkeeping is O(number of shards), never O(ids): a
10M-row input at 256 rows per shard is ~40k names (docs/BENCHMARKS.md measures it).

~450 lines: listing, validation, identity and resume arithmetic share one InputFile record and are read together;
the per-format readers live in jsonl_input.py and arrow_input.py.
"""

from __future__ import annotations

import hashlib
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.fs as pafs
import pyarrow.parquet as pq

from job import schema, storage
from job.errors import JobError
from job.generate import arrow_input, jsonl_input, prompts
from job.layout import CompletionUnit
from job.storage import StorageConfig


class InputError(JobError, ValueError):
    """Input the user must fix; the message names the file and the problem."""


@dataclass(frozen=True)
class InputFile:
    uri: str
    num_rows: int
    size: int
    """Bytes of the whole file (not its footer)."""
    mtime: float | None = None
    """Last modification (S3: LastModified), seconds since the epoch."""
    max_row_group_rows: int = 0
    """Largest parquet row group / Arrow record batch (0 for JSONL)."""
    format: str = "parquet"
    """parquet, jsonl or arrow."""
    checkpoints: tuple[int, ...] = field(default=(), compare=False, repr=False)
    """Plain JSONL: byte offset of every jsonl_input.CHECKPOINT_ROWS-th row, so a unit can seek to its rows."""


# ---------------------------------------------------------------------------------------------------------------
# Listing and validation
# ---------------------------------------------------------------------------------------------------------------


FORMATS = {"parquet": (".parquet",), "jsonl": jsonl_input.SUFFIXES, "arrow": arrow_input.SUFFIXES}
ALL_SUFFIXES = tuple(x for suffixes in FORMATS.values() for x in suffixes)


def format_of(uri: str) -> str | None:
    return next((name for name, suffixes in FORMATS.items() if uri.endswith(suffixes)), None)


def list_input_files(uri: str, storage_config: StorageConfig) -> list[InputFile]:
    """Every input file under `uri` (a folder, a single file or an S3 prefix) with its row count: parquet from its
    footer, Arrow from its batch headers, JSONL by counting lines (one streaming pass, see jsonl_input.py)."""
    storage.check_reachable(uri, storage_config)
    fs, path = storage.resolve(uri, storage_config)
    try:
        info = storage.with_retries(fs.get_file_info, path, what=f"stat {uri}", storage=storage_config)
    except OSError as e:
        raise InputError(f"input {uri}: cannot be read: {_short(e)}") from None
    if info.type == pafs.FileType.File:
        if format_of(uri) is None:
            raise InputError(f"input {uri}: not a supported input file (names end in {', '.join(ALL_SUFFIXES)})")
        stats = {uri: (int(info.size or 0), info.mtime.timestamp() if info.mtime else None)}
    elif info.type == pafs.FileType.Directory or storage.is_s3(uri):
        try:
            if storage.exists(storage.join(uri, "dataset_dict.json"), storage_config):
                raise InputError(f"input {uri} is a DatasetDict (it has dataset_dict.json): point the input at one "
                                 "split's directory, e.g. {uri}/train".replace("{uri}", uri))
            listed = {name: (size, mtime)
                      for name, size, mtime in storage.list_file_infos(uri, ALL_SUFFIXES, storage_config)}
            names = list(listed)
            if names and all(format_of(n) == "arrow" for n in names):
                names = arrow_input.ordered_names(uri, names, storage_config)
            stats = {storage.join(uri, name): listed[name] for name in names}
        except OSError as e:  # e.g. the bucket does not exist
            raise InputError(f"input {uri}: cannot be listed: {_short(e)}") from None
        except ValueError as e:
            raise InputError(str(e)) from None
    else:
        raise InputError(f"input {uri}: no such file or directory")
    if not stats:
        raise InputError(f"input {uri}: no .parquet files found (nor {', '.join(ALL_SUFFIXES[1:])} files)")
    formats = {format_of(u) for u in stats}
    if len(formats) > 1:
        examples = {format_of(u): u for u in stats}
        raise InputError(f"input {uri} mixes formats ({', '.join(f'{k}: {v}' for k, v in sorted(examples.items()))}); "
                         "one input is one format")
    fmt = formats.pop()

    def scan(u: str) -> InputFile:
        size, mtime = stats[u]
        if fmt == "parquet":
            meta = _read_metadata(u, storage_config)
            return InputFile(uri=u, num_rows=meta.num_rows, size=size, mtime=mtime, max_row_group_rows=max(
                (meta.row_group(g).num_rows for g in range(meta.num_row_groups)), default=0))
        try:
            if fmt == "arrow":
                _, num_rows, max_batch = arrow_input.scan(u, storage_config)
                return InputFile(uri=u, num_rows=num_rows, size=size, mtime=mtime, max_row_group_rows=max_batch,
                                 format=fmt)
            num_rows, checkpoints = jsonl_input.scan(u, storage_config)
            return InputFile(uri=u, num_rows=num_rows, size=size, mtime=mtime, format=fmt, checkpoints=checkpoints)
        except (OSError, pa.ArrowException) as e:
            raise InputError(f"input file {u} is not a readable {fmt} file: {_short(e)}") from None

    with ThreadPoolExecutor(16) as pool:  # footers are tiny; S3 latency dominates, so read them in parallel
        return list(pool.map(scan, list(stats)))


def compressed_note(files: list[InputFile], rows_per_shard: int) -> str | None:
    """A note when compressed JSONL files are large: every unit decompresses its file from the start."""
    big = [f for f in files if jsonl_input.codec_of(f.uri) and f.num_rows > 64 * rows_per_shard]
    if not big:
        return None
    return (f"note: {len(big)} compressed JSONL file(s) hold more than {64 * rows_per_shard:,} rows "
            f"(e.g. {big[0].uri}: "
            f"{big[0].num_rows:,}); a compressed file cannot seek, so each unit decompresses it from the start up "
            "to its rows. Decompressing it once (plain .jsonl seeks) or splitting it saves that work.")


def row_group_note(files: list[InputFile], rows_per_shard: int) -> str | None:
    """A note when input row groups dwarf the work units: each unit then streams through its whole row group
    (time and S3 reads, not memory: read_rows keeps only the unit's rows)."""
    big = [f for f in files if f.max_row_group_rows > 16 * rows_per_shard]
    if not big:
        return None
    worst = max(big, key=lambda f: f.max_row_group_rows)
    return (f"note: {len(big)} input file(s) have row groups far larger than rows_per_shard={rows_per_shard} (e.g. "
            f"{worst.uri}: {worst.max_row_group_rows:,} rows in one group), so every unit reads through its whole "
            f"row group. Rewriting them with row_group_size of about {rows_per_shard * 4:,} reads only what each "
            "unit needs.")


def _read_metadata(uri: str, storage_config: StorageConfig) -> pq.FileMetaData:
    fs, path = storage.resolve(uri, storage_config)
    try:
        return storage.with_retries(lambda: pq.read_metadata(path, filesystem=fs), what=f"read footer of {uri}",
                                    storage=storage_config)
    except (OSError, pa.ArrowException) as e:
        raise InputError(f"input file {uri} is not a readable parquet file: {_short(e)}") from None


def _short(e: Exception) -> str:
    return str(e).strip().splitlines()[0][:300]


def read_schema(uri: str, storage_config: StorageConfig) -> pa.Schema:
    """Columns of a parquet or Arrow file (JSONL's come from validation: `validate_input`)."""
    if format_of(uri) == "arrow":
        try:
            return arrow_input.scan(uri, storage_config)[0]
        except (OSError, pa.ArrowException) as e:
            raise InputError(f"input file {uri} is not a readable Arrow file: {_short(e)}") from None
    return _read_metadata(uri, storage_config).schema.to_arrow_schema()


def _schema_and_ids(f: InputFile, storage_config: StorageConfig) -> tuple[pa.Schema, pa.Array | None]:
    """(columns, ids) of one file; ids None when there is no id column."""
    if f.format == "jsonl":
        try:
            ids, keys = jsonl_input.read_ids(f.uri, storage_config)
        except ValueError as e:  # a line that is not a JSON object
            raise InputError(str(e)) from None
        except (OSError, pa.ArrowException) as e:
            raise InputError(f"input file {f.uri} could not be read: {_short(e)}") from None
        return jsonl_input.table_schema(keys), ids if schema.ID in keys else None
    s = read_schema(f.uri, storage_config)
    if schema.ID not in s.names:
        return s, None
    return s, read_rows(f.uri, storage_config, columns=[schema.ID]).column(schema.ID).combine_chunks()


def validate_input(files: list[InputFile], storage_config: StorageConfig,
                   ids_digests: dict[str, str] | None = None, regenerate: str | None = None) -> pa.Schema:
    """Refuse input that cannot be processed at all; return the schema of the carried columns. `ids_digests`,
    when given, receives each file's ids digest (see `ids_digest`), computed from the ids read here anyway.

    Checks: every file has `id` and `prompt`, `messages` or `conversations`, and the same schema (JSONL: the
    union of all keys); ids are never null and unique across the whole input; under
    `regenerate: every_assistant_turn` or `conversation`, whose outputs are named `<id>#<turn>`, no id ends in
    `#<digits>` (so output ids are unique by construction: `a#1` beside a two-turn `a` would give two rows named
    `a#1`). The id check reads the `id` column
    of every file (~1 s per 10M integer parquet ids; JSONL parses every line, docs/BENCHMARKS.md); it runs on a
    run's first start only (run.json records the result and the columns).
    """
    schemas, hashes = {}, []
    for f in files:
        s, ids = _schema_and_ids(f, storage_config)
        if ids is None:
            raise InputError(f"input file {f.uri} has no `{schema.ID}` column (columns: {s.names})")
        if not any(c in s.names for c in schema.CONVERSATION_COLUMNS):
            raise InputError(f"input file {f.uri} has neither a `{schema.PROMPT}` nor a `{schema.MESSAGES}` column "
                             f"(nor ShareGPT `{schema.CONVERSATIONS}`; columns: {s.names})")
        first = files[0].uri
        if f.format != "jsonl" and not s.remove_metadata().equals(schemas.get(first, s).remove_metadata()):
            raise InputError(f"input files disagree on their schema: {first} has {schemas[first]} but {f.uri} has {s}")
        schemas[f.uri] = s
        if ids.null_count:
            raise InputError(f"input file {f.uri}: {ids.null_count} row(s) have a null `{schema.ID}`; every row "
                             "needs an id")
        if pa.types.is_floating(ids.type):  # NaN != NaN: duplicate NaN ids would pass the uniqueness check
            nan = pc.sum(pc.is_nan(ids).cast(pa.int64())).as_py() or 0
            if nan:
                raise InputError(f"input file {f.uri}: {nan} row(s) have a NaN `{schema.ID}`; every row needs an "
                                 "id (floating-point ids are fragile: prefer strings or integers)")
        if regenerate in prompts.PER_TURN_MODES:
            _refuse_turn_suffixes(f.uri, ids)
        # Uniqueness in ~8 bytes per id: a 64-bit hash per id (file by file), one sort, then an exact recheck of
        # the few ids whose hashes collide. Arrow's own hash table needs ~100 bytes per id (1 GB at 10M ids,
        # docs/BENCHMARKS.md); this needs ~160 MB.
        hashes.append(_hash64(ids))
        if ids_digests is not None:
            ids_digests[f.uri] = _digest(hashes[-1])
        del ids
    if files[0].format == "jsonl":  # JSON rows need not share keys: the columns are all keys of all files
        return_schema = jsonl_input.table_schema(list(dict.fromkeys(n for s in schemas.values() for n in s.names)))
    else:
        return_schema = schemas[files[0].uri]

    ordered = np.sort(np.concatenate(hashes))
    suspects = set(ordered[1:][ordered[1:] == ordered[:-1]].tolist())
    if suspects:
        counts: dict = {}
        for f in files:
            ids = _schema_and_ids(f, storage_config)[1]
            mask = np.isin(_hash64(ids), np.fromiter(suspects, dtype=np.uint64))
            for value in ids.filter(pa.array(mask)).to_pylist():
                counts[value] = counts.get(value, 0) + 1
        dups = [v for v, n in counts.items() if n > 1]
        if dups:
            raise InputError(f"input has {len(dups)} duplicate id(s), e.g. {dups[0]!r}; ids must be unique across "
                             "the input")
    return return_schema


def _refuse_turn_suffixes(uri: str, ids: pa.Array) -> None:
    """Under every_assistant_turn and conversation an output is `<input id>#<turn>`: refuse input ids that already
    end that way."""
    if not (pa.types.is_string(ids.type) or pa.types.is_large_string(ids.type)):
        return  # integer ids cannot end in '#<digits>'
    bad = ids.filter(pc.match_substring_regex(ids, r"#[0-9]+$"))
    if len(bad):
        shown = ", ".join(repr(v) for v in bad.slice(0, 5).to_pylist())
        more = " …" if len(bad) > 5 else ""
        raise InputError(f"input file {uri}: {len(bad)} id(s) end in '#<number>' ({shown}{more})"
                         ", the form of generate.regenerate: every_assistant_turn's and conversation's output ids "
                         "(`<id>#<turn>`), so they could collide with another row's turns. Rename those ids, or use "
                         "regenerate: last_turn")


def _hash64(ids: pa.Array) -> np.ndarray:
    if pa.types.is_unsigned_integer(ids.type):  # uint64 ids above 2^63 do not fit int64
        return ids.cast(pa.uint64()).to_numpy()
    if pa.types.is_integer(ids.type):
        return ids.cast(pa.int64()).to_numpy().view(np.uint64)
    import pandas as pd  # vectorized 64-bit hashing of strings (pandas comes with Ray Data)

    return pd.util.hash_array(ids.cast(pa.string()).to_numpy(zero_copy_only=False), categorize=False)


def read_rows(uri: str, storage_config: StorageConfig, columns: list[str] | None = None,
              start: int = 0, stop: int | None = None) -> pa.Table:
    """Rows [start, stop) of one parquet or Arrow file, reading only the row groups (batches) that cover them."""
    if format_of(uri) == "arrow":
        try:
            return arrow_input.read_rows(uri, storage_config, columns, start, stop)
        except (OSError, pa.ArrowException) as e:
            raise InputError(f"input file {uri} could not be read: {_short(e)}") from None
    fs, path = storage.resolve(uri, storage_config)

    def _read() -> pa.Table:
        with fs.open_input_file(path) as fh:
            pf = pq.ParquetFile(fh)
            end = pf.metadata.num_rows if stop is None else stop
            groups, offset, first_offset = [], 0, None
            for g in range(pf.metadata.num_row_groups):
                n = pf.metadata.row_group(g).num_rows
                if offset + n > start and offset < end:
                    groups.append(g)
                    first_offset = offset if first_offset is None else first_offset
                offset += n
            if not groups:
                return pf.schema_arrow.empty_table().select(columns) if columns else pf.schema_arrow.empty_table()
            group_rows = sum(pf.metadata.row_group(g).num_rows for g in groups)
            if group_rows <= 4 * (end - start) + 1024:  # groups about the unit's size: read them whole
                table = pf.read_row_groups(groups, columns=columns).slice(start - first_offset, end - start)
            else:
                # Row groups much larger than the unit (one group per file is what pq.write_table and pandas write
                # by default): stream them in small batches, keep only the rows wanted, stop after the last one.
                # Memory stays at about one batch instead of the whole group, for as long as the unit lives.
                kept, pos = [], first_offset
                for batch in pf.iter_batches(batch_size=max(1024, min(end - start, 65536)), row_groups=groups,
                                             columns=columns, use_threads=False):
                    a, b = max(start, pos), min(end, pos + batch.num_rows)
                    if b > a:
                        kept.append(batch.slice(a - pos, b - a))
                    pos += batch.num_rows
                    if pos >= end:
                        break
                table = pa.Table.from_batches(kept, schema=kept[0].schema)
            # A copy of just these rows: a slice would keep the whole decoded group's buffers alive.
            return table.take(pa.array(np.arange(table.num_rows)))

    try:
        return storage.with_retries(_read, what=f"read {uri}", storage=storage_config)
    except (OSError, pa.ArrowException) as e:
        raise InputError(f"input file {uri} could not be read: {_short(e)}") from None


def read_unit(unit: CompletionUnit, storage_config: StorageConfig, carried: pa.Schema) -> pa.Table:
    """The rows of one work unit, whatever the format (`carried`: the input's columns, as validation found them)."""
    if format_of(unit.file_uri) != "jsonl":
        return read_rows(unit.file_uri, storage_config, None, unit.start, unit.stop)
    try:
        return jsonl_input.read_rows(unit.file_uri, storage_config, carried, unit.start, unit.stop,
                                     unit.seek_row, unit.seek_byte)
    except ValueError as e:
        raise InputError(str(e)) from None
    except (OSError, pa.ArrowException) as e:
        raise InputError(f"input file {unit.file_uri} could not be read: {_short(e)}") from None


def _digest(hashes: np.ndarray) -> str:
    return hashlib.sha256(np.ascontiguousarray(hashes).tobytes()).hexdigest()[:16]


def ids_digest(uri: str, storage_config: StorageConfig) -> str:
    """A digest of a file's ids in row order: the same rows in the same places, or not."""
    f = InputFile(uri=uri, num_rows=0, size=0, format=format_of(uri) or "parquet")
    return _digest(_hash64(_schema_and_ids(f, storage_config)[1]))


def _relative(uri: str, root: str) -> str:
    return uri[len(root):].lstrip("/") if uri.startswith(root) and uri != root else uri.rsplit("/", 1)[-1]


def content_digests(files: list[InputFile], storage_config: StorageConfig, num_threads: int = 8) -> dict[str, dict]:
    """Each file's content identity: {"sha256": …} of its bytes, streamed, and for an S3 object its {"etag": …} too
    (so that a resume need not download an unchanged input again: `check_unchanged`)."""
    def identity(f: InputFile) -> dict:
        out = {"sha256": storage.sha256(f.uri, storage_config)}
        if storage.is_s3(f.uri):
            out["etag"] = storage.etag(f.uri, storage_config)
        return out

    with ThreadPoolExecutor(max(1, min(num_threads, len(files)))) as pool:
        return dict(zip((f.uri for f in files), pool.map(identity, files)))


def _same_content(recorded: dict, f: InputFile, storage_config: StorageConfig) -> bool:
    """Whether `f` still has the content `recorded` describes. A local file is hashed again (~0.5 s per GB); an
    S3 object whose ETag is unchanged has the same bytes, and one whose ETag changed is downloaded and hashed (a
    re-upload of the same bytes, with another part size, is accepted)."""
    if storage.is_s3(f.uri) and recorded.get("etag") and storage.etag(f.uri, storage_config) == recorded["etag"]:
        return True
    return storage.sha256(f.uri, storage_config) == recorded["sha256"]


def describe_files(files: list[InputFile], root: str, ids_digests: dict[str, str],
                   contents: dict[str, dict]) -> list[dict]:
    """What run.json records of each input file, to tell on resume whether it is still the same file."""
    return [{"name": _relative(f.uri, root), "format": f.format, "num_rows": f.num_rows, "size": f.size,
             "mtime": f.mtime, "ids": ids_digests.get(f.uri), "content": contents.get(f.uri)} for f in files]


def check_unchanged(recorded: list[dict], files: list[InputFile], root: str,
                    storage_config: StorageConfig) -> list[dict]:
    """Refuse to resume over input that changed since the run started: a shard holds rows by position in its file,
    so a rewritten file (a re-export, a reshuffle, an edited prompt: same row count, other rows) would pair old
    shards with new rows (some ids twice, some never), and an added or removed file shifts every later file's
    index. Not overridable.

    Every file is identified by its content on every resume, whatever its modification time says (a copy that
    keeps times, `touch -d`): `_same_content`. Row count and size must match too. Every changed file is named.
    Returns the records to store (with the new times)."""
    now = {_relative(f.uri, root): f for f in files}
    before = {r["name"]: r for r in recorded}
    added, removed = sorted(set(now) - set(before)), sorted(set(before) - set(now))
    if added or removed:
        what = "; ".join(x for x in (f"added: {', '.join(added[:5])}" if added else "",
                                     f"removed: {', '.join(removed[:5])}" if removed else "") if x)
        raise InputError(f"input {root}: its files changed since this run started ({what}). Shards are named after "
                         "a file's position in the listing, so resuming would pair them with other rows. Restore the "
                         "input, or write this input to a new --output.")
    out, changed_files = [], []
    for name, f in now.items():
        r = before[name]
        changed = []
        if r["num_rows"] != f.num_rows:
            changed.append(f"rows {r['num_rows']:,} → {f.num_rows:,}")
        if r["size"] != f.size:
            changed.append(f"size {r['size']:,} → {f.size:,} bytes")
        if not changed and r.get("content") and not _same_content(r["content"], f, storage_config):
            changed.append("same size and rows, other content")
        elif not changed and not r.get("content") and r.get("mtime") != f.mtime and r.get("ids"):
            # A run directory from before contents were recorded: its ids, in order, are what it has.
            if ids_digest(f.uri, storage_config) != r["ids"]:
                changed.append("same size, but other ids or another order")
        if changed:
            changed_files.append(f"{f.uri} ({'; '.join(changed)})")
        out.append({**r, "mtime": f.mtime})
    if changed_files:
        raise InputError(f"{len(changed_files)} input file(s) changed since this run started: "
                         f"{', '.join(changed_files[:5])}{' …' if len(changed_files) > 5 else ''}. Their shards hold "
                         "rows by position, so resuming would write some ids twice and others never. Restore the "
                         "files, or write this input to a new --output.")
    return out


def fingerprint(files: list[InputFile]) -> str:
    """Identity of an input listing (names, row counts, file sizes). `check_unchanged` compares file by file."""
    h = hashlib.sha256()
    for f in files:
        h.update(f"{f.uri.rsplit('/', 1)[-1]}\t{f.num_rows}\t{f.size}\n".encode())
    return h.hexdigest()[:16]
