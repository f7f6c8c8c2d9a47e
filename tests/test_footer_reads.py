"""A shard's footer and small columns in as few reads as possible (job/storage.py `read_tail`, `TailFile`,
`read_shard_schema`, `read_shard_columns`; issue 48): the same answers as reading the whole file, and the same
refusals of a file that is not whole, locally and on a real S3 server (moto)."""

from __future__ import annotations

import boto3
import pyarrow as pa
import pyarrow.ipc as ipc
import pytest

from job import shard_reads, storage

COLUMNS = ["num_output_tokens", "error"]


def shard_bytes(rows: int = 128, tokens: int = 2000) -> bytes:
    """A completion-shard-like file: an id column, a big token-list column between it and the small ones."""
    table = pa.table({"id": [f"row-{i}" for i in range(rows)],
                      "output_token_ids": pa.array([list(range(i, i + tokens)) for i in range(rows)],
                                                   pa.list_(pa.int32())),
                      "num_output_tokens": pa.array([tokens] * rows, pa.int32()),
                      "error": pa.array([None] * (rows - 1) + ["boom"], pa.string())})
    return storage.table_to_ipc_bytes(table.replace_schema_metadata({b"shard_id": b"abc"}), compression=None)


def test_tail_file_serves_the_footer_from_the_tail_and_columns_in_few_fetches():
    data = shard_bytes()
    assert len(data) > shard_reads.FOOTER_READ_BYTES + shard_reads.READ_AHEAD_BYTES  # the columns lie outside the tail
    fetches = []

    def fetch(offset, n):
        fetches.append((offset, n))
        return data[offset:offset + n]

    tail = data[-shard_reads.FOOTER_READ_BYTES:]
    f = pa.PythonFile(shard_reads.TailFile(len(data), tail, fetch), mode="r")
    reader = ipc.open_file(f)
    assert reader.schema.metadata == {b"shard_id": b"abc"} and fetches == []  # the footer: no read beyond the tail
    wanted = [reader.schema.names.index(c) for c in COLUMNS]
    got = ipc.open_file(f, options=ipc.IpcReadOptions(included_fields=wanted)).read_all()
    assert got.equals(ipc.open_file(pa.BufferReader(data)).read_all().select(COLUMNS))
    # The record batch's header, then the small columns side by side: one fetch each, not one per buffer.
    assert len(fetches) <= 2, fetches
    assert all(offset + n <= len(data) - len(tail) or n <= shard_reads.READ_AHEAD_BYTES for offset, n in fetches)


@pytest.mark.parametrize("cut", [1, 9, 5000])
def test_a_truncated_shard_has_no_footer(tmp_path, cut):
    path = tmp_path / "f00000-r0000000000-0000000128.arrow"
    path.write_bytes(shard_bytes(rows=8, tokens=10)[:-cut])
    with pytest.raises(pa.ArrowInvalid):
        shard_reads.read_shard_schema(str(path))


def test_local_footer_columns_and_refusals(tmp_path):
    path = tmp_path / "s.arrow"
    data = shard_bytes()
    path.write_bytes(data)
    assert shard_reads.read_shard_schema(str(path)).metadata == {b"shard_id": b"abc"}
    whole = ipc.open_file(pa.BufferReader(data)).read_all()
    assert shard_reads.read_shard_columns(str(path), [*COLUMNS, "absent"]).equals(whole.select(COLUMNS))
    (tmp_path / "empty.arrow").write_bytes(b"")
    with pytest.raises(pa.ArrowInvalid):
        shard_reads.read_shard_schema(str(tmp_path / "empty.arrow"))
    with pytest.raises(FileNotFoundError):
        shard_reads.read_shard_schema(str(tmp_path / "gone.arrow"))
    # A local file's columns are read by pyarrow itself: the same refusals as the footer's.
    (tmp_path / "cut.arrow").write_bytes(data[:-100])
    for bad in ("cut.arrow", "empty.arrow"):
        with pytest.raises(pa.ArrowInvalid):
            shard_reads.read_shard_columns(str(tmp_path / bad), COLUMNS)
    with pytest.raises(FileNotFoundError):
        shard_reads.read_shard_columns(str(tmp_path / "gone.arrow"), COLUMNS)


def test_s3_footer_columns_json_and_refusals(s3_server, s3_bucket):
    client = boto3.client("s3", endpoint_url=s3_server)
    data = shard_bytes()
    for key, body in (("big.arrow", data), ("small.arrow", shard_bytes(rows=4, tokens=3)),
                      ("cut.arrow", data[:-100]), ("empty.arrow", b""), ("m.json", b'{"a": 1}')):
        client.put_object(Bucket=s3_bucket, Key=f"run/{key}", Body=body)
    uri = f"s3://{s3_bucket}/run"
    assert shard_reads.read_tail(f"{uri}/big.arrow", 10) == (data[-10:], len(data))
    assert shard_reads.read_shard_schema(f"{uri}/big.arrow").metadata == {b"shard_id": b"abc"}
    assert shard_reads.read_shard_schema(f"{uri}/small.arrow").metadata == {b"shard_id": b"abc"}  # smaller than a tail
    whole = ipc.open_file(pa.BufferReader(data)).read_all()
    assert shard_reads.read_shard_columns(f"{uri}/big.arrow", COLUMNS).equals(whole.select(COLUMNS))
    assert storage.read_json(f"{uri}/m.json") == {"a": 1}
    # A whole object of ~1 MB (pyarrow's input stream would read it in ~256 KB pieces; read_bytes opens it as
    # a file of known size): every byte, once.
    assert len(data) > 2 * 256 * 1024 and storage.read_bytes(f"{uri}/big.arrow") == data
    for bad in ("cut.arrow", "empty.arrow"):
        with pytest.raises(pa.ArrowInvalid):
            shard_reads.read_shard_schema(f"{uri}/{bad}")
    with pytest.raises(FileNotFoundError):
        shard_reads.read_shard_schema(f"{uri}/gone.arrow")
    with pytest.raises(FileNotFoundError):
        storage.read_json(f"{uri}/gone.json")


def test_one_s3_client_per_endpoint_and_credentials(monkeypatch):
    config = storage.StorageConfig(endpoint_url="http://127.0.0.1:9")
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "a")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "b")
    first = storage._s3_client(config)
    assert storage._s3_client(config) is first
    assert storage.resolve("s3://x/y", config)[0] is storage.resolve("s3://x/z", config)[0]
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "other")  # other credentials: another client, never the first's
    assert storage._s3_client(config) is not first
    assert storage._s3_client(storage.StorageConfig(endpoint_url="http://127.0.0.1:10")) is not first


def test_footer_schema_from_the_tail_alone():
    data = shard_bytes()
    whole = ipc.open_file(pa.BufferReader(data)).schema
    tail = data[-shard_reads.FOOTER_READ_BYTES:]
    assert shard_reads.footer_schema(tail, len(data)).equals(whole, check_metadata=True)
    assert shard_reads.footer_schema(data, len(data)).equals(whole, check_metadata=True)
    assert shard_reads.footer_schema(data[-20:], len(data)) is None  # the footer is longer than the tail: read more
    assert shard_reads.footer_schema(data[-1000:-5], len(data) - 5) is None  # no magic at the end: not a whole file
    with pytest.raises((pa.ArrowInvalid, OSError), match="[Ff]ooter"):  # the magic, garbage before it: as pyarrow
        shard_reads.footer_schema(b"\xff" * 1000 + (100).to_bytes(4, "little") + b"ARROW1", 10 ** 6)
