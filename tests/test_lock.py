"""The writer lock (job/lock.py) on a local directory and on a real S3 protocol server (moto, which implements
conditional writes): one winner among jobs starting together, refusal while held, take-over that stops the
previous holder at its next renewal, staleness by the storage's clock, release that never deletes another's lock;
fencing (a writer whose lock was taken commits nothing), epochs that only grow, one lock per stage, a holder judged
dead only in its own container, and a holder that ignores SIGINT still stopped."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time

import pytest

from job import layout, lock, run_record, storage
from job.config import RunConfig, StorageConfig
from job.lock import FencedOut, LockError, WriterLock


@pytest.fixture(autouse=True)
def _short_settle(monkeypatch):
    monkeypatch.setattr(lock, "TAKEOVER_SETTLE_S", 0.1)  # S3 take-over's wait for in-flight commits (10 s)


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
        WriterLock(output, "generate").__enter__()
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
    # Python's own SIGINT handler, as a driver has it: the lock interrupts the main thread with SIGINT, and a handler
    # an earlier test in this worker left behind (Ray's, vLLM's) would swallow it, so the lock's 10-s grace would
    # end this worker with os._exit (seen in a fresh-clone .ci/run, 2026-12-06: "[gw1] node down", this test).
    monkeypatch.setattr(lock, "LOCK_HEARTBEAT_S", 0.2)
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        _interrupted_holder(output)
    finally:
        signal.signal(signal.SIGINT, previous)


def _interrupted_holder(output):
    started = time.monotonic()
    taker = WriterLock(output, "generate", take_over=True)
    work_finished = False
    with pytest.raises(LockError, match="stopped: another job took over"):
        with WriterLock(output, "generate"):
            taker.__enter__()
            while time.monotonic() - started < 120:  # the job's work; interrupted at the next renewal (0.2 s)
                time.sleep(0.05)
            work_finished = True
    # Interrupted inside its work, not refused at its end: a fact, not a timing (it used to assert < 5 s).
    assert not work_finished
    taker.__exit__(None, None, None)


def test_a_writer_whose_lock_was_taken_commits_nothing(output):
    """Fencing: every write, delete and move of a stage (a shard, a marker, run.json, a cache) goes through the holder's
    fence; after a take-over the old holder's are refused and change nothing, the new holder's go through."""
    first = WriterLock(output, "generate").__enter__()
    target = storage.join(output.output, "completions", "f00000-r0000000000-0000000004.arrow")
    other = storage.join(output.output, "completions", "f00000-r0000000004-0000000008.arrow")
    first.fence.write_bytes(target, b"first")  # current: committed
    first.fence.write_json(other, {"kept": True})
    second = WriterLock(output, "generate", take_over=True).__enter__()
    assert second.epoch == first.epoch + 1
    stale = first.fence
    with pytest.raises(FencedOut, match="another job took over.*commits nothing more"):
        stale.write_bytes(target, b"stale")
    for refused in (lambda: stale.delete(target), lambda: stale.move(other, target + ".moved"),
                    lambda: stale.write_json(other, {"kept": False}),
                    lambda: run_record.update(output, "generate", stale, status="running")):
        with pytest.raises(FencedOut):
            refused()
    assert storage.read_bytes(target, output.storage) == b"first"
    assert storage.read_json(other, output.storage) == {"kept": True}
    assert not storage.exists(target + ".moved", output.storage)
    assert not storage.exists(run_record.run_json_uri(output.output), output.storage)
    if not storage.is_s3(output.output):  # the refused commit's temp file is gone too
        assert [n for n in os.listdir(os.path.dirname(target)) if n.startswith(".")] == []
    second.fence.write_bytes(target, b"second")
    run_record.update(output, "generate", second.fence, status="running")
    assert storage.read_bytes(target, output.storage) == b"second"
    second.fence.delete(other)
    assert not storage.exists(other, output.storage)
    first.renew()
    with pytest.raises(LockError):
        first.__exit__(None, None, None)
    second.__exit__(None, None, None)


def test_the_epoch_only_grows_and_each_stage_has_its_own_lock(output):
    with WriterLock(output, "generate") as a:
        with WriterLock(output, "hidden_states") as b:  # stage 2 beside stage 1
            assert (a.epoch, b.epoch) == (1, 1)
    with WriterLock(output, "generate") as c:  # a released lock is taken without --take-lock, one epoch later
        assert c.epoch == 2
        stale = a.fence
        with pytest.raises(FencedOut):
            stale.check()
    held = storage.read_json(storage.join(output.output, layout.lock_name("generate")), output.storage)
    assert held["released"] and held["epoch"] == 2


def test_run_json_keeps_both_stages_updates_when_they_write_at_once(output):
    """Two stages update run.json at once, each field in its own write: none is lost (a lost update would put a field
    back to its default)."""
    barrier = threading.Barrier(2)
    writes = {"generate": {"status": "running", "error": "e", "canary_passed": True, "num_engines": 3,
                           "output_tokens_per_s": 1.5, "sampling": {"t": 1}, "max_num_seqs": {"cpu": 8},
                           "max_num_seqs_auto": {"cpu": {}}, "identity": {"seed": 1}},
              "hidden_states": {"status": "partial", "error": "f", "estimate": {"n": 1}, "identity": {"dtype": "x"}}}

    def write(stage_key):
        with WriterLock(output, stage_key) as held:
            barrier.wait()
            for name, value in writes[stage_key].items():
                run_record.update(output, stage_key, held.fence, **{name: value})

    threads = [threading.Thread(target=write, args=(k,)) for k in writes]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    record = run_record.read(output.output, output.storage)
    for key, fields in writes.items():
        assert {name: getattr(record.stages[key], name) for name in fields} == fields, key


def _fake_lock(output, **holder):
    """A lock as another process left it: this host's name, the given identity fields, renewed just now."""
    me = lock.host_identity()
    body = {"owner": f"{me['host']}:{holder.get('pid', me['pid'])}:other", "epoch": 7, "stage": "generate",
            "holder": {**me, **holder}, "heartbeat": time.time()}
    storage.write_bytes_atomic(storage.join(output.output, layout.lock_name("generate")),
                               json.dumps(body).encode(), output.storage)


def test_a_holder_is_judged_dead_only_in_its_own_container(output):
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()  # a pid that existed and is gone now
    # Another container with the same hostname (its own boot id / pid namespace): its pid means nothing here.
    _fake_lock(output, pid=gone.pid, boot_id="another-container-boot-id")
    with pytest.raises(LockError, match="another job is writing"):
        WriterLock(output, "generate").__enter__()
    _fake_lock(output, pid=gone.pid, pid_ns="pid:[1]")
    with pytest.raises(LockError, match="another job is writing"):
        WriterLock(output, "generate").__enter__()
    # This container, a pid reused by a later process (start time differs): dead, taken at once.
    _fake_lock(output, pid=os.getpid(), started="1")
    with WriterLock(output, "generate") as held:
        assert held.epoch == 8
    # This container, the process gone: dead, taken at once.
    _fake_lock(output, pid=gone.pid)
    with WriterLock(output, "generate") as held:
        assert held.epoch == 8


def test_a_holder_that_ignores_sigint_still_stops(tmp_path):
    """A driver started with `&` or under a scheduler ignores SIGINT, so interrupting its main thread does nothing:
    it must still stop (exit code 75) shortly after its lock is taken over."""
    output = str(tmp_path / "run")
    child = subprocess.Popen([sys.executable, "-c", textwrap.dedent(f"""
        import signal, sys, time
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        from job import lock
        from job.config import RunConfig
        lock.LOCK_HEARTBEAT_S, lock.LOST_GRACE_S = 0.2, 1.0
        with lock.WriterLock(RunConfig(model="m", output={output!r}), "generate"):
            print("held", flush=True)
            while True:
                time.sleep(0.05)
    """)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=os.path.dirname(os.path.dirname(__file__)))
    assert child.stdout.readline().strip() == "held"
    with WriterLock(RunConfig(model="m", output=output), "generate", take_over=True):
        code = child.wait(timeout=120)  # it exits by itself at its next renewal; the bound only ends a hang
    # Its own exit code and words say it stopped because it lost the lock (no timing asserted: it used to be < 10 s).
    stderr = child.stderr.read()
    assert code == lock.LOCK_LOST_EXIT_CODE, stderr
    assert "commits nothing more" in stderr
