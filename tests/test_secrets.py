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
    "github classic": ("GH_PAT ghp_aBcDeFgHiJkLmNoPqRsTuVwXyZ0123456789 here", "ghp_aBcDeFgHiJkLmNoPqRsTuVwXyZ0123456789"),
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

