"""No secret leaves the job (issue 28): redaction by value, in one place (job/redaction.py), for every shape a
secret comes in; secrets kept out of Ray's runtime_env; credentials in an endpoint URL refused. The end-to-end
checks — a job with unique fake secrets of every shape, then every file of its Ray session, its run directory and
its output searched for them — are tests/test_inspect.py (stage 1 and 2, on the shared run) and
tests/test_job_submit.py (`ray job submit`)."""

from __future__ import annotations

import subprocess
import sys

import pytest
from conftest import DEMO_CONFIG, REPO

from job import redaction
from job.redaction import REDACTED, redact, redact_text

# Every shape of secret the issue names (fake values, the right form), each with the text around it.
SHAPES = {
    "yaml password": ("password: hunter2-but-longer", "hunter2-but-longer"),
    "yaml short password": ("password: hunter2", "hunter2"),
    "passphrase by name": ("SIGNING_PASSPHRASE=correct-horse-battery-staple", "correct-horse-battery-staple"),
    "azure connection string": ("DefaultEndpointsProtocol=https;AccountName=acct;AccountKey="
                                "Zm9vYmFyZm9vYmFyZm9vYmFyZm9vYmFyZm9vYmFyZm9vYmFyZm9vYmFyZm9vYmFyZm9vYmFyZm9vYmFyZm9v"
                                "YmFyZm9vYmE=;EndpointSuffix=core.windows.net",
                                "Zm9vYmFyZm9vYmFyZm9vYmFy"),
    "azure SAS": ("https://acct.blob.core.windows.net/c/p.parquet?sv=2022-11-02&sig=Q2hhbmdlTWVQbGVhc2UlM0Q%3D",
                  "Q2hhbmdlTWVQbGVhc2UlM0Q"),
    "sentry DSN": ("SENTRY_DSN is https://0123456789abcdef0123456789abcdef@o123.ingest.sentry.io/1",
                   "0123456789abcdef0123456789abcdef"),
    "github classic": ("GH_PAT ghp_aBcDeFgHiJkLmNoPqRsTuVwXyZ0123456789 here",
                       "ghp_aBcDeFgHiJkLmNoPqRsTuVwXyZ0123456789"),
    "github fine-grained": ("github_pat_11ABCDEFG0123456789_abcdefghijklmnopqrstuvwxyzABCDEF",
                            "github_pat_11ABCDEFG0123456789"),
    "hugging face": ("token=hf_AbCdEfGhIjKlMnOpQrStUvWxYz012345", "hf_AbCdEfGhIjKlMnOpQrStUvWxYz012345"),
    "hugging face alone": ("using hf_ZyXwVuTsRqPoNmLkJiHgFeDcBa543210 now", "hf_ZyXwVuTsRqPoNmLkJiHgFeDcBa543210"),
    "aws access key id": ("key id AKIAIOSFODNN7EXAMPLE in a line", "AKIAIOSFODNN7EXAMPLE"),
    "slack": ("xoxb-1234567890-0987654321-AbCdEfGhIjKlMnOp", "xoxb-1234567890"),
    "gitlab": ("deploy with glpat-abcdefghij0123456789", "glpat-abcdefghij0123456789"),
    "openai style": ("OPENAI sk-proj-abcdefghijklmnopqrstuvwxyz0123456789", "sk-proj-abcdefghijklmnopqrstuvwxyz"),
    "presigned s3 url": ("s3 input https://b.s3.amazonaws.com/p.parquet?X-Amz-Algorithm=AWS4-HMAC-SHA256&"
                         "X-Amz-Credential=AKIDEXAMPLE%2F20260101%2Fus-east-1%2Fs3%2Faws4_request&X-Amz-Date="
                         "20260101T000000Z&X-Amz-Security-Token=FwoGZXIvYXdzEXAMPLETOKEN&X-Amz-Signature="
                         "fe5f80f77d5fa3beca038a248ff027d0445342fe2855ddc963176630326f1024",
                         "fe5f80f77d5fa3beca038a248ff027d0445342fe2855ddc963176630326f1024"),
    "url password": ("endpoint http://admin:s3cr3t-pw@10.0.0.5:9000", "s3cr3t-pw"),
    "jwt": ("Authorization Bearer eyJhbGciOiJIUzI1NiJ9.eyJzdWIiOiIxMjM0In0.c2lnbmF0dXJlLWhlcmU",
            "eyJzdWIiOiIxMjM0In0"),
}


@pytest.mark.parametrize("text, secret", SHAPES.values(), ids=SHAPES.keys())
def test_each_shape_of_secret_is_redacted_by_value(text, secret):
    assert secret in text
    clean = redact_text(text)
    assert secret not in clean and REDACTED in clean, clean


@pytest.mark.parametrize("text", [
    "max_tokens=512 num_speculative_tokens: 3 rows_per_shard=64",
    "s3://bucket/runs/qwen/completions/f00000-r0000000000-0000000008.arrow",
    "shard_id 890a351c25db40e3a6db55c723f6aa39 sha256 fc89b058321df1593762d4e4c7a4e0d79a8bc954951a9147e13926426b151db1",
    "[generate] 31/31 rows (100.0%) | 248 tok/s now | errors 19.4% | engines 0/1",
    "error: input file /data/in/part-000.parquet has no `id` column (columns: ['key', 'prompt'])",
    "http://127.0.0.1:9000 and https://huggingface.co/Qwen/Qwen3.6-27B",
    "dropped 1: no loss-mask token: an empty completion, nothing to train on",
])
def test_what_is_not_a_secret_is_left_alone(text):
    assert redact_text(text) == text


def test_structures_are_redacted_by_key_and_by_value():
    config = {"env_vars": {"HF_TOKEN": "anything", "GH_PAT": "x", "SENTRY_DSN": "y", "VLLM_CPU_KVCACHE_SPACE": "2",
                           "NOTE": "hf_AbCdEfGhIjKlMnOpQrStUvWxYz012345"},
              "input": SHAPES["presigned s3 url"][0], "engine_kwargs": {"max_tokens": 8}}
    out = redact(config)
    assert out["env_vars"] == {"HF_TOKEN": REDACTED, "GH_PAT": REDACTED, "SENTRY_DSN": REDACTED,
                               "VLLM_CPU_KVCACHE_SPACE": "2", "NOTE": REDACTED}
    assert SHAPES["presigned s3 url"][1] not in out["input"] and out["engine_kwargs"] == {"max_tokens": 8}


def test_secret_env_vars_never_go_into_a_runtime_env():
    plain, secret = redaction.split_env({"HF_TOKEN": "t", "VLLM_CPU_KVCACHE_SPACE": "2", "PYTHONPATH": "/x",
                                         "SOME_URL": SHAPES["sentry DSN"][0].split()[-1],
                                         "AZURE_STORAGE_CONNECTION_STRING": SHAPES["azure connection string"][0]})
    assert plain == {"VLLM_CPU_KVCACHE_SPACE": "2", "PYTHONPATH": "/x"}
    assert set(secret) == {"HF_TOKEN", "SOME_URL", "AZURE_STORAGE_CONNECTION_STRING"}


def test_a_process_that_installs_redaction_prints_and_logs_no_secret():
    """Everything printed or logged after `install()` (as the CLI and every actor do) passes through redaction,
    even a secret split over several writes of one line."""
    code = f"""
import logging, sys
sys.path.insert(0, {str(REPO)!r})
from job import redaction
redaction.install()
logging.basicConfig(level=logging.INFO)
print("token=hf_AbCdEfGh" + "IjKlMnOpQrStUvWxYz012345", flush=True)
sys.stdout.write("part one ghp_aBcDeFgHiJ"); sys.stdout.write("kLmNoPqRsTuVwXyZ0123456789 end\\n")
logging.getLogger("x").warning("dsn %s", "https://0123456789abcdef0123456789abcdef@o1.ingest.sentry.io/1")
raise SystemExit("error: http://admin:s3cr3t-pw@10.0.0.5:9000 unreachable")
"""
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    both = proc.stdout + proc.stderr
    for secret in ("hf_AbCdEfGhIjKlMnOpQrStUvWxYz012345", "ghp_aBcDeFgHiJkLmNoPqRsTuVwXyZ0123456789",
                   "0123456789abcdef0123456789abcdef", "s3cr3t-pw"):
        assert secret not in both, both
    assert both.count(REDACTED) == 4 and "end" in proc.stdout, both


@pytest.mark.parametrize("endpoint", ["http://admin:s3cr3t-pw@127.0.0.1:9000", "http://AKIDEXAMPLE@127.0.0.1:9000"])
def test_credentials_in_an_endpoint_url_are_refused_where_they_belong(tmp_path, endpoint):
    proc = subprocess.run([sys.executable, "-m", "job", "status", "s3://bucket/runs/x", "--endpoint-url", endpoint],
                          cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr
    last = proc.stderr.strip().splitlines()[-1]
    assert "credentials" in last and "AWS_ACCESS_KEY_ID" in last and "s3cr3t-pw" not in proc.stderr and \
        "AKIDEXAMPLE" not in proc.stderr, proc.stderr
    cfg = tmp_path / "c.yaml"
    cfg.write_text(open(DEMO_CONFIG).read() + f"\nstorage:\n  endpoint_url: {endpoint}\n")
    proc = subprocess.run([sys.executable, "-m", "job", "generate", "--config", str(cfg), "--input", str(tmp_path),
                           "--output", str(tmp_path / "run")], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "storage.endpoint_url" in proc.stderr and "s3cr3t-pw" not in proc.stderr, \
        proc.stderr



# ---------------------------------------------------------------------------------------------------------------
# Redaction removes secrets, never data or prose (issue 43)
# ---------------------------------------------------------------------------------------------------------------

# Names of this job's own figures and of a model's pieces: a secret word (token, key, session) with a word that makes
# it a count, an id, a path or a piece of the model. Every one of them once came out as <redacted>.
NOT_SECRET_NAMES = ["bytes_per_token", "feature_bytes_per_token", "num_tokens", "max_num_batched_tokens", "max_tokens",
                    "num_tokens_pending", "stored_bytes_per_token", "hidden_bytes_per_token", "kv_bytes_per_token",
                    "completion-bytes-per-token", "pad_token_id", "eos_token", "bos_token_id", "end_of_turn_token",
                    "num_key_value_heads", "linear_num_key_heads", "past_key_values", "tokens_key", "stage_key",
                    "session_dir", "session_name", "token_ids", "output_token_ids", "per_token", "loss_mask_token"]
SECRET_NAMES = ["HF_TOKEN", "hf_token", "AWS_SESSION_TOKEN", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "apiKey",
                "api_key", "private_key", "auth_token", "X-Amz-Signature", "X-Amz-Security-Token", "sig", "token",
                "GH_PAT", "SENTRY_DSN", "password_file", "AZURE_STORAGE_CONNECTION_STRING", "session"]


@pytest.mark.parametrize("name", NOT_SECRET_NAMES)
def test_figures_and_model_pieces_are_not_secret_names(name):
    assert not redaction.is_secret_name(name)
    assert redact({name: 2048}) == {name: 2048}
    assert redact_text(f"{name}=2048 and {name}: 2048") == f"{name}=2048 and {name}: 2048"


@pytest.mark.parametrize("name", SECRET_NAMES)
def test_secret_names_still_are(name):
    assert redaction.is_secret_name(name)
    assert redact({name: "abc123"}) == {name: REDACTED}
    assert "abc123" not in redact_text(f"{name}=abc123")


@pytest.mark.parametrize("text", [
    "stage-2 bytes per token: 4 × hidden size × 2 (default 71,680)",
    "hidden states: 2,048 B/token; 31,744 tokens in 4 shards",
    "max tokens per session: 512",
    "the end-of-turn token: <|im_end|> (the template's)",
])
def test_prose_with_secret_words_is_left_alone(text):
    assert redact_text(text) == text


def test_prose_does_not_hide_a_secret():
    """The words before `name:` decide only for prose (`name: value`); `name=value` is judged by its name."""
    for text in ("the session token: abc123xyz", "bytes per token=abc123xyz but HF_TOKEN=abc123xyz",
                 "my password: abc123xyz"):
        assert "abc123xyz" not in redact_text(text).split("bytes per token=")[-1], text


def test_no_help_text_is_redacted():
    """Every subcommand's --help, as printed (through redaction.install, as `python -m job` prints it)."""
    from job import cli

    parser = cli.build_parser()
    (sub,) = [a for a in parser._actions if isinstance(a, __import__("argparse")._SubParsersAction)]
    texts = [parser.format_help()] + [p.format_help() for p in sub.choices.values()]
    assert len(texts) > 10
    for text in texts:
        assert redact_text(text) == text, [line for line in text.splitlines() if redact_text(line) != line]
    proc = subprocess.run([sys.executable, "-m", "job", "plan", "--help"], cwd=REPO, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0 and "bytes per token" in proc.stdout and REDACTED not in proc.stdout, proc.stdout


def test_run_json_keeps_the_runs_own_figures(tmp_path):
    """run.json as job/run_record.py writes it, for the demo's and the production config with stage 2's storage estimate
    (job/hidden_states/run.py estimate_storage's keys): not one `<redacted>` when no secret was given."""
    import json

    from job import run_record
    from job.config import load_config
    from job.lock import WriterLock

    estimate = {"bytes_per_token": 1544, "feature_bytes_per_token": 1536, "num_layers": 3, "layer_ids": [0, 1, 3],
                "hidden_size": 256, "dtype": "bfloat16", "num_samples": 31, "num_tokens": 9000,
                "total_bytes": 9000 * 1544, "num_tokens_pending": 0, "pending_bytes": 0}
    for config_path in (DEMO_CONFIG, str(REPO / "configs" / "qwen3.6-27b.yaml")):
        config = load_config(config_path, output=str(tmp_path / "run"))
        with WriterLock(config, "hidden_states") as held:
            run_record.update(config, "hidden_states", held.fence, estimate=estimate)
        run = run_record.read(config.output, config.storage).to_dict()
        assert REDACTED not in json.dumps(run), [line for line in json.dumps(run, indent=1).splitlines()
                                                 if REDACTED in line]
        assert run["hidden_states"]["estimate"] == estimate
        (tmp_path / "run" / "run.json").unlink()
