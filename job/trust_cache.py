"""What a run's files were found to say, kept so that a file already read is not read again.

At 20,000 shards on S3, reading every completion shard's footer and every stage-2 marker was 20,000-60,000 GETs per
command (a resume 70 s, `status` 200 s on a loaded 2-core machine). A listing already says, for free, each object's
size and ETag (the content's MD5 for a single-part upload; another value whenever the bytes change): a file whose
size and ETag are those recorded beside what it was found to say need not be read again.

- One cache per kind of file (`COMPLETIONS`, `MARKERS`), at `<output>/cache/<kind>.jsonz` (gzip'd JSON;
  job/layout.py), written only by that kind's writer under its writer lock's fence: stage 1 for the completion
  shards' footers, stage 2 for its markers. The readers (`status`, export, the notebook, `plan --from`) use it
  and never write it.
- Content, not names: an entry counts only when the listing's size AND ETag are the entry's (`Entries.get`). A
  shard regenerated, truncated or replaced under the same name has another ETag and is read again. Only what was
  found trusted is kept: a damaged shard has no entry and is read (and named) every time.
- The cache file is checked as a whole: it carries the SHA-256 of its entries; a file that does not read, or whose
  digest does not match, counts as no cache (every file is read, as without one).
- Local files have no ETag, so nothing is cached for them: a local footer read is ~0.2 ms.
"""

from __future__ import annotations

import gzip
import hashlib
import json

from job import layout, storage
from job.storage import StorageConfig

COMPLETIONS = "completions"
MARKERS = "markers"
VERSION = 1


class Entries:
    """{name: (size, ETag, value)} of one cache, as read; `get` is the one rule of when an entry counts."""

    def __init__(self, entries: dict[str, tuple[int, str, object]] | None = None):
        self.entries = dict(entries or {})
        self.changed = False

    def get(self, name: str, size: int, etag: str | None):
        """The value recorded for `name`, only if the file listed now has the size and ETag recorded with it; else
        None (never cached: no ETag; or stale: the file changed since)."""
        found = self.entries.get(name)
        if etag is None or found is None or found[0] != size or found[1] != etag:
            return None
        return found[2]

    def put(self, name: str, size: int, etag: str | None, value) -> None:
        """Record what a file of this size and ETag was found to say (nothing without an ETag)."""
        if etag is None or self.entries.get(name) == (size, etag, value):
            return
        self.entries[name] = (size, etag, value)
        self.changed = True

    def keep_only(self, names: set[str]) -> None:
        """Forget the entries of files no longer listed (moved aside, deleted)."""
        gone = [n for n in self.entries if n not in names]
        for n in gone:
            del self.entries[n]
        self.changed |= bool(gone)


def _digest(body: bytes) -> str:
    return hashlib.sha256(body).hexdigest()


def encode(kind: str, entries: Entries) -> bytes:
    body = json.dumps({n: list(e) for n, e in sorted(entries.entries.items())}, separators=(",", ":"),
                      sort_keys=True).encode()
    head = json.dumps({"version": VERSION, "kind": kind, "sha256": _digest(body)}, sort_keys=True).encode()
    return gzip.compress(head + b"\n" + body, compresslevel=5)


def decode(kind: str, data: bytes) -> Entries:
    """The entries of a cache file's bytes; empty when they do not read whole, are of another kind or version, or do
    not match their digest."""
    try:
        head, body = gzip.decompress(data).split(b"\n", 1)
        meta = json.loads(head)
        if meta.get("version") != VERSION or meta.get("kind") != kind or meta.get("sha256") != _digest(body):
            return Entries()
        return Entries({n: (int(e[0]), str(e[1]), e[2]) for n, e in json.loads(body).items()})
    except (OSError, EOFError, ValueError, TypeError, IndexError, KeyError):  # not gzip, not JSON, cut short
        return Entries()


def uri_of(run_uri: str, kind: str) -> str:
    return storage.join(run_uri, layout.trust_cache_name(kind))


def load(run_uri: str, kind: str, storage_config: StorageConfig | None = None) -> Entries:
    """The run's cache of `kind` (one GET on S3); empty for a local run, before it is first written, or when it does
    not check."""
    if not storage.is_s3(run_uri):
        return Entries()
    try:
        return decode(kind, storage.read_bytes(uri_of(run_uri, kind), storage_config))
    except FileNotFoundError:
        return Entries()


def save(run_uri: str, kind: str, entries: Entries, fence) -> bool:
    """Write the cache of `kind` (atomically, under `fence`: only its kind's writer calls this) when it changed.
    Returns whether it wrote."""
    if not entries.changed or not storage.is_s3(run_uri):
        return False
    fence.write_bytes(uri_of(run_uri, kind), encode(kind, entries))
    entries.changed = False
    return True
