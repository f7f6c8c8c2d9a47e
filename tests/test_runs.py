"""run.json: what it records, and what it must never record (secrets), written by the project's own writer."""

from __future__ import annotations

from pathlib import Path

import pytest
from conftest import DEMO_CONFIG

from job import runs, storage
from job.config import load_config
from job.redaction import REDACTED


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
    runs.write_run_json(config, "generate", {"identity": ident, "status": "running"})
    stage2 = load_config(DEMO_CONFIG, output=str(tmp_path / "run"), model="other-model",
                         **{"hidden_states.engine_kwargs": {"hf_token": secrets[1]}})
    runs.write_run_json(stage2, "hidden_states", {"status": "complete"})

    text = "".join(p.read_text() for p in Path(tmp_path / "run").rglob("*") if p.is_file())
    for s in secrets:
        assert s not in text, s
    run = runs.read_run_json(config.output, config.storage)
    assert run["config"]["engine_kwargs"] == {"hf_token": REDACTED, "max_num_batched_tokens": 4096}
    assert run["config"]["input"].endswith(f"X-Amz-Date=20260101T000000Z&X-Amz-Signature={REDACTED}")
    assert run["config"]["env_vars"] == {"HF_TOKEN": REDACTED, "VLLM_CPU_KVCACHE_SPACE": "1"}
    # Stage 2 keeps stage 1's provenance (its model, its config) and records its own beside it.
    assert run["config"]["model"] == config.model
    assert run["hidden_states"]["provenance"]["config"]["model"] == "other-model"
    # The identity is stored redacted and compared redacted: resuming the same config is no drift.
    runs.check_drift(run["generate"]["identity"], runs.identity(config, {"max_tokens": 64}, None, "f" * 16),
                     allow_drift=False)
    assert storage.exists(runs.run_json_uri(config.output))


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
