"""Which storage errors are retried: pyarrow's own error texts for S3 failures (as its AWS SDK words them), and
the attempt count. The S3 behaviour end to end (a faulty proxy in front of moto) is in test_resume.py."""

from __future__ import annotations

import os

import pytest
from faulty_proxy import FaultyProxy

from job import storage
from job.storage import StorageConfig, StorageError


@pytest.mark.parametrize("text, transient", [
    ("When reading information for key 'runs/x/completions/f00000-r0000000500-0000000756.arrow' in bucket "
     "'b': AWS Error ACCESS_DENIED during HeadObject operation: Access Denied", False),
    ("When uploading part for key 'runs/x/f00000-r0000000503-0000000600.arrow' in bucket 'b': AWS Error "
     "NO_SUCH_UPLOAD during UploadPart operation", False),
    ("AWS Error UNKNOWN (HTTP status 503) during PutObject operation: Slow Down", True),
    ("When writing key 'a/b' in bucket 'b': AWS Error UNKNOWN (HTTP status 500) during PutObject", True),
    ("AWS Error SLOW_DOWN during PutObject operation: Please reduce your request rate.", True),
    ("AWS Error NETWORK_CONNECTION during GetObject operation: curlCode: 56, Failure when receiving data", True),
    ("When getting information for bucket 'b': AWS Error NO_SUCH_BUCKET during HeadBucket", False),
])
def test_transient_errors_are_told_from_user_errors(text, transient):
    assert storage._is_transient(OSError(text)) is transient


def test_zero_retries_still_tries_once_and_counts_attempts():
    calls = []

    def ok():
        calls.append(1)
        return 42

    assert storage.with_retries(ok, what="x", storage=StorageConfig(num_retries=0)) == 42 and len(calls) == 1

    def flaky():
        calls.append(1)
        raise OSError("AWS Error SLOW_DOWN during PutObject operation")

    calls.clear()
    with pytest.raises(StorageError, match="still failing after 3 attempts"):
        storage.with_retries(flaky, what="x", storage=StorageConfig(num_retries=3, retry_base_s=0.001))
    assert len(calls) == 3


def test_a_connection_closed_by_the_server_is_retried_not_a_crash(monkeypatch):
    """boto3's ConnectionClosedError (moto, or S3, closing a connection mid-request) has `response = None`: it must
    become a transient OSError that `with_retries` retries, not an AttributeError out of the error's parsing (seen
    once in CI, failing the session's shared run)."""
    from botocore.exceptions import ConnectionClosedError

    closed = {"n": 0}

    class Client:
        def get_object(self, **kwargs):
            closed["n"] += 1
            if closed["n"] == 1:
                raise ConnectionClosedError(endpoint_url="http://127.0.0.1:1/b/k")
            return {"Body": type("Body", (), {"read": lambda self: b"{}"})()}

    monkeypatch.setattr(storage, "_s3_client", lambda storage_config: Client())
    assert storage.read_json("s3://b/k", StorageConfig(num_retries=3, retry_base_s=0.001)) == {}
    assert closed["n"] == 2


@pytest.mark.parametrize("streamed", [False, True], ids=["bytes", "streamed-ipc"])
def test_a_failed_multipart_upload_leaves_no_object(s3_server, s3_bucket, streamed):
    """A 24 MB shard is a multipart upload; its second part fails every time (a fault injected by a proxy in front
    of the real moto server). Nothing may be committed under the shard's name: resume trusts names. The same for
    a stage-2 part streamed from its table (write_ipc_atomic)."""
    import boto3
    import pyarrow as pa

    from job.hidden_states.shards import table_to_ipc

    table = pa.table({"features": pa.array([os.urandom(4 * 1024 * 1024) for _ in range(6)], pa.binary())})
    data = table_to_ipc(table).to_pybytes() if streamed else os.urandom(24 * 1024 * 1024)

    def write(uri, config=None):
        if streamed:
            return storage.write_ipc_atomic(uri, table, config)
        return storage.write_bytes_atomic(uri, data, config)

    uri = f"s3://{s3_bucket}/run-{'ipc' if streamed else 'bytes'}/completions/f00000-r0-16.arrow"  # a shared bucket
    port = int(s3_server.rsplit(":", 1)[1])
    with FaultyProxy(port, match="partNumber=2", fail_always=True) as proxy:
        config = StorageConfig(endpoint_url=proxy.url, num_retries=2, retry_base_s=0.01)
        with pytest.raises(StorageError, match="still failing after 2 attempts"):
            write(uri, config)
        assert proxy.num_faults >= 2
    assert not storage.exists(uri)
    # The same write without the fault commits the whole object, size checked.
    write(uri)
    head = boto3.client("s3", endpoint_url=s3_server).head_object(Bucket=s3_bucket,
                                                                  Key=uri.split("/", 3)[3])
    assert head["ContentLength"] == len(data)


def test_a_streamed_stage2_part_is_table_to_ipc_s_bytes_and_commits_whole_or_not_at_all(tmp_path, s3_server,
                                                                                      s3_bucket):
    """write_ipc_atomic streams a part from its table's buffers (no file-sized copy): the file is byte for byte what
    table_to_ipc made before (so readers memory-map it as they did), locally and on S3 (a 24 MB part: a multipart
    upload), with its size returned; a commit the fence refuses leaves no file and no temp file."""
    import numpy as np
    import pyarrow as pa

    from job.hidden_states.shards import table_to_ipc

    rng = np.random.default_rng(0)
    table = pa.table({"id": [f"s{i}" for i in range(6)],
                      "features": pa.array([rng.bytes(4 * 1024 * 1024) for _ in range(6)], pa.binary())})
    expected = table_to_ipc(table).to_pybytes()
    local = str(tmp_path / "hidden_states" / "f00000-p0000.arrow")
    assert storage.write_ipc_atomic(local, table) == len(expected)
    assert open(local, "rb").read() == expected
    remote = f"s3://{s3_bucket}/run/hidden_states/f00000-p0000.arrow"
    assert storage.write_ipc_atomic(remote, table) == len(expected)
    assert storage.read_bytes(remote) == expected

    class Refused(Exception):
        pass

    def refuse():
        raise Refused("another writer holds the lock")

    refused = str(tmp_path / "hidden_states" / "f00001-p0000.arrow")
    with pytest.raises(Refused):
        storage.write_ipc_atomic(refused, table, guard=refuse)
    assert os.listdir(tmp_path / "hidden_states") == ["f00000-p0000.arrow"]
