"""Exactly once under failure, with real Ray, real vLLM (CPU) and a moto S3 server:
driver killed (also mid-write), engine actor killed, engine process killed (EngineDeadError), engine stalled
(hang watchdog), transient and persistent S3 faults, a concurrent writer, and config drift on resume."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from pathlib import Path

import psutil
import pytest
import yaml
from conftest import DEMO_CONFIG, REPO, read_run, simple_prompts, write_prompts
from faulty_proxy import FaultyProxy

from job import storage
from job.config import load_config
from job.generate import run_generate
from job.generate.inputs import InputError
from job.lock import WriterLock
from job.runs import RunError
from job.storage import StorageError


def wait_for(condition, timeout_s: float, what: str):
    """The first truthy value of `condition()`. Act on that value, not on a second call: a second listing of
    processes races one that exits in between (CI saw an engine found by the wait and gone by the next listing)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if found := condition():
            return found
        time.sleep(0.2)
    raise TimeoutError(f"timed out waiting for {what}")


def processes(pattern: str, root: int | None = None) -> list[psutil.Process]:
    """Descendants of `root` (default: this test process, whose local Ray runs the job) matching `pattern`.
    Only our own tree: other jobs' engines on a shared machine are never touched."""
    found = []
    for p in psutil.Process(root or os.getpid()).children(recursive=True):
        try:
            if pattern in " ".join(p.cmdline()):
                found.append(p)
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            pass
    return found


def shards(run: Path) -> list[Path]:
    return sorted((run / "completions").glob("*.arrow")) if (run / "completions").exists() else []


def assert_exactly_once(output: str, rows: list[dict]):
    ids = read_run(output).column("id").to_pylist()
    assert Counter(ids) == Counter(str(r["id"]) for r in rows)


ROWS_PER_SHARD = 16


def small_config_file(tmp_path: Path, **generate) -> str:
    """configs/demo.yaml with small shards, so a run has many commit points to be killed between, and completions
    of at most 64 tokens: what is tested is which ids are written, not what they say (128 rows: 59.7 s with the
    demo's 512, 42.3 s with 64, one job alone on this 2-core machine)."""
    data = yaml.safe_load(Path(DEMO_CONFIG).read_text())
    data["generate"].update({"rows_per_shard": ROWS_PER_SHARD, **generate})
    data["generate"]["sampling"] = {**data["generate"]["sampling"], "max_tokens": 64}
    data["quality"]["canary_rows"] = 0
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(data))
    return str(path)


# ---------------------------------------------------------------------------------------------------------------
# Driver killed
# ---------------------------------------------------------------------------------------------------------------


def _start_job(cmd: list[str]) -> subprocess.Popen:
    # Writes pause 1.5 s between the temp file and the rename (tests/fault_injection), so the kill can land inside
    # a write.
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), str(REPO / "tests" / "fault_injection")]),
           "DATAGEN_TEST_WRITE_DELAY_S": "1.5"}
    log = open(Path(cmd[cmd.index("--output") + 1]).parent / "driver.log", "ab")  # read when a wait times out
    return subprocess.Popen(cmd, cwd=REPO, env=env, start_new_session=True, stdout=log, stderr=subprocess.STDOUT)


def _driver_log(run: Path) -> str:
    path = run.parent / "driver.log"
    return path.read_bytes().decode(errors="replace")[-4000:] if path.exists() else ""


def _kill_job(proc: subprocess.Popen) -> None:
    """SIGKILL the driver and the local Ray it started, and anything of the job that left its process group
    (nothing may keep writing)."""
    tree = psutil.Process(proc.pid).children(recursive=True)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    for p in tree:
        try:
            p.kill()
        except psutil.NoSuchProcess:
            pass
    time.sleep(1)


@pytest.mark.alone  # a driver with a local Ray of its own, killed twice (tests/suite_guard.py)
def test_driver_killed_at_engine_start_then_mid_write_then_rerun_finishes_exactly_once(tmp_path, capfd,
                                                                                        tiny_model_dir, local_ray):
    """The same command killed twice, as an operator's job dies: while its engine starts, then (run again) inside a
    shard write; the third run finishes. ~150 s: three engine starts (the first one cut short), which is what is
    tested (each kill takes its own local Ray and engine down with it); drift and changed input are then refused
    on the finished run without starting an engine."""
    rows = simple_prompts(128)
    inp = write_prompts(tmp_path / "in", rows, num_files=2)
    run = tmp_path / "run"
    cfg = small_config_file(tmp_path)
    cmd = [sys.executable, "-m", "job", "generate", "--config", cfg, "--model", tiny_model_dir, "--input", inp,
           "--output", str(run)]

    # 1. Killed while its engine starts: nothing is committed, whatever was begun.
    proc = _start_job(cmd)
    try:
        try:
            wait_for(lambda: processes("EngineCore", proc.pid), 300, "the engine to start")  # under load: minutes
        except TimeoutError as e:
            raise TimeoutError(f"{e}; the driver's log ends:\n{_driver_log(run)}") from None
    finally:
        _kill_job(proc)
    for p in shards(run):  # every visible shard is whole
        assert storage.read_shard(str(p)).num_rows > 0

    # 2. The same command again (it takes over the dead job's lock), killed inside a shard write.
    proc = _start_job(cmd)
    try:
        wait_for(lambda: shards(run) and list((run / "completions").glob(".*.tmp-*")), 240,
                 "a shard write in progress")
    finally:
        _kill_job(proc)
    done_before = {p.name: p.stat().st_mtime_ns for p in shards(run)}
    for p in shards(run):  # every visible shard is whole
        assert storage.read_shard(str(p)).num_rows > 0
    assert done_before, "the kill landed after the first shard"
    leftovers = list((run / "completions").glob(".*.tmp-*"))
    assert leftovers, "the kill landed inside a write"
    # A reader never sees the half-committed shard: dataset discovery skips the dot-file.
    assert sorted(read_run(str(run)).column("id").to_pylist()) == sorted(
        i for n in done_before for i in storage.read_shard(str(run / "completions" / n)).column("id").to_pylist())

    # 3. Run again, in this process: the rest, exactly once.
    config = load_config(cfg, model=tiny_model_dir, input=inp, output=str(run))
    capfd.readouterr()
    summary = run_generate(config)
    # Its engine is stopped in order when the job is done: vLLM's "AsyncLLM output_handler failed ... EngineDeadError"
    # traceback, which followed 2 of 14 successful runs when the engine process died before its actor, is not there.
    time.sleep(2)  # the actors' last log lines reach this process's output through Ray's log monitor
    printed = "".join(capfd.readouterr())
    assert "EngineDeadError" not in printed and "output_handler failed" not in printed, printed[-3000:]
    assert summary.num_rows_done_before == sum(storage.read_shard(str(run / "completions" / n)).num_rows
                                               for n in done_before)
    assert summary.num_rows == len(rows) - summary.num_rows_done_before, "done work is not redone"
    assert_exactly_once(str(run), rows)
    assert not list((run / "completions").glob(".*.tmp-*")), "the rerun removed the killed writer's temp file"
    for name, mtime in done_before.items():
        assert (run / "completions" / name).stat().st_mtime_ns == mtime, "a committed shard was rewritten"

    # Resuming with other sampling settings is refused, unless --allow-drift.
    with pytest.raises(RunError, match="different settings.*sampling"):
        run_generate(load_config(cfg, model=tiny_model_dir, input=inp, output=str(run),
                                 **{"generate.sampling": {"max_tokens": 512, "temperature": 0.5}}))
    config = load_config(cfg, model=tiny_model_dir, input=inp, output=str(run),
                         **{"generate.sampling": {"max_tokens": 512, "temperature": 0.5}})
    forced = run_generate(config, allow_drift=True)
    assert forced.already_complete  # (and the run's settings are now these)

    # The input re-uploaded unchanged (new modification times, same bytes): its ids are re-read, and it resumes.
    time.sleep(0.01)
    write_prompts(tmp_path / "in", rows, num_files=2)
    assert run_generate(config).already_complete
    # Rewritten with the same row count and other rows in its places (a reshuffle), or a file added: refused,
    # --allow-drift or not, naming the file. Resuming would have paired the old shards with other rows.
    write_prompts(tmp_path / "in", rows[:64] + rows[64:][::-1], num_files=2)
    for allow in (False, True):
        with pytest.raises(InputError, match=r"1 input file\(s\) changed since this run started: \S*part-001\.parquet"):
            run_generate(config, allow_drift=allow, take_lock=allow)
    write_prompts(tmp_path / "in", rows, num_files=2)
    write_prompts(tmp_path / "extra", simple_prompts(4, prefix="extra"))
    os.rename(tmp_path / "extra" / "part-000.parquet", tmp_path / "in" / "part-002.parquet")
    with pytest.raises(InputError, match=r"its files changed since this run started \(added: part-002\.parquet\)"):
        run_generate(config)
    assert_exactly_once(str(run), rows)


# ---------------------------------------------------------------------------------------------------------------
# Actor / engine failures inside a running job
# ---------------------------------------------------------------------------------------------------------------


def kill_every(pattern: str):
    """A fault: SIGKILL every process of ours matching `pattern`."""
    def fault():
        for p in wait_for(lambda: processes(pattern), 60, f"a {pattern} process"):
            p.kill()
    return fault


@pytest.mark.slow  # injected faults: four engine starts (the first and three replacements), ~3.5 min
def test_actor_killed_engine_killed_and_engine_hung_are_each_replaced_exactly_once(tmp_path, tiny_model_dir,
                                                                                    local_ray):
    """Three faults hit one running job, one after the other, each once the previous fault's replacement has written
    a shard: the engine actor SIGKILLed (Ray replaces it and retries its units); vLLM's EngineCore SIGKILLed (the
    actor sees EngineDeadError and must die, not retry on a dead engine); the engine stalled (SIGSTOP: its requests
    never finish, and the hang watchdog kills the actor). Every id exactly once at the end. One job instead of three
    saves two engine starts (~100 s); a fault whose handling fails still names itself: the wait for its replacement's
    shard times out with its name.

    The engine takes one shard's rows at a time (16 in flight, 2 units at the gate), so each fault lands while most
    shards are still to come. (With the demo's 256 rows in flight all rows ran at once, every shard landed within
    the same second, and a fault could find the engine already exiting at the end of the run: a failed CI run, stop
    23.)"""
    rows = simple_prompts(160)  # 10 shards of 16
    inp = write_prompts(tmp_path / "in", rows)
    run = tmp_path / "run"
    config = load_config(small_config_file(tmp_path, max_rows_in_flight=16, units_in_flight_per_engine=2,
                                           hang_timeout_s=8), model=tiny_model_dir, input=inp, output=str(run))
    stopped: list[psutil.Process] = []

    def stall_engine():  # a real stall: the engine process stops running, its requests never finish
        for p in wait_for(lambda: processes("EngineCore"), 60, "the engine process"):
            p.suspend()
            stopped.append(p)

    faults = [("engine actor killed", kill_every("ray::MapWorker")),
              ("engine process killed", kill_every("EngineCore")), ("engine hung", stall_engine)]
    errors, hit = [], []  # hit: (fault, shards written when it struck)

    def inject():
        try:
            seen, after = 0, "the job's start"
            for name, fault in faults:
                seen = wait_for(lambda: len(shards(run)) > seen and len(shards(run)), 300,
                                f"a shard written after {after}")
                fault()
                hit.append((name, len(shards(run))))
                seen, after = len(shards(run)), name
        except Exception as e:  # surfaced by the assertion below
            errors.append(e)

    t = threading.Thread(target=inject, daemon=True)
    t.start()
    try:
        summary = run_generate(config)
    finally:
        t.join(5)
        for p in stopped:
            try:
                p.kill()
            except psutil.NoSuchProcess:
                pass
    assert not errors, errors
    assert [name for name, _ in hit] == [name for name, _ in faults], hit
    for name, written in hit:
        assert written < len(rows) // ROWS_PER_SHARD, f"{name}: the fault hit a job that had written every shard"
    assert summary.num_rows == len(rows)
    assert_exactly_once(str(run), rows)


# ---------------------------------------------------------------------------------------------------------------
# Storage faults (a fault-injecting proxy in front of the moto server)
# ---------------------------------------------------------------------------------------------------------------


# Transient S3 faults (503s and dropped connections, retried) are injected into the session's shared run
# (tests/conftest.py `shared_run`), which test_generate checks for exactly once.


def test_persistent_s3_errors_fail_clearly_with_nothing_half_written(tmp_path, make_config, s3_server, s3_bucket,
                                                                      local_ray):
    """An S3 outage that outlasts the retries ends the job naming it, and leaves no object behind. What is under test
    is the shard write, not generation: `generate.regenerate: none` (the data's own answers, written by the same
    actors and the same writer) reaches the first write without an engine start (~50 s saved, issue 47)."""
    rows = [{"id": f"q{i:03d}", "messages": [{"role": "user", "content": f"What is {i} plus one?"},
                                             {"role": "assistant", "content": f"{i + 1}."}]} for i in range(32)]
    inp = write_prompts(tmp_path / "in", rows)
    port = int(s3_server.rsplit(":", 1)[1])
    with FaultyProxy(port, match=f"PUT /{s3_bucket}/run/completions", fail_always=True) as proxy:
        config = make_config(input=inp, output=f"s3://{s3_bucket}/run", **{
            "storage.endpoint_url": proxy.url, "storage.retry_base_s": 0.05, "storage.num_retries": 3,
            "generate.rows_per_shard": 16, "generate.regenerate": "none", "quality.canary_rows": 0})
        with pytest.raises(StorageError, match="still failing after 3 attempts"):
            run_generate(config)
    assert storage.list_files(f"s3://{s3_bucket}/run/completions", ".arrow") == []


# ---------------------------------------------------------------------------------------------------------------
# Two jobs, one output
# ---------------------------------------------------------------------------------------------------------------


def test_second_writer_is_refused(tmp_path, make_config):
    inp = write_prompts(tmp_path / "in", simple_prompts(4))
    config = make_config(input=inp, output=str(tmp_path / "run"))
    with WriterLock(config, "generate"):
        with pytest.raises(RunError, match="another job is writing to this output.*--take-lock"):
            run_generate(config)
        with WriterLock(config, "generate", take_over=True):  # --take-lock: for a lock whose job is dead
            pass
    from job.cli import main

    assert main(["generate", "--config", DEMO_CONFIG, "--input", inp, "--output", config.output, "--force"]) == 2


# ---------------------------------------------------------------------------------------------------------------
# A poison unit
# ---------------------------------------------------------------------------------------------------------------


@pytest.mark.slow  # an injected fault: two engine starts (the killed actor's and its replacement's), ~2 min
def test_a_unit_whose_actor_always_dies_is_written_as_errors_not_retried_for_ever(tmp_path, make_config, local_ray):
    """A poison unit: its actor is killed while it works on the unit, every time (what the OOM killer does to a
    row that needs more memory than the node has). Ray replaces the actor and retries the unit, which used to go
    on for ever. After `max_unit_attempts` attempts in this job the unit is written as error rows; the job ends.
    The kill is the only stand-in: real Ray, real vLLM engines, real storage."""
    rows = simple_prompts(6)
    inp = write_prompts(tmp_path / "in", rows)
    attempts_dir = tmp_path / "run" / "attempts"
    config = make_config(input=inp, output=str(tmp_path / "run"), **{
        "generate.max_unit_attempts": 1, "generate.rows_per_shard": 16, "quality.canary_rows": 0,
        "generate.sampling": {"max_tokens": 2048}})
    killed, stop = [], threading.Event()

    def killer():  # on the unit's first attempt (its count file says which), SIGKILL its actor
        while not stop.is_set() and not killed:
            counts = [json.loads(p.read_text())["attempts"] for p in attempts_dir.glob("*.json")
                      if p.stat().st_size] if attempts_dir.exists() else []
            if counts and counts[0] == len(killed) + 1:
                for p in processes("CompletionGenerator"):
                    p.kill()
                killed.append(counts[0])
            time.sleep(0.05)

    thread = threading.Thread(target=killer, daemon=True)
    thread.start()
    try:
        summary = run_generate(config)
    finally:
        stop.set()
        thread.join(5)
    assert killed == [1]
    assert summary.num_rows == len(rows)
    table = read_run(config.output)
    assert sorted(table.column("id").to_pylist()) == sorted(r["id"] for r in rows)
    errors = table.column("error").to_pylist()
    assert all(e and e.startswith("unit failed 1 times") for e in errors), errors
    assert not list(attempts_dir.glob("*.json")), "the count goes once the shard is written"
