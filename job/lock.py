"""The writer lock: one job writes one output at a time.

`<output>/lock.json` is a lease with fencing, built on conditional writes:
- taken with a create-if-absent (S3 `If-None-Match: *`; locally `O_CREAT | O_EXCL`): of two jobs starting at the
  same moment exactly one wins;
- renewed every LOCK_HEARTBEAT_S with a replace-if-unchanged (S3 `If-Match: <our ETag>`): a job whose lock was
  taken over learns it at its next renewal and stops (its main thread is interrupted), instead of writing on;
- judged stale by the storage's own clock (S3: the object's LastModified against the same response's Date), never
  by comparing two machines' clocks;
- released with a delete-if-unchanged, so a job never deletes a lock another job holds now.

Two writers used to cut different unit boundaries and write every remaining row twice under different names;
with fencing the second writer is refused, or the first one stops.
"""

from __future__ import annotations

import _thread
import hashlib
import json
import os
import socket
import threading
import time
from email.utils import parsedate_to_datetime
from urllib.parse import urlparse

from job import storage
from job.config import RunConfig
from job.runs import RunError

LOCK_NAME = "lock.json"
LOCK_HEARTBEAT_S = 30.0
LOCK_STALE_S = 120.0  # a lock not renewed for this long belongs to a dead driver


class LockError(RunError):
    """Another job holds this output's lock, or took it over from us."""


class _Conflict(Exception):
    """A conditional write or delete failed: the lock is not what we expected."""


class _S3Lock:
    def __init__(self, uri: str, config: storage.StorageConfig):
        import boto3

        parsed = urlparse(uri)
        self.bucket, self.key = parsed.netloc, parsed.path.lstrip("/")
        self.client = boto3.client("s3", endpoint_url=storage.s3_endpoint(config),
                                   region_name=storage.s3_region(config))

    def _call(self, method: str, **kwargs):
        from botocore.exceptions import ClientError

        try:
            return getattr(self.client, method)(Bucket=self.bucket, Key=self.key, **kwargs)
        except ClientError as e:
            code = e.response.get("Error", {}).get("Code", "")
            if code in ("PreconditionFailed", "412", "ConditionalRequestConflict", "409"):
                raise _Conflict(code) from None
            if code in ("NoSuchKey", "404"):
                raise FileNotFoundError(self.key) from None
            raise

    def create(self, body: bytes) -> str:
        return self._call("put_object", Body=body, IfNoneMatch="*")["ETag"]

    def replace(self, body: bytes, etag: str) -> str:
        return self._call("put_object", Body=body, IfMatch=etag)["ETag"]

    def read(self) -> tuple[dict, str, float]:
        """(content, etag, age in seconds by the server's clock)."""
        r = self._call("get_object")
        server_now = parsedate_to_datetime(r["ResponseMetadata"]["HTTPHeaders"]["date"])
        return json.loads(r["Body"].read()), r["ETag"], (server_now - r["LastModified"]).total_seconds()

    def delete(self, etag: str) -> None:
        self._call("delete_object", IfMatch=etag)


class _LocalLock:
    """The same operations on a local file (one machine: its clock is the storage's clock)."""

    def __init__(self, path: str):
        self.path = path

    @staticmethod
    def _etag(body: bytes) -> str:
        return hashlib.sha256(body).hexdigest()

    def create(self, body: bytes) -> str:
        os.makedirs(os.path.dirname(self.path), exist_ok=True)
        tmp = f"{self.path}.tmp-{os.getpid()}-{threading.get_ident()}"
        with open(tmp, "wb") as f:
            f.write(body)
        try:  # link: create-if-absent with the whole content at once (a reader never sees an empty lock)
            os.link(tmp, self.path)
        except FileExistsError:
            raise _Conflict("exists") from None
        finally:
            os.remove(tmp)
        return self._etag(body)

    def replace(self, body: bytes, etag: str) -> str:
        try:
            with open(self.path, "rb") as f:
                if self._etag(f.read()) != etag:
                    raise _Conflict("changed")
        except FileNotFoundError:
            raise _Conflict("gone") from None
        tmp = f"{self.path}.tmp-{os.getpid()}-{threading.get_ident()}"
        with open(tmp, "wb") as f:
            f.write(body)
        os.replace(tmp, self.path)
        return self._etag(body)

    def read(self) -> tuple[dict, str, float]:
        with open(self.path, "rb") as f:
            body = f.read()
        return json.loads(body), self._etag(body), time.time() - os.path.getmtime(self.path)

    def delete(self, etag: str) -> None:
        try:
            with open(self.path, "rb") as f:
                if self._etag(f.read()) != etag:
                    raise _Conflict("changed")
            os.remove(self.path)
        except FileNotFoundError:
            pass


def _owner_is_dead(owner: str) -> bool:
    """True when the lock was taken on this host by a process that no longer exists (a killed driver rerun on
    the same machine resumes at once instead of waiting for the lock to go stale)."""
    host, _, rest = owner.partition(":")
    pid = rest.partition(":")[0]
    if host != socket.gethostname() or not pid.isdigit():
        return False
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        return False
    return False


class WriterLock:
    """`with WriterLock(config, "generate"):` — see the module docstring. `take_over` takes a lock another job
    holds (--take-lock: only when that job is dead); that job then stops at its next renewal."""

    def __init__(self, config: RunConfig, stage: str, take_over: bool = False):
        uri = storage.join(config.output, LOCK_NAME)
        self.store = _S3Lock(uri, config.storage) if storage.is_s3(uri) else _LocalLock(os.path.abspath(uri))
        self.stage = stage
        self.take_over = take_over
        self.token = f"{socket.gethostname()}:{os.getpid()}:{time.time_ns()}"
        self.etag: str | None = None
        self.lost: str | None = None
        self._last_renewal = 0.0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def _body(self) -> bytes:
        return json.dumps({"owner": self.token, "stage": self.stage, "heartbeat": time.time()}).encode()

    def __enter__(self):
        for _ in range(3):  # a lock released between our create and our read: try again
            try:
                self.etag = self.store.create(self._body())
                break
            except _Conflict:
                pass
            try:
                held, etag, age = self.store.read()
            except FileNotFoundError:
                continue
            if not self.take_over and age < LOCK_STALE_S and not _owner_is_dead(str(held.get("owner", ""))):
                raise LockError(f"another job is writing to this output right now ({held.get('stage')} by "
                                f"{held.get('owner')}, renewed {age:.0f} s ago). Wait for it to finish, or if it is "
                                f"dead, rerun in {LOCK_STALE_S - age:.0f} s (its lock goes stale) or pass "
                                "--take-lock.")
            try:
                self.etag = self.store.replace(self._body(), etag)
                break
            except _Conflict:
                raise LockError("another job took this output's lock at the same moment; run `status` and retry "
                                "if that job is not running") from None
        else:
            raise LockError("could not take this output's lock (it kept changing); is another job starting?")
        self._last_renewal = time.monotonic()
        self._thread = threading.Thread(target=self._beat, daemon=True, name="writer-lock")
        self._thread.start()
        return self

    def renew(self) -> None:
        """One renewal. A conditional-write conflict means another job holds the lock now: mark it lost."""
        try:
            self.etag = self.store.replace(self._body(), self.etag)
            self._last_renewal = time.monotonic()
        except _Conflict:
            self.lost = "another job took over this output's writer lock (--take-lock, or it judged ours stale)"
        except Exception:  # storage trouble: retried at the next beat, until the lease could have gone stale
            if time.monotonic() - self._last_renewal > LOCK_STALE_S - LOCK_HEARTBEAT_S:
                self.lost = (f"the writer lock could not be renewed for {LOCK_STALE_S - LOCK_HEARTBEAT_S:.0f} s, so "
                             "another job may take it")

    def _beat(self):
        while not self._stop.wait(LOCK_HEARTBEAT_S):
            self.renew()
            if self.lost and not self._stop.is_set():
                _thread.interrupt_main()  # the driver stops writing; __exit__ says why
                return

    def __exit__(self, exc_type, exc, tb):
        self._stop.set()
        if self._thread:
            self._thread.join(timeout=5)
        if not self.lost:
            try:
                self.store.delete(self.etag)
            except _Conflict:  # not ours any more: leave it to its holder
                pass
            except Exception:  # it goes stale by itself
                pass
        if self.lost and (exc_type is None or issubclass(exc_type, KeyboardInterrupt)):
            raise LockError(f"stopped: {self.lost}. Every shard written so far is whole; the job that holds the lock "
                            "now continues the run.") from None
        return False
