"""Conditional operations on one small JSON object, on S3 (`If-None-Match` / `If-Match`) or in a local file under
a flock: the writer locks (job/lock.py) and run.json (job/runs.py), which two stages may update at once. A write
that finds the object other than expected raises `Conflict`; the caller reads again and decides."""

from __future__ import annotations

import datetime
import fcntl
import hashlib
import json
import os
import threading
import time
from contextlib import contextmanager
from email.utils import parsedate_to_datetime
from urllib.parse import urlparse

from job.storage import StorageConfig, is_s3, s3_endpoint, s3_region


class Conflict(Exception):
    """A conditional write failed: the object is not what we expected."""


class S3Object:
    def __init__(self, uri: str, config: StorageConfig):
        import boto3  # heavy: imported on use
        from botocore.config import Config  # heavy: imported on use

        parsed = urlparse(uri)
        self.bucket, self.key = parsed.netloc, parsed.path.lstrip("/")
        # As many attempts for throttling (503 SlowDown), 5xx and dropped connections as the data path gets
        # (storage.num_retries): botocore's default of 3 failed run.json's update at the canary once in a CI run,
        # through the test proxy that faults ~17 % of requests while the engines write.
        self.client = boto3.client("s3", endpoint_url=s3_endpoint(config), region_name=s3_region(config),
                                   config=Config(retries={"max_attempts": max(1, config.num_retries),
                                                          "mode": "standard"}))

    def _call(self, method: str, **kwargs):
        from botocore.exceptions import ClientError  # heavy: imported on use

        try:
            return getattr(self.client, method)(Bucket=self.bucket, Key=self.key, **kwargs)
        except ClientError as e:
            code = e.response.get("Error", {}).get("Code", "")
            if code in ("PreconditionFailed", "412", "ConditionalRequestConflict", "409"):
                raise Conflict(code) from None
            if code in ("NoSuchKey", "404"):
                raise FileNotFoundError(self.key) from None
            raise

    @contextmanager
    def exclusive(self):
        yield  # S3's conditional writes are atomic by themselves

    def create(self, body: bytes) -> str:
        return self._call("put_object", Body=body, IfNoneMatch="*")["ETag"]

    def replace(self, body: bytes, etag: str) -> str:
        return self._call("put_object", Body=body, IfMatch=etag)["ETag"]

    def body(self) -> bytes:
        return self._call("get_object")["Body"].read()

    def read(self) -> tuple[dict, str, float]:
        """(content, etag, age in seconds by the server's clock)."""
        r = self._call("get_object")
        server_now = parsedate_to_datetime(r["ResponseMetadata"]["HTTPHeaders"]["date"])
        if server_now.tzinfo is None:  # HTTP dates are GMT; a proxy may drop the zone name
            server_now = server_now.replace(tzinfo=datetime.timezone.utc)
        return json.loads(r["Body"].read()), r["ETag"], (server_now - r["LastModified"]).total_seconds()


class LocalObject:
    """The same operations on a local file. Each one holds an exclusive `flock` on a sidecar file, so a check and
    the write that depends on it are one step for every process of this machine (and of an NFS v4 mount)."""

    def __init__(self, path: str):
        self.path = path
        head, tail = os.path.split(path)
        self.flock_path = os.path.join(head, f".{tail}.flock")  # a dot-file: never listed as output

    @contextmanager
    def exclusive(self):
        os.makedirs(os.path.dirname(self.path), exist_ok=True)
        with open(self.flock_path, "a") as f:
            fcntl.flock(f, fcntl.LOCK_EX)  # released when the file closes, also if this process dies
            yield

    @staticmethod
    def _etag(body: bytes) -> str:
        return hashlib.sha256(body).hexdigest()

    def body(self) -> bytes:
        with open(self.path, "rb") as f:
            return f.read()

    def _write(self, body: bytes) -> None:
        head, tail = os.path.split(self.path)
        tmp = os.path.join(head, f".{tail}.tmp-{os.getpid()}-{threading.get_ident()}")  # a dot-file: never listed
        with open(tmp, "wb") as f:
            f.write(body)
        os.replace(tmp, self.path)

    def create(self, body: bytes) -> str:
        with self.exclusive():
            if os.path.exists(self.path):
                raise Conflict("exists")
            self._write(body)
        return self._etag(body)

    def replace(self, body: bytes, etag: str) -> str:
        with self.exclusive():
            try:
                if self._etag(self.body()) != etag:
                    raise Conflict("changed")
            except FileNotFoundError:
                raise Conflict("gone") from None
            self._write(body)
        return self._etag(body)

    def read(self) -> tuple[dict, str, float]:
        with self.exclusive():
            body = self.body()
            age = time.time() - os.path.getmtime(self.path)
        return json.loads(body), self._etag(body), age


def conditional_object(uri: str, config: StorageConfig):
    return S3Object(uri, config) if is_s3(uri) else LocalObject(os.path.abspath(uri))
