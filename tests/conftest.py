"""Shared fixtures: the tiny model (built once per checkout), a moto S3 server on loopback, prompt shards and
run configs derived from configs/demo.yaml (the embedded default doubles as the test fixture)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

REPO = Path(__file__).resolve().parents[1]
DEMO_CONFIG = str(REPO / "configs" / "demo.yaml")

# Every engine in the tests is a CPU engine with a small KV cache: several may run one after another.
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
os.environ.setdefault("RAY_DEDUP_LOGS", "0")


@pytest.fixture(scope="session")
def tiny_model_dir() -> str:
    from job.tiny_model import ensure_tiny_model

    return ensure_tiny_model(str(REPO / ".cache" / "tiny-model"))


@pytest.fixture(scope="session")
def tiny_hybrid_dir() -> str:
    """The target's architecture (Qwen3.5/3.6: Gated DeltaNet + gated attention, vision tower, MTP head) at tiny
    scale, built once per checkout (~2 min on 2 cores)."""
    from job.tiny_model import ensure_tiny_model

    return ensure_tiny_model(str(REPO / ".cache" / "tiny-hybrid"), architecture="hybrid")


# vLLM arguments the hybrid needs: text prompts only (no vision encoder profiling).
HYBRID_ENGINE_KWARGS = {"language_model_only": True}


@pytest.fixture(scope="session")
def tokenizer(tiny_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_dir)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="session")
def s3_server():
    """A real S3 protocol server (moto) on loopback, in its own process. Yields its endpoint URL and sets the
    standard AWS environment variables, which the local Ray's workers inherit."""
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    endpoint = f"http://127.0.0.1:{port}"
    for _ in range(100):
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
            break
        except OSError:
            time.sleep(0.1)
    env = {"AWS_ENDPOINT_URL": endpoint, "AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing-secret",
           "AWS_DEFAULT_REGION": "us-east-1", "AWS_REGION": "us-east-1"}
    old = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        yield endpoint
    finally:
        proc.terminate()
        proc.wait(10)
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


@pytest.fixture
def s3_bucket(s3_server, request):
    import boto3

    name = "t-" + request.node.name.lower().replace("_", "-")[:40].strip("-")
    boto3.client("s3", endpoint_url=s3_server).create_bucket(Bucket=name)
    return name


def write_prompts(directory: str | Path, rows: list[dict], num_files: int = 1, schema: pa.Schema | None = None):
    """Write `rows` as `num_files` parquet shards (local path) with one explicit schema."""
    os.makedirs(directory, exist_ok=True)
    table = pa.Table.from_pylist(rows, schema=schema)
    per = -(-len(rows) // num_files)
    for i in range(num_files):
        pq.write_table(table.slice(i * per, per), os.path.join(directory, f"part-{i:03d}.parquet"))
    return str(directory)


def simple_prompts(n: int, prefix: str = "p") -> list[dict]:
    from job.demo import demo_questions

    questions = demo_questions()
    return [{"id": f"{prefix}{i:04d}", "prompt": questions[i % len(questions)], "topic": f"t{i % 3}"}
            for i in range(n)]


# One local Ray per test module that asks for it (stage 2 and export tests); left alone if a test started one.
@pytest.fixture(scope="module")
def local_ray():
    import ray

    started = not ray.is_initialized()
    if started:
        ray.init(address="local", num_cpus=2, include_dashboard=False, configure_logging=False, log_to_driver=False)
    yield
    if started:
        ray.shutdown()


@pytest.fixture
def make_config(tiny_model_dir):
    """RunConfig from configs/demo.yaml with test overrides (dotted keys)."""
    from job.config import load_config

    def make(**overrides):
        overrides.setdefault("model", tiny_model_dir)
        return load_config(DEMO_CONFIG, **overrides)

    return make


def read_run(output: str):
    """All completion rows of a run as a pyarrow Table, through pyarrow.dataset as a user would."""
    import pyarrow.dataset as ds

    from job import storage

    fs, path = storage.resolve(output + "/completions")
    return ds.dataset(path, filesystem=fs, format="arrow").to_table()
