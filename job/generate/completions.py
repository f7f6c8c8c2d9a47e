"""The run's completion shards as stage 1 keeps them: which count as done (the trusted ones; the others are moved
aside to quarantine/ and their rows generated again), and the caches it saves of them on S3 so that the next command
reads no footer (job/trust_cache.py) and the notebook no shard (job/rows_cache.py). Every change goes through the
stage's fence."""

from __future__ import annotations

import logging
import time

import pyarrow as pa

from job import layout, lock, scan, storage
from job.config import RunConfig

log = logging.getLogger("job.generate")

CACHE_REFRESH_S = 600.0
"""How often a running stage 1 adds the shards it wrote to the trust cache (S3): `status` during a run then reads
only the footers of the last ~10 minutes' shards, not of every shard this job wrote."""


def done_shard_names(config: RunConfig, fence: lock.Fence) -> list[str]:
    """Names of the completion shards that count as done: the trusted ones (scan.judge_completion_shards). One
    that cannot be trusted (truncated, zero bytes, not a completion shard) is moved aside to quarantine/ (never
    deleted) and its rows are generated again; one line names them."""
    found = scan.judge_completion_shards(config.output, config.storage)
    aside = storage.join(config.output, layout.QUARANTINE_DIR, layout.COMPLETIONS_DIR)
    line = found.problem_line(f"moved aside to {aside}/ and their rows generated again")
    if line:
        print(line, flush=True)
        stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
        completions = storage.join(config.output, layout.COMPLETIONS_DIR)
        for name in found.problems:
            fence.move(storage.join(completions, name), storage.join(aside, f"{name}.{stamp}"))
    # The footers read now are not read again by the next command (job/trust_cache.py): the trusted ones only.
    try:
        scan.remember_completion_shards(config.output, found, fence)
    except storage.StorageError as e:  # an optimization: the job goes on without it
        log.warning("the completion shards' trust cache could not be written (%s)", e)
    return [s.name for s in found.trusted]


def remember_shards(config: RunConfig, fence: lock.Fence) -> scan.CompletionShards | None:
    """The run's completion shards judged now (a footer read for each shard the trust cache does not hold) and
    saved as its cache (job/trust_cache.py), with their small columns (job/rows_cache.py). A cache that cannot be
    written now is no failure: it is an optimization, and the next save writes it. Returns the shards as judged
    (None: a local run, which keeps no cache, or no listing now)."""
    if not storage.is_s3(config.output):
        return None
    try:
        found = scan.judge_completion_shards(config.output, config.storage)
        scan.remember_completion_shards(config.output, found, fence)
    except storage.StorageError as e:
        log.warning("the completion shards' trust cache could not be written (%s); the next command reads their "
                    "footers", e)
        return None
    try:
        # And their small columns in one object (job/rows_cache.py): the notebook and the report read it, not every
        # shard. Only the shards written since the last save are read here: their bodies, not only their footers,
        # so a shard moved or damaged since the listing fails this save (never the run; a fenced-out job still stops).
        scan.remember_small_columns(config.output, found, fence)
    except (storage.StorageError, OSError, pa.ArrowException) as e:
        log.warning("the completion shards' rows cache could not be written (%s); the notebook and `report` read "
                    "every shard", e)
    return found
