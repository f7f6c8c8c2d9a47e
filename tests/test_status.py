"""`python -m job status RUN`: progress from the run directory alone, on finished and partial runs, local and
on a real S3 protocol server (moto). Shards are written with the project's own writer and schema; their
modification times are set, so rates and ETAs are exact."""

from __future__ import annotations

import os
import time

import pyarrow as pa
import pytest

from job import cli, layout, schema, storage
from job.layout import CompletionUnit
from job.runview import status
from job.storage import StorageConfig

T0 = 1_800_000_000.0  # a fixed "wall clock" for the shard mtimes


def shard_table(file_index: int, start: int, stop: int, tokens_per_row: int, errors: int = 0,
                too_short: int = 0) -> pa.Table:
    rows = []
    for i in range(start, stop):
        k = i - start
        err = "prompt too long: 9999 tokens" if k < errors else None
        row = {c: None for c in schema.COMPLETION_COLUMNS}
        row.update({schema.ID: f"{file_index}-{i}", schema.ERROR: err})
        if err is None:
            row.update({schema.PROMPT_TOKEN_IDS: [1] * 10, schema.OUTPUT_TOKEN_IDS: [2] * tokens_per_row,
                        schema.NUM_PROMPT_TOKENS: 10, schema.NUM_OUTPUT_TOKENS: tokens_per_row,
                        schema.FINISH_REASON: "stop", schema.REASONING: "r", schema.ANSWER: "a"})
            row.update({f: False for f in schema.QUALITY_FLAGS})
            row[schema.FLAG_TOO_SHORT] = k - errors < too_short
        rows.append(row)
    return pa.Table.from_pylist(rows, schema=schema.completion_schema())


def write_run(run: str, shards: list[dict], total_rows: int, rows_per_shard: int = 4, storage_config=None,
              generate: dict | None = None) -> None:
    """shards: dicts with file, start, stop, tokens (per row), mtime, and optionally errors, too_short."""
    storage.write_json(storage.join(run, layout.RUN_JSON), {
        "created_at": "2027-01-15T08:00:00Z",
        "config": {"generate": {"rows_per_shard": rows_per_shard}, "engine_kwargs": {}},
        "generate": {"status": "running", "input": {"num_rows": total_rows}, **(generate or {})},
    }, storage_config)
    for s in shards:
        name = CompletionUnit(s["file"], "in.parquet", s["start"], s["stop"]).shard_name
        uri = storage.join(run, layout.COMPLETIONS_DIR, name)
        storage.write_shard(uri, shard_table(s["file"], s["start"], s["stop"], s["tokens"], s.get("errors", 0),
                                             s.get("too_short", 0)), storage_config)
        if "mtime" in s and not storage.is_s3(run):
            os.utime(uri, (s["mtime"], s["mtime"]))


def steady_shards(n: int, *, rows: int = 4, tokens: int = 100, every_s: float = 10.0, start_t: float = T0,
                  file: int = 0, first_row: int = 0) -> list[dict]:
    return [{"file": file, "start": first_row + i * rows, "stop": first_row + (i + 1) * rows, "tokens": tokens,
             "mtime": start_t + i * every_s} for i in range(n)]


# ---------------------------------------------------------------------------------------------------------------


def test_finished_run(tmp_path):
    run = str(tmp_path / "run")
    shards = steady_shards(10)
    shards[0]["errors"] = 1
    shards[1]["too_short"] = 2
    write_run(run, shards, total_rows=40)
    st = status.build_status(run, now=T0 + 95)
    assert st["rows_total"] == 40 and st["rows_done"] == 40 and st["rows_remaining"] == 0
    assert st["shards_done"] == 10 and st["shards_remaining_approx"] == 0
    assert st["output_tokens"] == 39 * 100 and st["prompt_tokens"] == 39 * 10
    assert st["error_rate"] == pytest.approx(1 / 40)
    assert st["flag_rates"][schema.FLAG_TOO_SHORT] == pytest.approx(2 / 39)
    assert st["eta_s"] == 0 and st["holes"] == []
    # 9 shards after the first, 36 rows / 3600 tokens, over the 90 s between the first and last shard.
    assert st["rate_overall"]["rows_per_s"] == pytest.approx(0.4)
    assert st["rate_overall"]["output_tokens_per_s"] == pytest.approx(40.0)
    text = status.format_status(st)
    assert "40 / 40 done (100.0%)" in text and "ETA      done" in text and "errors 2.5%" in text


def test_partial_run_rates_eta_and_holes(tmp_path):
    run = str(tmp_path / "run")
    shards = steady_shards(20, every_s=10.0)  # rows 0..80 of file 0, one shard every 10 s
    del shards[5]  # rows 20-24 lost with a crashed unit
    shards += steady_shards(2, file=1, start_t=T0 + 195, every_s=2)  # rows 0..8 of file 1
    write_run(run, shards, total_rows=1000, rows_per_shard=4)
    now = T0 + 200
    st = status.build_status(run, now=now, window_s=60)
    assert st["rows_done"] == 19 * 4 + 8 and st["rows_remaining"] == 1000 - 84
    assert st["holes"] == [{"file_index": 0, "start": 20, "stop": 24}]
    assert st["shards_remaining_approx"] == -(-916 // 4)
    recent = st["rate_recent"]  # shards at 140..197 s, plus the one just before the window (130 s) as the start
    assert recent is not None and recent["seconds"] == pytest.approx(67)
    assert recent["rows_per_s"] == pytest.approx(8 * 4 / 67)
    assert st["eta_s"] == pytest.approx(916 / recent["rows_per_s"])
    assert st["last_shard_age_s"] == pytest.approx(3)
    text = status.format_status(st)
    assert "84 / 1,000 done" in text and "916 to go" in text
    assert "f00000 rows 20-24" in text and "ETA" in text


def test_a_long_gap_is_not_generation_time(tmp_path):
    run = str(tmp_path / "run")
    # 5 shards, then the job died; resumed 3 hours later for 5 more shards.
    shards = steady_shards(5) + steady_shards(5, start_t=T0 + 3 * 3600, first_row=20)
    write_run(run, shards, total_rows=100)
    st = status.build_status(run, now=T0 + 3 * 3600 + 40)
    # Two stretches of 40 s each, 4 shards of 4 rows counted in each: 32 rows over 80 s.
    assert st["rate_overall"]["seconds"] == pytest.approx(80)
    assert st["rate_overall"]["rows_per_s"] == pytest.approx(0.4)


def test_stalled_run_is_called_out(tmp_path):
    run = str(tmp_path / "run")
    write_run(run, steady_shards(3), total_rows=100)
    st = status.build_status(run, now=T0 + 7200)
    assert st["rate_recent"] is None and st["rate_overall"] is not None
    assert "is the job still running?" in status.format_status(st)


def test_run_without_shards_and_not_a_run(tmp_path, capsys):
    run = str(tmp_path / "run")
    write_run(run, [], total_rows=100)
    st = status.build_status(run)
    assert st["rows_done"] == 0 and st["rows_remaining"] == 100 and st["rate_overall"] is None
    assert "not enough shards" in status.format_status(st)
    assert cli.main(["status", str(tmp_path / "nothing-here")]) == 2
    assert "not a run directory" in capsys.readouterr().err


def test_cli_names_only_and_json(tmp_path, capsys):
    run = str(tmp_path / "run")
    write_run(run, steady_shards(3), total_rows=12)
    assert cli.main(["status", run, "--names-only"]) == 0
    out = capsys.readouterr().out
    assert "12 / 12 done" in out and "tokens" not in out  # shards were not opened
    assert cli.main(["status", run, "--json"]) == 0
    import json

    assert json.loads(capsys.readouterr().out)["output_tokens"] == 1200


def test_status_on_s3(moto_s3):
    """The same status from an s3:// run directory: listing, mtimes and column-selective range reads."""
    run = "s3://runs/partial"
    sc = StorageConfig(endpoint_url=moto_s3)
    write_run(run, steady_shards(3, tokens=7) + [{"file": 2, "start": 0, "stop": 5, "tokens": 3, "errors": 1}],
              total_rows=50, storage_config=sc)
    st = status.build_status(run, sc, now=time.time())
    assert st["rows_done"] == 17 and st["rows_remaining"] == 33 and st["shards_done"] == 4
    assert st["output_tokens"] == 12 * 7 + 4 * 3
    assert st["error_rate"] == pytest.approx(1 / 17)
    assert st["last_shard_age_s"] is not None and st["last_shard_age_s"] < 600


def test_unreachable_or_mistyped_s3_is_one_line_at_once(moto_s3, capsys, monkeypatch):
    """A bucket that does not exist, a host that does not resolve, an endpoint nobody listens on: one line, no
    traceback, no minute of retries, for `status`, `plan --from` and `report`."""
    from job import cli
    from job.storage import StorageError, check_reachable

    closed_port = free_port()  # nothing listens there
    cases = [(["s3://no-such-bucket/runs/x", "--endpoint-url", moto_s3], "bucket 'no-such-bucket' does not exist"),
             (["s3://runs/x", "--endpoint-url", "http://no-such-host.invalid:9000"],
              "cannot resolve the endpoint's host name"),
             (["s3://runs/x", "--endpoint-url", f"http://127.0.0.1:{closed_port}"], "cannot connect to the endpoint")]
    for argv, expected in cases:
        started = time.monotonic()
        assert cli.main(["status", *argv]) == 2
        err = capsys.readouterr().err
        assert err.startswith("error: ") and expected in err and len(err.strip().splitlines()) == 1, err
        assert time.monotonic() - started < 15, "refused at once, not after the retries"

    # The other read-side commands go through the same first contact (run.json), with the endpoint from the env.
    monkeypatch.setenv("AWS_ENDPOINT_URL", moto_s3)
    assert cli.main(["plan", "--from", "s3://no-such-bucket/runs/x", "--prompts", "10", "--gpus", "1"]) == 2
    assert "bucket 'no-such-bucket' does not exist" in capsys.readouterr().err
    assert cli.main(["report", "s3://no-such-bucket/runs/x"]) == 2
    assert "bucket 'no-such-bucket' does not exist" in capsys.readouterr().err
    # The existing bucket passes (and an empty run location is "not a run directory", as before).
    check_reachable("s3://runs/x", StorageConfig(endpoint_url=moto_s3))
    with pytest.raises(StorageError, match="does not exist"):
        check_reachable("s3://nope/x", StorageConfig(endpoint_url=moto_s3))
    assert cli.main(["status", "s3://runs/x", "--endpoint-url", moto_s3]) == 2
    assert "not a run directory" in capsys.readouterr().err


def free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture
def moto_s3(monkeypatch):
    """A real S3 protocol server on loopback with one bucket, `runs`."""
    from moto.server import ThreadedMotoServer

    for k, v in {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_REGION": "us-east-1",
                 "AWS_EC2_METADATA_DISABLED": "true"}.items():
        monkeypatch.setenv(k, v)
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0)
    server.start()
    host, port = server.get_host_and_port()
    endpoint = f"http://{host}:{port}"
    import boto3

    boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1").create_bucket(Bucket="runs")
    try:
        yield endpoint
    finally:
        server.stop()
