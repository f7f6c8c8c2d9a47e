"""The writer lock of each stage, with fencing: one job writes one stage of one output at a time, and a job that
lost its lock commits nothing more.

`<output>/locks/<stage>.json` (job/layout.py) is a lease built on conditional writes:
- taken with a create-if-absent (S3 `If-None-Match: *`; locally a link, under a `flock`) or, when the previous
  holder released it, went stale or died, with a replace-if-unchanged (S3 `If-Match: <ETag>`): of two jobs
  starting at the same moment exactly one wins;
- every acquisition raises the lock's **epoch** by one (a release keeps the file and its epoch: the epoch only
  grows). The holder's (owner, epoch) is its fencing token;
- renewed every LOCK_HEARTBEAT_S with a replace-if-unchanged; judged stale by the storage's own clock (S3: the
  object's LastModified against the same response's Date), never by comparing two machines' clocks;
- a holder that learns at a renewal that its lock was taken interrupts its main thread and, if that does not end
  the process within LOST_GRACE_S (SIGINT ignored: a job started with `&`, under nohup, CI or a scheduler), exits
  the process;
- **every commit is fenced** (`Fence.guard`, handed to every actor): a completion shard, a stage-2 part or
  marker, run.json and the reports are committed only while the lock still holds the writer's (owner, epoch).
  Locally the check and the rename happen under the same `flock` as the lock's own replace, so a take-over and a
  stale commit cannot interleave. On S3 the check comes right before the one PUT that commits; a job that takes
  a live lock over waits TAKEOVER_SETTLE_S before it lists the output, so a commit checked just before the
  take-over has landed by then.

A lock is judged dead at once (no waiting for staleness) only when its holder ran on this very machine and
container (same hostname, boot id and pid namespace) and its process is gone or its pid now belongs to a process
started later. Containers repeat hostnames and pids; a boot id and a pid namespace they do not share.
"""

from __future__ import annotations

import _thread
import json
import os
import socket
import sys
import threading
import time
import uuid
from contextlib import contextmanager
from dataclasses import dataclass

from job import conditional, layout, storage
from job.runs import RunError

LOCK_HEARTBEAT_S = 30.0
LOCK_STALE_S = 120.0  # a lock not renewed for this long belongs to a dead driver
LOST_GRACE_S = 10.0  # after losing its lock, a driver whose main thread is not interrupted exits the process
TAKEOVER_SETTLE_S = 10.0  # S3: a commit checked just before a take-over lands within this (one PUT)
LOCK_LOST_EXIT_CODE = 75


class LockError(RunError):
    """Another job holds this stage's lock, or took it over from us."""


class FencedOut(LockError):
    """A commit refused: this writer's lock was taken over (its fencing token is no longer current)."""


# ---------------------------------------------------------------------------------------------------------------
# Which process holds a lock: identities that containers do not repeat
# ---------------------------------------------------------------------------------------------------------------


def _read(path: str) -> str | None:
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return None


def _process_start(pid: int) -> str | None:
    """The process's start time in clock ticks since boot (/proc/<pid>/stat field 22), None if there is no such
    process. With the boot id it names one process for good: a pid reused later has another start time."""
    stat = _read(f"/proc/{pid}/stat")
    if stat is None:
        return None
    return stat.rsplit(")", 1)[1].split()[19]  # fields after "(comm)": state is field 3, starttime field 22


def host_identity() -> dict:
    """This process, as a lock records it: hostname for people; boot id, pid namespace, pid and start time to
    decide whether the holder is gone."""
    try:
        pid_ns = os.readlink("/proc/self/ns/pid")
    except OSError:
        pid_ns = None
    return {"host": socket.gethostname(), "boot_id": _read("/proc/sys/kernel/random/boot_id"), "pid_ns": pid_ns,
            "pid": os.getpid(), "started": _process_start(os.getpid())}


def owner_is_dead(held: dict) -> bool:
    """True only when the holder ran on this machine, in this container (same host, boot id and pid namespace), and
    its process is gone or its pid now belongs to a later process. Anything else — another host, another
    container with the same hostname, a lock from before identities were recorded — is alive until stale."""
    me = host_identity()
    who = held.get("holder") or {}
    if not who or any(who.get(k) is None or who.get(k) != me[k] for k in ("host", "boot_id", "pid_ns")):
        return False
    started = _process_start(int(who.get("pid", -1)))
    return started is None or started != who.get("started")


# ---------------------------------------------------------------------------------------------------------------
# The fence every commit goes through, and the lock
# ---------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Fence:
    """A writer's fencing token: picklable, handed to every actor of the stage. `guard()` wraps a commit."""
    uri: str
    owner: str
    epoch: int
    storage_config: storage.StorageConfig

    def _store(self):
        store = getattr(self, "_cached", None)
        if store is None:
            store = conditional.conditional_object(self.uri, self.storage_config)
            object.__setattr__(self, "_cached", store)
        return store

    def _check(self, store) -> None:
        held = {}
        for attempt in range(max(1, self.storage_config.num_retries)):
            try:
                held = json.loads(store.body())  # (locally the caller holds the flock already)
                break
            except FileNotFoundError:
                break
            except Exception:  # S3 trouble (boto3 retried it already): again, as storage.with_retries would
                if attempt == max(1, self.storage_config.num_retries) - 1:
                    raise
                time.sleep(min(20.0, self.storage_config.retry_base_s * 2 ** attempt))
        if held.get("released") or held.get("owner") != self.owner or held.get("epoch") != self.epoch:
            now = "released" if held.get("released") else f"held by {held.get('owner')} (epoch {held.get('epoch')})"
            raise FencedOut(f"stopped: another job took over this stage's writer lock (it is {now}; this job had "
                            f"epoch {self.epoch}): this job commits nothing more. Every file committed so far is "
                            "whole; the job that holds the lock now continues the run.")

    def check(self) -> None:
        store = self._store()
        with store.exclusive():
            self._check(store)

    @contextmanager
    def guard(self):
        """`with fence.guard(): <commit>`: the commit happens only while this writer's token is current; locally
        no take-over can happen between the check and the commit."""
        store = self._store()
        with store.exclusive():
            self._check(store)
            yield

    # The one way a stage changes its run directory: every write, delete and move below commits under `guard`, so
    # a job whose lock was taken over changes nothing (tests/test_code_rules.py keeps the storage module's own
    # writers out of the stages).

    def write_bytes(self, uri: str, data: bytes) -> None:
        """`data` at `uri`, whole or not at all (storage.write_bytes_atomic), committed under the fence."""
        storage.write_bytes_atomic(uri, data, self.storage_config, self.guard)

    def write_ipc(self, uri: str, table) -> int:
        """`table` as an uncompressed Arrow IPC file, streamed (storage.write_ipc_atomic), committed under the fence;
        returns its size."""
        return storage.write_ipc_atomic(uri, table, self.storage_config, self.guard)

    def write_json(self, uri: str, obj) -> None:
        storage.write_json(uri, obj, self.storage_config, self.guard)

    def write_shard(self, uri: str, table, compression: str | None = "zstd") -> None:
        storage.write_shard(uri, table, self.storage_config, compression, self.guard)

    def delete(self, uri: str) -> None:
        with self.guard():
            storage.delete(uri, self.storage_config)

    def move(self, uri: str, to_uri: str) -> None:
        with self.guard():
            storage.move(uri, to_uri, self.storage_config)

    def clear_temp_files(self, uri: str) -> int:
        """Delete the temp files killed writers left under `uri` (local only: S3 writes leave none)."""
        with self.guard():
            return storage.remove_temp_files(uri)

    def __getstate__(self):
        return {"uri": self.uri, "owner": self.owner, "epoch": self.epoch, "storage_config": self.storage_config}

    def __setstate__(self, state):
        for k, v in state.items():
            object.__setattr__(self, k, v)


class WriterLock:
    """`with WriterLock(config, "generate") as held:` — see the module docstring; `held.fence` guards commits.
    `take_over` takes a lock another job holds (--take-lock: meant for a job that is dead; one that is alive
    commits nothing more and stops)."""

    def __init__(self, config, stage: str, take_over: bool = False):
        uri = storage.join(config.output, layout.lock_name(stage))
        self.uri, self.storage_config = uri, config.storage
        self.store = conditional.conditional_object(uri, config.storage)
        self.stage = stage
        self.take_over = take_over
        self.holder = host_identity()
        self.token = f"{self.holder['host']}:{self.holder['pid']}:{uuid.uuid4().hex[:8]}"
        self.epoch = 0
        self.etag: str | None = None
        self.lost: str | None = None
        self._last_renewal = 0.0
        self._stop = threading.Event()
        self._exited = threading.Event()
        self._thread: threading.Thread | None = None

    @property
    def fence(self) -> Fence:
        return Fence(self.uri, self.token, self.epoch, self.storage_config)

    def _body(self, **extra) -> bytes:
        return json.dumps({"owner": self.token, "epoch": self.epoch, "stage": self.stage, "holder": self.holder,
                           "heartbeat": time.time(), **extra}).encode()

    def __enter__(self):
        took_live = False
        for _ in range(5):  # a lock released or replaced between our create and our read: try again
            self.epoch = 1
            try:
                self.etag = self.store.create(self._body())
                break
            except conditional.Conflict:
                pass
            try:
                held, etag, age = self.store.read()
            except FileNotFoundError:
                continue
            self.epoch = int(held.get("epoch") or 0) + 1
            free = bool(held.get("released")) or age >= LOCK_STALE_S or owner_is_dead(held)
            if not free and not self.take_over:
                raise LockError(f"another job is writing to this output right now ({self.stage} by "
                                f"{held.get('owner')}, renewed {age:.0f} s ago). Wait for it to finish, or if it is "
                                f"dead, rerun in {LOCK_STALE_S - age:.0f} s (its lock goes stale) or pass "
                                "--take-lock.")
            try:
                self.etag = self.store.replace(self._body(), etag)
                took_live = not free
                break
            except conditional.Conflict:
                continue
        else:
            raise LockError("could not take this output's lock (it kept changing); is another job starting?")
        self._last_renewal = time.monotonic()
        if took_live and storage.is_s3(self.uri):
            print(f"lock: took over a live lock (epoch {self.epoch}); waiting {TAKEOVER_SETTLE_S:.0f} s for a commit "
                  "the previous holder may have had in flight", flush=True)
            time.sleep(TAKEOVER_SETTLE_S)
        self._thread = threading.Thread(target=self._beat, daemon=True, name="writer-lock")
        self._thread.start()
        return self

    def renew(self) -> None:
        """One renewal. A conditional-write conflict means another job holds the lock now: mark it lost."""
        try:
            self.etag = self.store.replace(self._body(), self.etag)
            self._last_renewal = time.monotonic()
        except conditional.Conflict:
            self.lost = "another job took over this stage's writer lock (--take-lock, or it judged ours stale)"
        except Exception:  # storage trouble: retried at the next beat, until the lease could have gone stale
            if time.monotonic() - self._last_renewal > LOCK_STALE_S - LOCK_HEARTBEAT_S:
                self.lost = (f"the writer lock could not be renewed for {LOCK_STALE_S - LOCK_HEARTBEAT_S:.0f} s, so "
                             "another job may take it")

    def _beat(self):
        while not self._stop.wait(LOCK_HEARTBEAT_S):
            self.renew()
            if self.lost and not self._stop.is_set():
                _thread.interrupt_main()  # the driver stops writing; __exit__ says why
                if not self._exited.wait(LOST_GRACE_S):
                    # SIGINT is ignored in this process (`&`, nohup, a scheduler): nothing else would stop it. Its
                    # actors commit nothing more (fenced); ending the driver ends them.
                    print(f"error: stopped: {self.lost}. This job commits nothing more and exits now "
                          f"(exit code {LOCK_LOST_EXIT_CODE}).", file=sys.stderr, flush=True)
                    os._exit(LOCK_LOST_EXIT_CODE)
                return

    def __exit__(self, exc_type, exc, tb):
        self._exited.set()
        self._stop.set()
        if self._thread:
            self._thread.join(timeout=5)
        if not self.lost:
            try:  # released, not deleted: the epoch stays with the lock and only grows
                self.store.replace(self._body(released=True), self.etag)
            except Exception:  # not ours any more (leave it to its holder), or storage trouble (it goes stale)
                pass
        if isinstance(exc, FencedOut):
            return False
        if self.lost and (exc_type is None or issubclass(exc_type, KeyboardInterrupt)):
            raise LockError(f"stopped: {self.lost}. Every file committed so far is whole; the job that holds the lock "
                            "now continues the run.") from None
        return False
