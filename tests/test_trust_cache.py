"""The trust cache (job/trust_cache.py, issue 48): a footer or marker already read is not read again while the
listing shows the same size and ETag; anything else (a shard regenerated, truncated, a marker rewritten, a cache
file damaged) is read again. On a real S3 server (moto), with the project's writers and a real writer lock; no
job run."""

from __future__ import annotations

import json
import uuid

import numpy as np
import pyarrow as pa
import pytest

from job import layout, rows_cache, scan, schema, shard_reads, stage, storage, trust_cache
from job.config import RunConfig
from job.trust_cache import Entries


def test_an_entry_counts_only_with_its_size_and_etag():
    e = Entries()
    e.put("a.arrow", 100, "etag-1", {"shard_id": "x"})
    assert e.changed and e.get("a.arrow", 100, "etag-1") == {"shard_id": "x"}
    assert e.get("a.arrow", 101, "etag-1") is None, "another size: stale"
    assert e.get("a.arrow", 100, "etag-2") is None, "another ETag (the same size, other bytes): stale"
    assert e.get("a.arrow", 100, None) is None, "no ETag (a local file): never a hit"
    assert e.get("b.arrow", 100, "etag-1") is None, "another name: a miss, whatever its content id"
    e2 = Entries()
    e2.put("a.arrow", 100, None, {"shard_id": "x"})
    assert not e2.changed and e2.entries == {}, "nothing is cached without an ETag"
    e.keep_only({"b.arrow"})
    assert e.entries == {}


def test_a_cache_file_that_does_not_check_is_no_cache():
    e = Entries({"a.arrow": (100, "etag-1", {"shard_id": "x"})})
    data = trust_cache.encode(trust_cache.COMPLETIONS, e)
    assert trust_cache.decode(trust_cache.COMPLETIONS, data).entries == e.entries
    assert trust_cache.decode(trust_cache.MARKERS, data).entries == {}, "another kind's cache"
    assert trust_cache.decode(trust_cache.COMPLETIONS, data[:len(data) // 2]).entries == {}, "cut short"
    import gzip

    head, body = gzip.decompress(data).split(b"\n", 1)
    forged = gzip.compress(head + b"\n" + body.replace(b"etag-1", b"etag-2"))
    assert trust_cache.decode(trust_cache.COMPLETIONS, forged).entries == {}, "entries that do not match the digest"
    assert trust_cache.decode(trust_cache.COMPLETIONS, b"not gzip").entries == {}


def test_shard_counts_give_kept_tokens_unless_a_row_is_clipped():
    flags = {f: [False] * 5 for f in schema.QUALITY_FLAGS}
    flags[schema.QUALITY_FLAGS[0]] = [False, True, False, False, False]
    table = pa.table({schema.ID: ["a", "b", "c", "d", "e"], schema.NUM_PROMPT_TOKENS: pa.array([3, 4, 5, 6, 7]),
                      schema.NUM_OUTPUT_TOKENS: pa.array([10, 20, None, 40, 1]),
                      schema.ERROR: [None, None, None, "boom", None],
                      **flags})
    counts = scan.shard_counts(table)
    assert counts["rows"] == 5 and counts["errors"] == 1 and counts["output_tokens"] == 71
    assert counts["flags"][schema.QUALITY_FLAGS[0]] == 1
    for keep_flagged in (True, False):
        for max_length in (None, 24, 100):
            assert scan.counted_kept_tokens(counts, keep_flagged, max_length) == \
                scan.kept_tokens(table, keep_flagged, max_length), (keep_flagged, max_length)
    assert scan.counted_kept_tokens(counts, True, 23) is None, "row b (24 tokens) would be clipped: read its columns"
    assert scan.counted_kept_tokens(None, True, None) is None


# ---------------------------------------------------------------------------------------------------------------
# On S3: the readers' rule and the writers' saves
# ---------------------------------------------------------------------------------------------------------------


def _shard(uri: str, rows: int = 8, counts: bool = True) -> tuple[bytes, str]:
    """A completion shard as the engine writes it: a fresh content id and its counts in the footer."""
    table = pa.table({schema.ID: [f"r{i}" for i in range(rows)], schema.ERROR: pa.nulls(rows, pa.string()),
                      schema.NUM_OUTPUT_TOKENS: pa.array(np.arange(rows, dtype=np.int32)),
                      schema.NUM_PROMPT_TOKENS: pa.array(np.ones(rows, dtype=np.int32))})
    shard_id = uuid.uuid4().hex
    meta = {schema.META_SHARD_ID: shard_id}
    if counts:
        meta[schema.META_COUNTS] = json.dumps(scan.shard_counts(table))
    data = storage.table_to_ipc_bytes(table.replace_schema_metadata(meta))
    storage.write_bytes_atomic(uri, data)
    return data, shard_id


@pytest.fixture
def footer_reads(monkeypatch):
    """The names of the shards whose footer was read (the real reader, counted)."""
    reads: list[str] = []
    real = scan.check_completion_shard

    def counted(shard, storage_config=None):
        reads.append(shard.name)
        return real(shard, storage_config)

    from job.scan import completions  # where judge_completion_shards calls it

    monkeypatch.setattr(completions, "check_completion_shard", counted)
    return reads


def test_a_trusted_footer_is_not_read_again_and_a_changed_one_is(s3_server, s3_bucket, footer_reads):
    run = f"s3://{s3_bucket}/run"
    completions = storage.join(run, layout.COMPLETIONS_DIR)
    names = [layout.completion_shard_name(0, s, s + 8) for s in (0, 8, 16, 24)]
    ids = {n: _shard(storage.join(completions, n))[1] for n in names}
    config = RunConfig(model="unused", output=run)

    found = scan.judge_completion_shards(run)  # a reader: reads every footer, writes nothing
    assert sorted(footer_reads) == names and not storage.exists(trust_cache.uri_of(run, trust_cache.COMPLETIONS))
    with stage.writing(config, "generate", layout.COMPLETIONS_DIR, take_lock=False) as fence:  # stage 1 saves it
        assert scan.remember_completion_shards(run, found, fence)
        assert not scan.remember_completion_shards(run, found, fence), "nothing new: nothing written"

    footer_reads.clear()
    again = scan.judge_completion_shards(run)
    assert footer_reads == [], "every footer came from the cache"
    assert {n: c.shard_id for n, c in again.checks.items()} == ids
    assert all(c.counts["rows"] == 8 for c in again.checks.values())

    # Shard 1 regenerated under its name (same size, another content id: another ETag); shard 2 cut short; shard 3
    # replaced by a zero-byte file.
    _, new_id = _shard(storage.join(completions, names[1]))
    data = storage.read_bytes(storage.join(completions, names[2]))
    storage.write_bytes_atomic(storage.join(completions, names[2]), data[:-40])
    storage.write_bytes_atomic(storage.join(completions, names[3]), b"")
    footer_reads.clear()
    after = scan.judge_completion_shards(run)
    assert sorted(footer_reads) == names[1:], "only the changed shards are read"
    assert after.checks[names[0]].shard_id == ids[names[0]] and after.checks[names[1]].shard_id == new_id
    assert set(after.problems) == {names[2], names[3]}, "a damaged shard is caught although it had an entry"
    assert [s.name for s in after.trusted] == names[:2]
    assert set(after.cache.entries) == set(names[:2]), "the damaged shards' entries are dropped"


def test_a_damaged_cache_file_means_every_footer_is_read(s3_server, s3_bucket, footer_reads):
    run = f"s3://{s3_bucket}/run"
    names = [layout.completion_shard_name(0, s, s + 8) for s in (0, 8)]
    for n in names:
        _shard(storage.join(run, layout.COMPLETIONS_DIR, n))
    with stage.writing(RunConfig(model="unused", output=run), "generate", layout.COMPLETIONS_DIR,
                       take_lock=False) as fence:
        scan.remember_completion_shards(run, scan.judge_completion_shards(run), fence)
    cache_uri = trust_cache.uri_of(run, trust_cache.COMPLETIONS)
    storage.write_bytes_atomic(cache_uri, storage.read_bytes(cache_uri)[:-5])
    footer_reads.clear()
    assert len(scan.judge_completion_shards(run).trusted) == 2 and sorted(footer_reads) == names


def test_a_local_run_has_no_cache(tmp_path, footer_reads):
    run = str(tmp_path / "run")
    _shard(storage.join(run, layout.COMPLETIONS_DIR, layout.completion_shard_name(0, 0, 8)))
    found = scan.judge_completion_shards(run)
    with stage.writing(RunConfig(model="unused", output=run), "generate", layout.COMPLETIONS_DIR,
                       take_lock=False) as fence:
        assert not scan.remember_completion_shards(run, found, fence)
    footer_reads.clear()
    scan.judge_completion_shards(run)
    assert len(footer_reads) == 1 and not (tmp_path / "run" / layout.CACHE_DIR).exists()


def test_markers_come_from_the_cache_until_one_is_rewritten(s3_server, s3_bucket, monkeypatch):
    run = f"s3://{s3_bucket}/run"
    completions = storage.join(run, layout.COMPLETIONS_DIR)
    hidden = storage.join(run, layout.HIDDEN_STATES_DIR)
    names = [layout.completion_shard_name(0, s, s + 8) for s in (0, 8)]
    sources = {n: _shard(storage.join(completions, n)) for n in names}

    def marker(name: str, shard_id: str) -> str:
        marker_name = f"{layout.DONE_DIR}/{name[:-len(layout.SHARD_SUFFIX)]}.json"
        storage.write_json(storage.join(hidden, marker_name),
                           {"num_parts": 0, "source": {"size": len(sources[name][0]), "shard_id": shard_id}})
        return marker_name

    markers = {n: marker(n, sources[n][1]) for n in names}
    reads: list[str] = []
    real = storage.read_json
    monkeypatch.setattr(storage, "read_json", lambda uri, cfg=None: reads.append(uri) or real(uri, cfg))

    found = scan.judge_completion_shards(run)
    judged = scan.stage2_markers(run, found.listed, found.checks)
    assert set(judged.matching) == set(names) and len(reads) == 2
    with stage.writing(RunConfig(model="unused", output=run), "hidden_states", layout.HIDDEN_STATES_DIR,
                       take_lock=False) as fence:
        assert scan.remember_markers(run, judged, fence)
    reads.clear()
    assert set(scan.stage2_markers(run, found.listed, found.checks).matching) == set(names) and reads == []

    marker(names[1], "other content")  # rewritten: another ETag, read again, and now stale
    reads.clear()
    judged = scan.stage2_markers(run, found.listed, found.checks)
    assert reads == [storage.join(hidden, markers[names[1]])]
    assert set(judged.matching) == {names[0]} and judged.stale == {names[1]: [markers[names[1]]]}


# ---------------------------------------------------------------------------------------------------------------
# The rows cache (job/rows_cache.py): the small columns of every trusted shard in one object
# ---------------------------------------------------------------------------------------------------------------


def test_cached_rows_count_only_with_their_size_etag_and_every_wanted_column():
    a = pa.table({schema.ID: ["a0", "a1"], schema.NUM_OUTPUT_TOKENS: pa.array([1, 2], pa.int32())})
    b = pa.table({schema.ID: ["b0"], schema.NUM_OUTPUT_TOKENS: pa.array([3], pa.int32()),
                  schema.VARIANT: ["x"]})  # a column the older shard `a` lacks
    rows = rows_cache.build([("b", 10, "e-b", b), ("a", 20, "e-a", a)],
                            [schema.ID, schema.NUM_OUTPUT_TOKENS, schema.VARIANT, schema.TURN])  # no shard has TURN
    cols = [schema.ID, schema.VARIANT, schema.NUM_OUTPUT_TOKENS, schema.TURN]
    assert rows.get("a", 20, "e-a", cols).to_pydict() == {schema.ID: ["a0", "a1"], schema.NUM_OUTPUT_TOKENS: [1, 2]}, \
        "as a read of the shard gives it: the column it lacks is absent, the others in the order asked"
    assert rows.get("b", 10, "e-b", cols).to_pydict() == {schema.ID: ["b0"], schema.VARIANT: ["x"],
                                                           schema.NUM_OUTPUT_TOKENS: [3]}
    assert rows.get("a", 21, "e-a", cols) is None, "another size"
    assert rows.get("a", 20, "e-other", cols) is None, "another ETag: the shard changed"
    assert rows.get("a", 20, None, cols) is None, "no ETag (a local file)"
    assert rows.get("c", 20, "e-a", cols) is None, "not cached"
    assert rows.get("a", 20, "e-a", [schema.ID, "output_token_ids"]) is None, "a column the cache does not keep"

    data = rows_cache.encode(rows)
    again = rows_cache.decode(data)
    assert again.index == rows.index and again.table.equals(rows.table)
    assert rows_cache.decode(data[:-7]).index == {}, "cut short"
    assert rows_cache.decode(data.replace(b'"e-a"', b'"e-z"', 1)).index == {}, "an index that does not match its digest"
    assert rows_cache.decode(b"not a cache").index == {}
    assert rows_cache.decode(rows_cache.encode(rows_cache.Rows())).index == {}, "an empty cache"


def test_the_rows_cache_serves_every_unchanged_shard_and_reads_the_changed_ones(s3_server, s3_bucket, monkeypatch):
    run = f"s3://{s3_bucket}/run"
    completions = storage.join(run, layout.COMPLETIONS_DIR)
    names = [layout.completion_shard_name(0, s, s + 8) for s in (0, 8, 16, 24)]
    for n in names:
        _shard(storage.join(completions, n))
    reads: list[str] = []
    real = shard_reads.read_shard_columns
    monkeypatch.setattr(shard_reads, "read_shard_columns",
                        lambda uri, cols, cfg=None: reads.append(uri) or real(uri, cols, cfg))  # counted
    direct = scan.read_columns(run, shards=[storage.join(completions, n) for n in names])  # never the cache
    assert len(reads) == 4 and not storage.exists(rows_cache.uri_of(run)), "readers write no cache"

    found = scan.judge_completion_shards(run)
    with stage.writing(RunConfig(model="unused", output=run), "generate", layout.COMPLETIONS_DIR,
                       take_lock=False) as fence:  # stage 1 saves it
        reads.clear()
        assert scan.remember_small_columns(run, found, fence) == 4 and len(reads) == 4
        reads.clear()
        assert scan.remember_small_columns(run, found, fence) is None and reads == [], "nothing new"
    reads.clear()
    assert scan.read_columns(run).equals(direct) and reads == [], "every row from the cache: no shard read"

    # Shard 1 regenerated under its name (another content: another ETag), shard 2 cut short: shard 1 is read again,
    # shard 2 is left out and named, whatever the cache holds for them.
    _shard(storage.join(completions, names[1]))
    data = storage.read_bytes(storage.join(completions, names[2]))
    storage.write_bytes_atomic(storage.join(completions, names[2]), data[:-40])
    reads.clear()
    problems: dict[str, str] = {}
    after = scan.read_columns(run, unreadable=problems)
    assert reads == [storage.join(completions, names[1])] and set(problems) == {names[2]}
    assert after.equals(scan.read_columns(run, shards=[storage.join(completions, n) for n in (names[0], names[1],
                                                                                              names[3])]))
    assert after.num_rows == 24

    # A damaged cache file is no cache: every shard is read.
    storage.write_bytes_atomic(rows_cache.uri_of(run), storage.read_bytes(rows_cache.uri_of(run))[:-9])
    reads.clear()
    assert scan.read_columns(run).equals(after) and len(reads) == 3


def test_a_local_run_has_no_rows_cache(tmp_path):
    run = str(tmp_path / "run")
    _shard(storage.join(run, layout.COMPLETIONS_DIR, layout.completion_shard_name(0, 0, 8)))
    with stage.writing(RunConfig(model="unused", output=run), "generate", layout.COMPLETIONS_DIR,
                       take_lock=False) as fence:
        assert scan.remember_small_columns(run, scan.judge_completion_shards(run), fence) is None
    assert not (tmp_path / "run" / layout.CACHE_DIR).exists() and scan.read_columns(run).num_rows == 8


def test_shards_whose_columns_do_not_concatenate_get_no_rows_cache(s3_server, s3_bucket):
    """A column whose type changed between shards (an older writer's int32, a newer int64): no cache is written,
    and nothing fails (the cache is an optimization; stage 1 calls this while it runs)."""
    run = f"s3://{s3_bucket}/run"
    for start, dtype in ((0, pa.int32()), (8, pa.int64())):
        table = pa.table({schema.ID: [f"r{i}" for i in range(8)], schema.ERROR: pa.nulls(8, pa.string()),
                          schema.NUM_OUTPUT_TOKENS: pa.array(range(8), dtype)})
        storage.write_bytes_atomic(storage.join(run, layout.COMPLETIONS_DIR, layout.completion_shard_name(0, start,
                                                                                                          start + 8)),
                                   storage.table_to_ipc_bytes(table.replace_schema_metadata(
                                       {schema.META_SHARD_ID: uuid.uuid4().hex})))
    with stage.writing(RunConfig(model="unused", output=run), "generate", layout.COMPLETIONS_DIR,
                       take_lock=False) as fence:
        assert scan.remember_small_columns(run, scan.judge_completion_shards(run), fence) is None
    assert not storage.exists(rows_cache.uri_of(run))
