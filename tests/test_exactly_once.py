"""Exactly once beyond crashes (issue 27), as an operator meets it, with real Ray, the real vLLM CPU engine, the
tiny model and moto: a live job taken over (its SIGINT ignored), completion shards truncated, emptied and
regenerated under stage 2's feet, stage 2 beside stage 1, input changed in place with size and time kept, output
ids that would collide, and a Ray that cannot start. (Host identity in containers: tests/test_lock.py.)"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import yaml
from conftest import (
    DEMO_CONFIG,
    REPO,
    SHARED_ROWS_PER_SHARD,
    check_completions,
    read_run,
    simple_prompts,
    write_prompts,
)

from job import layout, storage
from job.config import load_config


def cli(*args: str, env: dict | None = None, timeout: float = 600) -> subprocess.CompletedProcess:
    """`python -m job ...` as a user runs it."""
    return subprocess.run([sys.executable, "-m", "job", *args], cwd=REPO, capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": str(REPO), **(env or {})}, timeout=timeout)


def config_file(tmp_path: Path, name: str, **generate) -> str:
    data = yaml.safe_load(Path(DEMO_CONFIG).read_text())
    data["generate"].update(generate)
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(data))
    return str(path)


def completion_ids(run: Path) -> Counter:
    return Counter(read_run(str(run)).column("id").to_pylist())


# ---------------------------------------------------------------------------------------------------------------
# 1. A live job taken over
# ---------------------------------------------------------------------------------------------------------------


@pytest.mark.slow  # two drivers, each with its own local Ray and engine, one taking over from the other (~2 min)
@pytest.mark.alone  # two drivers, each with a local Ray of its own (tests/suite_guard.py)
def test_a_live_job_taken_over_commits_nothing_more_and_every_id_is_written_once(tmp_path, tiny_model_dir):
    """Driver A runs in the background with SIGINT ignored (as under `&`, nohup or a scheduler) and commits its
    shards one small unit at a time; driver B takes its lock over with --take-lock and cuts the rest into other,
    larger units. Before fencing, A's engines kept committing: 302 rows for 160 ids. Now A's next commit is refused,
    A stops, and every id is in the output exactly once."""
    n = 160
    inp = write_prompts(tmp_path / "in", simple_prompts(n))
    out = tmp_path / "run"
    slow = config_file(tmp_path, "slow", rows_per_shard=4, units_in_flight_per_engine=1)
    fast = config_file(tmp_path, "fast", rows_per_shard=16, units_in_flight_per_engine=8)
    common = ["--model", tiny_model_dir, "--input", inp, "--output", str(out), "--no-canary"]
    log_a = open(tmp_path / "a.log", "w")
    a = subprocess.Popen([sys.executable, "-m", "job", "generate", "--config", slow, *common], cwd=REPO,
                         env={**os.environ, "PYTHONPATH": str(REPO)}, stdout=log_a, stderr=subprocess.STDOUT,
                         preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN), start_new_session=True)
    try:
        deadline = time.monotonic() + 300
        while not list((out / "completions").glob("*.arrow")):
            assert a.poll() is None, (tmp_path / "a.log").read_text()[-3000:]
            assert time.monotonic() < deadline, "driver A wrote no shard in 300 s"
            time.sleep(0.5)
        b = cli("generate", "--config", fast, *common, "--take-lock")
        assert b.returncode == 0, b.stderr[-3000:]
        code = a.wait(timeout=120)
    finally:
        if a.poll() is None:
            os.killpg(a.pid, signal.SIGKILL)
        log_a.close()
    text_a = (tmp_path / "a.log").read_text()
    assert code != 0 and "another job took over this stage's writer lock" in text_a, text_a[-3000:]
    ids = completion_ids(out)
    assert ids == Counter(f"p{i:04d}" for i in range(n)), {k: v for k, v in ids.items() if v != 1}
    sizes = Counter(stop - start for _, start, stop in
                    (layout.parse_completion_shard_name(p.name) for p in (out / "completions").glob("*.arrow")))
    assert sizes[4] >= 1, "A committed before the take-over"
    assert "already done" in b.stdout and sizes[4] * 4 + sum(k * v for k, v in sizes.items() if k != 4) == n
    st = json.loads(cli("status", str(out), "--json").stdout)
    assert st["rows_done"] == n and not st["holes"]


# ---------------------------------------------------------------------------------------------------------------
# 2 + 3 + 5. Shards truncated, emptied and regenerated; stage 2 beside stage 1
# ---------------------------------------------------------------------------------------------------------------


def _hidden_state_rows(run: Path) -> dict[str, list[int]]:
    """Every hidden-state sample that counts (stage 2's done rule): id → input ids."""
    from job import scan

    rows = {}
    for uri, _ in scan.done_hidden_state_parts(str(run)):
        t = storage.read_shard(uri).select(["id", "input_ids"])
        for i, ids in zip(t.column("id").to_pylist(), t.column("input_ids").to_pylist()):
            assert i not in rows, f"{i} has hidden states twice"
            rows[i] = ids
    return rows


@pytest.mark.slow  # a stage-1 rerun (an engine start) and a stage-2 rerun on a copy of the shared run (~90 s)
def test_damaged_and_regenerated_shards_get_their_rows_and_hidden_states_made_again(shared_run, tmp_path,
                                                                                      s3_server, tokenizer, capsys):
    from job.generate import run_generate
    from job.hidden_states import run_hidden_states
    from job.lock import WriterLock

    run = tmp_path / "run"
    shutil.copytree(shared_run.full, run)
    shards = sorted((run / "completions").glob("*.arrow"))
    # Three shards with an intact one between each two: the rerun cuts each one's rows into a unit of the same name
    # (a shard regenerated under its old name). Neighbours would be re-cut together into other names.
    truncated, emptied, regenerated = shards[0], shards[2], shards[4]
    truncated_bytes = truncated.read_bytes()[:len(truncated.read_bytes()) // 2]
    truncated.write_bytes(truncated_bytes)
    emptied.write_bytes(b"")
    regenerated.unlink()  # stage 1 writes it again: new content under the old name, stage 2's marker still there

    # status and report name the damaged shards, by file, in one line each, and count the rest.
    st = cli("status", str(run))
    assert st.returncode == 0, st.stderr
    (line,) = [x for x in st.stdout.splitlines() if x.startswith("damaged")]
    assert truncated.name in line and emptied.name in line and "zero bytes" in line and "truncated?" in line
    rep = cli("report", str(run))
    assert rep.returncode == 0 and "Traceback" not in rep.stderr, rep.stderr
    assert any(truncated.name in x and emptied.name in x for x in rep.stdout.splitlines())

    # Stage 1 again: the damaged shards are moved aside (kept, never deleted) and their rows generated again.
    config = load_config(DEMO_CONFIG, **_overrides(shared_run, run, s3_server))
    capsys.readouterr()
    run_generate(config)
    out = capsys.readouterr().out
    assert "2 completion shard(s) cannot be read whole" in out and "moved aside" in out, out
    aside = sorted((run / layout.QUARANTINE_DIR / layout.COMPLETIONS_DIR).iterdir())
    assert [p.name.split(".arrow")[0] + ".arrow" for p in aside] == sorted([truncated.name, emptied.name])
    assert {p.read_bytes() for p in aside} == {truncated_bytes, b""}
    check_completions(read_run(str(run)), tokenizer, shared_run.rows)  # every id exactly once

    # Stage 2 again, while stage 1 holds its own lock (stage 2 beside stage 1): the three shards with new content
    # get their hidden states again; nothing made from the old content is left counted.
    stage2 = load_config(DEMO_CONFIG, model=shared_run.model, output=str(run))
    with WriterLock(config, "generate"):
        run_hidden_states(stage2)
    out = capsys.readouterr().out
    assert "3 completion shard(s) changed since their hidden states were made" in out, out
    completions = read_run(str(run))
    expected = {i: (p or []) + (o or []) for i, p, o, e in zip(
        completions.column("id").to_pylist(), completions.column("prompt_token_ids").to_pylist(),
        completions.column("output_token_ids").to_pylist(), completions.column("error").to_pylist()) if e is None}
    hidden = _hidden_state_rows(run)
    assert set(hidden) <= set(expected)
    mismatched = [i for i, ids in hidden.items() if ids != expected[i][:len(ids)]]
    assert not mismatched, f"{len(mismatched)} samples no longer match their completion: {mismatched[:5]}"
    st = json.loads(cli("status", str(run), "--json").stdout)
    hs = st["hidden_states"]
    assert not st["unreadable_shards"] and hs["rows_to_do"] == 0 and not hs["completion_shards_changed"], hs


def _overrides(shared_run, run: Path, endpoint: str) -> dict:
    """The shared run's stage-1 settings, for a rerun into a local copy of it (its input stays on moto)."""
    return {"model": shared_run.model, "input": shared_run.input_uri, "output": str(run),
            "limit": shared_run.config.limit, "storage.endpoint_url": endpoint,
            "generate.rows_per_shard": SHARED_ROWS_PER_SHARD, "quality.canary_rows": 16,
            "generate.hang_timeout_s": 0}


# ---------------------------------------------------------------------------------------------------------------
# 6 + 8. Input changed in place; a Ray that cannot start; a path that is not a run
# ---------------------------------------------------------------------------------------------------------------


def _write_uncompressed(path: Path, rows: list[dict]) -> None:
    pq.write_table(pa.Table.from_pylist(rows), path, compression="none")


def test_changed_input_is_refused_by_content_and_a_ray_that_cannot_start_leaves_the_run_as_it_was(tmp_path,
                                                                                                  tiny_model_dir):
    """A first start whose Ray cannot start (RAY_TMPDIR on a read-only filesystem): one line, exit 2, the lock
    released, run.json "failed", nothing generated. Its run.json recorded the input; then the input changes in place
    with size and modification time kept — rows reordered, one prompt's text edited — and each change is refused
    by name before any work starts. The restored input is accepted again."""
    rows = [{"id": f"q{i:03d}", "prompt": f"Question number {i:03d}?"} for i in range(40)]
    inp = tmp_path / "in"
    inp.mkdir()
    first, second = inp / "part-000.parquet", inp / "part-001.parquet"
    _write_uncompressed(first, rows[:20])
    _write_uncompressed(second, rows[20:])
    out = tmp_path / "run"
    no_ray = {"RAY_TMPDIR": "/proc/no-such-dir"}
    args = ["generate", "--config", DEMO_CONFIG, "--model", tiny_model_dir, "--input", str(inp), "--output",
            str(out), "--no-canary"]

    def attempt() -> str:
        proc = cli(*args, env=no_ray, timeout=300)
        assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
        return proc.stderr.strip().splitlines()[-1]

    last = attempt()
    assert last.startswith("error: could not start or join Ray") and "run directory is as it was" in last, last
    run = json.loads((out / "run.json").read_text())
    assert run["generate"]["status"] == "failed" and "could not start" in run["generate"]["error"]
    lock = json.loads((out / layout.lock_name("generate")).read_text())
    assert lock["released"], lock
    assert not list(out.glob("completions/*.arrow"))

    def changed_in_place(path: Path, new_rows: list[dict]) -> None:
        stat = path.stat()
        _write_uncompressed(path, new_rows)
        assert path.stat().st_size == stat.st_size  # the change the old check could not see
        os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns))

    original_first, original_second = first.read_bytes(), second.read_bytes()
    first_stat = first.stat()
    changed_in_place(first, rows[:20][::-1])  # reordered
    last = attempt()
    assert "1 input file(s) changed since this run started" in last and "part-000.parquet" in last and \
        "other content" in last, last
    first.write_bytes(original_first)
    os.utime(first, ns=(first_stat.st_atime_ns, first_stat.st_mtime_ns))
    changed_in_place(second, [{**r, "prompt": r["prompt"].replace("Question", "Questiom")} if r["id"] == "q025"
                              else r for r in rows[20:]])  # one prompt edited: same ids, same size
    last = attempt()
    assert "part-001.parquet" in last and "part-000" not in last and "other content" in last, last
    second.write_bytes(original_second)
    assert attempt().startswith("error: could not start or join Ray")  # restored: past the input check again


def test_report_and_status_on_a_path_that_is_not_a_run_exit_non_zero_in_one_line(tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    plain = tmp_path / "file.txt"
    plain.write_text("not a run")
    for command in ("report", "status"):
        for path in (empty, plain):
            proc = cli(command, str(path))
            assert proc.returncode == 2, (command, path, proc.stdout, proc.stderr)
            lines = proc.stderr.strip().splitlines()
            assert len(lines) == 1 and "not a run directory" in lines[0], proc.stderr


# ---------------------------------------------------------------------------------------------------------------
# 4. Output ids that would collide
# ---------------------------------------------------------------------------------------------------------------


def test_input_ids_that_could_collide_with_turn_ids_are_refused_before_any_work(tmp_path, tiny_model_dir):
    """With `regenerate: every_assistant_turn` outputs are named `<id>#<turn>`: an input holding `a` (two turns)
    beside `a#1` gave two rows named `a#1`. Refused, naming the ids, before anything is written."""
    chat = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"},
            {"role": "user", "content": "and?"}, {"role": "assistant", "content": "more"}]
    inp = write_prompts(tmp_path / "in", [{"id": "a", "messages": chat}, {"id": "a#1", "messages": chat[:2]},
                                          {"id": "b", "messages": chat}])
    cfg = config_file(tmp_path, "turns", regenerate="every_assistant_turn")
    out = tmp_path / "run"
    proc = cli("generate", "--config", cfg, "--model", tiny_model_dir, "--input", inp, "--output", str(out))
    assert proc.returncode == 2, proc.stderr[-2000:]
    last = proc.stderr.strip().splitlines()[-1]
    assert "1 id(s) end in '#<number>' ('a#1')" in last and "every_assistant_turn" in last, last
    assert not out.exists()
