"""The writer lock (job/lock.py) on a local directory and on a real S3 protocol server (moto, which implements
conditional writes): one winner among jobs starting together, refusal while held, take-over that stops the
previous holder at its next renewal, staleness by the storage's clock, release that never deletes another's lock."""

from __future__ import annotations

import threading
import time

import pytest

from job import lock
from job.config import RunConfig, StorageConfig
from job.lock import LockError, WriterLock


@pytest.fixture(params=["local", "s3"])
def output(request, tmp_path):
    if request.param == "local":
        return RunConfig(model="m", output=str(tmp_path / "run"))
    endpoint = request.getfixturevalue("s3_server")
    bucket = request.getfixturevalue("s3_bucket")
    return RunConfig(model="m", output=f"s3://{bucket}/runs/r1", storage=StorageConfig(endpoint_url=endpoint))


def test_one_winner_among_jobs_starting_together(output):
    results, barrier = [], threading.Barrier(8)

    def start():
        barrier.wait()
        try:
            held = WriterLock(output, "generate").__enter__()
            results.append(held)
        except LockError as e:
            results.append(e)

    threads = [threading.Thread(target=start) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    winners = [r for r in results if isinstance(r, WriterLock)]
    assert len(winners) == 1 and all("another job" in str(r) for r in results if r not in winners)
    winners[0].__exit__(None, None, None)
    with WriterLock(output, "generate"):  # released: the next job takes it
        pass


def test_take_over_stops_the_holder_and_its_release_leaves_the_new_lock(output):
    first = WriterLock(output, "generate").__enter__()
    with pytest.raises(LockError, match="another job is writing to this output.*--take-lock"):
        WriterLock(output, "generate").__enter__()
    second = WriterLock(output, "generate", take_over=True).__enter__()
    first.renew()
    assert first.lost and "took over" in first.lost
    with pytest.raises(LockError, match="stopped: another job took over"):
        first.__exit__(None, None, None)
    with pytest.raises(LockError, match="another job is writing"):  # the first job's exit left the new lock
        WriterLock(output, "hidden_states").__enter__()
    second.__exit__(None, None, None)
    WriterLock(output, "generate").__enter__().__exit__(None, None, None)


def test_a_lock_not_renewed_goes_stale_by_the_storages_clock(output, monkeypatch):
    monkeypatch.setattr(lock, "LOCK_HEARTBEAT_S", 600.0)  # no renewal while the test waits
    monkeypatch.setattr(lock, "LOCK_STALE_S", 1.5)
    first = WriterLock(output, "generate").__enter__()
    first.token = "another-host:1:1"  # as if held by a driver on another machine (not judged dead by its pid)
    first.renew()
    with pytest.raises(LockError):
        WriterLock(output, "generate").__enter__()
    time.sleep(2.5)
    second = WriterLock(output, "generate").__enter__()  # stale: taken without --take-lock
    first.renew()
    assert first.lost
    with pytest.raises(LockError, match="stopped"):
        first.__exit__(None, None, None)  # (its heartbeat thread stops with it)
    second.__exit__(None, None, None)


def test_a_holder_that_loses_its_lock_is_interrupted(output, monkeypatch):
    monkeypatch.setattr(lock, "LOCK_HEARTBEAT_S", 0.2)
    started = time.monotonic()
    taker = WriterLock(output, "generate", take_over=True)
    with pytest.raises(LockError, match="stopped: another job took over"):
        with WriterLock(output, "generate"):
            taker.__enter__()
            while time.monotonic() - started < 20:  # the job's work; interrupted at the next renewal
                time.sleep(0.05)
    assert time.monotonic() - started < 5
    taker.__exit__(None, None, None)
