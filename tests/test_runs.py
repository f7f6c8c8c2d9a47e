"""run.json: what it records, and what it must never record (secrets), written by the project's own writer."""

from __future__ import annotations

from pathlib import Path

import pytest
from conftest import DEMO_CONFIG

from job import run_record, runs, storage
from job.config import load_config
from job.lock import WriterLock
from job.redaction import REDACTED
from job.runs import RunError


def test_run_json_never_holds_secrets_and_keeps_stage1_provenance(tmp_path):
    secrets = ["hf_SECRET_engine", "hf_SECRET_stage2", "SECRETSIGNATURE", "SECRET_env_value", "sk-SECRET-api"]
    config = load_config(DEMO_CONFIG, output=str(tmp_path / "run"), **{
        "engine_kwargs": {"hf_token": secrets[0], "max_num_batched_tokens": 4096},
        "hidden_states.engine_kwargs": {"hf_token": secrets[1]},
        "input": f"https://b.s3.amazonaws.com/p.parquet?X-Amz-Date=20260101T000000Z&X-Amz-Signature={secrets[2]}",
        "env_vars": {"HF_TOKEN": secrets[3], "VLLM_CPU_KVCACHE_SPACE": "1"},
        "generate.chat_template_kwargs": {"openai": {"apiKey": secrets[4]}},
    })
    ident = runs.identity(config, {"max_tokens": 64}, None, "f" * 16)
    with WriterLock(config, "generate") as held:
        run_record.update(config, "generate", held.fence, identity=ident, status="running")
    stage2 = load_config(DEMO_CONFIG, output=str(tmp_path / "run"), model="other-model",
                         **{"hidden_states.engine_kwargs": {"hf_token": secrets[1]}})
    with WriterLock(stage2, "hidden_states") as held:
        run_record.update(stage2, "hidden_states", held.fence, status="complete")

    text = "".join(p.read_text() for p in Path(tmp_path / "run").rglob("*") if p.is_file())
    for s in secrets:
        assert s not in text, s
    run = storage.read_json(run_record.run_json_uri(config.output))
    assert run["config"]["engine_kwargs"] == {"hf_token": REDACTED, "max_num_batched_tokens": 4096}
    assert run["config"]["input"].endswith(f"X-Amz-Date=20260101T000000Z&X-Amz-Signature={REDACTED}")
    assert run["config"]["env_vars"] == {"HF_TOKEN": REDACTED, "VLLM_CPU_KVCACHE_SPACE": "1"}
    # Stage 2 keeps stage 1's provenance (its model, its config) and records its own beside it.
    assert run["config"]["model"] == config.model
    assert run["hidden_states"]["provenance"]["config"]["model"] == "other-model"
    # The identity is stored redacted and compared redacted: resuming the same config is no drift.
    runs.check_drift(run["generate"]["identity"], runs.identity(config, {"max_tokens": 64}, None, "f" * 16),
                     allow_drift=False)
    record = run_record.read(config.output, config.storage)
    assert record.status("generate") == "running"
    assert record.hidden_states.provenance["config"]["model"] == "other-model"


def test_identity_covers_the_model_files_output_engine_arguments_and_vllm(tmp_path, tiny_model_dir):
    """A model re-staged under the same path (other weights, another chat template), an engine argument that
    changes the outputs (dtype), or another vLLM: drift. An argument that changes only speed: no drift."""
    import shutil

    model = tmp_path / "model"
    shutil.copytree(tiny_model_dir, model)
    base = load_config(DEMO_CONFIG, model=str(model))
    ident = runs.identity(base, {"max_tokens": 8}, None, "f")
    assert ident["model_files"] and ident["vllm"]

    faster = load_config(DEMO_CONFIG, model=str(model), engine_kwargs={**base.engine_kwargs, "max_num_seqs": 3})
    assert runs.check_drift(ident, runs.identity(faster, {"max_tokens": 8}, None, "f"), allow_drift=False) == {}

    other_dtype = load_config(DEMO_CONFIG, model=str(model), engine_kwargs={**base.engine_kwargs, "dtype": "float16"})
    with pytest.raises(runs.RunError, match="engine_kwargs"):
        runs.check_drift(ident, runs.identity(other_dtype, {"max_tokens": 8}, None, "f"), allow_drift=False)

    (model / "chat_template.jinja").write_text((model / "chat_template.jinja").read_text() + "\n")
    with pytest.raises(runs.RunError, match="model_files"):
        runs.check_drift(ident, runs.identity(base, {"max_tokens": 8}, None, "f"), allow_drift=False)
    assert runs.check_drift({**ident, "vllm": "0.1.0"}, ident, allow_drift=True) == {"vllm": ("0.1.0", ident["vllm"])}


def test_run_record_reads_older_and_newer_files_and_refuses_a_wrong_type():
    """run.json typed (job/run_record.py): a file from before a field existed reads with its default; a field or a
    stage this version does not know is kept and written back as it was; a field of the wrong type is refused in one
    line naming it."""
    older = {"config": {"model": "m", "generate": {"rows_per_shard": 8}}, "created_at": "2026-01-01T00:00:00Z",
             "generate": {"status": "running", "identity": {"seed": 0}, "input": {"num_rows": 10}},
             "a_newer_top_level_field": [1]}
    record = run_record.RunRecord.from_dict(older)
    assert (record.rows_total, record.status("generate"), record.generate.canary_passed) == (10, "running", False)
    assert record.status("hidden_states") is None and record.hidden_states is None
    assert record.setting("generate.rows_per_shard") == 8 and record.setting("generate.nope", 3) == 3
    newer = {**older, "generate": {**older["generate"], "a_newer_field": {"x": 1}},
             "train": {"status": "complete", "steps": 12}}
    again = run_record.RunRecord.from_dict(newer).to_dict()
    assert again["generate"]["a_newer_field"] == {"x": 1} and again["train"] == {**newer["train"],
                                                                                 **again["train"]}
    assert again["a_newer_top_level_field"] == [1] and again["train"]["steps"] == 12
    for bad, name in (({"generate": {"status": 3}}, "status"), ({"generate": {"input": {"num_rows": "ten"}}},
                                                               "num_rows"), ({"config": []}, "config")):
        with pytest.raises(RunError, match=f"{name} is .*not a"):
            run_record.RunRecord.from_dict(bad)
