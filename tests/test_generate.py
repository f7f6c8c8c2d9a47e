"""Stage 1 end to end: real local Ray, real vLLM (CPU build), the tiny model, a moto S3 server. The dense model's
end-to-end run is the session's shared run (tests/conftest.py), checked in test_inspect.py beside the read side
that uses it; the hybrid's runs are in the slow tier."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from conftest import (
    BAD_ROWS,
    DEMO_CONFIG,
    check_completions,
    read_run,
    shared_input_files,
    shared_input_rows,
    simple_prompts,
    write_prompts,
)

from job.config import load_config
from job.generate import run_generate
from job.generate.engine_start import EngineStartError


def write_mixed_input(directory, rows: list[dict]) -> str:
    """The rows as the two parquet files of the shared run's input (tests/conftest.py), written locally."""
    os.makedirs(directory, exist_ok=True)
    for name, data in shared_input_files(rows).items():
        Path(directory, name).write_bytes(data)
    return str(directory)


# ---------------------------------------------------------------------------------------------------------------
# The target's architecture: the tiny hybrid (Qwen3.5/3.6: Gated DeltaNet + gated attention, MTP head)
# ---------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("engine", [
    {"enable_prefix_caching": True},
    # MTP drafts with the model's own head. The CPU build runs it only without prefix caching and without top_k
    # (known_engine_problem in job/generate/engine.py); GPUs run the production settings.
    # max_num_seqs auto, as in the production config: sized for MTP's state slots, checked against vLLM's pool.
    {"enable_prefix_caching": False, "speculative_config": {"method": "mtp", "num_speculative_tokens": 2},
     "max_num_seqs": "auto"},
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
    run = json.loads((tmp_path / "run" / "run.json").read_text())
    if not mtp:
        assert run["generate"]["canary_passed"] is True, "the trained hybrid answers in the thinking format"
        return
    # `auto` on the CPU build: VLLM_CPU_KVCACHE_SPACE 2 GiB, sequences of the length mix (capped at 128), 3 state slots
    # (MTP's 2 drafts + 1). The sums lay the cache out as vLLM does; the pool vLLM allocated (its block count) must
    # agree: the chosen value fits it (every sequence that fits: no rounding since issue 49).
    sizing = run["generate"]["max_num_seqs_auto"]["cpu"]
    chosen, holds = sizing["max_num_seqs"], sizing["vllm_pool_holds"]
    assert run["generate"]["max_num_seqs"] == {"cpu": chosen}
    assert chosen <= holds < chosen + 8, sizing["check"]
    assert "auto, checked: vLLM's pool is " in sizing["check"], sizing["check"]
    # Sized for the configured length mix (no rows measured before this job), capped at this run's max_tokens.
    assert "sized for" in sizing["check"] and "configured: output mean 2,500" in sizing["check"], sizing["check"]
    assert "capped at 128" in sizing["check"], sizing["check"]


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
